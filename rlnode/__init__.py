"""rlnode: asynchronous multi-step RL for LLM agents.

Where a sample lives, by folder:
  actor/    born: engine (generation), router (admission leases), later the
            scheduler and episode coroutines that turn cube tasks into samples
  trainer/  consumed: buffer, loss, optimizer, weight broadcast, checkpoints
  config/   the typed knobs of every role; cli.py the entry point.
"""

__version__ = "0.1.0"
