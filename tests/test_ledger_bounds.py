"""Issue 20: no fault and no peer can drain the credit ledger.

Leaks: a group the actor's link refuses, or one whose task fails after
admission, gives its credit back (counted, logged); a failed background
task is logged; a config whose groups cannot fit a frame is refused at
load; a run where no group arrives raises an alarm.
Bounds: what an authenticated peer reports (want, started, returned) and
delivers cannot take more than its share; group ids are bound to their
sender; incarnations are tokens; a node announces a bounded number of
engines and workers. Real ZeroMQ on loopback, as in test_link."""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest
import structlog.testing
import zmq
import zmq.asyncio

from rlnode.actor.episode import EpisodeResult
from rlnode.actor.scheduler import Group, RolloutScheduler, VersionSource
from rlnode.config import ConfigError, LinkConfig, SchedulerConfig, load_config, max_group_bytes
from rlnode.cubes.base import CubeTaskRef
from rlnode.aio import spawn
from rlnode.link import ActorLink, LinkFatalError, TrainerLink
from rlnode.link.credits import MAX_WANT, CreditLedger
from rlnode.link.peers import MAX_RANKS_PER_NODE
from rlnode.actor.scheduler import group_to_delivery
from rlnode.wire import (
    REJECT_INVALID_GROUP, REJECT_PROTOCOL, CreditReport, EngineInfo, GroupDelivery, Register, Reject, ToActor,
    Welcome, )

from test_credits import group
from test_link import ANY_PORT, ENC, sample, until

FAST = LinkConfig(heartbeat_s=0.1, peer_timeout_s=1.0)


def report(want: int, started: int = 0, returned: int = 0) -> CreditReport:
    return CreditReport("s1", want, started, returned)


def _ledger(budget: int | None, **wants: int) -> CreditLedger:
    led = CreditLedger("s1", budget)
    for peer, want in wants.items():
        led.peer_joined(peer)
        led.on_report(peer, report(want))
    return led


# ---- the ledger's bounds ------------------------------------------------------


def test_an_inflated_returned_count_cannot_take_the_budget():
    led = _ledger(8, a=4, b=4)
    led.grant()
    assert (led.peers["a"].granted, led.peers["b"].granted) == (4, 4)
    # a claims it gave back a million credits it never had. Unbounded, its
    # hands would look empty for ever: every grant round would hand it all
    # that is free, and none of it would count against the budget.
    led.on_report("a", report(4, started=4, returned=10**6))
    for _ in range(5):
        led.grant()
    a = led.peers["a"]
    # Clamped to what it held (4): it is topped up once to its want, no more.
    assert (a.returned, a.granted, a.in_hands) == (4, 8, 4)
    assert led.returned_total == 4 and led.clamped_reports == 1
    assert led.outstanding() == 8


def test_want_is_capped_at_the_budget_or_max_want():
    led = _ledger(6, a=10**9, b=2)
    assert led.peers["a"].want == 6 and led.clamped_reports == 1  # past MAX_WANT: no honest actor says that
    # Room for more than the budget is normal (the demo's actor wants 32
    # of 8): capped, not counted or logged as an anomaly.
    led.on_report("b", report(7, started=led.peers["b"].started))
    assert led.peers["b"].want == 6 and led.clamped_reports == 1
    led.on_report("b", report(2, started=led.peers["b"].started))
    led.grant()
    # Shared by demand with a's want at most the whole budget: b gets its 2
    # (uncapped, a's 1e9 would leave b 1 credit of 6).
    assert (led.peers["a"].granted, led.peers["b"].granted) == (4, 2)
    # Without a budget (bare links) grant() loops once per credit: a claim of
    # 10 * MAX_WANT stops at MAX_WANT instead of spinning the trainer's loop.
    bare = _ledger(None, a=10 * MAX_WANT)
    bare.grant()
    assert bare.peers["a"].granted == MAX_WANT


def test_deliveries_beyond_the_grant_refund_nothing():
    led = _ledger(4, a=2, b=2)
    led.grant()
    # a sends ten junk groups under this session (rejected as invalid: they
    # cost it nothing). Counted as delivered, they would push its hands below
    # zero, and every later grant would go to it without counting.
    for i in range(10):
        led.on_delivered("a", "s1", f"junk{i}", accepted=False)
    for _ in range(5):
        led.grant()
    a = led.peers["a"]
    assert (a.delivered, a.granted, a.in_hands) == (2, 4, 2) and led.uncredited == 8
    assert led.outstanding() == 4


# ---- leaks on the actor ---------------------------------------------------------


def test_groups_without_a_credit_wait_only_within_the_senders_share():
    """Deliveries no credit paid for (an older session's, resent after a
    trainer restart; or a peer past its grant) may wait for a step only up
    to the sender's share of the budget: one peer cannot fill the trainer."""
    led = _ledger(4, a=2, b=2)
    assert led.share() == 2  # budget 4 over 2 connected peers
    for i in range(2):
        assert led.admits("a", "old")
        led.on_delivered("a", "old", f"a{i}", accepted=True)
    assert not led.admits("a", "old") and led.uncredited_refused == 1
    assert led.admits("b", "old")  # b's share is its own
    led.grant()
    assert led.admits("a", "s1")  # a credit of this session: always
    led.release(["a0"])  # a step consumed one
    assert led.admits("a", "old")
    assert led.summary()["uncredited_refused"] == 1


def _group(gid: str, session: str, tokens: int) -> Group:
    """A scheduler Group whose one sample carries ``tokens`` prompt tokens."""
    s = sample(gid, 0, 0, node_tokens=tokens)
    ep = EpisodeResult(f"{gid}/e0", gid, "arith", "t1", 1.0, True, 1, "done", 0, 0.1, [s])
    return Group(gid, CubeTaskRef("arith", "t1"), 0, [ep], session)


async def test_a_group_the_link_refuses_gives_its_credit_back():
    from rlnode.actor.daemon import TrainerGroupSink

    trainer = TrainerLink(ANY_PORT, FAST, credit_budget=2)
    await trainer.start()
    actor = ActorLink(trainer.endpoint, "a", [(0, 1)], FAST, credit_want=2, max_frame_bytes=64 << 10)
    try:
        await actor.start()
        await until(lambda: actor.credits.granted == 2, 5, "the budget to be granted")
        sink = TrainerGroupSink(actor, "a")
        prefix = f"a-{actor.incarnation}-"
        # Over the frame limit: the link refuses it after all its episodes ran.
        await sink.put(_group(f"{prefix}g0000000", await asyncio.wait_for(actor.credits.acquire(), 5), tokens=100_000))
        # A second group under an id the link already holds (a bug, but a
        # credit was spent on it): refused too.
        await sink.put(_group(f"{prefix}g0000001", await asyncio.wait_for(actor.credits.acquire(), 5), tokens=8))
        await sink.put(_group(f"{prefix}g0000001", await asyncio.wait_for(actor.credits.acquire(), 5), tokens=8))
        c = actor.counters()
        assert (c.dropped_oversize, c.duplicate_submits, c.submitted) == (1, 1, 1)
        assert (sink.lost, sink.submitted, actor.credits.returned) == (2, 1, 2)
        # The trainer hears of it and grants the two credits again: the actor
        # keeps running two groups, not zero.
        peer = trainer.credits.peers[f"a/{actor.incarnation}"]
        await until(lambda: peer.returned == 2 and actor.credits.granted == 4, 5, "the lost credits to come back")
        assert trainer.credits.outstanding() == 2
    finally:
        await actor.close()
        await trainer.close()


class _Gate:
    def __init__(self):
        self.started, self.returned = 0, []

    async def acquire(self) -> str:
        if self.started:  # one group is enough
            await asyncio.Event().wait()
        self.started += 1
        return "s1"

    def give_back(self, session: str) -> None:
        self.returned.append(session)


class _FailingOut:
    async def put(self, group) -> None:
        raise RuntimeError("sink broke")


async def test_a_group_that_fails_after_admission_gives_its_credit_back_and_is_logged():
    cube = types.SimpleNamespace(task_ids=None)

    async def task_ids(split):
        return ["t1"]

    cube.task_ids = task_ids
    gate = _Gate()
    sched = RolloutScheduler({"c": cube}, {"c": 1.0}, [], None, None, SchedulerConfig(attempts=2), None,
                             VersionSource(0), id_prefix="n-1-", gate=gate)

    async def one_episode(ref, episode_id, group_id, settings):
        return EpisodeResult(episode_id, group_id, "c", ref.task_id, 1.0, True, 1, "done", 0, 0.0, [])

    sched._one_episode = one_episode
    await sched.prepare()
    with structlog.testing.capture_logs() as logs:
        run = asyncio.create_task(sched.run(_FailingOut()))
        await until(lambda: gate.returned, 5, "the credit to come back")
        await asyncio.sleep(0.05)  # the task's done-callbacks run
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    assert gate.returned == ["s1"] and sched.groups_failed == 1
    events = {e["event"]: e for e in logs}
    assert events["group.failed"]["group"] == "n-1-g0000000"
    assert "sink broke" in events["task.failed"]["error"]


async def test_spawn_logs_a_task_that_fails():
    tasks: set[asyncio.Task] = set()

    async def boom():
        raise ValueError("lost in the background")

    with structlog.testing.capture_logs() as logs:
        t = spawn(tasks, boom())
        await asyncio.gather(t, return_exceptions=True)
        await asyncio.sleep(0)
        spawn(tasks, asyncio.sleep(0))  # a task that ends well logs nothing
        await asyncio.sleep(0.01)
    failed = [e for e in logs if e["event"] == "task.failed"]
    assert len(failed) == 1 and "lost in the background" in failed[0]["error"] and not tasks


# ---- config: a group must fit a frame ------------------------------------------


def test_a_group_that_cannot_fit_a_frame_is_refused_at_load():
    big = ["actor.scheduler.attempts=16", "actor.episode.max_turns=50", "model.max_model_len=32768",
           "actor.sampling.max_tokens=1024"]
    with pytest.raises(ConfigError) as e:
        load_config(None, big)
    msg = str(e.value)
    for key in ("link.max_frame_bytes", "actor.scheduler.attempts", "actor.episode.max_turns",
                "model.max_model_len", "actor.sampling.max_tokens"):
        assert key in msg, key
    need = max_group_bytes(load_config(None, big + [f"link.max_frame_bytes={1 << 30}"]))
    assert need > 64 << 20
    assert load_config(None, big + [f"link.max_frame_bytes={need}"]).link.max_frame_bytes == need
    assert load_config(None, []).link.max_frame_bytes == 64 << 20  # the defaults fit


def test_the_group_size_estimate_bounds_the_real_encoding():
    """The largest group a config allows, built with long ids, encodes
    below max_group_bytes (and not far below: the estimate is no guess)."""
    cfg = load_config(None, ["actor.scheduler.attempts=3", "actor.episode.max_turns=4", "model.max_model_len=512",
                             "actor.sampling.max_tokens=64"])
    gid = "a-very-long-hostname.example.internal-0123456789abcdef-g0000123"
    eps = []
    for e in range(3):
        samples = []
        for t in range(4):
            s = sample(gid, e, t, node_tokens=512 - 64)
            s.completion_ids = bytes(4 * 64)
            s.logprobs, s.loss_mask = bytes(4 * 64), bytes(64)
            s.weight_versions = [(str(10**6 + i), i, i + 1) for i in range(4)]
            samples.append(s)
        eps.append(EpisodeResult(f"{gid}/e{e}", gid, "a-cube-with-a-long-name", "task-" + "x" * 40, 0.5, True, 4,
                                 "max_turns", 0, 1.0, samples))
    delivery = group_to_delivery(Group(gid, CubeTaskRef("a-cube-with-a-long-name", "task-" + "x" * 40), 7, eps,
                                       "0123456789abcdef"), "a-very-long-hostname.example.internal")
    size = len(msgspec.msgpack.encode(delivery))
    assert size <= max_group_bytes(cfg) <= 1.5 * size, (size, max_group_bytes(cfg))


# ---- the no-group alarm ------------------------------------------------------------


async def test_the_trainer_raises_an_alarm_when_no_group_arrives():
    cfg = LinkConfig(heartbeat_s=0.1, peer_timeout_s=2.0, no_group_alarm_s=0.5)
    trainer = TrainerLink(ANY_PORT, cfg)
    await trainer.start()
    actor = ActorLink(trainer.endpoint, "a", [(0, 1)], cfg)
    try:
        with structlog.testing.capture_logs() as logs:
            await asyncio.sleep(0.8)
            assert trainer.starved() == ""  # nobody connected: nobody to blame yet
            await actor.start()
            assert await actor.wait_connected(5)
            await asyncio.sleep(0.2)
            assert trainer.starved() == ""  # the clock starts when an actor is there
            await until(lambda: any(e["event"] == "link.trainer.no_group_alarm" for e in logs), 3, "the alarm")
            assert "link.no_group_alarm_s = 0.5" in trainer.starved()
            assert actor.submit(group(f"a-{actor.incarnation}-g0000000", "a", ""))
            await until(lambda: not trainer.starved(), 3, "the alarm to clear")
            await asyncio.sleep(0.3)
        alarms = [e for e in logs if e["event"] == "link.trainer.no_group_alarm"]
        assert len(alarms) == 1 and alarms[0]["log_level"] == "error"
        assert [e for e in logs if e["event"] == "link.trainer.no_group_alarm_cleared"]
    finally:
        await actor.close()
        await trainer.close()


def test_the_actor_turns_unhealthy_when_no_group_reaches_its_link():
    import time

    from rlnode.actor.daemon import ActorDaemon, TrainerGroupSink

    cfg = load_config(None, ["link.no_group_alarm_s=60"])
    link = types.SimpleNamespace(connected=True, credits=types.SimpleNamespace(available=0, granted=4))
    me = types.SimpleNamespace(cfg=cfg, sink=TrainerGroupSink(link, "a"), link=link, scheduler=types.SimpleNamespace(
        in_flight_groups=0, waiting_for_credit=True, groups_failed=0))
    assert ActorDaemon._starved(me) == ""
    me.sink.last_at = time.monotonic() - 61  # four credits leaked, nothing ran for a minute
    why = ActorDaemon._starved(me)
    assert "link.no_group_alarm_s = 60" in why and "waiting for a credit: True" in why
    assert "credits available 0 of 4" in why


# ---- what a peer may claim ------------------------------------------------------------


async def test_group_ids_are_bound_to_their_sender():
    trainer = TrainerLink(ANY_PORT, FAST)
    await trainer.start()
    a = ActorLink(trainer.endpoint, "a", [(0, 1)], FAST)
    b = ActorLink(trainer.endpoint, "b", [(0, 1)], FAST)
    try:
        for link in (a, b):
            await link.start()
            assert await link.wait_connected(5)
        a_id = f"a-{a.incarnation}-g0000000"
        # b delivers, under its own node id, a group carrying a's next id.
        assert b.submit(group(a_id, "b", ""))
        await until(lambda: b.counters().rejected == 1, 5, "b's forgery to be rejected")
        assert trainer.counters.invalid_by_reason == {"group_id": 1}
        assert not trainer.is_consumed(a_id) and trainer.deliveries.empty()
        # a's real group with that id is trained, not acked as a duplicate.
        assert a.submit(group(a_id, "a", "")) and await a.flush(5)
        assert trainer.counters.duplicates == 0
        peer, got = trainer.deliveries.get_nowait()
        assert (peer, got.group_id) == (f"a/{a.incarnation}", a_id)
    finally:
        for link in (a, b):
            await link.close()
        await trainer.close()


async def test_a_peer_past_its_share_is_told_busy_and_resends_later():
    """The trainer link: a's groups without a credit beyond its share are
    refused busy (nothing lost: a keeps and resends them); once a step
    consumed the first, the next one is taken."""
    trainer = TrainerLink(ANY_PORT, FAST, credit_budget=2)
    await trainer.start()
    a = ActorLink(trainer.endpoint, "a", [(0, 1)], FAST, ack_timeout_s=0.3)
    b = ActorLink(trainer.endpoint, "b", [(0, 1)], FAST)
    try:
        for link in (a, b):
            await link.start()
            assert await link.wait_connected(5)
        await until(lambda: trainer.credits.share() == 1, 5, "both peers in the ledger")
        ids = [f"a-{a.incarnation}-g{i:07d}" for i in range(3)]
        for gid in ids:
            assert a.submit(group(gid, "a", "old-session"))
        await until(lambda: trainer.credits.uncredited_refused >= 2, 5, "a's groups past its share refused")
        assert trainer.buffered_ids() == [ids[0]] and trainer.counters.busy_rejects >= 2
        trainer.mark_consumed([ids[0]])
        trainer.release_credits([ids[0]])
        await until(lambda: ids[1] in trainer.buffered_ids(), 5, "a's resend taken once its share freed")
        assert ids[2] not in trainer.buffered_ids()
        assert a.counters().rejected == 0  # busy is not a rejection: a still holds its groups
    finally:
        for link in (a, b):
            await link.close()
        await trainer.close()


async def _register(trainer: TrainerLink, identity: str, msg: Register):
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.identity, raw.linger = identity.encode(), 0
    raw.connect(trainer.endpoint)
    try:
        await raw.send(ENC.encode(msg))
        return msgspec.msgpack.decode(await asyncio.wait_for(raw.recv(), 2), type=ToActor)
    finally:
        raw.close(0)
        ctx.term()


async def test_a_free_form_incarnation_is_refused():
    """Node "n" with incarnation "x-1" would own group-id prefix "n-x-1-",
    which is node "n-x"'s under incarnation "1"."""
    trainer = TrainerLink(ANY_PORT, FAST)
    await trainer.start()
    try:
        reply = await _register(trainer, "n/x-1", Register("n", "x-1", [EngineInfo(0, 1)]))
        assert isinstance(reply, Reject) and reply.reason == REJECT_PROTOCOL and "incarnation" in reply.detail
        assert isinstance(await _register(trainer, "n-x/1", Register("n-x", "1", [EngineInfo(0, 1)])), Welcome)
        assert [p.node_id for p in trainer.peers().values()] == ["n-x"]
        assert trainer.counters.registers_refused == 1
    finally:
        await trainer.close()
    with pytest.raises(ValueError, match="incarnation"):
        ActorLink("tcp://127.0.0.1:1", "n", [], FAST, incarnation="x-1")


@pytest.mark.parametrize("engines", [
    [EngineInfo(0, 100_000)],  # one engine claiming 100k workers
    [EngineInfo(i, 1) for i in range(MAX_RANKS_PER_NODE + 1)],  # more ranks than a node holds
    [EngineInfo(0, 1), EngineInfo(0, 1)],  # one engine twice
    [EngineInfo(0, 0)],
])
async def test_a_node_cannot_announce_unbounded_engines(engines):
    trainer = TrainerLink(ANY_PORT, FAST)
    await trainer.start()
    try:
        reply = await _register(trainer, "n/1", Register("n", "1", engines))
        assert isinstance(reply, Reject) and reply.reason == REJECT_PROTOCOL and "register refused" in reply.detail
        assert trainer.peers() == {} and trainer.counters.registers_refused == 1
    finally:
        await trainer.close()


async def test_an_actor_refused_for_its_engines_stops_with_the_reason():
    trainer = TrainerLink(ANY_PORT, FAST)
    await trainer.start()
    actor = ActorLink(trainer.endpoint, "a", [(0, 1000)], FAST)
    try:
        await actor.start()
        with pytest.raises(LinkFatalError, match="num_workers"):
            for _ in range(10):
                await asyncio.wait_for(actor.next_control(), 5)
    finally:
        await actor.close()
        await trainer.close()


# ---- shutdown vs. a push in flight ------------------------------------------------------


def test_closing_the_weight_group_waits_for_a_broadcast_in_flight(monkeypatch):
    """The trainer's shutdown closes the group from its own thread, outside
    the pusher's lock; a push thread may still be broadcasting. The close
    must wait for it, not tear the communicator down under it."""
    import threading

    import torch

    import rlnode.weights.broadcast as W
    from rlnode.config import WeightSyncConfig

    class Comm:
        def __init__(self):
            self.events, self.sending, self.release = [], threading.Event(), threading.Event()
            self.spec = types.SimpleNamespace(epoch=1)

        def broadcast(self, buf):
            self.events.append("broadcast")
            self.sending.set()
            self.release.wait(10)
            self.events.append("broadcast done")

        sends_in_background = False

        def start_broadcast(self, buf):
            self.broadcast(buf)
            return types.SimpleNamespace(wait=lambda: True)

        def close(self):
            self.events.append("close")

    monkeypatch.setattr(W, "agree_on_plan", lambda comm, digest, reject: 0)
    bc = W.WeightBroadcaster(WeightSyncConfig(backend="gloo"), master_host="127.0.0.1")
    comm = bc._comm = Comm()
    bc.spec = types.SimpleNamespace(epoch=1, backend="gloo")
    tensors = [("w", torch.ones(4))]
    plan = bc.plan(tensors, version=3)
    push = threading.Thread(target=bc.broadcast, args=(plan, tensors))
    push.start()
    assert comm.sending.wait(5)
    closer = threading.Thread(target=bc.close_group)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and comm.events == ["broadcast"]  # waiting, not closing under the push
    comm.release.set()
    push.join(5)
    closer.join(5)
    assert not push.is_alive() and not closer.is_alive()
    assert comm.events == ["broadcast", "broadcast done", "close"] and bc._comm is None
