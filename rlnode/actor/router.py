"""AdmissionRouter: the per-generation gate in front of this node's engines.

Owns: how many generations run on each engine at once (``llm_max_rollouts``
permits per engine), which engine a generation goes to, and the timing
metadata of every lease. Holds no tasks, sockets or engines of its own: it is
a small state machine driven by ``acquire``/``release``, so it is tested
directly and under the real engine alike.

One *lease* covers one LLM call, not an episode: an episode that is waiting
for a tool holds no permit. Engine choice: the episode's previous engine
(affinity, for prefix-cache reuse) if it has a free permit, else the
least-loaded engine. When every engine is full, callers wait in FIFO order
and a released permit is handed straight to the oldest waiter.

Release is guaranteed: ``lease()`` is a context manager, and a waiter that is
cancelled after it was granted a permit gives the permit back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec

from rlnode.wire import LeaseMetadata  # the lease's record travels in every sample


@dataclass(eq=False)
class Lease:
    """A permit to run one generation on ``engine_id``."""

    route_id: int
    engine_id: int
    requested_mono: float
    granted_mono: float = 0.0
    started_at: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    metadata: LeaseMetadata | None = None  # set on release

    def record(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Token counts of the generation, for the lease metadata."""
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class RouterStats(msgspec.Struct):
    in_flight: list[int]  # per engine
    max_in_flight: list[int]  # per engine, high-water mark since start
    waiting: int
    leases_granted: int
    leases_released: int
    wait_s_p50: float
    wait_s_p99: float
    wait_s_max: float
    wait_s_sum: float


class _Waiter:
    __slots__ = ("future", "affinity", "lease")

    def __init__(self, future: asyncio.Future, affinity: int | None, lease: Lease):
        self.future = future
        self.affinity = affinity
        self.lease = lease


class AdmissionRouter:
    # Wait times kept for quantiles (a bounded window of the most recent).
    WAIT_WINDOW = 4096

    def __init__(self, num_engines: int, llm_max_rollouts: int, affinity: bool = True):
        if num_engines < 1 or llm_max_rollouts < 1:
            raise ValueError("num_engines and llm_max_rollouts must be >= 1")
        self.num_engines = num_engines
        self.capacity = llm_max_rollouts
        self.affinity_enabled = affinity
        self._in_flight = [0] * num_engines
        self._max_in_flight = [0] * num_engines
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._route_ids = itertools.count(1)
        self._granted = 0
        self._released = 0
        self._waits: collections.deque[float] = collections.deque(maxlen=self.WAIT_WINDOW)
        self._wait_sum = 0.0
        self._wait_max = 0.0

    # -- engine choice -------------------------------------------------------

    def _pick(self, affinity: int | None) -> int | None:
        """Engine to run on now, or None when every engine is full."""
        if (
            self.affinity_enabled
            and affinity is not None
            and 0 <= affinity < self.num_engines
            and self._in_flight[affinity] < self.capacity
        ):
            return affinity
        best = min(range(self.num_engines), key=self._in_flight.__getitem__)
        return best if self._in_flight[best] < self.capacity else None

    def _grant(self, lease: Lease, engine_id: int) -> None:
        lease.engine_id = engine_id
        lease.granted_mono = time.monotonic()
        lease.started_at = time.time()
        self._in_flight[engine_id] += 1
        if self._in_flight[engine_id] > self._max_in_flight[engine_id]:
            self._max_in_flight[engine_id] = self._in_flight[engine_id]
        self._granted += 1
        wait = lease.granted_mono - lease.requested_mono
        self._waits.append(wait)
        self._wait_sum += wait
        self._wait_max = max(self._wait_max, wait)

    # -- public API ----------------------------------------------------------

    async def acquire(self, affinity: int | None = None) -> Lease:
        """Wait for a permit. ``affinity`` = preferred engine id (or None)."""
        lease = Lease(route_id=next(self._route_ids), engine_id=-1, requested_mono=time.monotonic())
        # Waiters queue strictly FIFO: a newcomer never overtakes them.
        if not self._waiters:
            engine = self._pick(affinity)
            if engine is not None:
                self._grant(lease, engine)
                return lease
        waiter = _Waiter(asyncio.get_running_loop().create_future(), affinity, lease)
        self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted in the same tick we were cancelled: give it back.
                self.release(lease)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        return lease

    def release(self, lease: Lease) -> LeaseMetadata:
        """Return the permit; idempotent. Returns the lease's metadata."""
        if lease.metadata is not None:
            return lease.metadata
        now = time.monotonic()
        self._in_flight[lease.engine_id] -= 1
        self._released += 1
        lease.metadata = LeaseMetadata(
            route_id=lease.route_id,
            engine_id=lease.engine_id,
            lease_wait_s=lease.granted_mono - lease.requested_mono,
            llm_latency_s=now - lease.granted_mono,
            prompt_tokens=lease.prompt_tokens,
            completion_tokens=lease.completion_tokens,
            started_at=lease.started_at,
            finished_at=lease.started_at + (now - lease.granted_mono),
        )
        self._wake_waiters()
        return lease.metadata

    def _wake_waiters(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():  # cancelled while queued
                self._waiters.popleft()
                continue
            engine = self._pick(head.affinity)
            if engine is None:
                return
            self._waiters.popleft()
            self._grant(head.lease, engine)
            head.future.set_result(None)

    @contextlib.asynccontextmanager
    async def lease(self, affinity: int | None = None) -> AsyncIterator[Lease]:
        """``async with router.lease(prev_engine) as lease:`` — released on
        success, error and cancellation alike."""
        lease = await self.acquire(affinity)
        try:
            yield lease
        finally:
            self.release(lease)

    # -- observability -------------------------------------------------------

    @property
    def in_flight(self) -> list[int]:
        return list(self._in_flight)

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    def stats(self) -> RouterStats:
        waits = sorted(self._waits)

        def q(p: float) -> float:
            if not waits:
                return 0.0
            return waits[min(len(waits) - 1, int(p * len(waits)))]

        return RouterStats(
            in_flight=list(self._in_flight),
            max_in_flight=list(self._max_in_flight),
            waiting=self.waiting,
            leases_granted=self._granted,
            leases_released=self._released,
            wait_s_p50=q(0.5),
            wait_s_p99=q(0.99),
            wait_s_max=self._wait_max,
            wait_s_sum=self._wait_sum,
        )
