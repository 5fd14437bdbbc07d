"""LLMClient: the one way an episode asks for a completion.

Owns: the pairing of an AdmissionRouter lease with an Engine call. Every
generation goes through here, so every completion comes back with its lease
metadata, and the permit is returned on success, error and cancellation.
"""

from __future__ import annotations

from typing import Callable, Sequence

import msgspec

from rlnode.actor.engine import Completion, Engine, SamplingSettings
from rlnode.actor.router import AdmissionRouter, LeaseMetadata


class Generation(msgspec.Struct, array_like=True):
    """One LLM call: what the engine produced and how it was admitted."""

    completion: Completion
    lease: LeaseMetadata


class LLMClient:
    def __init__(self, engines: list[Engine], router: AdmissionRouter):
        if router.num_engines != len(engines):
            raise ValueError("router and engine list disagree on the number of engines")
        self.engines = engines
        self.router = router

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingSettings,
        affinity: int | None = None,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
        on_admitted: Callable[[], None] | None = None,
    ) -> Generation:
        """``affinity``: the engine this episode used last (prefix reuse);
        ``on_tokens``: streaming callback (see ``Engine.generate``);
        ``on_admitted``: called once the router granted the permit."""
        async with self.router.lease(affinity) as lease:
            if on_admitted is not None:
                on_admitted()
            completion = await self.engines[lease.engine_id].generate(prompt_token_ids, sampling,
                                                                      on_tokens=on_tokens)
            lease.record(len(prompt_token_ids), len(completion.token_ids))
        return Generation(completion, lease.metadata)
