"""Admission of agent starts: how many external agents may be *starting* at
once on this node (``actor.scheduler.max_starting_agents``).

An external agent's start (a sandbox, an interpreter, its imports: verifiers'
chat program spends 1.4-1.9 CPU-s in ``import openai`` alone) is CPU work
that produces no token. Started all at once, 64 of them share two cores for
a minute, none reaches its first LLM call, and the engine idles while every
episode's deadline runs out. Admitted a few at a time, each start gets the
CPU, reaches the model within seconds, and the next one starts while the
engine serves it.

An episode holds a start slot from its admission until its first request
reaches the gateway (its agent is up: a model or env call of its session)
or it ends, whichever is first. Its ``timeout_s`` counts from its admission:
the wait for a slot is time spent behind other episodes, not this one's
(reported as the phase ``start_wait_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import AsyncIterator


def daemon_cpus() -> set[int]:
    """The CPUs this process may run on (a unit's CPUAffinity, a cgroup's
    cpuset as the kernel applies it to the affinity mask)."""
    try:
        return os.sched_getaffinity(0) or {0}
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def node_cpus() -> int:
    return len(daemon_cpus())


def bound_cpus(omp_threads_bind: str) -> set[int]:
    """The CPUs of ``VLLM_CPU_OMP_THREADS_BIND`` ("0-3", "0,2", "0-1|2-3"
    per rank; "auto" / "nobind": none of them for the engine alone)."""
    cpus: set[int] = set()
    for part in omp_threads_bind.replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def default_limit(engine_device: str, omp_threads_bind: str) -> int:
    """One start per CPU of this daemon, less those bound to a CPU engine's
    threads: an agent's start on a core the engine computes on stalls the
    engine's OpenMP threads for all of its running calls (64 reverse_text
    episodes on 2 cores: 31 of 64 first tries timed out with the engine
    unbound, none with it on core 0 and the agents on core 1)."""
    mine = daemon_cpus()
    if engine_device == "cpu":
        mine = mine - bound_cpus(omp_threads_bind)
    return max(1, len(mine))


class AgentStarts:
    """At most ``limit`` agents starting at once (``limit`` 0: one per CPU)."""

    def __init__(self, limit: int = 0):
        self.limit = limit or node_cpus()
        self._slots = asyncio.Semaphore(self.limit)
        self.starting = 0  # episodes holding a slot now (a gauge)
        self.waiting = 0  # episodes waiting for one

    @contextlib.asynccontextmanager
    async def admit(self, up: asyncio.Event) -> AsyncIterator[None]:
        """Wait for a slot; hold it until ``up`` is set or the block ends."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.starting += 1
        held = True

        def release(_=None) -> None:
            nonlocal held
            if held:
                held = False
                self.starting -= 1
                self._slots.release()

        watch = asyncio.ensure_future(up.wait())
        watch.add_done_callback(release)
        try:
            yield
        finally:
            watch.cancel()
            release()


__all__ = ["AgentStarts", "bound_cpus", "daemon_cpus", "default_limit", "node_cpus"]
