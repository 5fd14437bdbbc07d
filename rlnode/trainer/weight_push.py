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

A member that fails leaves (benched): failures are laid at the actors they
name (a ``PushFailed`` names its peers; a rendezvous that times out names
the ranks that did not come, mapped back to their actors; a plan vote or
broadcast that times out names the members that had not answered
``SILENT_WAIT_S`` later while the others reported it: ``SilentMembers``,
a member stalled after it joined). An actor named
in ``bench_after`` failed conversations in a row, each of which another
member did complete, is left out of the epochs that follow, so the others
keep getting weights and the trainer keeps stepping (``engines_behind``
counts members only). An actor that heartbeats but whose engine cannot load
weights (a frozen engine core) would otherwise be in every epoch and fail
each. A benched actor is probed (``Probe``: every engine answers through
its engine core, no weight job in its way), first ``PROBE_MIN_S`` after it
was benched, then doubling per unanswered probe to ``PROBE_MAX_S``; when it
answers it is let back in and a push is requested at once (rendezvous and
channel check included), on probation: one more failure benches it again,
and each such failed readmission in a row doubles the wait before its first
probe (bounded by ``PROBE_MAX_S``); ``bench_status`` says why (``why``).
A new incarnation of the node (a restart) starts with a clean record.

Guarantees:
  * serialized: one epoch change or push at a time (``lock``);
  * consistent: a push reads the parameters and their version under the
    ``WeightGuard`` that optimizer steps hold, so it never carries a
    half-stepped model and its version names the weights it carries;
  * monotonic: pushes are serialized and each reads the guard's version,
    which only grows (actors also refuse an older version; see
    ``rlnode.actor.weight_receiver.apply_weight_update``);
  * not silent: a failed push is retried in the background (``run``) with
    backoff, ``RETRY_MIN_S`` doubling to ``RETRY_MAX_S`` (at once after a
    member was benched); after ``max_failures`` of the trainer's own failures
    in a row ``health()`` names the problem and the trainer's /healthz turns
    503 (systemd's watchdog then restarts it). A failure is the trainer's own
    unless it names actors while another member did its part: a failure
    that names no one, or every member, says nothing for the trainer's own
    side. A successful push clears it. ``bench_status()`` lists the benched.

Must not train, and must not block the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from rlnode.link.base import LinkError
from rlnode.link.trainer_link import TrainerLink
from rlnode.log import get_logger
from rlnode.weights.broadcast import BroadcastStats, WeightBroadcaster, WeightGuard, update_tensors
from rlnode.weights.lora import adapter_tensors
from rlnode.weights.plan import AdapterSpec, PlanMismatch, TransferError, WeightUpdateError, WeightUpdatePlan
from rlnode.weights.protocol import JoinEpoch, LoadWeights, Probe, WeightCommand
from rlnode.weights.rendezvous import RendezvousError

log = get_logger("rlnode.trainer.weight_push")

# Delay before retrying a failed push (s): RETRY_MIN_S after the first
# failure, doubling per further failure, at most RETRY_MAX_S.
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
# After a vote against a plan, how long to wait for the actors' reasons (s).
REJECT_REASONS_WAIT_S = 5.0
# After the trainer's side of a collective failed, how long members have to
# report that failure (s): each member's side fails on the same group
# timeout, so a live one answers within moments; one still silent then is
# stalled (its receive wedged after it joined) and is named (SilentMembers).
SILENT_WAIT_S = 15.0
# A benched actor's probes (s): the first PROBE_MIN_S after it was benched,
# then doubling per unanswered probe, at most PROBE_MAX_S apart. Each gives
# the engines PROBE_TIMEOUT_S, and the reply PROBE_REPLY_SLACK_S more. An
# actor that answers probes but is benched again before a push with it
# lands (it cannot join: a firewalled rendezvous port) waits longer each
# time: its first probe PROBE_MIN_S * 2**failed_readmissions after it was
# benched, at most PROBE_MAX_S, so it costs the others a failed push per
# PROBE_MAX_S at worst, not one every few seconds.
PROBE_MIN_S = 2.0
PROBE_MAX_S = 30.0
PROBE_TIMEOUT_S = 10.0
PROBE_REPLY_SLACK_S = 5.0


class SilentMembers(TransferError):
    """The trainer's side of a join or an update failed (a vote or broadcast
    timed out: a collective waits for everyone), and some members had not
    answered at all ``SILENT_WAIT_S`` later while others had reported the
    same failure: the silent ones are the stall. ``failed``: peer id -> why."""

    def __init__(self, message: str, failed: dict[str, str]):
        super().__init__(message)
        self.failed = dict(failed)


class PushFailed(WeightUpdateError):
    """Some members did not confirm a join or an update (failed reply,
    timeout, gone) although the trainer's own side completed. ``failed``:
    peer id -> why."""

    def __init__(self, message: str, failed: dict[str, str] | None = None):
        super().__init__(message)
        self.failed = dict(failed or {})


@dataclass
class Benched:
    """An actor left out of the weight group, and its probes."""

    node_id: str
    reason: str  # the failure that benched it
    since: float  # wall clock
    next_probe_at: float  # monotonic
    probes: int = 0  # unanswered since it was benched
    probe_error: str = ""  # why the last probe went unanswered
    failed_readmissions: int = 0  # let back in, then benched again before a push with it landed


class WeightPusher:
    def __init__(self, link: TrainerLink, broadcaster: WeightBroadcaster, model, guard: WeightGuard,
                 request_timeout_s: float = 300.0, max_failures: int = 5, ranks=None, bench_after: int = 2,
                 adapter: AdapterSpec | None = None):
        self.link = link
        # A LoRA run (trainer.lora): pushes carry the adapter of ``model`` (a
        # peft model), which the engines serve as a new adapter per version.
        self.adapter = adapter
        # FSDP ranks (rlnode.trainer.parallel.RankGroup) when the weights are
        # sharded: every rank takes part in each full-tensor gather.
        self.ranks = ranks
        self.broadcaster = broadcaster
        self.model = model
        self.guard = guard
        self.request_timeout_s = request_timeout_s
        self.max_failures = max_failures
        self.bench_after = bench_after
        self.members: dict[str, tuple[str, list]] = {}  # peer_id -> (node_id, its engines)
        self._rank_peer: dict[int, str] = {}  # the current epoch's rank -> the peer whose engine holds it
        self.dirty = True
        self.lock = asyncio.Lock()  # one epoch change or push at a time
        self.pushed_version = -1  # the last version every member confirmed
        self.last_push_s = 0.0
        self.pushes = 0
        self.failures = 0  # in total
        self.failures_in_a_row = 0  # any cause: sets the retry backoff
        self.own_failures_in_a_row = 0  # blamed on no actor (see the module doc): health()
        self.last_error = ""
        self.strikes: dict[str, int] = {}  # peer_id -> failed conversations in a row
        self.benched: dict[str, Benched] = {}  # peer_id -> left out of the group since
        # peer_id -> readmissions in a row that ended benched again (reset by
        # a push that lands with it as a member).
        self.failed_readmissions: dict[str, int] = {}
        self._on_probation: set[str] = set()  # readmitted, no push landed with it yet
        self.benches = 0  # in total
        self.readmissions = 0  # benched actors let back in after answering a probe
        self._bench_changed = asyncio.Event()  # wakes the probe loop
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
        """The group's engines (connected, not benched) hold weights more
        than ``max_lag`` versions older than ``version``: whatever they
        generate now the trainer would drop as stale. None in the group:
        nobody is behind (a benched actor's samples that are too old are
        dropped by the staleness rule; it catches up when it rejoins)."""
        return bool(self._candidates()) and version - self.pushed_version > max_lag

    async def wait_engines(self, version: int, max_lag: int, poll_s: float = 1.0) -> float:
        """Until no engine in the group is behind ``version`` by more than
        ``max_lag`` (a push succeeded, or the lagging actor left or was
        benched); returns
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
        """'' unless the trainer's own pushes keep failing: then why the
        trainer is unhealthy. Failures laid at actors (benched ones) do not
        count: a trainer restart would not fix them."""
        if self.own_failures_in_a_row < self.max_failures:
            return ""
        return (f"weight push failed {self.own_failures_in_a_row} times in a row "
                f"(trainer at version {self.guard.version}, actors at {self.pushed_version}): {self.last_error}")

    def bench_status(self) -> list[dict]:
        """The benched actors, for /status."""
        now = time.monotonic()
        return [{"peer": pid, "node_id": b.node_id, "since": b.since, "reason": b.reason, "probes": b.probes,
                 "next_probe_in_s": round(max(0.0, b.next_probe_at - now), 1), "probe_error": b.probe_error,
                 "failed_readmissions": b.failed_readmissions, "why": _bench_why(b)}
                for pid, b in self.benched.items()]

    def _live_peers(self) -> dict[str, tuple[str, list]]:
        return {pid: (p.node_id, p.engines) for pid, p in self.link.peers().items() if p.connected and p.engines}

    def _candidates(self) -> dict[str, tuple[str, list]]:
        """The actors the next epoch takes: connected with engines, not benched."""
        return {pid: v for pid, v in self._live_peers().items() if pid not in self.benched}

    async def run(self) -> None:
        """Background pushes, forever: for joining actors (``request``),
        retries of failed pushes after their backoff, and the probes that
        let benched actors back in."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._push_loop(), name="weight-pushes")
            tasks.create_task(self._probe_loop(), name="weight-probes")

    async def _push_loop(self) -> None:
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
        return (not self.dirty and set(self._candidates()) == set(self.members)
                and self.pushed_version == self.guard.version)

    async def push(self, version: int | None = None) -> bool:
        """Bring every connected actor to the weights the trainer holds now.
        ``version``: the caller's view of the current version, for the log
        only; the version sent is read with the weights (``WeightGuard``), so
        it is never lower. Returns False when no actor is in the group
        (connected and not benched: nothing to do) or the push failed (then
        a retry is scheduled)."""
        async with self.lock:
            self._forget_replaced()
            live = self._candidates()
            if not live:
                self.members, self.failures_in_a_row, self.own_failures_in_a_row, self.last_error = {}, 0, 0, ""
                await asyncio.to_thread(self.broadcaster.close_group)  # waits for a broadcast in flight
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
        blamed = self._blame(e)
        # Laid at actors only while another member did its part: a failure
        # naming every member says nothing for the trainer's own side.
        benched = []
        if blamed and set(self.members) - set(blamed):
            for pid in self.members:
                self.strikes[pid] = self.strikes.get(pid, 0) + 1 if pid in blamed else 0
                if self.strikes[pid] >= self.bench_after:
                    self._bench(pid, blamed[pid])
                    benched.append(pid)
        else:
            self.own_failures_in_a_row += 1
        # With a member benched the rest go on at once, in a new epoch.
        delay = 0.0 if benched else min(RETRY_MAX_S, RETRY_MIN_S * 2 ** (self.failures_in_a_row - 1))
        self._retry_at = time.monotonic() + delay
        self._due.set()
        log.warning("weights.push_failed", version=self.guard.version, requested=version,
                    in_a_row=self.failures_in_a_row, own_in_a_row=self.own_failures_in_a_row,
                    blamed=sorted(blamed), benched=benched, retry_in_s=delay, error=self.last_error)

    def _blame(self, e: Exception) -> dict[str, str]:
        """The members ``e`` names (peer id -> why): the peers a PushFailed
        lists, the actors whose ranks a rendezvous found missing or
        unproven; {} when it names no one."""
        if isinstance(e, (PushFailed, SilentMembers)):
            return {pid: why for pid, why in e.failed.items() if pid in self.members}
        if isinstance(e, RendezvousError):
            return {self._rank_peer[r]: str(e) for r in e.ranks if self._rank_peer.get(r) in self.members}
        return {}

    def _bench(self, pid: str, why: str) -> None:
        node_id = self.members[pid][0] if pid in self.members else pid.split("/", 1)[0]
        if pid in self._on_probation:  # let back in, and out again before a push with it landed
            self._on_probation.discard(pid)
            self.failed_readmissions[pid] = self.failed_readmissions.get(pid, 0) + 1
        again = self.failed_readmissions.get(pid, 0)
        first_probe_s = min(PROBE_MAX_S, PROBE_MIN_S * 2 ** again)
        self.benched[pid] = Benched(node_id, why[:300], time.time(), time.monotonic() + first_probe_s,
                                    failed_readmissions=again)
        self.benches += 1
        self._bench_changed.set()
        self._progress.set()  # wait_engines: the benched one no longer counts
        log.warning("weights.peer_benched", peer=pid, failures_in_a_row=self.strikes[pid],
                    members_left=[p for p in self.members if p not in self.benched], reason=why[:300])

    def _forget_replaced(self) -> None:
        """Records of peers the link no longer knows (a new incarnation of
        the node replaced them) go: the restarted node starts clean."""
        known = self.link.peers()
        for table in (self.benched, self.strikes, self.failed_readmissions):
            for pid in [p for p in table if p not in known]:
                del table[pid]
        self._on_probation &= set(known)

    async def _probe_loop(self) -> None:
        """Probe each benched actor when its time comes (see the module doc)."""
        while True:
            self._bench_changed.clear()
            self._forget_replaced()
            now = time.monotonic()
            if due := [pid for pid, b in self.benched.items() if b.next_probe_at <= now]:
                await asyncio.gather(*(self._probe(pid, self.benched[pid]) for pid in due))
                continue
            wake = min((b.next_probe_at for b in self.benched.values()), default=None)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._bench_changed.wait(), None if wake is None else wake - now)

    async def _probe(self, pid: str, b: Benched) -> None:
        """One probe of a benched actor: answered, it is let back in (on
        probation: one more failure benches it again) and pushed to at
        once; else the next probe waits twice as long."""
        peer = self.link.peers().get(pid)
        if peer is None or not peer.connected:  # probed once it is back
            b.next_probe_at = time.monotonic() + PROBE_MIN_S
            return
        try:
            reply = await self.link.request(pid, Probe(PROBE_TIMEOUT_S),
                                            timeout_s=PROBE_TIMEOUT_S + PROBE_REPLY_SLACK_S)
            error = "" if reply.ok else reply.error
        except (LinkError, TimeoutError) as e:
            error = repr(e)
        if self.benched.get(pid) is not b:  # forgotten meanwhile
            return
        if error:
            b.probes += 1
            b.probe_error = error[:300]
            delay = min(PROBE_MAX_S, PROBE_MIN_S * 2 ** b.probes)
            b.next_probe_at = time.monotonic() + delay
            log.info("weights.probe_unanswered", peer=pid, probes=b.probes, next_in_s=delay, error=b.probe_error)
            return
        del self.benched[pid]
        self.strikes[pid] = self.bench_after - 1
        self._on_probation.add(pid)
        self.readmissions += 1
        log.info("weights.peer_readmitted", peer=pid, benched_s=round(time.time() - b.since, 1),
                 probes=b.probes + 1)
        self.membership_changed()
        self.request()

    def _succeeded(self, plan: WeightUpdatePlan, stats: BroadcastStats, push_s: float, version: int | None) -> None:
        if self.failures_in_a_row:
            log.info("weights.push_recovered", version=plan.version, after_failures=self.failures_in_a_row,
                     benched=sorted(self.benched))
        self.failures_in_a_row, self.own_failures_in_a_row, self.last_error = 0, 0, ""
        for pid in self.members:
            self.strikes[pid] = 0
            self.failed_readmissions.pop(pid, None)
            self._on_probation.discard(pid)
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
        PushFailed names the members that failed after ``own`` completed;
        SilentMembers those that had not answered ``SILENT_WAIT_S`` after
        ``own`` failed on a collective while others had answered."""
        peers, kind = list(self.members), type(command).__name__
        asks = [asyncio.ensure_future(self.link.request(pid, command, timeout_s=self.request_timeout_s))
                for pid in peers]
        replies = asyncio.gather(*asks, return_exceptions=True)
        try:
            try:
                result = await own
            except PlanMismatch as e:
                await asyncio.wait([replies], timeout=REJECT_REASONS_WAIT_S)
                why = _failed_peers(kind, peers, replies.result()) if replies.done() else {}
                raise PlanMismatch(f"{e}; {why or 'no reasons received'}") from e
            except TransferError as e:
                if isinstance(e, RendezvousError) or len(peers) < 2:
                    raise  # a rendezvous names its missing ranks itself; one member is the whole group
                await asyncio.wait(asks, timeout=SILENT_WAIT_S)
                # Answered: a reply came, success or the same failure. Silent:
                # none yet, or the request itself timed out or was lost.
                silent = [pid for pid, ask in zip(peers, asks)
                          if not ask.done() or ask.cancelled() or ask.exception() is not None]
                if silent and len(silent) < len(peers):
                    why = (f"joined the epoch but did not answer {kind} within {SILENT_WAIT_S:g} s of the "
                           f"trainer's failure ({e}), while the other members did")
                    raise SilentMembers(f"{e}; no answer from {silent}", {pid: why for pid in silent}) from e
                raise
            outcomes = await replies
        finally:
            if not replies.done():
                replies.cancel()
                replies.add_done_callback(_consume)
        if failed := _failed_peers(kind, peers, outcomes):
            raise PushFailed(f"{kind}: {len(failed)} of {len(peers)} actor(s) failed: {failed}", failed)
        return result

    def group_members(self) -> list[str]:
        """The actors in a working epoch (every one of them joined), for
        /status; [] while an epoch forms or after one failed. ``members``
        alone is the epoch tried last: it names an actor whose join is in
        flight or failed, which is not in the group."""
        return [] if self.dirty else sorted(self.members)

    async def _reform(self, live: dict[str, tuple[str, list]]) -> None:
        self.dirty = True  # until every member joined (group_members)
        self.members = live
        # Members are named "<node id>/<engine id>": how an actor finds its ranks.
        owners, engines = zip(*((pid, (f"{node}/{e.engine_id}", e.num_workers, e.host, e.gpus))
                                for pid, (node, es) in live.items() for e in es))
        # A thread: it binds a port and may ask NVML for the trainer's GPU.
        spec = await asyncio.to_thread(self.broadcaster.new_epoch, list(engines))
        self._rank_peer = {r: pid for pid, m in zip(owners, spec.members)
                           for r in range(m.first_rank, m.first_rank + m.num_ranks)}
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
            tensors = adapter_tensors(self.model) if self.adapter is not None else update_tensors(self.model)
            plan = self.broadcaster.plan(tensors, version, adapter=self.adapter)
            loop.call_soon_threadsafe(_resolve, planned, plan)
            return self.broadcaster.broadcast(plan, tensors)


def _bench_why(b: Benched) -> str:
    """What the benched actor's health line says."""
    why = f"benched: {b.reason}"
    if b.failed_readmissions:
        why += (f"; answered probes but failed again after {b.failed_readmissions} readmission(s) in a row "
                "(can it reach the trainer's weight rendezvous ports? trainer.weights.base_port and up)")
    return why


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
