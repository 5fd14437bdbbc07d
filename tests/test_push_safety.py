"""Weight pushes that cannot lie and cannot fail silently.

* a push requested while an optimizer step runs carries exactly the
  post-step weights, labelled with their version, never a mix (the real
  engine behind a real ActorDaemon, real ZeroMQ, real gloo);
* an engine refuses a version older than the one it holds, without hanging
  the collective, and keeps serving its weights;
* pushes that keep failing (an actor that registers but never answers)
  turn the trainer's /healthz to 503 with the reason;
* groups waiting with no optimizer step for trainer.stall_timeout_s turn it
  to 503 too.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
import torch

from conftest import reference_logprobs
from daemons import free_port
from rlnode.config import WeightSyncConfig, load_config
from rlnode.trainer.weight_push import WeightPusher
from rlnode.weights.broadcast import WeightBroadcaster, WeightGuard


@dataclass
class Rig:
    actor: object  # ActorDaemon, running
    pusher: WeightPusher
    hf: torch.nn.Module  # the trainer's model
    prompts: list[list[int]]


async def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
async def rig(tmp_path_factory, engine_config):
    from transformers import AutoModelForCausalLM

    from rlnode.actor.daemon import ActorDaemon
    from rlnode.link.trainer_link import TrainerLink
    from rlnode.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("push-safety"), tie_embeddings=False, seed=7)
    port = free_port()
    cfg = load_config(None, [f"model.path={path}", "model.max_model_len=1024", 'trainer.device="cpu"',
                             "actor.cubes=[]", f'actor.peers=["127.0.0.1:{port}"]', 'actor.node_id="n1"',
                             "link.heartbeat_s=0.5"])
    cfg.actor.engine = engine_config
    link = TrainerLink(f"tcp://127.0.0.1:{port}", cfg.link)
    await link.start()
    actor = ActorDaemon(cfg)
    stop = asyncio.Event()
    run = None
    # As the trainer daemon's: its plans name the link's incarnation.
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=30, source=link.incarnation)
    try:
        await actor.start()
        run = asyncio.create_task(actor.run(stop))
        await _wait(lambda: any(p.connected and p.engines for p in link.peers().values()), 30, "the actor to register")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rng = random.Random(11)
        # Several KV blocks: a stale prefix cache would show as a mismatch.
        prompts = [[rng.randrange(40, 200) for _ in range(rng.randrange(300, 360))] for _ in range(2)]
        yield Rig(actor, WeightPusher(link, bc, hf, WeightGuard(0), request_timeout_s=60), hf, prompts)
    finally:
        stop.set()
        if run is not None:
            await asyncio.gather(run, return_exceptions=True)
        await actor.shutdown()
        bc.close_group()
        await link.close()


def _label(rig: Rig, version: int) -> str:
    """The name of the weights the rig's trainer pushed as ``version``."""
    from rlnode.wire import weights_label

    return weights_label(version, rig.pusher.link.incarnation)


async def _engine_diffs(rig: Rig, version: int, *models) -> list[float]:
    """Sample from the engine; max |engine - model| logprob per model. Every
    token must carry ``version``'s label."""
    from rlnode.actor.engine import SamplingSettings

    engine = rig.actor.engines[0]
    outs = await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=12, seed=i, ignore_eos=True))
                                  for i, p in enumerate(rig.prompts)))
    for c in outs:
        assert c.weight_versions == [(_label(rig, version), 0, 12)], c.weight_versions
    return [max((reference_logprobs(m, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
                for p, c in zip(rig.prompts, outs)) for m in models]


class StepDone:
    """What WeightGuard.step reads of a step's metrics: the weights moved."""

    skipped = False


def _staged_step(model: torch.nn.Module, target: dict[str, torch.Tensor], started: threading.Event,
                 gap_s: float) -> StepDone:
    """An 'optimizer step' that writes the parameters in two halves with a
    gap between them: a push that read the parameters in the gap would carry
    half old, half new weights."""
    params = list(model.named_parameters())
    with torch.no_grad():
        for name, p in params[: len(params) // 2]:
            p.copy_(target[name])
        started.set()
        time.sleep(gap_s)
        for name, p in params[len(params) // 2 :]:
            p.copy_(target[name])
    return StepDone()


@pytest.mark.engine
async def test_push_during_a_step_carries_the_post_step_weights_and_their_version(rig):
    assert await rig.pusher.push()  # version 0, the weights on disk
    assert rig.actor.engines[0].weight_version == _label(rig, 0)
    before = copy.deepcopy(rig.hf)
    gen = torch.Generator().manual_seed(3)
    target = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in rig.hf.named_parameters()}
    after = copy.deepcopy(rig.hf)
    after.load_state_dict(target, strict=False)

    guard, started = rig.pusher.guard, threading.Event()
    step = asyncio.ensure_future(asyncio.to_thread(guard.step, _staged_step, rig.hf, target, started, 1.5))
    assert await asyncio.to_thread(started.wait, 30)
    t0 = time.monotonic()
    pushed = await rig.pusher.push(0)  # the caller still believes version 0
    waited = time.monotonic() - t0
    await step
    assert pushed and guard.version == rig.pusher.pushed_version == 1
    assert waited > 1.0  # it waited for the step instead of reading mid-step
    assert rig.actor.engines[0].weight_version == _label(rig, 1)
    new_diff, old_diff = await _engine_diffs(rig, 1, after, before)
    assert new_diff < 1e-4, f"engine vs post-step weights: {new_diff}"
    assert old_diff > 1e-2, f"engine still serves the pre-step weights: {old_diff}"


@torch.no_grad()
def _scale(model: torch.nn.Module, factor: float) -> StepDone:
    for p in model.parameters():
        p.mul_(factor)
    return StepDone()


@pytest.mark.engine
async def test_engine_refuses_an_older_version_without_hanging_the_group(rig):
    from rlnode.actor.weight_receiver import load_failure

    guard, pusher = rig.pusher.guard, rig.pusher
    held = guard.version
    assert held >= 1 and pusher.pushed_version == held  # left by the previous test
    # A trainer that went back (a bug): same incarnation, older version.
    guard.version = held - 1
    t0 = time.monotonic()
    assert not await pusher.push()
    refused_s = time.monotonic() - t0
    assert refused_s < 10, f"a refusal must not wait for the group timeout (took {refused_s:.1f} s)"
    # The trainer's error names the actor's reason (and so does /healthz
    # once such failures pile up).
    assert pusher.failures_in_a_row == 1, pusher.last_error
    assert pusher.last_error.startswith(f"PlanMismatch: version {held - 1}: 1 receiver rank(s) rejected the plan")
    assert f"version {held - 1} is older than version {held} that the engine holds" in pusher.last_error
    # Nothing loaded: same weights, same label.
    assert rig.actor.engines[0].weight_version == _label(rig, held) and not load_failure(rig.actor.engines[0])
    assert (await _engine_diffs(rig, held, rig.hf))[0] < 1e-4

    # The next (newer) version goes through and clears the failure streak.
    guard.version = held
    await asyncio.to_thread(guard.step, _scale, rig.hf, 1.02)
    assert await pusher.push()
    assert pusher.failures_in_a_row == 0 and pusher.pushed_version == held + 1
    assert (await _engine_diffs(rig, held + 1, rig.hf))[0] < 1e-4


# --------------------------------------------------------------------------
# Trainer health (the trainer daemon in this process; no engine)


def _trainer_cfg(model_dir, tmp_path, *extra: str):
    return load_config(None, [
        f"model.path={model_dir}", 'trainer.device="cpu"', f"run.run_dir={tmp_path / 'run'}",
        f"trainer.port={free_port()}", "trainer.bind_host=\"127.0.0.1\"", "link.heartbeat_s=0.5",
        f"trainer.weights.base_port={random.randrange(30000, 60000)}", "actor.scheduler.groups_per_step=2",
        *extra])


def _healthz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.asynccontextmanager
async def _trainer_running(cfg):
    """The trainer daemon running (no engine of its own), stopped and shut
    down on the way out; yields (trainer, its run task)."""
    from rlnode.trainer.daemon import TrainerDaemon

    trainer, stop, run = TrainerDaemon(cfg), asyncio.Event(), None
    try:
        await trainer.start()
        run = asyncio.create_task(trainer.run(stop))
        yield trainer, run
    finally:
        stop.set()
        if run is not None:
            await asyncio.gather(run, return_exceptions=True)
        await trainer.shutdown()


@contextlib.asynccontextmanager
async def _hung_actor(cfg):
    """An actor that registers one engine and never answers a control
    request: every push to it times out."""
    from rlnode.link.actor_link import ActorLink

    hung = ActorLink(f"tcp://127.0.0.1:{cfg.trainer.port}", "hung", [(0, 1)], cfg.link)
    try:
        await hung.start()
        yield hung
    finally:
        await hung.close()


async def test_pushes_that_keep_failing_turn_healthz_red(tiny_model_dir, tmp_path):
    """An actor that registers with one engine but never answers a control
    request: each push's rendezvous times out, is retried with backoff, and
    after max_failures /healthz answers 503 with the reason."""
    from rlnode.ops.http import OpsServer

    cfg = _trainer_cfg(tiny_model_dir, tmp_path, "trainer.weights.timeout_s=1.5", "trainer.weights.max_failures=2")
    http = free_port()
    async with _trainer_running(cfg) as (trainer, run):
        ops = OpsServer([trainer], "127.0.0.1", http)
        try:
            await ops.start()
            assert await asyncio.to_thread(_healthz, http) == (200, {"ok": True, "reasons": {}})
            async with _hung_actor(cfg):
                t0 = time.monotonic()
                while (status := await asyncio.to_thread(_healthz, http))[0] == 200:
                    assert time.monotonic() - t0 < 60, "healthz stayed green"
                    await asyncio.sleep(0.3)
                code, body = status
                why = body["reasons"]["trainer"]
                assert code == 503 and "weight push failed 2 times in a row" in why and "rendezvous failed" in why, body
                assert trainer.pusher.pushes == 0 and trainer.pusher.failures == 2
                assert not run.done()  # unhealthy, not dead: systemd's watchdog decides
        finally:
            await ops.close()


async def test_groups_waiting_without_a_step_turn_health_red(tiny_model_dir, tmp_path):
    from rlnode.trainer.daemon import TrainerDaemon
    from rlnode.wire import GroupDelivery

    trainer = TrainerDaemon(_trainer_cfg(tiny_model_dir, tmp_path, "trainer.stall_timeout_s=0.5"))
    try:
        await trainer.start()  # the train loop is not running: nothing will step
        trainer.buffer.put(GroupDelivery("g1", "n", "c", "t", 0, [], []))
        await asyncio.sleep(0.6)
        assert trainer.healthy() == (True, "")  # one group waiting: not a batch
        trainer.buffer.put(GroupDelivery("g2", "n", "c", "t", 0, [], []))
        ok, why = trainer.healthy()
        assert not ok and why.startswith("stalled: 2 groups waiting, no optimizer step for "), why
        await asyncio.to_thread(trainer.pusher.guard.step, StepDone)  # a step: progress
        assert trainer.healthy() == (True, "")
        await asyncio.sleep(0.6)
        assert not trainer.healthy()[0]
        trainer.cfg.trainer.stall_timeout_s = 0  # off
        assert trainer.healthy() == (True, "")
    finally:
        await trainer.shutdown()


# --------------------------------------------------------------------------
# Versions name weights that moved (the trainer daemon's own loop; no engine)


def _stale_group(gid: str, version: int):
    """A complete group of two episodes (rewards 0 and 1: signal) whose
    samples were generated at ``version``."""
    from rlnode.wire import EpisodeSummary, GroupDelivery, LeaseMetadata, TrainingSample, pack_f32, pack_i32

    episodes = [EpisodeSummary(f"{gid}/e{e}", float(e), bool(e), 1, "done") for e in range(2)]
    samples = [TrainingSample(
        sample_id=f"{gid}/e{e}/0", group_id=gid, episode_id=f"{gid}/e{e}", cube_id="c", task_id="t",
        step_index=0, prompt_ids=pack_i32([5, 6, 7]), completion_ids=pack_i32([8]), logprobs=pack_f32([-1.0]),
        loss_mask=b"\x01", reward=float(e), finish_reason="stop", termination_reason="done",
        policy_version=version, temperature=1.0,
        lease=LeaseMetadata(route_id=0, engine_id=0, lease_wait_s=0.0, llm_latency_s=0.0), num_turns=1)
        for e in range(2)]
    return GroupDelivery(gid, "n", "c", "t", version, episodes, samples)


async def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _train_loop(trainer):
    """The daemon's own train loop over its buffer (no actor, no engine),
    stopped and the trainer shut down on the way out."""
    stop = asyncio.Event()
    loop_task = None
    try:
        await trainer.start()
        loop_task = asyncio.create_task(trainer._train_loop(stop))
        yield trainer
    finally:
        stop.set()
        if loop_task is not None:
            loop_task.cancel()
            await asyncio.gather(loop_task, return_exceptions=True)
        await trainer.shutdown()


async def test_a_batch_with_nothing_to_train_on_makes_no_version(tiny_model_dir, tmp_path):
    """Every sample of the batch is older than max_lag: the groups are
    consumed (recorded, credits back) but no step runs and no version is
    made. Before: an optimizer step on nothing, version + 1 each time, so
    the gap to engines stuck on an old version only grew (issue 20)."""
    from rlnode.trainer.daemon import TrainerDaemon

    trainer = TrainerDaemon(_trainer_cfg(tiny_model_dir, tmp_path, "actor.scheduler.max_lag=1"))
    trainer.version = 3  # samples of version 0 are 3 behind (start() hands it to the guard)
    trainer.buffer.put(_stale_group("g1", 0))
    trainer.buffer.put(_stale_group("g2", 0))
    async with _train_loop(trainer):
        await _until(lambda: trainer.pending_commit, 30, "the stale batch to be consumed")
        assert (trainer.version, trainer.step, trainer.pusher.guard.version) == (3, 0, 3)
        assert trainer.empty_batches == 1
        assert trainer.pending_commit == ["g1", "g2"]
        records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert records == [{**records[0], "no_step": True, "version": 3, "group_ids": ["g1", "g2"],
                            "dropped_stale": 4, "groups": 2}]
        assert "step" not in records[0]  # not a step: step numbers name optimizer steps
        # A fresh batch still trains: the version moves with the weights.
        trainer.buffer.put(_stale_group("g3", 3))
        trainer.buffer.put(_stale_group("g4", 2))
        await _until(lambda: trainer.step == 1, 60, "a step on fresh samples")
        assert trainer.version == trainer.pusher.guard.version == 4


async def test_groups_consumed_without_a_step_are_checkpointed_at_shutdown(tiny_model_dir, tmp_path):
    """Issue 36: a stop after groups were consumed without an optimizer step
    (stale here; a skipped step is the same) skipped the final checkpoint
    (no step since the last one, nothing buffered), so those groups were
    never saved as consumed nor committed to their actors: the next trainer
    took them again. Now the final checkpoint holds them."""
    from rlnode.trainer.daemon import TrainerDaemon

    trainer = TrainerDaemon(_trainer_cfg(tiny_model_dir, tmp_path, "actor.scheduler.max_lag=1"))
    trainer.version = 3
    trainer.buffer.put(_stale_group("g1", 0))
    trainer.buffer.put(_stale_group("g2", 0))
    async with _train_loop(trainer):
        await _until(lambda: trainer.pending_commit, 30, "the stale batch to be consumed")
        assert trainer.step == 0 and trainer.checkpoints.latest() is None
    path = trainer.checkpoints.latest()
    assert path is not None and trainer.pending_commit == []
    state = (path / "state.json").read_text()  # the consumed ids the next trainer resumes with
    assert '"g1"' in state and '"g2"' in state


async def test_a_skipped_step_makes_no_version(tiny_model_dir, tmp_path):
    """A non-finite step leaves the weights as they were: the guard's version
    (the one pushes carry and samples are tagged with) and the daemon's stay
    equal. Before: the guard added 1 for every step function that returned."""
    import msgspec

    from rlnode.trainer.daemon import TrainerDaemon
    from rlnode.wire import pack_f32

    trainer = TrainerDaemon(_trainer_cfg(tiny_model_dir, tmp_path))
    trainer.buffer.put(_stale_group("g1", 0))
    trainer.buffer.put(_stale_group("g2", 0))
    real_step = None

    def nonfinite(batch):  # the real step, made to see a NaN loss
        batch.samples = [msgspec.structs.replace(s, logprobs=pack_f32([float("nan")] * (len(s.logprobs) // 4)))
                         for s in batch.samples]
        return real_step(batch)

    async with _train_loop(trainer):
        real_step, trainer.learner.train_step = trainer.learner.train_step, nonfinite
        await _until(lambda: trainer.learner.skipped_steps == 1 and trainer.pending_commit, 60, "a skipped step")
        assert (trainer.version, trainer.pusher.guard.version, trainer.step) == (0, 0, 0)
        trainer.learner.train_step = real_step
        trainer.buffer.put(_stale_group("g3", 0))
        trainer.buffer.put(_stale_group("g4", 0))
        await _until(lambda: trainer.step == 1, 60, "a real step")
        assert trainer.version == trainer.pusher.guard.version == 1
    # metrics.jsonl: the skipped step is its own record kind, with no step
    # number (it repeated the previous step's), then step 1.
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "no_step" not in r]
    assert [(r.get("step"), r.get("skipped_step", False)) for r in trained] == [(None, True), (1, False)]


async def test_the_trainer_waits_while_its_engines_are_more_than_max_lag_behind(tiny_model_dir, tmp_path):
    """An actor whose pushes never land (it registers an engine and never
    answers): the trainer steps to max_lag ahead of what the engine holds,
    then holds its next step (waiting_for_engines) instead of training on
    and leaving the engine ever further behind. Before: it stepped on every
    batch, whatever the engines held."""
    cfg = _trainer_cfg(tiny_model_dir, tmp_path, "trainer.weights.timeout_s=1", "trainer.weights.max_failures=2",
                       "actor.scheduler.max_lag=1")
    async with _trainer_running(cfg) as (trainer, _run), _hung_actor(cfg):
        await _until(lambda: trainer.pusher.failures >= 1, 60, "a failed push")
        for i in range(6):  # three steps' worth, all fresh at version 0 and 1
            trainer.buffer.put(_stale_group(f"g{i}", 0))
        await _until(lambda: trainer.waiting_for_engines, 60, "the trainer to hold its step")
        await asyncio.sleep(3)  # more failed pushes; no step meanwhile
        assert trainer.version == 1 and trainer.step == 1, (trainer.version, trainer.step)
        assert trainer.pusher.pushed_version == -1 and trainer.waiting_for_engines
        assert trainer.status()["waiting_for_engines"] and len(trainer.buffer) == 4
        assert not trainer.healthy()[0]  # max_failures in a row: red


async def test_connected_actors_that_deliver_nothing_turn_the_trainer_red_but_not_its_watchdog(tiny_model_dir,
                                                                                             tmp_path):
    """link.no_group_alarm_s: an actor connected (no engines, so no pushes
    to fail) and no group for the alarm's time: /healthz red with the
    reason, but a trainer restart would not make the actor deliver, so the
    watchdog is not told to restart it."""
    from rlnode.link.actor_link import ActorLink
    from rlnode.trainer.daemon import TrainerDaemon

    cfg = _trainer_cfg(tiny_model_dir, tmp_path, "link.no_group_alarm_s=1", "link.heartbeat_s=0.2")
    trainer = TrainerDaemon(cfg)
    idle = None
    try:
        await trainer.start()
        assert trainer.healthy() == (True, "") and not trainer.restart_would_help()
        idle = ActorLink(f"tcp://127.0.0.1:{cfg.trainer.port}", "idle", [], cfg.link)
        await idle.start()
        await _until(lambda: not trainer.healthy()[0], 30, "the no-group alarm")
        ok, why = trainer.healthy()
        assert "no group accepted for" in why and "link.no_group_alarm_s = 1" in why, why
        assert not trainer.restart_would_help()
    finally:
        if idle is not None:
            await idle.close()
        await trainer.shutdown()
