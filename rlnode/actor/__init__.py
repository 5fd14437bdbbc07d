"""Actor role: where samples are born. engine.py runs vLLM, router.py admits
each generation, generation.py pairs the two for episodes."""
