"""A weight push whose peer vanishes fails within the group's timeout and
never hangs, on either end, and the next epoch works.

The peer is a real process on the real gloo transport (rlnode.weights.comm):
it receives the first bucket of a push and then dies (SIGKILL: its sockets
close) or freezes (SIGSTOP: its sockets stay open, nothing moves; what a
partitioned or swapped-out host looks like). No engine: the engine's side of
a failed transfer (notice, discard, old weights kept) is covered in
test_weights and test_push_safety."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from test_weights import _receiver  # rank 1 in a thread: votes, receives
from rlnode.config import WeightSyncConfig
from rlnode.weights.broadcast import WeightBroadcaster, update_tensors
from rlnode.weights.comm import WeightComm, agree_on_plan, keep_stdout
from rlnode.weights.plan import GroupMember, GroupSpec, TransferError, encode
from rlnode.weights.rendezvous import new_secret

TIMEOUT_S = 4.0  # the group's per-collective timeout
# What "within its timeout" may add: detecting the failure, tearing down.
SLACK_S = 6.0

# The peer: joins the group at rank 1 (or 0 with "send"), agrees on the plan,
# moves the first bucket, then does what argv[3] says.
PEER = r"""
import os, signal, sys
import torch
from rlnode.weights.comm import WeightComm, agree_on_plan
from rlnode.weights.plan import decode_plan, decode_spec
spec, plan = decode_spec(bytes.fromhex(sys.argv[1])), decode_plan(bytes.fromhex(sys.argv[2]))
rank = 0 if sys.argv[4] == "send" else 1
print("ready", flush=True)
comm = WeightComm(spec, rank, "cpu")
assert not agree_on_plan(comm, plan.digest(), reject=False)
for i, bucket in enumerate(plan.buckets):
    comm.broadcast(torch.zeros(bucket.nbytes, dtype=torch.uint8))
    print("bucket", i, flush=True)
    if i == 0:
        os.kill(os.getpid(), getattr(signal, sys.argv[3]))
"""


def _model() -> torch.nn.Module:
    # Buckets of 1 MiB: the first moves, the rest meet a vanished peer.
    return torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))


def _peer(spec: GroupSpec, plan, how: str, role: str = "receive") -> subprocess.Popen:
    """Started and past its imports (seconds on a loaded host, which must
    not count against the group's timeout)."""
    proc = subprocess.Popen([sys.executable, "-c", PEER, encode(spec).hex(), encode(plan).hex(), how, role],
                            stdout=subprocess.PIPE, text=True)
    _expect(proc, "ready")
    return proc


def _expect(proc: subprocess.Popen, line: str) -> None:
    """Read the peer's output up to ``line`` (its log lines go there too)."""
    for got in proc.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"peer {proc.pid} ended (code {proc.wait()}) before saying {line!r}")


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(10)
    proc.stdout.close()


def _wait_first_bucket(proc: subprocess.Popen) -> None:
    _expect(proc, "bucket 0")
    # The signal is sent right after the line: let it land.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "Z") or proc.poll() is not None:
            return
        time.sleep(0.01)
    raise AssertionError(f"peer {proc.pid} neither stopped nor died")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_push_whose_receiver_vanishes_fails_within_its_timeout(how):
    """Trainer side: the broadcast raises TransferError within the timeout
    (a killed receiver at once, a frozen one when the collective times
    out), and a new epoch with a live receiver carries the next push."""
    tensors = update_tensors(_model())
    cfg = WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=29500 + os.getpid() % 20000)
    bc = WeightBroadcaster(cfg, master_host="127.0.0.1", timeout_s=TIMEOUT_S)
    spec = bc.new_epoch([("peer/0", 1)])
    # The plan needs the open group; the peer needs the plan: make it on a
    # throwaway copy of the spec's shape (same tensors, same epoch).
    bc.spec = spec
    plan = bc.plan(tensors, 1)
    bc.spec = None
    assert len(plan.buckets) >= 4
    proc = _peer(spec, plan, how)
    try:
        bc.open_group(spec)
        outcome: list = []

        def push() -> None:
            t0 = time.monotonic()
            try:
                bc.broadcast(plan, tensors)
                outcome.append(("sent", time.monotonic() - t0))
            except TransferError as e:
                outcome.append((e, time.monotonic() - t0))

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        _wait_first_bucket(proc)
        pusher.join(TIMEOUT_S + SLACK_S)
        assert not pusher.is_alive(), f"the push hangs {TIMEOUT_S + SLACK_S} s after its receiver got {how}"
        (err, took), = outcome
        assert isinstance(err, TransferError), f"the push to a receiver that got {how} succeeded"
        assert "broadcast failed" in str(err) and took < TIMEOUT_S + SLACK_S
        # The epoch is unusable now, and says so without touching the wire.
        with pytest.raises(TransferError, match="failed earlier"):
            bc.broadcast(plan, tensors)
    finally:
        _end(proc)
    # A new epoch (fresh port and secret) with a live receiver works.
    spec2 = bc.new_epoch([("peer/0", 1)])
    plans: queue.Queue = queue.Queue()
    got: list = []
    joined = threading.Event()
    thread = threading.Thread(target=_receiver, args=(spec2, joined, plans, [False], got))
    try:
        with keep_stdout():
            thread.start()
            bc.open_group(spec2)
        plan2 = bc.plan(tensors, 2)
        plans.put(encode(plan2))
        assert bc.broadcast(plan2, tensors).buckets == len(plan2.buckets)
    finally:
        thread.join(30)
        bc.close_group()
    (received,) = got
    assert received.keys() == dict(tensors).keys() and all(torch.equal(received[n], t) for n, t in tensors)


def test_a_receive_whose_trainer_freezes_fails_within_its_timeout():
    """Engine side: the trainer (rank 0, another process) sends one bucket
    and freezes; the receiving rank's broadcast raises within the timeout
    instead of waiting for bytes that never come."""
    import socket

    tensors = update_tensors(_model())
    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    listen.close()  # the peer binds it as rank 0
    spec = GroupSpec(1, "127.0.0.1", port, 2, "gloo", (GroupMember("me/0", 1),), TIMEOUT_S, secret=new_secret())
    cfg = WeightSyncConfig(backend="gloo", bucket_mb=1)
    bc = WeightBroadcaster(cfg, master_host="127.0.0.1", timeout_s=TIMEOUT_S)
    bc.spec = spec  # only to make the plan
    plan = bc.plan(tensors, 1)
    proc = _peer(spec, plan, "SIGSTOP", role="send")
    comm = None
    try:
        comm = WeightComm(spec, 1, "cpu")
        assert not agree_on_plan(comm, plan.digest(), reject=False)
        comm.broadcast(torch.empty(plan.buckets[0].nbytes, dtype=torch.uint8))
        _wait_first_bucket(proc)
        t0 = time.monotonic()
        with pytest.raises(Exception) as caught:  # gloo's own error type: the timeout
            comm.broadcast(torch.empty(plan.buckets[1].nbytes, dtype=torch.uint8))
        took = time.monotonic() - t0
        assert took < TIMEOUT_S + SLACK_S, took
        assert "imed out" in str(caught.value) or "timeout" in str(caught.value).lower(), caught.value
    finally:
        if comm is not None:
            comm.close()
        _end(proc)


# --------------------------------------------------------------------------
# A member that fails leaves (issue 36): the trainer's WeightPusher over a
# real TrainerLink, two actors on real ActorLinks whose one engine rank each
# is real gloo in a thread (the vLLM side is covered in test_cluster's
# frozen-engine scenario).


class GlooActor:
    """An actor daemon's weight side without vLLM: it answers JoinEpoch,
    LoadWeights and Probe like ``ActorDaemon._handle``, its one engine rank
    on the real gloo transport in a thread. ``frozen``: the daemon
    heartbeats but nothing is answered (its engine core under SIGSTOP)."""

    def __init__(self, endpoint: str, node_id: str, link_cfg):
        from rlnode.link.actor_link import ActorLink

        self.node_id = node_id
        self.link = ActorLink(endpoint, node_id, [(0, 1)], link_cfg)
        self.frozen = False
        # wedged: its weight-receive thread hangs in its next LoadWeights
        # (holding the engine's update lock) and never answers; heartbeats
        # and probes go on. join_fails: it cannot reach the trainer's
        # rendezvous (a firewalled port): every JoinEpoch fails, probes are
        # answered.
        self.wedged = False
        self.join_fails = False
        self._unwedge = threading.Event()
        self.version = -1
        self.received: dict[str, torch.Tensor] = {}
        self.probes = 0
        self._comm: WeightComm | None = None
        self._engine_lock = threading.Lock()  # one join or update at a time, as an engine's update lock
        self._tasks: set[asyncio.Task] = set()
        self._serving: asyncio.Task | None = None

    async def start(self) -> None:
        await self.link.start()
        self._serving = asyncio.create_task(self._serve())

    async def close(self) -> None:
        for t in [self._serving, *self._tasks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [self._serving, *self._tasks] if t is not None), return_exceptions=True)
        self._unwedge.set()
        await self.link.close()
        await asyncio.to_thread(self._leave)

    async def _serve(self) -> None:
        from rlnode.wire import ControlRequest

        while True:
            item = await self.link.next_control()
            if isinstance(item, ControlRequest) and not self.frozen:
                task = asyncio.create_task(self._answer(item))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _answer(self, req) -> None:
        from rlnode.weights.protocol import EpochJoined, JoinEpoch, LoadWeights, ProbeAnswered, WeightsLoaded
        from rlnode.wire import ControlReply

        try:
            match req.command:
                case JoinEpoch(spec=spec):
                    if self.join_fails:
                        raise ConnectionRefusedError(f"cannot reach the rendezvous {spec.master_host}:{spec.master_port}")
                    rank = spec.member(f"{self.node_id}/0").first_rank
                    await asyncio.to_thread(self._join, spec, rank)
                    result = EpochJoined(spec.epoch)
                case LoadWeights() if self.wedged:
                    await asyncio.to_thread(self._wedge)
                    return  # never answered
                case LoadWeights(plan=plan):
                    await asyncio.to_thread(self._receive, plan)
                    result = WeightsLoaded(plan.version, 0.0)
                case _:  # Probe
                    self.probes += 1
                    result = ProbeAnswered(1)
            reply = ControlReply(req.request_id, True, result=result)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, as the daemon does
            reply = ControlReply(req.request_id, False, error=repr(e)[:500])
        if not self.frozen:  # frozen meanwhile: the answer never leaves
            self.link.reply(reply)

    def _leave(self) -> None:
        if self._comm is not None:
            comm, self._comm = self._comm, None
            comm.close()

    def _wedge(self) -> None:
        with self._engine_lock:
            self._unwedge.wait()

    def _join(self, spec: GroupSpec, rank: int) -> None:
        with self._engine_lock:
            self._leave()
            self._comm = WeightComm(spec, rank, "cpu")

    def _receive(self, plan) -> None:
        with self._engine_lock:
            self._receive_locked(plan)

    def _receive_locked(self, plan) -> None:
        from rlnode.weights.plan import unpack_bucket

        assert not agree_on_plan(self._comm, plan.digest(), reject=False)
        received = {}
        for bucket in plan.buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            self._comm.broadcast(buf)
            received.update((n, t.clone()) for n, t in unpack_bucket(bucket, buf))
        self.received, self.version = received, plan.version


class _Stepped:
    skipped = False  # what WeightGuard.step reads: the weights moved


async def _eventually(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _pusher(monkeypatch):
    """A real trainer link and WeightPusher (gloo, TIMEOUT_S per collective,
    bench_after 2, max_failures 2), fast probes; and the link's settings."""
    from rlnode.config import LinkConfig
    from rlnode.link.trainer_link import TrainerLink
    from rlnode.trainer import weight_push as push
    from rlnode.trainer.weight_push import WeightPusher
    from rlnode.weights.broadcast import WeightGuard

    from daemons import free_port

    monkeypatch.setattr(push, "PROBE_MIN_S", 0.2)
    monkeypatch.setattr(push, "PROBE_MAX_S", 1.6)
    monkeypatch.setattr(push, "PROBE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(push, "PROBE_REPLY_SLACK_S", 0.5)
    monkeypatch.setattr(push, "SILENT_WAIT_S", 3.0)  # a live member reports a failed vote within a second
    link_cfg = LinkConfig(heartbeat_s=0.3, peer_timeout_s=10)
    link = TrainerLink(f"tcp://127.0.0.1:{free_port()}", link_cfg)
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=29500 + os.getpid() % 20000),
                           master_host="127.0.0.1", timeout_s=TIMEOUT_S)
    pusher = WeightPusher(link, bc, _model(), WeightGuard(0), request_timeout_s=TIMEOUT_S + 30, max_failures=2,
                          bench_after=2)
    return link, bc, pusher, link_cfg


async def _started(link, link_cfg, names, actors: list) -> dict[str, str]:
    """Start the link, then a GlooActor per name on its endpoint (appended
    to ``actors`` as each starts, for the caller's cleanup); peer ids by name."""
    await link.start()
    for name in names:
        actors.append(GlooActor(link.endpoint, name, link_cfg))
        await actors[-1].start()
    await _eventually(lambda: sum(p.connected for p in link.peers().values()) == len(names), 30, "the actors")
    return {p.node_id: p.peer_id for p in link.peers().values()}


async def _closed(link, bc, actors, background=None) -> None:
    if background is not None:
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)
    for a in actors:
        await a.close()
    await asyncio.to_thread(bc.close_group)
    await link.close()


async def test_a_member_that_keeps_failing_is_benched_and_rejoins_when_it_answers(monkeypatch):
    """Two actors; one freezes (its daemon heartbeats, nothing answers).
    After trainer.weights.bench_after failures named on it (silent in the
    plan vote, then its rank does not join), it is benched: the next push forms an epoch with the healthy
    actor alone and lands, the trainer's wait for its engines no longer
    counts the frozen one, and the failures are not the trainer's own
    (health stays green). While frozen its probes go unanswered; thawed, a
    probe is answered and it rejoins and catches up. Before: every push
    failed ("rank(s) [..] did not join"), the healthy actor got no weights
    either, and health turned red after max_failures."""
    link, bc, pusher, link_cfg = _pusher(monkeypatch)
    model = pusher.model
    actors: list[GlooActor] = []
    background = None
    with keep_stdout():  # ranks of one group initialise gloo in threads of this process
        try:
            pid = await _started(link, link_cfg, ("good", "frozen"), actors)
            good, frozen = actors
            assert await pusher.push()
            assert good.version == frozen.version == 0

            frozen.frozen = True
            await asyncio.to_thread(pusher.guard.step, lambda: _Stepped())
            # The frozen rank never votes on the plan; the healthy actor
            # reports the vote's failure, the frozen one is silent: named
            # (1st failure on it), not the trainer's own.
            assert not await pusher.push()
            assert pusher.strikes[pid["frozen"]] == 1 and pusher.own_failures_in_a_row == 0
            assert pusher.health() == "" and not pusher.benched
            # The failed epoch is not a group: /status shows no members while
            # pusher.members still names the two it tried (before: /status
            # showed both, and a test waiting for both to be in the group
            # went on while one had never joined).
            assert set(pusher.members) == {pid["good"], pid["frozen"]} and pusher.group_members() == []
            assert not await pusher.push()  # a new epoch: its rank does not join (2nd): benched
            assert list(pusher.benched) == [pid["frozen"]], pusher.last_error
            assert "did not join" in pusher.benched[pid["frozen"]].reason
            assert await pusher.push()  # the healthy actor alone, in a new epoch
            assert set(pusher.members) == {pid["good"]} and good.version == pusher.pushed_version == 1
            assert pusher.group_members() == [pid["good"]]
            assert all(torch.equal(good.received[n], t) for n, t in update_tensors(model))
            assert not pusher.engines_behind(pusher.guard.version, 0)
            assert pusher.health() == "" and pusher.own_failures_in_a_row == 0
            (shown,) = pusher.bench_status()
            assert shown["node_id"] == "frozen" and shown["peer"] == pid["frozen"]

            # The probes: unanswered while it is frozen.
            background = asyncio.create_task(pusher.run())
            await _eventually(lambda: pusher.benched[pid["frozen"]].probes >= 2, 30, "two unanswered probes")
            assert frozen.version == 0 and pid["frozen"] in pusher.benched
            await asyncio.to_thread(pusher.guard.step, lambda: _Stepped())
            assert await pusher.push()  # steps go on with the healthy actor
            assert good.version == 2

            frozen.frozen = False  # thawed: the next probe is answered, it rejoins and catches up
            await _eventually(lambda: not pusher.benched and frozen.version == 2 and pusher.pushed_version == 2,
                              60, "the thawed actor to rejoin and catch up")
            assert set(pusher.members) == {pid["good"], pid["frozen"]} and pusher.readmissions == 1
            assert pusher.group_members() == sorted([pid["good"], pid["frozen"]])
            assert frozen.probes >= 1 and pusher.health() == ""
            assert all(torch.equal(frozen.received[n], t) for n, t in update_tensors(model))
        finally:
            await _closed(link, bc, actors, background)


async def test_a_member_that_joins_and_never_votes_is_named_and_benched(monkeypatch):
    """Two actors in a working epoch; one's weight-receive thread wedges
    (it joined, its heartbeats and probes go on, its LoadWeights is never
    answered). The plan vote times out on the trainer's side and on the
    healthy actor's, which reports it; the wedged one stays silent and is
    named: its strike, not the trainer's own failure. The next epoch cannot
    take it (its engine's update lock is held) and it is benched; the
    healthy actor gets the weights, health stays green. Before: the vote's
    TransferError named nobody, counted as the trainer's own, and after
    max_failures (2 here) the trainer's /healthz went red."""
    link, bc, pusher, link_cfg = _pusher(monkeypatch)
    actors: list[GlooActor] = []
    with keep_stdout():
        try:
            pid = await _started(link, link_cfg, ("good", "wedged"), actors)
            good, wedged = actors
            assert await pusher.push() and good.version == wedged.version == 0
            wedged.wedged = True
            await asyncio.to_thread(pusher.guard.step, lambda: _Stepped())
            assert not await pusher.push()
            assert "no answer from" in pusher.last_error and pid["wedged"] in pusher.last_error, pusher.last_error
            assert pusher.strikes == {pid["good"]: 0, pid["wedged"]: 1}
            assert pusher.own_failures_in_a_row == 0 and pusher.health() == ""
            assert not await pusher.push()  # a new epoch: its rank cannot join (2nd strike): benched
            assert list(pusher.benched) == [pid["wedged"]] and pusher.own_failures_in_a_row == 0
            assert await pusher.push() and good.version == 1 and set(pusher.members) == {pid["good"]}
            assert pusher.health() == ""
            (shown,) = pusher.bench_status()
            assert shown["node_id"] == "wedged" and shown["why"].startswith("benched: ")
        finally:
            await _closed(link, bc, actors)


async def test_a_member_that_answers_probes_but_cannot_join_is_readmitted_ever_later(monkeypatch):
    """An actor whose every join fails (the trainer's rendezvous port is
    firewalled from it) but whose probes are answered: benched, readmitted,
    benched again at its first push. Each time it comes back later
    (PROBE_MIN_S doubling per failed readmission, bounded), its bench entry
    says why and names the setting, and the healthy actor gets every
    version; health stays green. Before: readmitted every PROBE_MIN_S, a
    full rendezvous timeout each time, with nothing saying why."""
    from rlnode.trainer import weight_push as push

    link, bc, pusher, link_cfg = _pusher(monkeypatch)
    actors: list[GlooActor] = []
    background = None
    with keep_stdout():
        try:
            pid = await _started(link, link_cfg, ("good", "walled"), actors)
            good, walled = actors
            walled.join_fails = True
            assert not await pusher.push() and not await pusher.push()  # two strikes: benched
            assert list(pusher.benched) == [pid["walled"]] and pusher.benched[pid["walled"]].failed_readmissions == 0
            benched_at: list[tuple[int, float]] = []  # (failed readmissions, seconds to its first probe)
            real_bench = pusher._bench

            def bench(p, why):
                real_bench(p, why)
                b = pusher.benched[p]
                benched_at.append((b.failed_readmissions, round(b.next_probe_at - time.monotonic(), 1)))

            pusher._bench = bench
            background = asyncio.create_task(pusher.run())
            await _eventually(lambda: len(benched_at) >= 3, 120, "three readmissions that failed")
            assert [n for n, _ in benched_at[:3]] == [1, 2, 3]
            assert [d for _, d in benched_at[:3]] == [min(push.PROBE_MAX_S, 0.2 * 2 ** n) for n in (1, 2, 3)]
            (shown,) = pusher.bench_status()
            assert shown["failed_readmissions"] >= 1 and "trainer.weights.base_port" in shown["why"], shown
            assert pusher.readmissions >= 3 and pusher.health() == "" and pusher.own_failures_in_a_row == 0
            assert good.version == pusher.pushed_version == pusher.guard.version  # nothing held back
        finally:
            await _closed(link, bc, actors, background)


def test_bench_after_is_validated():
    from rlnode.config import ConfigError, load_config

    assert load_config(None).trainer.weights.bench_after == 2
    with pytest.raises(ConfigError, match=r"trainer\.weights\.bench_after"):
        load_config(None, ["trainer.weights.bench_after=0"])


async def test_a_trainer_whose_actor_freezes_keeps_stepping_healthy(tiny_model_dir, tmp_path):
    """The trainer daemon's own loop: with one of two actors frozen it
    benches that one and keeps stepping past max_lag with the other,
    /healthz stays green and its watchdog is not asked to restart it (a
    restart cannot thaw an actor); /status names the benched actor. Before:
    the loop held its step (waiting_for_engines) while every push failed,
    and /healthz turned red after max_failures."""
    from test_push_safety import _stale_group, _trainer_cfg, _trainer_running

    cfg = _trainer_cfg(tiny_model_dir, tmp_path, "trainer.weights.timeout_s=3", "trainer.weights.max_failures=2",
                       "actor.scheduler.max_lag=1", "trainer.weights.bench_after=2")
    endpoint = f"tcp://127.0.0.1:{cfg.trainer.port}"
    actors: list[GlooActor] = []
    with keep_stdout():
        async with _trainer_running(cfg) as (trainer, _run):
            try:
                for name in ("good", "frozen"):
                    actors.append(GlooActor(endpoint, name, cfg.link))
                    await actors[-1].start()
                good, frozen = actors
                await _eventually(lambda: good.version == frozen.version == 0, 60, "version 0 on both actors")
                frozen.frozen = True
                for step in range(4):  # four steps' worth, each fresh when it is trained
                    v = trainer.version
                    for i in range(2):
                        trainer.buffer.put(_stale_group(f"s{step}g{i}", v))
                    await _eventually(lambda: trainer.version > v, 120, f"step {step + 1}")
                    ok, why = trainer.healthy()
                    assert ok and not trainer.restart_would_help(), why
                assert trainer.step == 4 and good.version >= 3 and frozen.version == 0
                st = trainer.status()["weights"]
                assert [b["node_id"] for b in st["benched"]] == ["frozen"] and st["benches"] == 1, st
                assert [m.split("/")[0] for m in st["members"]] == ["good"], st
            finally:
                for a in actors:
                    await a.close()


def test_probe_travels_in_a_control_request_and_its_answer_back():
    """Probe / ProbeAnswered are appended members of the weight unions: each
    end's typed decoder reads them, and a failed probe's reply carries why."""
    import msgspec

    from rlnode.weights.protocol import Probe, ProbeAnswered
    from rlnode.wire import ControlReply, ControlRequest, ToActor, ToTrainer

    to_actor, to_trainer = msgspec.msgpack.Decoder(ToActor), msgspec.msgpack.Decoder(ToTrainer)
    enc = msgspec.msgpack.Encoder()
    assert to_actor.decode(enc.encode(ControlRequest(7, Probe(2.5)))) == ControlRequest(7, Probe(2.5))
    reply = ControlReply(7, True, result=ProbeAnswered(2))
    assert to_trainer.decode(enc.encode(reply)) == reply
    assert to_trainer.decode(enc.encode(ControlReply(7, False, error="engine 0: no answer"))).error.startswith("engine 0")
