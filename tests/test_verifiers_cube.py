"""The ``verifiers`` cube and the shipped verifiers environment ``vf_guess``.

Two kinds of tests:

* Environment logic, against a *scripted policy*: a small aiohttp server in
  the test answers chat completions with scripted guesses (binary search, a
  constant, no number). It checks the environment's turn handling and its
  rubric, not rlnode: a correct guess scores 1.0, wrong ones 0.0, the game
  stops at max_turns, each request extends the last one by exactly the
  reply and the feedback.
* rlnode end to end, with the real tiny engine: episodes through the real
  gateway (samples, rubric reward, token parity) and a ``--role all`` run
  that trains on the verifiers cube.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import pytest
from aiohttp import web

from conftest import skip_or_fail
from daemons import ROOT, free_port
from rlnode.config import ConfigError
from rlnode.cubes.base import AgentEndpoint, CubeError
from rlnode.cubes.registry import make_cube, parse_options
from rlnode.wire import unpack_i32

GUESS = "rlnode.cubes.vf_guess"


@pytest.fixture(scope="module")
def vf():
    # Not importorskip: in CI (which installs the extra) an ImportError
    # anywhere under verifiers must fail these tests, not hide them.
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        skip_or_fail(f"verifiers.v1 cannot be imported ({e}); pip install 'rlnode[verifiers]'")
    return vf


def guess_cube(**options):
    opts = {"env": GUESS, "num_train": 6, "num_test": 3, **options}
    return make_cube("vf", "verifiers", opts, seed=0)


# -- scripted policies (environment logic only) ---------------------------------


def binary_search(messages, max_number=8):
    lo, hi = 1, max_number
    guesses = [int(m["content"]) for m in messages if m["role"] == "assistant"]
    feedback = [m["content"] for m in messages if m["role"] == "user"][1:]
    for g, fb in zip(guesses, feedback):
        lo, hi = (g + 1, hi) if fb.startswith("Higher") else (lo, g - 1)
    return str((lo + hi) // 2)


@contextlib.asynccontextmanager
async def scripted_server(policy, key="rlnode-test-key", fail: bool = False, delay_s: float = 0.0):
    """An OpenAI chat-completions endpoint whose replies come from
    ``policy(messages)``; it checks the bearer key like the gateway does."""
    requests: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        requests.append(body)
        await asyncio.sleep(delay_s)
        if fail:
            return web.json_response({"error": {"message": "engine down"}}, status=503)
        text = policy(body["messages"])
        return web.json_response({
            "id": f"c{len(requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })

    app = web.Application()
    app.router.add_post("/ep/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield AgentEndpoint(f"http://127.0.0.1:{port}/ep/v1", key, "", "scripted"), requests
    finally:
        await runner.cleanup()


async def play_one(cube, task_id, policy, **server):
    task = await cube.open_task(task_id)
    async with scripted_server(policy, **server) as (endpoint, requests):
        reward = await task.run_agent(endpoint, {})
    return task, reward, requests


async def test_binary_search_wins_and_requests_extend_by_reply_and_feedback(vf):
    cube = guess_cube(env_args={"taskset": {"max_number": 8, "max_turns": 4}})
    await cube.start()
    for task_id in await cube.task_ids("train"):
        task, reward, requests = await play_one(cube, task_id, binary_search)
        answer = task.task.data.answer
        assert reward == 1.0 and (await task.evaluate()).reward == 1.0
        guesses = [int(binary_search(r["messages"])) for r in requests]
        assert guesses[-1] == answer and answer not in guesses[:-1]
        assert (await task.evaluate()).info["metrics"] == [{"guesses": float(len(requests))}]
        # The conversation only grows: each request is the last one plus the
        # reply it got and the environment's feedback, which is what lets
        # the gateway extend its token history.
        for prev, nxt, g in zip(requests, requests[1:], guesses):
            word = "Higher." if g < answer else "Lower."
            assert nxt["messages"] == prev["messages"] + [{"role": "assistant", "content": str(g)},
                                                         {"role": "user", "content": word}]
        assert requests[0]["messages"][0]["role"] == "system"
        assert requests[0]["messages"][1]["content"] == (await task.reset()).observation


async def test_wrong_guesses_score_zero_and_stop_at_max_turns(vf):
    cube = guess_cube(env_args={"taskset": {"max_number": 8, "max_turns": 3}})
    await cube.start()
    task, reward, requests = await play_one(cube, "train-00000", lambda m: "0")
    assert reward == 0.0 and len(requests) == 3
    ev = await task.evaluate()
    assert (ev.reward, ev.success) == (0.0, False)
    task, reward, requests = await play_one(cube, "train-00001", lambda m: "no idea")
    assert reward == 0.0 and len(requests) == 3
    assert requests[-1]["messages"][-1] == {"role": "user", "content": "Reply with one whole number."}


async def test_turn_cost_and_range_feedback(vf):
    cube = guess_cube(env_args={"taskset": {"max_number": 8, "max_turns": 4, "feedback": "range",
                                            "task": {"turn_cost": 0.1}}})
    await cube.start()
    rewards = []
    for task_id in await cube.task_ids("train"):
        task, reward, requests = await play_one(cube, task_id, binary_search)
        assert reward == pytest.approx(1.0 - 0.1 * (len(requests) - 1))
        rewards.append(reward)
        for r in requests[1:]:
            assert " It is between " in r["messages"][-1]["content"]
    assert len(set(rewards)) > 1  # some took more guesses than others


async def test_splits_are_disjoint_and_deterministic(vf):
    held_out = guess_cube()
    await held_out.start()
    assert await held_out.task_ids("train") == [f"train-{i:05d}" for i in range(6)]
    assert await held_out.task_ids("test") == [f"test-{i:05d}" for i in range(3)]
    ids = lambda cube, split: [t.data.id for t in cube.tasks[split]]
    assert not set(ids(held_out, "train")) & set(ids(held_out, "test"))
    split = guess_cube(test_env_args={"taskset": {"split": "eval"}})
    await split.start()
    assert ids(split, "test") == ["eval-00000", "eval-00001", "eval-00002"]
    again = guess_cube(test_env_args={"taskset": {"split": "eval"}})
    await again.start()
    answers = lambda cube, split: [t.data.answer for t in cube.tasks[split]]
    assert answers(again, "train") == answers(split, "train")
    assert answers(again, "test") == answers(split, "test")
    with pytest.raises(KeyError):
        await split.open_task("train-00006")
    task = await split.open_task("test-00001")
    assert task.ref.task_id == "test-00001"
    with pytest.raises(NotImplementedError):
        await task.step(None)
    with pytest.raises(CubeError, match="no rubric reward"):
        await task.evaluate()  # never played


async def test_a_failed_rollout_fails_the_episode(vf):
    cube = guess_cube()
    await cube.start()
    task = await cube.open_task("train-00000")
    async with scripted_server(binary_search, fail=True) as (endpoint, requests):
        with pytest.raises(CubeError, match="verifiers episode failed"):
            await task.run_agent(endpoint, {})
    assert len(requests) == 1
    # What the evaluator makes of a failed run (the agent episode asks only
    # when the gateway ended it): the rubric on the transcript so far.
    ev = await task.evaluate()
    assert ev.reward == 0.0 and ev.info["metrics"] == [{"guesses": 0.0}]
    # A wrong key reaches the endpoint as a wrong key (401), not as a pass.
    task = await cube.open_task("train-00001")
    async with scripted_server(binary_search, key="other") as (endpoint, requests):
        endpoint = AgentEndpoint(endpoint.base_url, "rlnode-test-key", "", "scripted")
        with pytest.raises(CubeError):
            await task.run_agent(endpoint, {})
    assert not requests
    assert not [k for k in os.environ if k.startswith("RLNODE_VF_API_KEY_")]


async def test_config_errors_surface_at_start(vf):
    with pytest.raises(ValueError, match="env_args.player.retries"):
        await guess_cube(env_args={"player": {"retries": {"max_retries": 2}}}).start()
    with pytest.raises(ValueError, match="max_number"):
        await guess_cube(env_args={"taskset": {"max_number": 1}}).start()
    # One line naming the cube, the environment and the cause: `rlnode eval`
    # prints it as a config error instead of a traceback.
    for env, missing in (("rlnode.cubes.no_such_env", "rlnode.cubes.no_such_env"), ("no_such_env", "no_such_env")):
        with pytest.raises(ConfigError) as e:
            await guess_cube(env=env).start()
        assert str(e.value) == (f"cube 'vf': verifiers environment {env!r} cannot be imported: "
                                f"No module named {missing!r}")


async def test_sampling_args_are_checked_at_start(vf):
    """A key the gateway would ignore, or a value of the wrong type, fails at
    start naming sampling_args, on both the held-out and the test_env_args
    paths."""
    for split_args in ({}, {"test_env_args": {"taskset": {"split": "eval"}}}):
        with pytest.raises(ConfigError, match=r"cube 'vf': sampling_args: .*`temprature`"):
            await guess_cube(sampling_args={"temprature": 0.5}, **split_args).start()
        with pytest.raises(ConfigError, match=r"cube 'vf': sampling_args: .*`sampling_args.max_tokens`"):
            await guess_cube(sampling_args={"max_tokens": "many"}, **split_args).start()
        await guess_cube(sampling_args={"temperature": 0.5, "max_tokens": 16}, **split_args).start()


# -- an upstream-shaped environment: verifiers' own single-agent env -------------

SINGLE = "vf_envs"  # tests/vf_envs.py
LOCAL = {"agent": {"runtime": {"type": "subprocess"}}}


def single_cube(env_args=LOCAL, **options):
    return make_cube("vf1", "verifiers", {"env": SINGLE, "num_train": 2, "num_test": 1, "env_args": env_args,
                                          **options}, seed=0)


async def test_a_remote_runtime_is_refused_at_start(vf):
    """verifiers' default runtime is its remote Prime sandbox: unchanged, an
    upstream env's episode needs a Prime login and died with SystemExit. The
    cube refuses it at start, naming the key to set."""
    with pytest.raises(ConfigError) as e:
        await single_cube(env_args={}).start()
    assert str(e.value) == ('cube \'vf1\': env_args.agent.runtime.type = "prime" needs network and credentials '
                            '(a remote sandbox); set env_args.agent.runtime.type = "subprocess"')
    with pytest.raises(ConfigError, match=r'test_env_args.agent.runtime.type = "modal"'):
        await single_cube(test_env_args={"agent": {"runtime": {"type": "modal"}}}).start()
    cube = single_cube()
    await cube.start()
    task = await cube.open_task("train-00000")
    async with scripted_server(lambda m: str(task.task.data.answer)) as (endpoint, requests):
        assert await task.run_agent(endpoint, {}) == 1.0
    assert len(requests) == 1


async def test_a_foreign_base_exception_fails_only_its_episode(vf):
    """SystemExit from the environment's harness or rubric (the rubric runs
    in a task verifiers spawns, where asyncio re-raises SystemExit out of the
    loop) is a CubeError for that episode; the loop and a concurrent episode
    carry on."""
    for where in ("harness", "rubric"):
        cube = single_cube(env_args={**LOCAL, "taskset": {"task": {"exit_in": where}}})
        await cube.start()
        healthy = single_cube()
        await healthy.start()
        bad, good = await cube.open_task("train-00000"), await healthy.open_task("train-00000")
        async with scripted_server(lambda m: "2") as (endpoint, _):
            results = await asyncio.gather(bad.run_agent(endpoint, {}), good.run_agent(endpoint, {}),
                                           return_exceptions=True)
        assert isinstance(results[0], CubeError) and f"SystemExit: the {where} exits" in str(results[0])
        assert results[1] == 1.0
    await asyncio.sleep(0)  # still on a live loop


async def test_a_cancelled_episode_is_cancelled_on_the_foreign_loop(vf):
    """The episode's timeout cancels the caller: its coroutine on the
    foreign loop is cancelled too (nothing left running there) and the key
    variable is gone."""
    from rlnode.cubes.foreign_loop import ForeignLoop

    cube = single_cube()
    await cube.start()
    task = await cube.open_task("train-00000")
    before = ForeignLoop.shared().stats()
    async with scripted_server(lambda m: "2", delay_s=4) as (endpoint, requests):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task.run_agent(endpoint, {}), 1.0)
    assert len(requests) == 1
    after = ForeignLoop.shared().stats()
    assert after["running"] == before["running"] and after["abandoned"] == before["abandoned"]
    assert not [k for k in os.environ if k.startswith("RLNODE_VF_API_KEY_")]


async def environ_watch(runs) -> list[str]:
    """Episode key variables seen in os.environ while ``runs`` run."""
    seen: set[str] = set()
    while not all(r.done() for r in runs):
        seen |= {k for k in os.environ if k.startswith("RLNODE_VF_API_KEY_")}
        await asyncio.sleep(0.005)
    return sorted(seen)


async def test_64_concurrent_episodes_share_the_environments_locks(vf):
    """Issue 34: verifiers shares asyncio locks between episodes (upstream's
    SubprocessRuntime keeps them on the class), and so does this test
    environment's harness (a lock and a semaphore, made at import, held
    across a suspension by every episode). 64 concurrent episodes, one
    try each: all 64 finish and score. With a loop per episode most failed
    with "... is bound to a different event loop"."""
    import vf_envs

    cube = single_cube(env_args={**LOCAL, "taskset": {"num_tasks": 80}}, num_train=64)
    await cube.start()
    tasks = [await cube.open_task(f"train-{i:05d}") for i in range(64)]
    entered = vf_envs.ExitHarness.entered
    async with scripted_server(lambda m: "1") as (endpoint, requests):
        # A deadline: on a loop per episode, some episodes also waited
        # forever on a lock whose waiter was on another loop.
        runs = [asyncio.ensure_future(t.run_agent(endpoint, {})) for t in tasks]
        keys_in_environ = asyncio.ensure_future(environ_watch(runs))
        done, stuck = await asyncio.wait(runs, timeout=60)
        for r in stuck:
            r.cancel()
    # The episodes' keys reached the server (it checks them) through
    # verifiers' own key lookup, yet never the process's environment, which
    # every process any thread starts would inherit.
    assert await keys_in_environ == []
    errors = [r.exception() for r in done if r.exception()]
    assert not errors and not stuck, (f"{len(errors)} of 64 failed (first: {errors[:1]!r}), "
                                      f"{len(stuck)} still running after 60 s")
    rewards = [r.result() for r in runs]
    assert len(requests) == 64 and vf_envs.ExitHarness.entered - entered == 64
    # Answers alternate 1, 2 (ExitTaskset): the constant guess "1" wins half.
    assert sorted(rewards) == [0.0] * 32 + [1.0] * 32


async def test_a_hanging_harness_ends_at_its_deadline_and_the_loop_serves_on(vf):
    """A harness that never returns ends at the episode's deadline (the
    agent loop's wait_for on timeout_s); its coroutine is cancelled on the
    foreign loop, which then serves the next episodes as before."""
    from rlnode.cubes.foreign_loop import ForeignLoop

    hung = single_cube(env_args={**LOCAL, "taskset": {"task": {"exit_in": "hang"}}}, timeout_s=1.0)
    await hung.start()
    healthy = single_cube()
    await healthy.start()
    before = ForeignLoop.shared().stats()
    async with scripted_server(lambda m: "1") as (endpoint, _):
        stuck = await hung.open_task("train-00000")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stuck.run_agent(endpoint, {}), stuck.timeout_s)
        assert ForeignLoop.shared().stats()["running"] == before["running"]
        rewards = await asyncio.gather(*[(await healthy.open_task(f"train-0000{i}")).run_agent(endpoint, {})
                                         for i in range(2)])
    assert sorted(rewards) == [0.0, 1.0]
    assert ForeignLoop.shared().stats()["abandoned"] == before["abandoned"]


async def test_a_harness_program_runs_behind_the_agents_wall(vf, tmp_path, monkeypatch):
    """A harness that runs its agent as a program in verifiers' subprocess
    runtime (as upstream's CLI harnesses do): the program reaches the model
    through the endpoint verifiers gave it (its port mirrored into the box),
    and every escape its tool calls could try is refused: the daemon's /proc
    environment, a fork bomb (limits.processes), the daemon's secrets in its
    environment, and the node's real CURVE keys, with which it would
    register as the node and deliver a group (real frames) to a real trainer
    link on loopback: nothing reaches it."""
    import msgspec

    import vf_envs
    from rlnode.bench.fuzz import FrameMaker
    from rlnode.config import load_config
    from rlnode.link.curve import auto_keys
    from rlnode.link.trainer_link import TrainerLink
    from rlnode.link.validate import GroupLimits
    from rlnode.wire import EngineInfo, Register
    from test_link import ANY_PORT, FAST

    keys = auto_keys(tmp_path / "run", "n1")
    link = TrainerLink(ANY_PORT, msgspec.structs.replace(FAST, curve_dir=keys))
    await link.start()
    frames = {"register": Register("n1", "stolen", [EngineInfo(0, 1)]),
              "deliver": FrameMaker(GroupLimits.from_config(load_config(None, []), 256), "n1").valid_group(0)}
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    for k, v in {"KEY_DIR": keys, "NODE_ID": "n1", "DAEMON_PID": str(os.getpid()),
                 "LINK_PORT": link.endpoint.rsplit(":", 1)[1],
                 "FRAMES": json.dumps({k: msgspec.msgpack.encode(f).hex() for k, f in frames.items()})}.items():
        monkeypatch.setenv(f"VF_TEST_{k}", v)
    vf_envs.ExitHarness.reports.clear()
    cube = single_cube(env_args={**LOCAL, "taskset": {"task": {"exit_in": "tool"}}}, limits={"processes": 64})
    await cube.start()
    try:
        task = await cube.open_task("train-00001")
        async with scripted_server(lambda m: "2") as (endpoint, requests):
            reward = await task.run_agent(endpoint, {})
        (printed,) = vf_envs.ExitHarness.reports.values()
        report = json.loads(printed.split("REPORT ", 1)[1])
        assert report.pop("model_call") == "ok: 200" and len(requests) == 1 and reward in (0.0, 1.0)
        assert report.pop("uid") != 0 and report.pop("secrets_in_env") == []
        assert all(v.startswith("refused") for v in report.values()), report
        c = link.counters
        assert (c.frames_in, c.registrations, c.groups_accepted) == (0, 0, 0) and not link.peers()
    finally:
        await link.close()


# One walled episode of vf_envs' "script" task in a process of its own, as
# a new node runs it: HOME and the cache are empty folders.
COLD_EPISODE = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[3])
from rlnode.cubes.base import AgentEndpoint
from rlnode.cubes.registry import make_cube
async def main():
    cube = make_cube("vf1", "verifiers", {"env": "vf_envs", "num_train": 2, "num_test": 1, "env_args": {
        "agent": {"runtime": {"type": "subprocess"}}, "taskset": {"task": {"exit_in": "script"}}}}, seed=0)
    await cube.start()
    task = await cube.open_task("train-00001")
    try:
        reward, error = await task.run_agent(AgentEndpoint(sys.argv[1], sys.argv[2], "", "scripted"), {}), None
    except Exception as e:
        reward, error = None, "%s: %s" % (type(e).__name__, e)
    import vf_envs
    print("RESULT " + json.dumps({"reward": reward, "error": error, "reports": vf_envs.ExitHarness.reports,
                                  "phases": task.phases()}))
asyncio.run(main())
"""


async def test_a_pep723_harness_script_runs_walled_from_an_empty_home_and_cache(vf, tmp_path):
    """verifiers' harnesses run their agent as a PEP 723 script
    (``prepare_uv_script``). On a new node (empty HOME, no cache) under the
    default wall, the script is prepared on the host into rlnode's cache
    and runs in the box: the episode's model call goes through, and the
    box can change neither its script, nor its interpreter's environment,
    nor the uv cache that later episodes run from."""
    import hashlib

    home, cache = tmp_path / "home", tmp_path / "xdg-cache"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "XDG_CACHE_HOME": str(cache), "LANG": "C.UTF-8"}
    async with scripted_server(lambda m: "2") as (endpoint, requests):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", COLD_EPISODE, endpoint.base_url, endpoint.api_key, os.path.dirname(__file__),
            env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().split("RESULT ", 1)[1])
    assert result["error"] is None, result["error"]
    assert result["reward"] == 0.0 and len(requests) == 1  # train-00001 is row 2 (after the test row): answer 1
    (printed,) = result["reports"].values()
    report = json.loads(printed.split("REPORT ", 1)[1])
    root = cache / "rlnode" / "verifiers"
    assert report.pop("model_call") == "ok: 200"
    assert report.pop("uid") not in (0, os.getuid())
    script = report.pop("script")
    assert script.startswith(str(root / "scripts") + "/") and report.pop("executable").startswith(str(root / "uv"))
    assert report.pop("virtual_env").startswith(str(root / "uv"))
    assert all(v.startswith("refused") for v in report.values()), report
    phases = result["phases"]  # where the episode's time went, from verifiers' trace and the task
    assert set(phases) == {"serving_s", "harness_start_s", "harness_s", "model_s", "rubric_s", "teardown_s"}
    assert phases["harness_start_s"] > 0 and phases["harness_s"] > 0 and phases["model_s"] > 0, phases
    assert all(v >= 0 for v in phases.values()), phases
    data = open(script, "rb").read()
    assert os.path.basename(script) == hashlib.sha256(data).hexdigest() + ".py"
    planted = [p for p in tmp_path.rglob("planted*")]
    assert planted == []
    assert sorted(p.name for p in home.iterdir()) == []  # nothing under HOME: the cache root holds it all


async def test_the_runtimes_host_side_files_never_follow_a_link_out_of_its_box(vf, tmp_path):
    """The daemon reads and writes a runtime's working directory from the
    host (verifiers' ``read``/``write``, the log of ``run_background``), and
    the box writes there too. A program in the box plants links to a key
    file: the daemon reads none of it and truncates none of it, through a
    link at the end or a linked folder on the way, and a path outside the
    directory is read in the box, where the key does not exist. The
    directory is the box's alone (0700, owned by its uid)."""
    import stat

    from verifiers.v1.errors import SandboxError
    from verifiers.v1.runtimes.subprocess import SubprocessConfig

    from rlnode.cubes.wall.agent_sandbox import AgentLimits
    from rlnode.cubes.wall.vf_runtime import make_walled_runtime
    from rlnode.cubes.vf_scripts import ScriptCache

    secret = tmp_path / "link-keys" / "n1.key_secret"
    secret.parent.mkdir()
    secret.write_bytes(b"THE-KEY")
    scripts = ScriptCache(tmp_path / "cache")
    scripts.make_dirs()
    runtime = make_walled_runtime(AgentLimits(), {"PATH": "/usr/bin:/bin"}, scripts)(SubprocessConfig(), "rt1")
    await runtime.start()
    try:
        await runtime.write("in.txt", b"from the host")
        plant = (f"ln -s {secret} out.txt && ln -s {secret.parent} keys && ln -s {secret} server.log && "
                 "cat in.txt && echo && stat -c %a .")
        done = await runtime.run(["sh", "-c", plant], {})
        assert done.exit_code == 0, done.stderr
        assert done.stdout.split() == ["from", "the", "host", "700"]
        if os.geteuid() == 0:
            assert os.stat(runtime.workdir).st_uid >= 1_200_000_000  # the box's fresh uid
        assert stat.S_IMODE(os.stat(runtime.workdir).st_mode) == 0o700
        for path in ("out.txt", "keys/n1.key_secret", f"{runtime.workdir}/out.txt"):
            with pytest.raises(SandboxError, match="link"):
                await runtime.read(path)
            with pytest.raises(SandboxError, match="link"):
                await runtime.read(path, max_bytes=100)
            with pytest.raises(SandboxError, match="link"):
                await runtime.write(path, b"")
        with pytest.raises(Exception, match="link"):
            await runtime.run_background(["true"], {}, "server.log")
        # Outside the working directory: the box's view, where it is not.
        with pytest.raises(Exception):
            await runtime.read(str(secret), max_bytes=100)
        await runtime.write("sub/dir/ok.txt", b"fine")
        assert await runtime.read("sub/dir/ok.txt") == b"fine"
        assert secret.read_bytes() == b"THE-KEY"
    finally:
        await runtime.teardown()
    assert not os.path.exists(runtime.workdir)


@pytest.mark.parametrize("flood", ["big", "many"])
async def test_a_box_that_fills_its_working_directory_is_ended_naming_the_cap(vf, tmp_path, flood):
    """A program writes into its runtime's working directory (on the node's
    disk), as 1 MiB files or as empty ones, and waits: past
    limits.disk_mib the daemon ends the box, the call fails naming the key,
    the directory is gone after teardown, and another runtime runs on."""
    from verifiers.v1.runtimes.subprocess import SubprocessConfig

    from rlnode.cubes.wall.agent_sandbox import AgentLimits
    from rlnode.cubes.wall.vf_runtime import make_walled_runtime
    from rlnode.cubes.vf_scripts import ScriptCache

    scripts = ScriptCache(tmp_path / "cache")
    scripts.make_dirs()
    make = make_walled_runtime(AgentLimits(disk_mib=8), {"PATH": "/usr/bin:/bin"}, scripts)
    # 64 MiB as files, or 10,000 empty ones (40 MiB counted), then it waits
    # to be stopped: the daemon's check comes every second, the program
    # gives up (and says DONE) only after two minutes.
    write, count = ("head -c 1048576 /dev/zero > f$i", 64) if flood == "big" else (": > f$i", 10_000)
    fill = f"i=0; while [ $i -lt {count} ]; do {write}; i=$((i+1)); done; sleep 120; echo DONE"
    runtime = make(SubprocessConfig(), "rt-fill")
    await runtime.start()
    try:
        with pytest.raises(Exception, match="limits.disk_mib = 8") as err:
            done = await runtime.run(["sh", "-c", fill], {})
            raise AssertionError(f"the box wrote on: exit {done.exit_code}, {done.stdout[-80:]!r}")
        assert "DONE" not in str(err.value)
    finally:
        await runtime.teardown()
    assert not os.path.exists(runtime.workdir)
    other = make(SubprocessConfig(), "rt-other")
    await other.start()
    try:
        assert (await other.run(["sh", "-c", "echo ok > f && cat f"], {})).stdout.strip() == "ok"
    finally:
        await other.teardown()


def test_rlnode_eval_prints_one_line_for_a_cube_that_cannot_start(vf, tmp_path, capsys):
    """`rlnode eval` (its command function, in-process: cubes start before
    any engine) on an environment that cannot be imported and on one left
    on the remote runtime: one config-error line each, exit code 2."""
    import argparse

    from rlnode.config import load_config
    from rlnode.evaluate import main_eval

    args = argparse.Namespace(model=None, cube=[], episodes=1, json=True)
    for options, line in (
            ('{env="no_such_env"}', "cube 'x': verifiers environment 'no_such_env' cannot be imported: "
                                    "No module named 'no_such_env'"),
            (f'{{env="{SINGLE}"}}', 'cube \'x\': env_args.agent.runtime.type = "prime" needs network and '
                                    'credentials (a remote sandbox); set env_args.agent.runtime.type = "subprocess"')):
        cfg = load_config(ROOT / "conf/verifiers-guess.toml",
                          [f"run.run_dir={tmp_path}", f'actor.cubes=[{{id="x", kind="verifiers", options={options}}}]'])
        assert main_eval(cfg, args) == 2
        out = capsys.readouterr()
        assert (out.out, out.err) == ("", f"rlnode eval: config error: {line}\n")


async def test_load_environment_builds_the_env_alone(vf):
    from rlnode.cubes import vf_guess

    env = vf_guess.load_environment(taskset={"max_number": 5, "num_tasks": 3})
    assert isinstance(env, vf_guess.GuessEnv)
    tasks = list(env.taskset)
    assert [t.data.id for t in tasks] == ["train-00000", "train-00001", "train-00002"]
    assert all(1 <= t.data.answer <= 5 for t in tasks)


def test_options_validate_without_verifiers_and_missing_extra_is_named(monkeypatch):
    opts = parse_options("verifiers", {"env": GUESS, "env_args": {"taskset": {"max_turns": 3}}})
    assert opts.env == GUESS and opts.timeout_s == 600.0
    import msgspec

    with pytest.raises(msgspec.ValidationError, match="num_tset"):
        parse_options("verifiers", {"env": GUESS, "num_tset": 3})
    from rlnode.cubes import verifiers_cube

    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"cube 'vf': .*pip install 'rlnode\[verifiers\]'"):
        asyncio.run(guess_cube().start())
    with pytest.raises(ModuleNotFoundError, match="verifiers extra"):
        verifiers_cube.import_verifiers()


# -- through the real gateway and engine -----------------------------------------


def reply_text(renderer, sample) -> str:
    """The text the gateway answered for a sample (its completion, without
    the closing end-of-turn token)."""
    ids = unpack_i32(sample.completion_ids).tolist()
    return renderer.decode(ids[:-1] if ids and ids[-1] == renderer.eos_id else ids)


@pytest.mark.engine
async def test_gateway_episodes_samples_rubric_reward_and_token_parity(vf, engine, tokenizer):
    from rlnode.actor.agent_episode import run_agent_episode
    from rlnode.actor.engine import SamplingSettings
    from rlnode.actor.episode import ChatRenderer, EpisodeSettings
    from rlnode.actor.gateway import Gateway
    from rlnode.actor.generation import LLMClient
    from rlnode.actor.router import AdmissionRouter
    from rlnode.cubes.vf_guess import play

    from conftest import assert_engine_idle

    settings = EpisodeSettings(SamplingSettings(max_tokens=2, temperature=1.0), max_turns=8, max_model_len=2048)
    router = AdmissionRouter(1, 16)
    renderer = ChatRenderer(tokenizer)
    gw = Gateway(LLMClient([engine], router), renderer, settings, model_name="tiny")
    cube = guess_cube(num_train=8, env_args={"taskset": {"max_number": 5, "max_turns": 3}})
    await cube.start()
    tasks = [await cube.open_task(t) for t in await cube.task_ids("train")]
    async with gw.serve():
        results = await asyncio.gather(*(run_agent_episode(gw, t, settings, f"ep-{i}", "g") for i, t in
                                         enumerate(tasks)))
    assert router.in_flight == [0]
    await assert_engine_idle(engine)
    assert gw.stats.history_resets == 0 and gw.stats.errors == 0
    assert gw.stats.calls == sum(len(r.samples) for r in results)
    for task, r in zip(tasks, results):
        # Every LLM call the environment made is one sample, in order.
        assert [s.step_index for s in r.samples] == list(range(len(r.samples)))
        assert (await task.evaluate()).info["metrics"] == [{"guesses": float(len(r.samples))}]
        # The reward is the rubric's, and the rubric is the game: replaying
        # the completions the engine produced gives the same outcome.
        replies = [reply_text(renderer, s) for s in r.samples]
        solved, used = play(task.task.data.answer, replies, 3)
        assert used == len(r.samples) and r.reward == task.reward == float(solved)
        assert {s.reward for s in r.samples} == {r.reward}
        # Multi-turn token parity: prompt k+1 = prompt k + completion k + the
        # feedback's template tokens.
        for prev, nxt in zip(r.samples, r.samples[1:]):
            head = unpack_i32(prev.prompt_ids).tolist() + unpack_i32(prev.completion_ids).tolist()
            assert unpack_i32(nxt.prompt_ids).tolist()[: len(head)] == head

    # The gateway's own cap (2 calls) ends 3-guess games early: the episode
    # still counts, scored by the rubric on the guesses made.
    capped = EpisodeSettings(settings.sampling, max_turns=2, max_model_len=2048)
    gw = Gateway(LLMClient([engine], router), renderer, capped, model_name="tiny")
    tasks = [await cube.open_task(t) for t in await cube.task_ids("train")]
    async with gw.serve():
        results = await asyncio.gather(*(run_agent_episode(gw, t, capped, f"cap-{i}", "g") for i, t in
                                         enumerate(tasks)))
    assert router.in_flight == [0]
    for task, r in zip(tasks, results):
        replies = [reply_text(renderer, s) for s in r.samples]
        solved, used = play(task.task.data.answer, replies, 3)
        assert r.reward == float(solved) and used == len(r.samples) <= 2
        assert r.termination_reason == ("max_turns" if not solved and used == 2 else "done")
    assert any(r.termination_reason == "max_turns" for r in results)


def _train(tmp_path, model, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlnode", "--role", "all", "--config", str(ROOT / "conf/verifiers-guess.toml"),
         "--log-json", "--set", f"model.path={model}", "--set", f"run.run_dir={tmp_path / 'run'}",
         "--set", f"trainer.max_steps={steps}", "--set", "actor.scheduler.eval_every=0",
         "--set", "actor.scheduler.groups_per_step=2", "--set", "actor.scheduler.attempts=4",
         "--set", f"trainer.port={free_port()}", "--set", "http.trainer_port=0", "--set", "http.actor_port=0",
         "--set", f"trainer.weights.base_port={free_port()}", *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"},
    )


@pytest.mark.engine
def test_a_verifiers_environment_trains_end_to_end(vf, tmp_path):
    """`rlnode --role all` on conf/verifiers-guess.toml: the trainer takes its
    steps on samples from the verifiers cube, every sample of every group
    arrives, no episode fails."""
    from rlnode.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0)
    steps = 3
    r = _train(tmp_path, model, steps)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_records = [x for x in records if "step" in x]
    assert len(step_records) == steps, records
    events = [json.loads(l) for l in r.stderr.splitlines() if l.startswith("{")]
    pushes = [e for e in events if e["event"].startswith(("weights.", "link.peer", "actor.connected"))]
    for x in step_records:
        # 2 whole groups of 4 episodes, each 1..3 LLM calls (one sample each).
        assert x["groups"] == 2 and x["dropped_stale"] == 0, x
        assert 8 <= x["samples"] <= 24, (x, pushes)
    # Every push from the first one that reached the actor on (as in
    # test_cluster::test_no_fault): the first step's may time out while the
    # actor's engine is still joining the weight group on a loaded machine,
    # and is retried with the next version.
    pushed = [x["weights_pushed"] for x in step_records]
    first = pushed.index(True) if True in pushed else len(pushed)
    assert first <= 1 and all(pushed[first:]), (pushed, pushes)
    assert not [e for e in events if e.get("level") == "error"]
    # The actor's own count at shutdown: every episode played, none failed.
    (stopped,) = [e for e in events if e["event"] == "actor.stopped"]
    stats = stopped["cubes"]["vf-guess"]
    assert stats["groups"] >= 2 * steps and stats["episodes"] == 4 * stats["groups"]
    assert stats["errors"] == stats["retries"] == stats["groups_dropped"] == 0, stats
    assert 1.0 <= stats["turns_mean"] <= 3.0
