"""The openai-agent cube: user agents (a function in the daemon or a
command) play episodes through the gateway with the real engine; failures
are retried then counted; nothing outlives an episode."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_engine_idle, reference_logprobs, sandbox_processes
from rlnode.actor.agent_episode import AgentFailed, run_agent_episode
from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings, RewardRefused
from rlnode.actor.gateway import make_gateway
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.actor.scheduler import CubeStats, RolloutScheduler, VersionSource
from rlnode.config import ActorConfig, ModelConfig, SchedulerConfig
from rlnode.cubes.base import CubeError, CubeTaskRef
from rlnode.cubes.openai_agent import AGENT_ENV_ALLOW
from rlnode.cubes.registry import make_cube

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "agent_fixtures.py"
EXAMPLE = ROOT / "examples" / "guess_openai_sdk.py"
GUESSING = {"kind": "guessing", "options": {"max_number": 8, "max_turns": 4}}
SETTINGS = EpisodeSettings(SamplingSettings(max_tokens=12, temperature=1.0), max_turns=6, max_model_len=2048)


@pytest.fixture
def router():
    return AdmissionRouter(1, 16)


def default_gateway(client, tokenizer, model_dir, settings=SETTINGS, model_name="rlnode"):
    """The gateway where the daemon runs it by default (actor.gateway_host)."""
    return make_gateway(ActorConfig().gateway_host, client, ChatRenderer(tokenizer), ModelConfig(path=str(model_dir)),
                        settings, model_name)


@pytest.fixture
async def gateway(engine, tokenizer, router, tiny_model_dir):
    gw = default_gateway(LLMClient([engine], router), tokenizer, tiny_model_dir)
    async with gw.serve():
        yield gw
    assert not gw.sessions
    assert router.in_flight == [0]
    await assert_engine_idle(engine)


OPEN_CUBES = []


@pytest.fixture(autouse=True)
async def close_cubes():
    """Every cube a test started is closed (its agent worker processes end)."""
    yield
    while OPEN_CUBES:
        await OPEN_CUBES.pop().close()


async def started(options, cube_id="agent"):
    if "tasks" in options:  # no evaluator: the agent's reward is the only one
        options = {"reward_source": "agent", **options}
    if "agent" in options:
        options = {"workers": 1, **options}
    cube = make_cube(cube_id, "openai-agent", options, seed=0)
    await cube.start()
    OPEN_CUBES.append(cube)
    return cube


def tasks_file(tmp_path) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"task {i}", "value": 0.6}) for i in range(20)))
    return str(path)


async def play(gateway, cube, episode_id="g0/e0", settings=SETTINGS):
    task = await cube.open_task((await cube.task_ids("train"))[0])
    return task, await run_agent_episode(gateway, task, settings, episode_id, "g0")


def check_samples(result, hf_model):
    samples = result.samples
    assert len(samples) == result.num_turns >= 1
    assert [s.step_index for s in samples] == list(range(len(samples)))
    for s in samples:
        assert s.reward == result.reward and s.sample_id == f"{result.episode_id}/{s.step_index}"
        comp = s.completion_token_ids
        ref = reference_logprobs(hf_model, s.prompt_token_ids.tolist(), comp.tolist(), s.temperature)
        assert (ref - torch.from_numpy(s.completion_logprobs.copy())).abs().max().item() < 1e-4
    for prev, nxt in zip(samples, samples[1:]):
        head = np.concatenate([prev.prompt_token_ids, prev.completion_token_ids])
        assert np.array_equal(nxt.prompt_token_ids[: len(head)], head)


@pytest.mark.parametrize("how", ["function", "command"])
async def test_example_agent_plays_guessing(how, gateway, hf_model):
    opts = {"env": GUESSING, "timeout_s": 120}
    if how == "function":
        opts["agent"] = f"{EXAMPLE}:play"
    else:
        opts["command"] = [sys.executable, str(EXAMPLE)]
    cube = await started(opts)
    task, result = await play(gateway, cube)
    await cube.close()
    # The reward is the guessing cube's evaluator: solved or not.
    assert result.reward == float(task.inner.solved) and result.success == task.inner.solved
    # Every guess was one LLM call; the game ends at its 4 guesses or a hit.
    assert result.num_turns == len(task.inner.guesses) and 1 <= result.num_turns <= 4
    assert result.termination_reason == "done"
    check_samples(result, hf_model)
    assert gateway.stats.history_resets == 0
    # Where its time went: the agent's run holds every LLM call, the evaluator was asked.
    p = result.phases
    assert set(p) == {"agent_s", "evaluate_s"} and p["evaluate_s"] > 0
    assert sum(s.lease.llm_latency_s for s in result.samples) < p["agent_s"] < result.duration_s


@pytest.mark.parametrize("agent,reward,success", [
    ("returns_reward", 0.25, True),
    ("posts_reward", 0.75, True),
    ("blocking_returns", 0.5, True),
])
async def test_reward_sources(agent, reward, success, gateway, tmp_path):
    cube = await started({"agent": f"{FIXTURES}:{agent}", "tasks": tasks_file(tmp_path)})
    _, result = await play(gateway, cube)
    assert result.reward == reward and result.success == success and result.num_turns == 1


async def test_command_agent_posts_reward_from_its_task(gateway, tmp_path):
    cube = await started({"command": [sys.executable, str(FIXTURES), "post"], "tasks": tasks_file(tmp_path)})
    _, result = await play(gateway, cube)
    assert result.reward == pytest.approx(0.6)


@pytest.mark.parametrize("agent,why", [
    ("no_reward", "no reward"),
    ("no_call", "no LLM call"),
    ("crash", "agent bug"),
])
async def test_agent_failures_fail_the_episode(agent, why, gateway, tmp_path):
    cube = await started({"agent": f"{FIXTURES}:{agent}", "tasks": tasks_file(tmp_path)})
    with pytest.raises(AgentFailed, match=why):
        await play(gateway, cube)


async def test_failing_command_reports_its_stderr(gateway, tmp_path):
    cube = await started({"command": [sys.executable, str(FIXTURES), "fail"], "tasks": tasks_file(tmp_path)})
    with pytest.raises(Exception, match="exited with 3: agent says: cannot continue"):
        await play(gateway, cube)


async def test_timed_out_command_is_killed_with_its_children(gateway, tmp_path):
    pid_file = tmp_path / "pids"
    cube = await started({"command": [sys.executable, str(FIXTURES), "hang"], "tasks": tasks_file(tmp_path),
                          "env_vars": {"PID_FILE": str(pid_file)}, "timeout_s": 8,
                          "isolation": "none"})  # host pids: the bwrap variant is in the isolation test
    with pytest.raises(AgentFailed, match="timed out"):
        await play(gateway, cube)
    pids = json.loads(pid_file.read_text())
    for pid in pids:
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"agent process {pid} outlived its episode")


async def test_agent_stopped_by_the_gateway_still_counts(gateway, hf_model):
    settings = EpisodeSettings(SamplingSettings(max_tokens=6), max_turns=3, max_model_len=2048)
    cube = await started({"agent": f"{FIXTURES}:until_refused", "env": GUESSING})
    _, result = await play(gateway, cube, settings=settings)
    assert result.termination_reason == "max_turns" and result.num_turns == 3
    assert all(s.termination_reason == "max_turns" for s in result.samples)
    check_samples(result, hf_model)


@pytest.mark.parametrize("agent", ["crash", "exits"])  # exits: SystemExit from foreign code must not end the daemon
async def test_scheduler_retries_a_crashing_agent_then_counts_it(agent, engine, tokenizer, router, tmp_path,
                                                                 tiny_model_dir):
    cube = await started({"agent": f"{FIXTURES}:{agent}", "tasks": tasks_file(tmp_path)}, "crashy")
    client = LLMClient([engine], router)
    renderer = ChatRenderer(tokenizer)
    gw = default_gateway(client, tokenizer, tiny_model_dir)
    cfg = SchedulerConfig(attempts=1, groups_per_step=1, max_retries=2, retry_backoff_s=0.0)
    sched = RolloutScheduler({"crashy": cube}, {"crashy": 1.0}, [], client, renderer, cfg, SETTINGS,
                             VersionSource(0), gateway=gw)
    await sched.prepare()
    stats = CubeStats()
    async with gw.serve():
        out = await sched._episode_with_retries(CubeTaskRef("crashy", "t1"), "g/e0", "g", stats)
    assert out is None and stats.errors == 1 and stats.retries == 2
    assert gw.stats.calls == 3 and not gw.sessions  # one call per attempt, every session closed
    assert router.in_flight == [0]
    await assert_engine_idle(engine)


def test_bad_options_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="exactly one of options.agent"):
        make_cube("x", "openai-agent", {"tasks": tasks_file(tmp_path)}, seed=0)
    with pytest.raises(ValueError, match="exactly one of options.env"):
        make_cube("x", "openai-agent", {"agent": "m:f"}, seed=0)


async def test_unloadable_agent_fails_at_start(tmp_path):
    cube = make_cube("x", "openai-agent", {"agent": "no_such_module_xyz:play", "tasks": tasks_file(tmp_path),
                                             "reward_source": "agent"}, seed=0)
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        await cube.start()


async def test_command_agent_does_not_inherit_the_daemons_secrets(gateway, tmp_path, monkeypatch):
    monkeypatch.setenv("RLNODE_HTTP_TOKEN", "ops-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-the-operators-own")
    for name in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "RLNODE_CURVE_SECRET"):
        monkeypatch.setenv(name, "secret")
    cube = await started({"command": [sys.executable, str(FIXTURES), "env"], "tasks": tasks_file(tmp_path),
                          "env_vars": {"OUT_FILE": "x"}})
    with pytest.raises(CubeError, match="exited with 3") as e:  # this agent only reports its environment
        await play(gateway, cube)
    seen = json.loads(str(e.value).split("ENV ", 1)[1])
    endpoint = ["ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENAI_API_KEY", "OPENAI_BASE_URL", "RLNODE_ENV_URL",
                "RLNODE_MODEL"]
    assert [k for k in seen if k.startswith(("RLNODE_", "OPENAI_", "ANTHROPIC_"))] == endpoint
    # An allowlist: whatever else the daemon holds stays with it.
    assert set(seen) <= set(AGENT_ENV_ALLOW) | {"OUT_FILE", "PWD", "MALLOC_ARENA_MAX", *endpoint} | {
        k for k in seen if k.startswith("LC_")}
    assert "PATH" in seen


# -- reward provenance -----------------------------------------------------------


async def test_a_tool_that_posts_a_reward_changes_nothing(gateway, tmp_path):
    """The evaluator decides (reward_source defaults to it): a tool the policy
    gets its agent to run, holding the agent's environment, posts 1e30; the
    gateway refuses it (403) and the episode's reward is the evaluator's."""
    cube = await started({"command": [sys.executable, str(FIXTURES), "forge"], "env": GUESSING})
    task, result = await play(gateway, cube)  # the agent exits 5 (failing the episode) unless refused with 403
    assert gateway.stats.rewards_refused == 1
    assert result.reward == float(task.inner.solved) and result.reward != 1e30


async def test_a_returned_reward_is_ignored_where_the_evaluator_decides(gateway):
    cube = await started({"agent": f"{FIXTURES}:returns_huge", "env": GUESSING})
    task, result = await play(gateway, cube)
    assert result.reward == float(task.inner.solved)
    assert gateway.stats.agent_rewards_ignored == 1


@pytest.mark.parametrize("agent", ["returns_huge", "returns_nan"])
async def test_an_agent_reward_must_be_finite_and_bounded(agent, gateway, tmp_path):
    cube = await started({"agent": f"{FIXTURES}:{agent}", "tasks": tasks_file(tmp_path)})
    with pytest.raises(RewardRefused, match="actor.episode.max_abs_reward"):
        await play(gateway, cube)


async def test_posting_needs_the_reward_key_and_a_bounded_value(gateway):
    import httpx

    async with gateway.session("ep-key") as s:  # no task: the agent is the reward source
        env = s.endpoint.env_url + "/reward"
        async with httpx.AsyncClient() as http:
            def auth(key):
                return {"Authorization": f"Bearer {key}"}
            assert (await http.post(env, json={"reward": 1.0}, headers=auth(s.api_key))).status_code == 401
            r = await http.post(env, json={"reward": 1e30}, headers=auth(s.reward_key))
            assert r.status_code == 400 and "max_abs_reward" in r.json()["error"]["message"]
            assert (await http.post(env, json={"reward": 0.5}, headers=auth(s.reward_key))).status_code == 200
        assert s.posted_reward == 0.5
    assert gateway.stats.rewards_refused == 2


def test_a_task_file_needs_the_agent_as_its_reward_source(tmp_path):
    with pytest.raises(ValueError, match='reward_source = "agent"'):
        make_cube("x", "openai-agent", {"agent": "m:f", "tasks": tasks_file(tmp_path)}, seed=0)


async def test_an_agent_raising_systemexit_fails_only_its_episode(gateway, tmp_path):
    cube = await started({"agent": f"{FIXTURES}:exits", "tasks": tasks_file(tmp_path)})
    with pytest.raises(AgentFailed, match="SystemExit"):
        await play(gateway, cube)


# -- isolation -------------------------------------------------------------------


def sandbox_uid_processes() -> list[str]:
    """Processes running as an agent sandbox's kernel uid (none may outlive
    an episode)."""
    return sandbox_processes()


async def test_a_timed_out_sandboxed_agent_leaves_nothing(gateway, tmp_path):
    cube = await started({"command": [sys.executable, str(FIXTURES), "hang"], "tasks": tasks_file(tmp_path),
                          "env_vars": {"PID_FILE": "/tmp/pids"}, "timeout_s": 8})
    with pytest.raises(AgentFailed, match="timed out"):
        await play(gateway, cube)
    for _ in range(100):
        if not sandbox_uid_processes():
            break
        time.sleep(0.05)
    assert sandbox_uid_processes() == []


async def test_isolation_none_is_an_explicit_choice_logged_as_an_error(tmp_path):
    import structlog

    with structlog.testing.capture_logs() as logs:
        cube = await started({"command": [sys.executable, str(FIXTURES), "post"], "tasks": tasks_file(tmp_path),
                              "isolation": "none"})
    await cube.close()
    (entry,) = [e for e in logs if e["event"] == "agent.unisolated"]
    assert entry["log_level"] == "error" and entry["key"] == "options.isolation"


# -- agents off the daemon's loop ----------------------------------------------------


async def test_function_agents_run_in_worker_processes(gateway, tmp_path):
    cube = await started({"agent": f"{FIXTURES}:off_the_daemon", "tasks": tasks_file(tmp_path),
                          "env_vars": {"DAEMON_PID": str(os.getpid())}})
    _, result = await play(gateway, cube)
    assert result.reward == 1.0


async def test_an_agent_that_ignores_its_timeout_is_killed_with_its_worker(gateway, tmp_path):
    """A blocking agent cannot be cancelled: CANCEL_GRACE_S after its timeout
    its worker process is killed (with its process group) and replaced."""
    from rlnode.cubes.wall import agent_workers

    cube = await started({"agent": f"{FIXTURES}:blocking_hang", "tasks": tasks_file(tmp_path), "timeout_s": 6})
    (worker,) = cube.workers.workers
    with pytest.raises(AgentFailed, match="timed out"):
        await play(gateway, cube)
    deadline = time.monotonic() + agent_workers.CANCEL_GRACE_S + 10
    while worker.alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not worker.alive() and cube.workers.restarts == 1
    _, result = await play(gateway, await started({"agent": f"{FIXTURES}:returns_reward",
                                                    "tasks": tasks_file(tmp_path)}), episode_id="g1/e0")
    assert result.reward == 0.25
