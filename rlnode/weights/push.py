"""WeightPusher: gets the trainer's weights into every actor's engines.

Owns: the trainer side of the weight-update conversation over the link:
which actors form the current group epoch, re-forming the epoch when an
actor joins or leaves, and pushing a version to every member while their
engines keep generating. The bytes move through ``WeightBroadcaster``
(torch.distributed); the requests and replies through ``TrainerLink``.

The conversation, per actor (``rlnode.weights.protocol``):
  JoinEpoch(spec)    -> the actor's engines join epoch N (ranks given)
  LoadWeights(plan)  -> the engines pause (keep), receive, load, resume
The trainer runs its own side (rendezvous / broadcast) in a thread at the
same time. A member that fails or times out marks the epoch dirty: the next
push forms a new epoch without it (and with anyone who joined) and sends
the current weights, so a rejoining actor catches up at once.

Guarantees:
  * serialized: one epoch change or push at a time (``lock``);
  * consistent: a push reads the parameters and their version under the
    ``WeightGuard`` that optimizer steps hold, so it never carries a
    half-stepped model and its version names the weights it carries;
  * monotonic: pushes are serialized and each reads the guard's version,
    which only grows (actors also refuse an older version; see
    ``rlnode.actor.weight_receiver.apply_weight_update``);
  * not silent: a failed push is retried in the background (``run``) with
    backoff, ``RETRY_MIN_S`` doubling to ``RETRY_MAX_S``; after
    ``max_failures`` failures in a row ``health()`` names the problem and the
    trainer's /healthz turns 503 (systemd's watchdog then restarts it). A
    successful push clears it.

Must not train, and must not block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from rlnode.link.base import LinkError
from rlnode.link.trainer_link import TrainerLink
from rlnode.log import get_logger
from rlnode.weights.broadcast import BroadcastStats, WeightBroadcaster, WeightGuard, update_tensors
from rlnode.weights.plan import PlanMismatch, WeightUpdateError, WeightUpdatePlan
from rlnode.weights.protocol import JoinEpoch, LoadWeights, WeightCommand

log = get_logger("rlnode.weights.push")

# Delay before retrying a failed push (s): RETRY_MIN_S after the first
# failure, doubling per further failure, at most RETRY_MAX_S.
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
# After a vote against a plan, how long to wait for the actors' reasons (s).
REJECT_REASONS_WAIT_S = 5.0


class PushFailed(WeightUpdateError):
    """Some members did not confirm a join or an update (failed reply,
    timeout, gone) although the trainer's own side completed."""


class WeightPusher:
    def __init__(self, link: TrainerLink, broadcaster: WeightBroadcaster, model, guard: WeightGuard,
                 request_timeout_s: float = 300.0, max_failures: int = 5, ranks=None):
        self.link = link
        # FSDP ranks (rlnode.trainer.parallel.RankGroup) when the weights are
        # sharded: every rank takes part in each full-tensor gather.
        self.ranks = ranks
        self.broadcaster = broadcaster
        self.model = model
        self.guard = guard
        self.request_timeout_s = request_timeout_s
        self.max_failures = max_failures
        self.members: dict[str, tuple[str, list]] = {}  # peer_id -> (node_id, its engines)
        self.dirty = True
        self.lock = asyncio.Lock()  # one epoch change or push at a time
        self.pushed_version = -1  # the last version every member confirmed
        self.last_push_s = 0.0
        self.pushes = 0
        self.failures = 0  # in total
        self.failures_in_a_row = 0
        self.last_error = ""
        # Background pushes (``run``): wanted at all / wanted now (a join).
        self._due = asyncio.Event()
        self._now = asyncio.Event()
        self._retry_at = 0.0
        # Set on every successful push and membership change (wait_engines).
        self._progress = asyncio.Event()

    def membership_changed(self) -> None:
        self.dirty = True
        self._progress.set()

    def engines_behind(self, version: int, max_lag: int) -> bool:
        """Connected engines hold weights more than ``max_lag`` versions
        older than ``version``: whatever they generate now the trainer would
        drop as stale. No engine connected: nobody is behind."""
        return bool(self._live_peers()) and version - self.pushed_version > max_lag

    async def wait_engines(self, version: int, max_lag: int, poll_s: float = 1.0) -> float:
        """Until no connected engine is behind ``version`` by more than
        ``max_lag`` (a push succeeded, or the lagging actor left); returns
        the seconds waited. The train loop calls this before each step so a
        failing push holds the trainer back instead of letting it step ahead
        on batches it must then drop whole."""
        t0 = time.monotonic()
        while self.engines_behind(version, max_lag):
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), poll_s)
        return time.monotonic() - t0

    def request(self) -> None:
        """Ask ``run`` to push the current weights now (an actor joined)."""
        self._retry_at = 0.0
        self._due.set()
        self._now.set()

    def health(self) -> str:
        """'' while pushes work; else why the trainer is unhealthy."""
        if self.failures_in_a_row < self.max_failures:
            return ""
        return (f"weight push failed {self.failures_in_a_row} times in a row "
                f"(trainer at version {self.guard.version}, actors at {self.pushed_version}): {self.last_error}")

    def _live_peers(self) -> dict[str, tuple[str, list]]:
        return {pid: (p.node_id, p.engines) for pid, p in self.link.peers().items() if p.connected and p.engines}

    async def run(self) -> None:
        """Background pushes, forever: for joining actors (``request``) and
        retries of failed pushes after their backoff."""
        while True:
            await self._due.wait()
            delay = self._retry_at - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._now.wait(), delay)
            self._due.clear()
            self._now.clear()
            if self._up_to_date():
                continue  # a retry that a later push made moot
            await self.push()

    def _up_to_date(self) -> bool:
        """Every live actor confirmed the guard's version on a clean epoch.
        Read without the guard: mid-step it sees the old version, and the
        train loop pushes the new one after the step anyway."""
        return (not self.dirty and set(self._live_peers()) == set(self.members)
                and self.pushed_version == self.guard.version)

    async def push(self, version: int | None = None) -> bool:
        """Bring every connected actor to the weights the trainer holds now.
        ``version``: the caller's view of the current version, for the log
        only; the version sent is read with the weights (``WeightGuard``), so
        it is never lower. Returns False when no actor is connected (nothing
        to do) or the push failed (then a retry is scheduled)."""
        async with self.lock:
            live = self._live_peers()
            if not live:
                self.members, self.failures_in_a_row, self.last_error = {}, 0, ""
                self.broadcaster.close_group()
                return False
            try:
                if self.dirty or set(live) != set(self.members):
                    await self._reform(live)
                plan, stats, push_s = await self._push()
            except (WeightUpdateError, LinkError) as e:
                self._failed(e, version)
                return False
            self._succeeded(plan, stats, push_s, version)
            return True

    def _failed(self, e: Exception, version: int | None) -> None:
        self.dirty = True
        self.failures += 1
        self.failures_in_a_row += 1
        self.last_error = f"{type(e).__name__}: {e}"[:500]
        delay = min(RETRY_MAX_S, RETRY_MIN_S * 2 ** (self.failures_in_a_row - 1))
        self._retry_at = time.monotonic() + delay
        self._due.set()
        log.warning("weights.push_failed", version=self.guard.version, requested=version,
                    in_a_row=self.failures_in_a_row, retry_in_s=delay, error=self.last_error)

    def _succeeded(self, plan: WeightUpdatePlan, stats: BroadcastStats, push_s: float, version: int | None) -> None:
        if self.failures_in_a_row:
            log.info("weights.push_recovered", version=plan.version, after_failures=self.failures_in_a_row)
        self.failures_in_a_row, self.last_error = 0, ""
        self.pushed_version = plan.version
        self._progress.set()
        self.last_push_s = push_s
        self.pushes += 1
        log.info("weights.pushed", version=plan.version, requested=version, epoch=plan.epoch,
                 peers=len(self.members), bytes=plan.nbytes, push_s=round(push_s, 3),
                 agree_s=stats.agree_s, transfer_s=stats.transfer_s)

    async def _converse(self, command: WeightCommand, own: asyncio.Future):
        """Send ``command`` to every member while the trainer's side (``own``)
        runs; returns ``own``'s result. When ``own`` fails its error is
        raised without waiting out the replies (a hung actor would hold the
        push for the whole request timeout; the epoch is unusable anyway),
        except after a vote against the plan: the receivers decided already,
        so their reasons are waited for (briefly) and named in the error.
        PushFailed names the members that failed after ``own`` completed."""
        peers, kind = list(self.members), type(command).__name__
        replies = asyncio.gather(*(
            self.link.request(pid, command, timeout_s=self.request_timeout_s) for pid in peers
        ), return_exceptions=True)
        try:
            try:
                result = await own
            except PlanMismatch as e:
                await asyncio.wait([replies], timeout=REJECT_REASONS_WAIT_S)
                why = _failed_peers(kind, peers, replies.result()) if replies.done() else {}
                raise PlanMismatch(f"{e}; {why or 'no reasons received'}") from e
            outcomes = await replies
        finally:
            if not replies.done():
                replies.cancel()
                replies.add_done_callback(_consume)
        if failed := _failed_peers(kind, peers, outcomes):
            raise PushFailed(f"{kind}: {len(failed)} of {len(peers)} actor(s) failed: {failed}")
        return result

    async def _reform(self, live: dict[str, tuple[str, list]]) -> None:
        self.members = live
        # Members are named "<node id>/<engine id>": how an actor finds its ranks.
        engines = [(f"{node}/{e.engine_id}", e.num_workers, e.host, e.gpus) for node, es in live.values() for e in es]
        spec = self.broadcaster.new_epoch(engines)
        own = asyncio.ensure_future(self.broadcaster.open_group_async(spec))
        await self._converse(JoinEpoch(spec), own)
        self.dirty = False
        log.info("weights.epoch", epoch=spec.epoch, world_size=spec.world_size, peers=list(live))

    async def _push(self) -> tuple[WeightUpdatePlan, BroadcastStats, float]:
        """One update on the current epoch: the plan is made and the
        parameters read inside the guard, in the broadcast's thread; the
        plan reaches the actors as soon as it exists."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        planned: asyncio.Future[WeightUpdatePlan] = loop.create_future()
        own = asyncio.ensure_future(asyncio.to_thread(self._read_and_broadcast, loop, planned))
        await asyncio.wait([planned, own], return_when=asyncio.FIRST_COMPLETED)
        if not planned.done():
            own.result()  # failed before planning: raises
        plan = planned.result()
        stats = await self._converse(LoadWeights(plan), own)
        return plan, stats, time.perf_counter() - t0

    def _read_and_broadcast(self, loop: asyncio.AbstractEventLoop,
                            planned: asyncio.Future) -> BroadcastStats:
        """Blocking (a worker thread): under the guard, read the version and
        the parameters, hand the plan to the loop, broadcast."""
        with self.guard.reading() as version:
            if self.ranks is not None:
                return self.ranks.push(self.broadcaster, version,
                                       lambda plan: loop.call_soon_threadsafe(_resolve, planned, plan))
            tensors = update_tensors(self.model)
            plan = self.broadcaster.plan(tensors, version)
            loop.call_soon_threadsafe(_resolve, planned, plan)
            return self.broadcaster.broadcast(plan, tensors)


def _failed_peers(kind: str, peers: list[str], outcomes: list) -> dict[str, str]:
    failed = {}
    for pid, r in zip(peers, outcomes):
        if isinstance(r, BaseException) or not r.ok:
            failed[pid] = repr(r) if isinstance(r, BaseException) else r.error
            log.warning("weights.peer_failed", peer=pid, kind=kind, error=failed[pid])
    return failed


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # dropped replies: read, so asyncio does not warn


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
