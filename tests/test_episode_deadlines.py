"""Every call into a cube task has a deadline (the task's ``timeout_s``):
a reset, step or evaluate that never returns, on the event loop or in a
thread, ends its episode as a counted error (retried, then its group
dropped and its credit given back) while other cubes' episodes go on. With
the real engine; only the cubes misbehave."""

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_fixtures import one_call
from agent_tasks import PlainAgentTask
from conftest import assert_engine_idle
from rlnode.actor.agent_episode import run_agent_episode
from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import ChatRenderer, CubeTimeout, EpisodeSettings
from rlnode.actor.gateway import make_gateway
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.actor.scheduler import RolloutScheduler, VersionSource
from rlnode.config import ModelConfig, SchedulerConfig
from rlnode.cubes.base import CubeTaskRef, run_blocking
from rlnode.cubes.guessing import GuessingCube, GuessingOptions, GuessingTask

pytestmark = pytest.mark.engine

TIMEOUT_S = 1.0
# How long a test waits for what a working deadline gives within seconds;
# on the code without deadlines it would wait forever.
PATIENCE_S = 90.0


class HangingCube(GuessingCube):
    """Guessing, whose tasks never return from ``hang`` ("reset", "step",
    "evaluate": awaiting on the loop; "evaluate_in_thread": blocking code in
    ``run_blocking``, as the cube contract asks) and have a deadline of
    ``TIMEOUT_S``."""

    kind = "hanging"

    def __init__(self, cube_id, hang: str):
        super().__init__(cube_id, GuessingOptions(max_turns=1), seed=0)
        self.hang = hang
        self.opened = self.closed = self.hung = 0
        self.release = threading.Event()  # frees the blocked threads at the end of the test

    async def open_task(self, task_id):
        cube = self

        class Task(GuessingTask):
            timeout_s = TIMEOUT_S

            async def reset(self):
                await cube.maybe_hang("reset")
                return await super().reset()

            async def step(self, action):
                await cube.maybe_hang("step")
                return await super().step(action)

            async def evaluate(self):
                await cube.maybe_hang("evaluate")
                return await super().evaluate()

            async def close(self):
                cube.closed += 1

        self.opened += 1
        return Task(CubeTaskRef(self.cube_id, task_id), self.target(task_id), self.opts)

    async def maybe_hang(self, call: str) -> None:
        if self.hang == call:
            self.hung += 1
            await asyncio.Event().wait()
        elif self.hang == f"{call}_in_thread":
            self.hung += 1
            await run_blocking(self.release.wait)


@contextlib.contextmanager
def small_default_executor(workers: int):
    """The loop's default executor with ``workers`` threads (asyncio sizes
    it by the machine's cores): blocking cube calls left behind by their
    deadline must not be what fills it."""
    loop = asyncio.get_running_loop()
    old, small = loop._default_executor, ThreadPoolExecutor(workers)  # asyncio has no getter
    loop.set_default_executor(small)
    try:
        yield
    finally:
        loop._default_executor = old
        small.shutdown(wait=False)


def make_scheduler(engine, cubes, cfg, versions):
    from transformers import AutoTokenizer

    client = LLMClient([engine], AdmissionRouter(1, 16))
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(engine.model_cfg.path))
    settings = EpisodeSettings(SamplingSettings(max_tokens=6, seed=None), max_turns=2, max_model_len=1024)
    return RolloutScheduler(cubes, {c: 1.0 for c in cubes}, [], client, renderer, cfg, settings, versions, seed=0)


@pytest.mark.parametrize("hang", ["reset", "step", "evaluate", "evaluate_in_thread"])
async def test_a_hanging_cube_call_fails_its_episode_and_the_others_go_on(hang, engine):
    hanging = HangingCube("hang", hang)
    ok = GuessingCube("ok", GuessingOptions(max_turns=1), seed=0)
    cfg = SchedulerConfig(attempts=2, groups_per_step=2, max_lag=0, max_retries=1, retry_backoff_s=0.01)
    versions = VersionSource(0)
    sched = make_scheduler(engine, {"hang": hanging, "ok": ok}, cfg, versions)
    await sched.prepare()
    out: asyncio.Queue = asyncio.Queue()
    delivered = []
    try:
        with small_default_executor(2):
            run = asyncio.create_task(sched.run(out))
            try:
                async with asyncio.timeout(PATIENCE_S):
                    while sched.stats["hang"].groups_dropped < 2 or len(delivered) < 2:
                        with contextlib.suppress(TimeoutError):
                            delivered.append(await asyncio.wait_for(out.get(), 0.2))
                            versions.set(versions.version + 1)  # consumed: the budget never stalls the draw
                # Calls left hanging in threads (4 per dropped group) hold no
                # thread of the loop's executor.
                assert await asyncio.wait_for(asyncio.to_thread(int, "7"), 10) == 7
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
    finally:
        hanging.release.set()
    s = sched.stats["hang"]
    # Every attempt of every dropped group hung and was ended by its deadline,
    # retried once, then counted; none of them became a group.
    assert s.groups == 0 and s.groups_dropped >= 2
    assert s.errors >= 2 * s.groups_dropped and s.retries >= s.errors and hanging.hung >= s.errors + s.retries
    assert sched.groups_failed == 0
    # The other cube's groups arrived whole, and every hanging task was closed.
    assert {g.ref.cube_id for g in delivered} == {"ok"} and all(len(g.episodes) == 2 for g in delivered)
    assert sched.stats["ok"].errors == 0
    await asyncio.sleep(0)  # the shielded closes of the cancelled episodes
    assert hanging.opened == hanging.closed
    assert sched.client.router.in_flight == [0]
    await assert_engine_idle(engine)


class HangingAgentTask(PlainAgentTask):
    """An agent task whose agent makes one LLM call and whose ``hang``
    (reset or evaluate: an LLM judge that never answers) never returns.
    ``timeout_s`` bounds the agent's run too, so the agent's one call would
    race a short deadline (CI at 0162b7a failed [evaluate] on "agent timed
    out after 1s (0 LLM calls)"; at 3 s it failed again beside a training
    job): the deadline is 3 s for the call that hangs, and the agent's run
    (before evaluate) has the test's patience instead."""

    def __init__(self, hang: str):
        # reset hangs before the agent runs: 3 s from the start; evaluate
        # hangs after it: 3 s once the agent is done (run_agent sets it).
        super().__init__(timeout_s=3.0 if hang == "reset" else PATIENCE_S)
        self.hang = hang

    async def reset(self):
        if self.hang == "reset":
            await asyncio.Event().wait()
        return await super().reset()

    async def evaluate(self):
        if self.hang == "evaluate":
            await asyncio.Event().wait()
        return await super().evaluate()

    async def run_agent(self, endpoint, task):
        await one_call(endpoint.base_url, endpoint.api_key)
        self.timeout_s = 3.0


@pytest.mark.parametrize("hang", ["reset", "evaluate"])
async def test_an_agent_episode_whose_cube_hangs_fails_by_its_deadline(hang, engine, tokenizer, tiny_model_dir):
    settings = EpisodeSettings(SamplingSettings(max_tokens=4), max_turns=2, max_model_len=2048)
    router = AdmissionRouter(1, 16)
    gateway = make_gateway("inline", LLMClient([engine], router), ChatRenderer(tokenizer),
                           ModelConfig(path=str(tiny_model_dir)), settings, "rlnode")
    task = HangingAgentTask(hang)
    await engine.generate(tokenizer.encode("hi"), SamplingSettings(max_tokens=4))  # the first call's compile
    async with gateway.serve():
        with pytest.raises(CubeTimeout, match=f"{hang} of task 't0' did not return within timeout_s = 3 s"):
            await asyncio.wait_for(run_agent_episode(gateway, task, settings, "g0/e0", "g0"), PATIENCE_S)
        assert not gateway.sessions
    assert task.closed == 1
    assert router.in_flight == [0]
    await assert_engine_idle(engine)


async def test_a_timeout_error_of_the_cube_itself_is_not_a_deadline():
    """``cube_call`` reports its own deadline; a TimeoutError the cube code
    raises (its HTTP client's, say) reaches the scheduler as it is."""
    from rlnode.actor.episode import cube_call

    task = HangingAgentTask("none")

    async def own_timeout():
        raise TimeoutError("the task server's socket timed out")

    with pytest.raises(TimeoutError, match="socket timed out") as e:
        await cube_call(task, "step", own_timeout())
    assert not isinstance(e.value, CubeTimeout)


async def test_blocking_cube_code_raising_systemexit_fails_only_its_call():
    """``run_blocking``: the call's result or exception comes back to the
    awaiting coroutine; a SystemExit from foreign code is that call's
    CubeError, never the daemon's exit."""
    from rlnode.cubes.base import CubeError

    assert await run_blocking(int, "3") == 3
    with pytest.raises(ValueError):
        await run_blocking(int, "x")

    def exits():
        raise SystemExit(2)

    with pytest.raises(CubeError, match="SystemExit"):
        await run_blocking(exits)
