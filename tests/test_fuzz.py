"""Hostile frames at a live trainer: a real TrainerDaemon (tiny model, no
engine) and a real ZeroMQ DEALER that registers like an actor, then sends
random, truncated, byte-mutated and decodable-but-inconsistent frames
between valid groups. The trainer must keep running, count every bad frame
by reason, and train the valid groups. Also: a handler bug is contained,
and a non-finite loss takes no optimizer step and no version."""

from __future__ import annotations

import asyncio
import math
import time
import types

import torch

from rlnode.bench.fuzz import FrameMaker, FuzzPeer, Oracle, expected_counters, fuzz
from rlnode.config import LinkConfig, load_config
from rlnode.link import TrainerLink
from rlnode.link import validate as V
from rlnode.trainer.buffer import BufferCounters, build_batch
from rlnode.trainer.daemon import TrainerDaemon
from rlnode.trainer.learner import Learner
from rlnode.wire import REJECT_INVALID_GROUP, REJECT_MALFORMED

FAST = LinkConfig(heartbeat_s=0.1, peer_timeout_s=5.0)


async def until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_config(model_dir, run_dir):
    return load_config(None, [
        f"model.path={model_dir}", f"run.run_dir={run_dir}", "run.progress=false", "trainer.device=cpu",
        "trainer.bind_host=127.0.0.1", f"trainer.port={free_port()}", f"trainer.weights.base_port={free_port()}",
        "trainer.cpu_threads=1", "trainer.sync=false", "trainer.checkpoint_every=0",
        "actor.scheduler.attempts=4", "actor.scheduler.groups_per_step=2", "actor.scheduler.max_lag=1000",
        "actor.episode.max_turns=2", "model.max_model_len=64", "actor.sampling.max_tokens=8",
        "link.heartbeat_s=0.2", "link.peer_timeout_s=10",
    ])


async def test_fuzzed_trainer_keeps_training_and_counts_every_bad_frame(tiny_model_dir, tmp_path):
    d = TrainerDaemon(trainer_config(tiny_model_dir, tmp_path))
    await d.start()
    stop = asyncio.Event()
    run = asyncio.create_task(d.run(stop))
    peer = FuzzPeer(d.link.endpoint)
    try:
        await peer.start()
        limits = d.link.limits
        assert (limits.attempts, limits.vocab_size, limits.max_model_len, limits.max_samples) == (4, 264, 64, 8)
        maker, oracle = FrameMaker(limits, peer.node_id, seed=7), Oracle(peer.node_id, limits)
        res = await fuzz(peer, maker, oracle, 2500, valid_every=10, seed=7)
        c = d.link.counters
        await until(lambda: c.frames_in == peer.sent, 60, "every frame read")
        assert not run.done(), "the trainer stopped"

        # Every category was sent, every rule was broken at least once.
        assert set(res.by_category) == {"valid", "random", "truncated", "mutated", "bad_utf8", "frame_count",
                                        "inconsistent", "resend_invalid"}
        exp = expected_counters(res)
        assert set(exp["invalid_by_reason"]) >= {*V.REASONS, "node_id"}
        assert exp["malformed_by_reason"]["decode"] >= res.by_category["random"] + res.by_category["bad_utf8"]
        # ... and the trainer counted each frame as the sender expected, by reason.
        assert c.malformed_by_reason == exp["malformed_by_reason"]
        assert c.invalid_by_reason == exp["invalid_by_reason"]
        assert c.groups_accepted == exp["groups_accepted"] >= len(res.valid_sent) == 250
        assert c.duplicates == exp["duplicates"] >= len(res.resent_invalid) > 0
        assert c.malformed_frames == sum(exp["malformed_by_reason"].values())
        assert c.invalid_groups == sum(exp["invalid_by_reason"].values())
        # A group naming another node is rejected as unexpected, not consumed
        # (its id may be that node's real group).
        assert c.handler_errors == 0 and c.unexpected_frames == exp["invalid_by_reason"]["node_id"]

        # The answers reached the sender: a resent invalid group is committed
        # (its actor forgets it), the invalid ones were rejected for good.
        await until(lambda: set(res.resent_invalid) <= peer.committed, 10, "commits for resent invalid groups")
        assert peer.replies[f"Reject/{REJECT_MALFORMED}"] == c.malformed_frames
        assert peer.replies[f"Reject/{REJECT_INVALID_GROUP}"] == c.invalid_groups
        assert all(peer.rejected[g] == REJECT_INVALID_GROUP for g in maker.invalid_sent)

        # The valid groups are trained: every accepted group is in a step's
        # metrics, but for less than one step's worth still buffered.
        def trained() -> set[str]:
            return {g for rec in d.step_history for g in rec["group_ids"]}

        await until(lambda: set(res.accepted) <= trained() | {g.group_id for g in d.buffer.snapshot()}
                    and len(d.buffer) < 2, 300, "every accepted group trained")
        assert not run.done(), "the trainer stopped"
        assert trained() <= set(res.accepted)  # nothing invalid was trained
        assert len(set(res.valid_sent) & trained()) >= len(res.valid_sent) - 1
        assert d.step >= len(res.accepted) // 2 and d.version == d.step
        assert all(math.isfinite(rec["loss"]) and rec["samples"] > 0 for rec in d.step_history)
    finally:
        await peer.close()
        stop.set()
        await asyncio.wait_for(run, 60)
        await d.shutdown()


async def test_a_handler_bug_is_contained_counted_and_the_group_rejected_for_good(monkeypatch):
    link = TrainerLink("tcp://127.0.0.1:*", FAST)
    await link.start()
    peer = FuzzPeer(link.endpoint)
    try:
        await peer.start()
        limits = V.GroupLimits(attempts=2, vocab_size=50, max_model_len=32, max_samples=4, max_version_ahead=1)
        maker = FrameMaker(limits, peer.node_id)
        real = link._on_group

        def buggy(p, g):
            if g.group_id.endswith("/1"):
                raise KeyError("a bug")
            return real(p, g)

        monkeypatch.setattr(link, "_on_group", buggy)
        first, second = maker.valid_group(0), maker.valid_group(0)
        await peer.send([msgspec_encode(first)])
        await peer.send([msgspec_encode(second)])
        await until(lambda: link.counters.groups_accepted == 1, 5, "the next group accepted")
        assert link.counters.handler_errors == 1
        assert link.counters.invalid_by_reason == {"handler_error": 1}
        await until(lambda: first.group_id in peer.rejected, 5, "the reject")
        assert peer.rejected[first.group_id] == REJECT_INVALID_GROUP
        # Its resend hits the bug again (counted) and is committed: no resend loop.
        await peer.send([msgspec_encode(first)])
        await until(lambda: first.group_id in peer.committed, 5, "the commit")
        assert link.counters.handler_errors == 2 and link.counters.invalid_groups == 1
        assert (await link.next_delivery())[1].group_id == second.group_id
        assert all(t.done() is False for t in link._tasks)
    finally:
        await peer.close()
        await link.close()


def msgspec_encode(msg) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(msg)


def test_nonfinite_loss_skips_the_step_and_the_version(tiny_model_dir, tmp_path):
    cfg = trainer_config(tiny_model_dir, tmp_path)
    learner = Learner(cfg)
    limits = V.GroupLimits.from_config(cfg, learner.vocab_size)
    g = FrameMaker(limits, "n").valid_group(0)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}

    batch = build_batch([g], 0, 1, cfg.trainer.advantage, BufferCounters())
    batch.advantages = [math.nan] * len(batch.advantages)
    m = learner.train_step(batch)
    assert m.skipped and not math.isfinite(m.loss)
    assert m.extra["nonfinite_skip"] == 1.0 and m.extra["nonfinite_skips_total"] == 1.0
    assert learner.skipped_steps == 1 and learner.scheduler.last_epoch == 0 and not learner.optimizer.state
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    assert all(p.grad is None for p in learner.model.parameters())

    ok = learner.train_step(build_batch([g], 0, 1, cfg.trainer.advantage, BufferCounters()))
    assert not ok.skipped and ok.extra["nonfinite_skip"] == 0.0 and math.isfinite(ok.grad_norm)
    assert learner.scheduler.last_epoch == 1
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())

    # The daemon's bookkeeping: a skipped step consumes its groups, bumps nothing.
    d = TrainerDaemon(cfg)
    d.learner = types.SimpleNamespace(skipped_steps=1)
    d._stepped(batch, m)
    assert (d.step, d.version, d.pending_commit) == (0, 0, [g.group_id])
    d._stepped(batch, ok)
    assert (d.step, d.version) == (1, 1)

