"""``NullEngine``: an engine that answers every request at once, for
measuring what surrounds the engine (``rlnode bench gateway --engine null``).

It has the interface the AdmissionRouter's callers use on ``Engine``
(``LLMClient`` calls ``generate``; ``start``/``shutdown``, the per-engine
counters and ``failing`` as the daemon reads them) and produces what the
real engine would for the same request: ``max_tokens`` valid token ids of
the model's vocabulary with one logprob each, ``finish_reason`` "length"
when the request ignores the end of turn (every benchmark call), else a
reply closed by the end-of-turn token and "stop" (truncated at
``max_tokens``, "length", like a real reply that runs out), the policy
version span, ``on_tokens`` once with the whole completion (one engine step
that produced everything). No model, no processes, no CPU of its own beyond
building the lists: a benchmark that runs on it measures the gateway, the
router and the agents, not the engine.

The replies are chosen by the caller (``guess_replies``: the numbers of the
guessing game, so episodes play on as with a model that answers) and taken
in turn, one per request.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Callable, Sequence

from rlnode.actor.engine import Completion, EngineError, SamplingSettings


class NullEngine:
    """Token ids in, token ids out, no model: see the module docstring."""

    FAILING_AFTER = 16

    def __init__(self, engine_id: int, replies: Sequence[Sequence[int]], pad_id: int, eos_id: int | None = None,
                 logprob: float = -1.0):
        if not replies or not all(replies):
            raise ValueError("NullEngine needs at least one non-empty reply")
        self.engine_id = engine_id
        self.replies = [list(r) for r in replies]
        self.pad_id, self.eos_id, self.logprob = pad_id, eos_id, logprob
        self._next = itertools.count()
        self.started = False
        # Engine's counters, kept the same way.
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests_total = 0
        self.requests_failed = 0
        self.failed_in_a_row = 0
        self.last_error = ""
        self.generated_tokens = 0
        self.weight_version = "0"
        self.visible_gpus: tuple[str, ...] = ()

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    async def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def failing(self) -> str:
        return ""

    def completion_ids(self, sampling: SamplingSettings) -> tuple[list[int], str]:
        """(token ids, finish reason) of the next reply under ``sampling``."""
        n = sampling.max_tokens
        reply = self.replies[next(self._next) % len(self.replies)]
        if sampling.ignore_eos or self.eos_id is None:
            return (reply + [self.pad_id] * (n - len(reply)))[:n], "length"
        ids = reply + [self.eos_id]
        return (ids, "stop") if len(ids) <= n else (ids[:n], "length")

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingSettings,
        request_id: str | None = None,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
    ) -> Completion:
        if not self.started:
            raise EngineError(f"engine {self.engine_id} is not started")
        if sampling.max_tokens < 1:
            raise EngineError(f"engine {self.engine_id}: max_tokens must be >= 1")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.requests_total += 1
        version = self.weight_version
        try:
            # A real request suspends its caller at least once (the engine's
            # output arrives from another process): so does this one.
            await asyncio.sleep(0)
            ids, finish = self.completion_ids(sampling)
            if on_tokens is not None:
                on_tokens(ids)
        finally:
            self.in_flight -= 1
        self.generated_tokens += len(ids)
        return Completion(ids, [self.logprob] * len(ids), finish, [(version, 0, len(ids))])


def guess_replies(tokenizer, max_number: int) -> list[list[int]]:
    """The token ids of the guesses 1..``max_number`` (a guessing game's
    whole answers), in the order a NullEngine takes them."""
    return [tokenizer.encode(str(k), add_special_tokens=False) for k in range(1, max_number + 1)]


def space_id(tokenizer) -> int:
    """A token that decodes to whitespace (pads a reply to max_tokens without
    changing the number it reads as)."""
    ids = tokenizer.encode(" ", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer encodes ' ' as {ids}, not one token")
    return ids[0]


def uniform_logprob(vocab_size: int) -> float:
    return -math.log(max(2, vocab_size))
