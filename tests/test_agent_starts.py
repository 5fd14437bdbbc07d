"""What an agent episode's deadline counts. Admission of agent starts
(``actor.scheduler.max_starting_agents``, rlnode/actor/agent_starts.py): at
most N external agents are between their admission and their first request
to the gateway; the next one starts at that request, not when the episode
ends; an episode's ``timeout_s`` counts from its admission. And it does not
count the time the episode's calls wait for a router permit (the node's
generation capacity). Real engine and gateway (inline and host process); the
agents and permits are held and released by the test, never raced against
the clock."""

import asyncio
import os
import time

import pytest

from agent_fixtures import one_call
from agent_tasks import PlainAgentTask
from conftest import assert_engine_idle
from rlnode.actor.agent_episode import AgentFailed, run_agent_episode
from rlnode.actor.agent_starts import AgentStarts, node_cpus
from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings
from rlnode.actor.gateway import make_gateway
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.config import ModelConfig, SchedulerConfig

pytestmark = pytest.mark.engine

PATIENCE_S = 90.0  # what a working gate gives within seconds
SETTINGS = EpisodeSettings(SamplingSettings(max_tokens=4), max_turns=2, max_model_len=2048)


class HeldAgentTask(PlainAgentTask):
    """An agent that signals ``began``, waits for ``go``, makes one LLM call
    (``called``), then waits for ``end`` (or makes no call at all: ``calls``
    False, it waits for ``go`` and the deadline)."""

    def __init__(self, i: int, timeout_s: float = PATIENCE_S, calls: bool = True):
        super().__init__(f"t{i}", timeout_s)
        self.calls = calls
        self.began, self.go, self.called, self.end = (asyncio.Event() for _ in range(4))

    async def run_agent(self, endpoint, task):
        self.began.set()
        await self.go.wait()
        if self.calls:
            await one_call(endpoint.base_url, endpoint.api_key)
            self.called.set()
            await self.end.wait()


@pytest.fixture
def router(request):
    """The node's router: 16 permits, or the test's (indirect parameter)."""
    return AdmissionRouter(1, getattr(request, "param", 16))


@pytest.fixture(params=["inline", "process"])
async def gateway(request, router, engine, tokenizer, tiny_model_dir):
    gw = make_gateway(request.param, LLMClient([engine], router), ChatRenderer(tokenizer),
                      ModelConfig(path=str(tiny_model_dir)), SETTINGS, "rlnode")
    await engine.generate(tokenizer.encode("hi"), SamplingSettings(max_tokens=4))  # the first call's compile
    async with gw.serve():
        yield gw
    assert router.in_flight == [0]
    await assert_engine_idle(engine)


async def until(cond, what: str) -> None:
    try:
        async with asyncio.timeout(PATIENCE_S):
            while not cond():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"no {what} within {PATIENCE_S:g} s") from None


async def test_the_next_agent_starts_at_the_first_ones_first_request_not_at_its_end(gateway):
    starts = AgentStarts(1)
    tasks = [HeldAgentTask(i) for i in range(3)]
    episodes = [asyncio.create_task(run_agent_episode(gateway, t, SETTINGS, f"g0/e{i}", "g0", starts=starts))
                for i, t in enumerate(tasks)]
    try:
        await until(lambda: any(t.began.is_set() for t in tasks) and starts.waiting == 2, "one agent up, two waiting")
        first = next(t for t in tasks if t.began.is_set())
        others = [t for t in tasks if t is not first]
        # The other two are admitted only when the first one's agent is up.
        assert not any(t.began.is_set() for t in others) and starts.starting == 1
        first.go.set()
        await until(lambda: first.called.is_set(), "the first agent's LLM call")
        # Its slot went at its first request, while its episode still runs.
        await until(lambda: sum(t.began.is_set() for t in others) == 1, "the second agent admitted")
        assert not episodes[tasks.index(first)].done() and starts.starting == 1 and starts.waiting == 1
        for t in tasks:
            t.go.set()
            t.end.set()
        results = await asyncio.wait_for(asyncio.gather(*episodes), PATIENCE_S)
    finally:
        for e in episodes:
            e.cancel()
        await asyncio.gather(*episodes, return_exceptions=True)
    assert [len(r.samples) for r in results] == [1, 1, 1]
    assert starts.starting == starts.waiting == 0
    waited = sorted(r.phases["start_wait_s"] for r in results)
    assert waited[0] < waited[1] <= waited[2]  # the first admitted at once, the others behind it


async def test_the_deadline_counts_from_admission_not_from_the_wait(gateway):
    """The first agent never calls the model: it holds its slot until its
    own timeout_s ends it. The second waited that long for the slot and
    still has its whole timeout_s after it."""
    timeout_s = 2.0
    starts = AgentStarts(1)
    silent, second = HeldAgentTask(0, timeout_s, calls=False), HeldAgentTask(1, timeout_s)
    second.go.set()
    second.end.set()
    first_ep = asyncio.create_task(run_agent_episode(gateway, silent, SETTINGS, "g0/e0", "g0", starts=starts))
    try:
        await until(silent.began.is_set, "the silent agent admitted")
        result = await asyncio.wait_for(run_agent_episode(gateway, second, SETTINGS, "g0/e1", "g0", starts=starts),
                                        PATIENCE_S)
        with pytest.raises(AgentFailed, match=r"timed out after 2s \(0 LLM calls\)"):
            await first_ep
    finally:
        first_ep.cancel()
        await asyncio.gather(first_ep, return_exceptions=True)
    assert result.reward == 1.0 and len(result.samples) == 1
    assert result.phases["start_wait_s"] >= timeout_s * 0.99  # behind the whole of the first one's deadline
    assert starts.starting == starts.waiting == 0


@pytest.mark.parametrize("router", [1], indirect=True, ids=["one_permit"])
async def test_a_call_waiting_for_a_router_permit_does_not_spend_the_deadline(gateway, router):
    """The node's one permit is held (by the test) for longer than the
    episode's timeout_s while the agent's call waits for it: the episode
    still succeeds; its own time is its start and the call in the engine."""
    timeout_s = 6.0
    task = HeldAgentTask(0, timeout_s)
    task.go.set()
    task.end.set()
    held = await router.acquire()
    episode = asyncio.create_task(run_agent_episode(gateway, task, SETTINGS, "g0/e0", "g0"))
    try:
        await until(lambda: router.waiting == 1, "the agent's call waiting for the permit")
        (s,) = gateway.sessions.values()
        await until(lambda: s.queue_time() > timeout_s, "a wait longer than the deadline")
        assert not episode.done()
        router.release(held)
        result = await asyncio.wait_for(episode, PATIENCE_S)
    finally:
        router.release(held)
        episode.cancel()
        await asyncio.gather(episode, return_exceptions=True)
    assert result.reward == 1.0 and len(result.samples) == 1
    assert result.samples[0].lease.lease_wait_s > timeout_s


async def test_the_deadline_clock_stops_only_while_it_is_told_to():
    """``aio.wait_for_charged``: uncharged time extends the deadline; with
    none it is ``wait_for``'s (the awaitable cancelled, TimeoutError); a
    cancelled caller cancels the awaitable."""
    from rlnode.aio import wait_for_charged

    t0 = time.monotonic()
    ev = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, ev.set)
    assert await wait_for_charged(ev.wait(), 0.05, lambda: time.monotonic() - t0) is True  # never charged
    gone = asyncio.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            gone.set()

    with pytest.raises(TimeoutError):
        await wait_for_charged(forever(), 0.05, lambda: 0.0)
    assert gone.is_set()
    gone.clear()
    outer = asyncio.create_task(wait_for_charged(forever(), 60, lambda: 0.0))
    await asyncio.sleep(0.05)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert gone.is_set()


def test_the_default_is_one_start_per_cpu_of_the_daemon():
    assert SchedulerConfig().max_starting_agents == 0
    assert AgentStarts(0).limit == node_cpus() == len(os.sched_getaffinity(0))
    assert AgentStarts(3).limit == 3


def test_the_default_leaves_a_cpu_engines_bound_cores_to_it():
    from rlnode.actor.agent_starts import bound_cpus, default_limit

    assert bound_cpus("0") == {0} and bound_cpus("0-3") == {0, 1, 2, 3} and bound_cpus("0-1|4,6") == {0, 1, 4, 6}
    assert bound_cpus("nobind") == bound_cpus("auto") == set()
    mine = os.sched_getaffinity(0)
    assert default_limit("cpu", "nobind") == default_limit("cuda", "0") == len(mine)
    assert default_limit("cpu", str(min(mine))) == max(1, len(mine) - 1)
    assert default_limit("cpu", ",".join(map(str, mine))) == 1  # never none
