"""Credit-based flow control (rlnode/link/credits.py): the ledger's rules,
then the protocol over real ZeroMQ links (trainer + actors on loopback)."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlnode.actor.router import LeaseMetadata
from rlnode.config import LinkConfig
from rlnode.link import ActorLink, TrainerLink
from rlnode.link.credits import ActorCredits, CreditLedger
from rlnode.wire import CreditReport, EpisodeSummary, GroupDelivery, TrainingSample, pack_f32, pack_i32

from test_link import ANY_PORT, until

FAST = LinkConfig(heartbeat_s=0.1, peer_timeout_s=1.0)


def report(session: str, want: int, started: int = 0, returned: int = 0) -> CreditReport:
    return CreditReport(session, want, started, returned)


def test_ledger_shares_the_budget_by_demand():
    led = CreditLedger("s1", budget=6)
    for p, want in (("a", 4), ("b", 4), ("c", 1)):
        led.peer_joined(p)
        assert led.on_report(p, report("s1", want))
    changed = led.grant()
    assert {p.peer_id: p.granted for p in changed} == {"a": 3, "b": 2, "c": 1}
    assert led.outstanding() == 6 and led.grant() == []  # the budget is spent

    # A delivered group still counts (it waits for a step) ...
    led.on_delivered("a", "s1", "g1", accepted=True)
    assert led.peers["a"].in_hands == 2 and led.waiting == {"g1"} and led.grant() == []
    # ... until the trainer releases it: its credit goes to the neediest actor.
    led.release(["g1"])
    assert [(p.peer_id, p.granted) for p in led.grant()] == [("b", 3)]
    # A group dropped on the actor returns its credit through the report.
    assert led.on_report("b", report("s1", 4, started=3, returned=1))
    assert led.outstanding() == 5 and led.returned_total == 1
    assert [(p.peer_id, p.granted) for p in led.grant()] == [("a", 4)]  # tie at 2/4: fewer granted first, then order
    # A rejected group frees its credit at once (never waits for a step).
    led.on_delivered("c", "s1", "bad", accepted=False)
    assert led.peers["c"].in_hands == 0 and "bad" not in led.waiting
    assert [(p.peer_id, p.granted) for p in led.grant()] == [("c", 2)]
    assert led.outstanding() == 6


def test_ledger_peers_leaving_and_foreign_counts():
    led = CreditLedger("s1", budget=4)
    for p in ("a", "b"):
        led.peer_joined(p)
        led.on_report(p, report("s1", 4))
    led.grant()
    assert led.peers["a"].granted + led.peers["b"].granted == 4
    # A report from another trainer incarnation is ignored.
    assert not led.on_report("a", report("old", 4, returned=3)) and led.foreign_reports == 1
    # A peer timed out: its credits stop counting and go to the others, but
    # nobody gets more than it wants.
    held_by_a = led.peers["a"].in_hands
    led.peer_left("a")
    assert led.outstanding() == 4 - held_by_a
    led.grant()
    assert led.peers["b"].granted == 4 and led.outstanding() == 4
    # Replaced by a new incarnation: forgotten; the newcomer starts at zero
    # and gets only what the budget has free (here nothing: no burst).
    led.forget("a")
    led.peer_joined("a2")
    led.on_report("a2", report("s1", 4))
    assert led.grant() == [] and led.peers["a2"].granted == 0
    # Groups that arrive without this session's credit (started before a
    # trainer restart) and restored ones still count, and hold grants back.
    led.on_delivered("b", "old", "g-old", accepted=True)
    led.hold(["g-restored"])
    assert led.outstanding() == 6 and led.peak == 6 and led.grant() == []
    assert led.reset_peak() == 6


def test_a_timed_out_actor_keeps_its_credits_for_reclaim_s(monkeypatch):
    import rlnode.link.credits as credits

    now = [100.0]
    monkeypatch.setattr(credits.time, "monotonic", lambda: now[0])
    led = CreditLedger("s1", budget=4, reclaim_s=10.0)
    for p in ("a", "b"):
        led.peer_joined(p)
        led.on_report(p, report("s1", 4))
    led.grant()
    held_by_a = led.peers["a"].in_hands
    led.peer_left("a")  # silent: maybe dead, maybe slow
    assert led.outstanding() == 4 and led.grant() == []
    led.peer_joined("a")  # it was only slow: back with what it held, no overshoot
    assert led.outstanding() == 4 and led.peak == 4
    led.peer_left("a")
    now[0] += 10.0  # silent for reclaim_s after its timeout: presumed dead
    assert led.outstanding() == 4 - held_by_a
    assert [p.peer_id for p in led.grant()] == ["b"] and led.outstanding() == 4


def test_actor_credits_session_rules():
    c = ActorCredits(want=2)
    assert c.available == 0  # no trainer yet
    c.new_session("s1")
    assert not c.on_grant("s0", 5) and c.on_grant("s1", 2) and c.available == 2
    assert not c.on_grant("s1", 1)  # cumulative: an older (reordered) grant is ignored
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(c.acquire()) == "s1"
        c.give_back("s0")  # a group started under an old trainer: not this session's credit
        c.give_back("s1")
        assert (c.started, c.returned, c.available) == (1, 1, 1)
        c.new_session("s2")  # a restarted trainer: old credits are void
        assert c.available == 0 and c.report() == CreditReport("s2", 2, 0, 0)
        waiter = loop.create_task(c.acquire())
        loop.run_until_complete(asyncio.sleep(0.01))
        assert not waiter.done()
        c.on_grant("s2", 1)
        assert loop.run_until_complete(asyncio.wait_for(waiter, 1)) == "s2"
    finally:
        loop.close()


def group(gid: str, node: str, session: str) -> GroupDelivery:
    eps = [EpisodeSummary(f"{gid}/e{j}", float(j), bool(j), 1, "done") for j in range(2)]
    samples = [TrainingSample(
        sample_id=f"{gid}/e{j}/0", group_id=gid, episode_id=f"{gid}/e{j}", cube_id="c", task_id="t",
        step_index=0, prompt_ids=pack_i32([1, 2, 3]), completion_ids=pack_i32([4, 5]),
        logprobs=pack_f32([-0.5, -0.7]), loss_mask=b"\x01\x01", reward=float(j), finish_reason="stop",
        termination_reason="done", policy_version=0, temperature=1.0,
        lease=LeaseMetadata(route_id=0, engine_id=0, lease_wait_s=0.0, llm_latency_s=0.1), num_turns=1)
        for j in range(2)]
    return GroupDelivery(gid, node, "c", "t", 0, eps, samples, credit_session=session)


def granted(*actors: ActorLink) -> int:
    return sum(a.credits.granted for a in actors)


async def test_credits_over_real_links():
    trainer = TrainerLink(ANY_PORT, FAST, credit_budget=4)
    await trainer.start()
    links: list[ActorLink] = []
    peaks: list[int] = []

    async def watch():
        while True:
            peaks.append(trainer.credits.outstanding())
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        a = ActorLink(trainer.endpoint, "a", [(0, 1)], FAST, credit_want=3)
        b = ActorLink(trainer.endpoint, "b", [(0, 1)], FAST, credit_want=3)
        links += [a, b]
        for link in (a, b):
            await link.start()
        await until(lambda: granted(a, b) == 4, 5, "the budget to be granted")
        assert a.credits.granted <= 3 and b.credits.granted <= 3

        # a starts a group and delivers it: it now waits in the trainer, so
        # its credit is still taken; nothing new is granted.
        session = await a.credits.acquire()
        assert session == trainer.incarnation
        assert a.submit(group("ga", "a", session))
        await until(lambda: "ga" in trainer.credits.waiting, 5, "the group to arrive")
        await asyncio.sleep(0.4)
        assert granted(a, b) == 4 and trainer.credits.outstanding() == 4
        # The trainer consumed it (step + push): one credit comes back.
        trainer.release_credits(["ga"])
        await until(lambda: granted(a, b) == 5, 5, "a credit for the consumed group")

        # b drops a group (its episodes failed): the credit returns through b's report.
        s = await b.credits.acquire()
        b.credits.give_back(s)
        await until(lambda: granted(a, b) == 6, 5, "a credit for the dropped group")

        # b is killed (no goodbye) and restarts under a new incarnation: the
        # old one's credits die with it, the new one starts from zero, and
        # the total never goes over the budget.
        await b.close()
        links.remove(b)
        b2 = ActorLink(trainer.endpoint, "b", [(0, 1)], FAST, credit_want=3)
        links.append(b2)
        await b2.start()
        await until(lambda: b2.credits.granted > 0, 5, "the restarted actor to get credits")
        await asyncio.sleep(0.3)
        assert trainer.credits.outstanding() == 4
        assert b2.credits.granted == 4 - trainer.credits.peers[f"a/{a.incarnation}"].in_hands
        assert max(peaks) <= 4, max(peaks)
        assert trainer.credits.peak <= 4
    finally:
        watcher.cancel()
        for link in links:
            await link.close()
        await trainer.close()


async def test_slow_actor_does_not_starve_a_fast_one():
    """b came first and took the whole budget; two of its groups run for
    ever. a joins later and delivers as fast as it can: every credit the
    trainer frees goes to a (fewest in hand for its demand), b keeps what it
    holds, and the total never passes the budget."""
    trainer = TrainerLink(ANY_PORT, FAST, credit_budget=4)
    await trainer.start()
    a = ActorLink(trainer.endpoint, "a", [(0, 1)], FAST, credit_want=4)
    b = ActorLink(trainer.endpoint, "b", [(0, 1)], FAST, credit_want=4)
    try:
        await b.start()
        await until(lambda: b.credits.granted == 4, 5, "b to take the budget")
        await a.start()
        assert await a.wait_connected(5)
        sessions = [await b.credits.acquire() for _ in range(4)]
        for i in range(2):  # two of b's groups finish and are consumed
            b.submit(group(f"b-{b.incarnation}-g{i:07d}", "b", sessions[i]))  # the scheduler's id shape
        await until(lambda: len(trainer.credits.waiting) == 2, 5, "b's groups")
        trainer.release_credits(list(trainer.credits.waiting))
        await until(lambda: a.credits.granted == 2, 5, "the freed credits to go to a")
        for i in range(10):
            session = await asyncio.wait_for(a.credits.acquire(), 5)
            gid = f"a-{a.incarnation}-g{i:07d}"
            a.submit(group(gid, "a", session))
            await until(lambda: gid in trainer.credits.waiting, 5, "the group to arrive")
            trainer.release_credits([gid])  # consumed by a step
            assert trainer.credits.outstanding() <= 4
        await until(lambda: a.credits.granted == 12, 5, "a to be refilled")
        assert b.credits.granted == 4 and trainer.credits.peak <= 4
    finally:
        for link in (a, b):
            await link.close()
        await trainer.close()


def test_an_unchanged_report_does_not_rerun_the_grant():
    """Every actor repeats its report each heartbeat. Re-running grant (a
    walk over every peer) for each unchanged one made the trainer's idle
    load grow as N^2 (a full core at 1,024 actors in rlnode bench link).
    Only a change re-grants at once; the heartbeat tick forces one."""
    from rlnode.link.credits import CreditLedger
    from rlnode.wire import CreditReport

    led = CreditLedger("s1", budget=4)
    for peer in ("a", "b"):
        led.peer_joined(peer)
        led.on_report(peer, CreditReport("s1", 4, 0, 0))
    assert {p.peer_id for p in led.grant()} == {"a", "b"} and led.outstanding() == 4
    walks = []
    real = led.outstanding
    led.outstanding = lambda: walks.append(1) or real()
    for _ in range(100):  # heartbeats: same counts again
        assert led.on_report("a", CreditReport("s1", 4, 0, 0))
        assert led.grant() == []
    assert walks == []  # no walk at all
    led.on_report("a", CreditReport("s1", 4, 2, 1))  # a group dropped: a credit back
    assert [p.peer_id for p in led.grant()] == ["a"] and walks
    # Credits freed by time alone (a timed-out peer past reclaim_s) change
    # nothing the ledger hears of: the link's heartbeat tick forces a grant.
    led.reclaim_s = 0.5
    led.peer_left("b")
    assert led.grant() == []  # b's 2 credits still count for reclaim_s
    time.sleep(0.6)
    assert led.grant() == [] and [p.peer_id for p in led.grant(force=True)] == ["a"]


def test_a_dead_incarnation_s_credits_are_reclaimed_and_counted():
    """An actor killed -9 comes back as a new incarnation: the credits the
    old one held (groups running or unsent died with it) return to the
    pool, and the count says how many."""
    from rlnode.link.credits import CreditLedger
    from rlnode.wire import CreditReport

    led = CreditLedger("s1", budget=4)
    led.peer_joined("n/old")
    led.on_report("n/old", CreditReport("s1", 4, 0, 0))
    led.grant()
    led.on_delivered("n/old", "s1", "g1", accepted=True)
    assert led.peers["n/old"].in_hands == 3 and led.outstanding() == 4
    led.forget("n/old")
    assert led.reclaimed == 3 and led.outstanding() == 1 and led.summary()["reclaimed"] == 3
    led.peer_joined("n/new")
    led.on_report("n/new", CreditReport("s1", 4, 0, 0))
    assert [p.granted for p in led.grant()] == [3]  # what the budget has free, no burst


@pytest.mark.parametrize("refusal", ["foreign_id", "handler_error"])
async def test_a_group_refused_for_good_spends_its_credit(refusal, monkeypatch):
    """Issue 36: two refusal paths (a group id naming another sender; a
    handler that raised on the group) answered REJECT_INVALID_GROUP, so the
    actor forgot the group, but the ledger never recorded its delivery: the
    credit stayed "in hands" for good and the budget shrank by one per
    refusal. Now it is spent, and the budget is granted again."""
    import rlnode.link.trainer_groups as trainer_groups  # where TrainerLink's group intake validates

    if refusal == "handler_error":
        real = trainer_groups.validate_group

        def breaks_on_bad(g, *args):
            if g.group_id == "bad":
                raise RuntimeError("a trainer bug this group triggers")
            return real(g, *args)

        monkeypatch.setattr(trainer_groups, "validate_group", breaks_on_bad)
    trainer = TrainerLink(ANY_PORT, FAST, credit_budget=2)
    await trainer.start()
    a = ActorLink(trainer.endpoint, "a", [(0, 1)], FAST, credit_want=2)
    try:
        await a.start()
        await until(lambda: a.credits.granted == 2, 5, "the budget to be granted")
        session = await a.credits.acquire()
        gid = "zz-0123abcd-g7" if refusal == "foreign_id" else "bad"  # foreign: node zz's scheduler id
        assert a.submit(group(gid, "a", session))
        await until(lambda: a.counters().rejected == 1, 5, "the refusal")
        peer = trainer.credits.peers[f"a/{a.incarnation}"]
        await until(lambda: a.credits.granted == 3, 5, "the spent credit to be granted again")
        assert peer.delivered == 1 and peer.in_hands == 2 and trainer.credits.outstanding() == 2
    finally:
        await a.close()
        await trainer.close()
