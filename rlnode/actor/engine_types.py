"""What an engine's callers exchange with it: the sampling settings of one
call, the completion it returns, and the error a failed generation raises.
Engine-side Structs only (never on the wire as-is: an episode turns a
``Completion`` into a ``wire.TrainingSample``). Imports nothing of vLLM.
"""

from __future__ import annotations

import msgspec


class SamplingSettings(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-call sampling (actor-side; never crosses the network as-is)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings (an agent's stop sequences, through the gateway): the
    # engine ends the completion with the token that completes one, and
    # its ids keep that token (what was sampled is what is trained); the
    # gateway cuts the text the agent sees before the string.
    stop: tuple[str, ...] = ()
    # Generate exactly max_tokens (benchmarks); never used for training.
    ignore_eos: bool = False


class Completion(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one generation produced: engine -> episode."""

    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" | "length" | "abort"
    # Policy versions that produced the tokens: [(version, start, end), ...]
    weight_versions: list[tuple[str, int, int]] = []


class EngineError(RuntimeError):
    """A generation failed inside the engine (recoverable for the caller:
    the episode may retry; the daemon keeps running)."""
