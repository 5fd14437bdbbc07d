"""RolloutScheduler with the real engine: complete groups, the staleness
budget, retries, the eval share, and clean cancellation."""

import asyncio

import pytest

from conftest import assert_engine_idle

from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.actor.scheduler import RolloutScheduler, VersionSource
from rlnode.config import SchedulerConfig
from rlnode.cubes.base import CubeError
from rlnode.cubes.guessing import GuessingCube, GuessingOptions, GuessingTask
from rlnode.cubes.registry import make_cube

pytestmark = pytest.mark.engine


class CountingCube(GuessingCube):
    """Guessing, plus open/close counters and scripted reset failures."""

    kind = "counting"

    def __init__(self, cube_id, options, seed, fail_first=0, always_fail=False):
        super().__init__(cube_id, options, seed)
        self.opened = self.closed = self.reset_failures = 0
        self.fail_first, self.always_fail = fail_first, always_fail

    async def open_task(self, task_id):
        cube = self
        self.opened += 1

        class Task(GuessingTask):
            async def reset(self):
                if cube.always_fail or cube.reset_failures < cube.fail_first:
                    cube.reset_failures += 1
                    raise CubeError("task server hiccup")
                return await super().reset()

            async def close(self):
                cube.closed += 1

        from rlnode.cubes.base import CubeTaskRef

        return Task(CubeTaskRef(self.cube_id, task_id), self.target(task_id), self.opts)


def make_scheduler(engine, cubes, cfg, versions, weights=None, eval_cubes=(), node_id=""):
    from transformers import AutoTokenizer

    client = LLMClient([engine], AdmissionRouter(1, 16))
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(engine.model_cfg.path))
    settings = EpisodeSettings(SamplingSettings(max_tokens=6, seed=None), max_turns=3, max_model_len=1024)
    return RolloutScheduler(cubes, weights or {c: 1.0 for c in cubes}, list(eval_cubes), client, renderer, cfg,
                            settings, versions, seed=0, node_id=node_id)


async def _play_groups(engine, node_id: str, n: int = 2) -> tuple[dict, list[int]]:
    """``n`` groups of 3 attempts, played concurrently: the tokens of each
    (group index, attempt) and the sampling seed of every LLM call."""
    cube = GuessingCube("g", GuessingOptions(max_turns=2), seed=0)
    cfg = SchedulerConfig(attempts=3, groups_per_step=n, max_lag=0, max_retries=0)
    sched = make_scheduler(engine, {"g": cube}, cfg, VersionSource(0), node_id=node_id)
    seeds, generate = [], sched.client.generate

    async def recording(prompt, sampling, **kw):
        seeds.append(sampling.seed)
        return await generate(prompt, sampling, **kw)

    sched.client.generate = recording
    await sched.prepare()
    out: asyncio.Queue = asyncio.Queue()
    run = asyncio.create_task(sched.run(out))
    groups = [await asyncio.wait_for(out.get(), 120) for _ in range(n)]
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    tokens = {(g.group_id.rsplit("g", 1)[1], j): (r.task_id, [bytes(s.completion_ids) for s in r.samples])
              for g in groups for j, r in enumerate(g.episodes)}
    return tokens, seeds


async def test_the_same_seed_plays_the_same_samples_and_no_two_calls_share_a_seed(engine):
    """Per-request seeds from (run seed, node, group, task, attempt, retry,
    turn): the same run replays token for token, although its 6 episodes
    run concurrently (an engine-wide generator would hand out its draws in
    whatever order requests arrive); no two LLM calls, and so no two
    attempts of a group, share a seed (equal seeds would make a group's
    samples identical and zero its advantages)."""
    first, seeds = await _play_groups(engine, "a")
    again, seeds_again = await _play_groups(engine, "a")
    assert None not in seeds and len(set(seeds)) == len(seeds)
    assert sorted(seeds) == sorted(seeds_again)
    assert first == again
    # Within a group: three attempts at one task, three different samplings.
    for idx in {k[0] for k in first}:
        attempts = [first[(idx, j)][1] for j in range(3)]
        assert len({tuple(a) for a in attempts}) > 1, attempts
    await assert_engine_idle(engine)


async def test_groups_complete_and_budget_holds(engine):
    cube = CountingCube("g", GuessingOptions(max_turns=2), seed=0)
    versions = VersionSource(0)
    cfg = SchedulerConfig(attempts=3, groups_per_step=2, max_lag=1, max_retries=0)
    sched = make_scheduler(engine, {"g": cube}, cfg, versions)
    await sched.prepare()
    out: asyncio.Queue = asyncio.Queue()
    run = asyncio.create_task(sched.run(out))
    groups = [await asyncio.wait_for(out.get(), 120) for _ in range(4)]
    await asyncio.sleep(0.5)
    # Budget at version 0: (0 + 1 + 1) * 2 = 4 groups, and not one more.
    assert sched.started_groups == 4 and out.empty()
    versions.set(1)  # the trainer consumed a step: 2 more groups may start
    groups += [await asyncio.wait_for(out.get(), 120) for _ in range(2)]
    await asyncio.sleep(0.5)
    assert sched.started_groups == 6
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    for g in groups:
        assert len(g.episodes) == 3
        assert {(e.cube_id, e.task_id) for e in g.episodes} == {(g.ref.cube_id, g.ref.task_id)}
        assert {e.group_id for e in g.episodes} == {g.group_id}
        assert len({e.episode_id for e in g.episodes}) == 3
    assert [g.start_version for g in groups[-2:]] == [1, 1]
    assert sched.max_in_flight_groups <= 4
    assert sched.stats["g"].groups == 6 and sched.stats["g"].episodes == 18
    assert cube.opened == cube.closed


async def test_retries_then_drop_counted(engine):
    flaky = CountingCube("flaky", GuessingOptions(max_turns=1), seed=0, fail_first=2)
    broken = CountingCube("broken", GuessingOptions(max_turns=1), seed=0, always_fail=True)
    cfg = SchedulerConfig(attempts=2, groups_per_step=1, max_lag=0, max_retries=2, retry_backoff_s=0.01)
    versions = VersionSource(0)
    sched = make_scheduler(engine, {"flaky": flaky}, cfg, versions)
    await sched.prepare()
    out: asyncio.Queue = asyncio.Queue()
    run = asyncio.create_task(sched.run(out))
    g = await asyncio.wait_for(out.get(), 120)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    assert len(g.episodes) == 2 and sched.stats["flaky"].retries == 2 and sched.stats["flaky"].errors == 0

    sched = make_scheduler(engine, {"broken": broken}, cfg, VersionSource(0))
    await sched.prepare()
    run = asyncio.create_task(sched.run(out))
    for _ in range(400):
        if sched.stats["broken"].groups_dropped >= 2:
            break
        await asyncio.sleep(0.05)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    s = sched.stats["broken"]
    # The budget is one group (max_lag 0, 1 group per step, version 0): a
    # dropped group gives its credit back, so the next one starts (counting
    # drops as started stalled whole runs).
    assert s.groups_dropped >= 2 and s.groups == 0 and out.empty()
    assert s.errors >= 2 * s.groups_dropped and s.retries >= 2 * s.errors  # 2 retries, then counted failed
    # A group still in flight when the run was cancelled gave its credit back too.
    assert sched.gate.started == sched.started_groups - s.groups_dropped - sched.groups_cancelled
    assert sched.groups_failed == 0
    assert broken.opened == broken.closed >= 12


async def test_eval_share_and_report(engine):
    g = make_cube("g", "guessing", {"max_turns": 2}, seed=0)
    a = make_cube("a", "arithmetic", {"max_operand": 5}, seed=0)
    cfg = SchedulerConfig(attempts=2, max_concurrent_episodes=8, eval_share=0.25, eval_episodes=6)
    sched = make_scheduler(engine, {"g": g, "a": a}, cfg, VersionSource(0), weights={"g": 1.0, "a": 0.0},
                           eval_cubes=["g", "a"])
    await sched.prepare()
    assert sched.train_cubes == ["g"]
    report = await sched.evaluate(version=0)
    assert sched.max_eval_in_flight == 2  # floor(0.25 * 8)
    assert set(report.cubes) == {"g", "a"}
    for stats in report.cubes.values():
        assert stats["episodes"] == 6 and stats["errors"] == 0
        assert 0.0 <= stats["success_rate"] <= 1.0


async def test_cancel_leaves_no_leases_or_open_tasks(engine):
    cube = CountingCube("g", GuessingOptions(max_turns=4), seed=0)
    cfg = SchedulerConfig(attempts=4, groups_per_step=4, max_lag=2)
    sched = make_scheduler(engine, {"g": cube}, cfg, VersionSource(0))
    await sched.prepare()
    run = asyncio.create_task(sched.run(asyncio.Queue()))
    while engine.in_flight == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert sched.client.router.in_flight == [0] and sched.client.router.waiting == 0
    assert sched.episodes_in_flight == 0 and sched.in_flight_groups == 0
    assert cube.opened == cube.closed > 0
    await assert_engine_idle(engine)


async def test_each_node_and_each_restart_draws_its_own_tasks():
    """Two actors of one run (one run.seed) must not play the same tasks in
    the same order, and a restarted node (a new incarnation) must not replay
    its first tasks (issue 36: a crash-looping actor replayed the same first
    tasks, with the same sampling seeds, after every restart). One
    incarnation's draws are reproducible."""
    async def draws(node_id: str, incarnation: str) -> list[str]:
        cube = GuessingCube("g", GuessingOptions(), seed=0)
        settings = EpisodeSettings(SamplingSettings(max_tokens=6), max_turns=3, max_model_len=1024)
        sched = RolloutScheduler({"g": cube}, {"g": 1.0}, [], None, None, SchedulerConfig(), settings,
                                 VersionSource(0), seed=0, node_id=node_id, incarnation=incarnation)
        await sched.prepare()
        return [sched.next_task().task_id for _ in range(20)]

    a = await draws("a", "1f2e3d4c")
    assert a == await draws("a", "1f2e3d4c") and a != await draws("b", "1f2e3d4c")
    assert a != await draws("a", "9a8b7c6d")


def test_a_restart_in_the_same_run_dir_counts_and_a_fresh_run_does_not(tmp_path):
    """What the actor gives the scheduler to mix into its draws: nothing on
    a run dir's first start (one seed replays its run), a start number on
    every restart (no replayed tasks), the random incarnation where the run
    dir cannot be written."""
    from rlnode.actor.daemon import count_start

    assert [count_start(str(tmp_path / "a"), "n1", "f00d") for _ in range(3)] == ["", "start1", "start2"]
    assert count_start(str(tmp_path / "b"), "n1", "f00d") == ""  # another run: a first start again
    assert count_start(str(tmp_path / "a"), "n2", "f00d") == ""  # another node: its own count
    (tmp_path / "file").write_text("")
    assert count_start(str(tmp_path / "file"), "n1", "f00d") == "f00d"
