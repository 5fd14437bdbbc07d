"""One wall for every agent kind (rlnode/cubes/wall/agent_sandbox.py): a command
agent's process and a function agent's workers run sandboxed, with an
allowlisted environment, no run dir, no link keys, rlimits, and the
gateway's episode routes as their only way out. Each test plays what a tool
call the policy got the agent to run could try."""

import asyncio
import re
import json
import os
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from rlnode.config import ConfigError, load_config
from rlnode.cubes.base import CubeError
from rlnode.cubes.wall.box_cgroup import BoxCgroups
from rlnode.link.curve import auto_keys
from rlnode.link.trainer_link import TrainerLink
from rlnode.link.validate import GroupLimits
from rlnode.wire import EngineInfo, Register

from test_agent_cube import FIXTURES, OPEN_CUBES, close_cubes, gateway, play, router, sandbox_uid_processes, started, tasks_file  # noqa: F401
from test_link import ANY_PORT, FAST

pytestmark = pytest.mark.engine

KINDS = ["function", "command"]


def agent(kind: str, name: str) -> dict:
    """Options running fixture ``name`` as a function agent or a command."""
    if kind == "function":
        return {"agent": f"{FIXTURES}:{name}"}
    return {"command": [sys.executable, str(FIXTURES), name]}


@pytest.mark.parametrize("kind", KINDS)
async def test_an_agent_reaches_the_gateway_and_nothing_else(kind, gateway, tmp_path, monkeypatch):
    """The daemon's /proc and environment, a secret file and the run dir,
    the link port on loopback, the internet, writing outside its /tmp: all
    refused, for a function agent's worker as for a command."""
    import socket

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    secret = run_dir / "curve.key_secret"
    secret.write_text("secret")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    link = socket.create_server(("127.0.0.1", 0))  # stands for the link's loopback port
    try:
        env = {"DAEMON_PID": str(os.getpid()), "SECRET_FILE": str(secret), "RUN_DIR": str(run_dir),
               "LINK_PORT": str(link.getsockname()[1])}
        cube = await started({**agent(kind, "escape"), "tasks": tasks_file(tmp_path), "env_vars": env})
        with pytest.raises(CubeError) as e:
            await play(gateway, cube)
    finally:
        link.close()
    got = json.loads(str(e.value).split("REPORT ", 1)[1].rstrip(")"))
    assert gateway.stats.calls == 1  # the gateway was reachable
    assert got.pop("uid") != 0 and got.pop("secrets_in_env") == []
    assert all(v.startswith("refused") for v in got.values()), got
    assert not (run_dir / "planted").exists()
    await cube.close()
    # The sandbox's pid namespace ends with its bwrap; the kernel reaps the
    # rest of it a moment later.
    for _ in range(100):
        if not sandbox_uid_processes():
            break
        await asyncio.sleep(0.05)
    assert sandbox_uid_processes() == []


@pytest.mark.parametrize("kind", KINDS)
async def test_an_agent_cannot_take_the_nodes_link_keys(kind, gateway, tmp_path):
    """The node's real CURVE keys (auto_keys, as for an agent cube) and a
    real trainer link under them: the agent cannot read the key files, and
    its Register and GroupDelivery (real frames, for the real node id) reach
    no trainer: nothing registered, nothing accepted, no frame even seen."""
    from rlnode.bench.fuzz import FrameMaker

    run_dir = tmp_path / "run"
    keys = auto_keys(run_dir, "n1")
    link = TrainerLink(ANY_PORT, msgspec.structs.replace(FAST, curve_dir=keys))
    await link.start()
    try:
        limits = GroupLimits.from_config(load_config(None, []), 256)
        frames = {"register": Register("n1", "stolen", [EngineInfo(0, 1)]),
                  "deliver": FrameMaker(limits, "n1").valid_group(0)}
        env = {"KEY_DIR": keys, "NODE_ID": "n1", "LINK_PORT": link.endpoint.rsplit(":", 1)[1],
               "FRAMES": json.dumps({k: msgspec.msgpack.encode(v).hex() for k, v in frames.items()})}
        cube = await started({**agent(kind, "steal"), "tasks": tasks_file(tmp_path), "env_vars": env})
        with pytest.raises(CubeError) as e:
            await play(gateway, cube)
        got = json.loads(str(e.value).split("REPORT ", 1)[1].rstrip(")"))
        assert all(v.startswith("refused") for v in got.values()), got
        c = link.counters
        assert (c.frames_in, c.registrations, c.groups_accepted) == (0, 0, 0) and not link.peers()
    finally:
        await link.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("abuse", ["bomb", "hog", "flood", "bigfile"])
async def test_an_agent_past_its_limits_fails_its_episode_alone(kind, abuse, gateway, tmp_path):
    """A fork bomb, 10,000 gateway connections, a 2 GiB memory hog and a
    64 MiB file each end as that episode's error (the limit held: the agent
    was refused), while another agent's episodes, started at the same time,
    score."""
    limits = {"processes": 64, "memory_mib": 1024, "open_files": 256, "file_mib": 16, "tmp_mib": 128}
    bad = await started({**agent(kind, abuse), "tasks": tasks_file(tmp_path), "limits": limits}, "bad")
    good = await started({"agent": f"{FIXTURES}:returns_reward", "tasks": tasks_file(tmp_path)}, "good")
    outcomes = await asyncio.gather(play(gateway, bad, "g0/e0"), play(gateway, good, "g1/e0"),
                                    play(gateway, good, "g1/e1"), return_exceptions=True)
    assert isinstance(outcomes[0], CubeError), outcomes[0]
    assert ("LIMIT" in str(outcomes[0])), outcomes[0]
    assert [o[1].reward for o in outcomes[1:]] == [0.25, 0.25]
    # The gateway serves on: one more episode after the abuse.
    assert (await play(gateway, good, "g2/e0"))[1].reward == 0.25


@pytest.mark.parametrize("kind", KINDS)
async def test_a_box_of_many_processes_is_capped_as_a_whole(kind, gateway, tmp_path):
    """Eight processes of 384 MiB each (each within its 1 GiB address
    space, 3 GiB together) in a box capped at 512 MiB: the kernel ends them
    inside that box, the episode's error names the cap's key, another
    agent's episodes score, and the box's cgroup is gone afterwards."""
    cgroups = BoxCgroups.here()
    if not cgroups.parents:
        pytest.skip(f"no box cgroups on this node: {cgroups.why_not}")
    before = {p: set(os.listdir(p)) for p in cgroups.parents}
    limits = {"processes": 64, "memory_mib": 1024, "box_memory_mib": 512}
    bad = await started({**agent(kind, "herd"), "tasks": tasks_file(tmp_path), "limits": limits}, "bad")
    good = await started({"agent": f"{FIXTURES}:returns_reward", "tasks": tasks_file(tmp_path)}, "good")
    outcomes = await asyncio.gather(play(gateway, bad, "g0/e0"), play(gateway, good, "g1/e0"),
                                    return_exceptions=True)
    assert isinstance(outcomes[0], CubeError), outcomes[0]
    assert "limits.box_memory_mib = 512" in str(outcomes[0]), outcomes[0]
    assert outcomes[1][1].reward == 0.25
    for cube in (bad, good):
        OPEN_CUBES.remove(cube)
        await cube.close()
    assert {p: set(os.listdir(p)) for p in cgroups.parents} == before


async def test_no_secret_is_on_any_argv_while_an_agent_runs(gateway, tmp_path):
    """/proc/PID/cmdline is world-readable: while a sandboxed command agent
    and a function agent's worker run, no process's argv holds an episode's
    key or tokened URL (bwrap is started with the environment instead)."""
    cmd = await started({**agent("command", "sleep"), "tasks": tasks_file(tmp_path), "env_vars": {"SLEEP_S": "4"}})
    fn = await started({"agent": f"{FIXTURES}:returns_reward", "tasks": tasks_file(tmp_path)}, "fn")
    episode = asyncio.ensure_future(play(gateway, cmd))
    seen: list[str] = []
    for _ in range(40):
        await asyncio.sleep(0.1)
        tokens = [s.token for s in gateway.sessions.values()] + [s.api_key for s in gateway.sessions.values()]
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            # The episodes' own secret values (other tests' programs may well
            # name the variables in their source), and bwrap's --setenv.
            seen += [argv[:200] for t in tokens if t in argv]
            seen += [argv[:200] for marker in ("--setenv",) if marker in argv]
    with pytest.raises(CubeError, match="no reward"):  # it only slept
        await episode
    assert fn.workers.workers and not seen, seen


async def test_the_agents_socket_serves_the_episode_routes_alone(gateway):
    """What sandboxed agents reach (their relay's upstream): the episode
    routes; the ops routes (/status, /metrics, /history, /) are not there."""
    conn = aiohttp.UnixConnector(path=gateway.agent_socket)
    async with aiohttp.ClientSession(connector=conn) as http:
        for path in ("/status", "/metrics", "/history", "/", "/healthz"):
            async with http.get(f"http://gateway{path}") as r:
                assert r.status == 404, path
        async with gateway.session("e0") as s:
            async with http.get(f"http://gateway/episodes/{s.token}/v1/models",
                                headers={"Authorization": f"Bearer {s.api_key}"}) as r:
                assert r.status == 200
    assert Path(gateway.agent_socket).stat().st_mode & 0o777 == 0o666
    assert Path(gateway.agent_socket).parent.stat().st_mode & 0o777 == 0o711


async def test_a_worker_near_its_cpu_limit_retires_without_failing_an_episode(gateway, tmp_path):
    """limits.cpu_s is an rlimit per process, and a function agent's worker
    lives across episodes: at 80% of it the worker takes no new episode,
    ends once its last one has (that episode scores), and is replaced; it
    is not counted as lost."""
    cube = await started({"agent": f"{FIXTURES}:burn", "tasks": tasks_file(tmp_path), "limits": {"cpu_s": 10}})
    (worker,) = cube.workers.workers
    _, result = await play(gateway, cube)
    assert result.reward == 0.5
    for _ in range(200):
        if not worker.alive():
            break
        await asyncio.sleep(0.05)
    assert not worker.alive() and worker not in cube.workers.workers
    assert (cube.workers.retired, cube.workers.restarts) == (1, 0)


async def test_a_worker_cannot_run_code_in_the_daemon(gateway, tmp_path):
    """The worker's channel is the daemon's too: a frame the agent forges
    there (a pickle that would run code when loaded) is refused as a broken
    frame, the worker is dropped and its episode fails; nothing ran in the
    daemon."""
    marker = tmp_path / "ran-in-the-daemon"
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": "p", "marker": str(marker)}) for i in range(20)))
    cube = await started({"agent": f"{FIXTURES}:forge_frame", "tasks": str(path)})
    with pytest.raises(CubeError) as e:
        await play(gateway, cube)
    assert not marker.exists()
    assert "undecodable frame" in str(e.value) and cube.workers.restarts == 1, (str(e.value), cube.workers.restarts)


async def test_a_function_agents_worker_reaches_every_gateway_host(engine, router, tiny_model_dir, tmp_path):
    """actor.gateway_hosts = 2: a worker relays to each host (a port each
    inside its sandbox; an episode's URL names its host's), so episodes
    served by either host score. The worker started before the gateway
    served is replaced by one with both relays, not counted as lost."""
    from rlnode.actor.gateway import HostedGateway
    from rlnode.actor.generation import LLMClient
    from rlnode.config import ModelConfig
    from test_agent_cube import SETTINGS

    gw = HostedGateway(LLMClient([engine], router), ModelConfig(path=str(tiny_model_dir)), SETTINGS, hosts=2)
    async with gw.serve():
        cube = await started({"agent": f"{FIXTURES}:returns_reward", "tasks": tasks_file(tmp_path)})
        outcomes = await asyncio.gather(*(play(gw, cube, f"g{i}/e0") for i in range(4)))
        assert [r.reward for _, r in outcomes] == [0.25] * 4
        (worker,) = cube.workers.workers
        assert [r.upstream for r in worker.relays] == gw.agent_sockets
        assert all(r.relayed > 0 for r in worker.relays), [r.relayed for r in worker.relays]
        assert cube.workers.restarts == 0
        await cube.close()


@pytest.fixture
def guarded(tmp_path, monkeypatch):
    """What the actor daemon guards at start (``no_box_sees``), all under
    ``tmp_path/srv``: the run dir, the key folder, the HTTP token file and
    the Hugging Face cache."""
    from huggingface_hub import constants

    from rlnode.actor.daemon import no_box_sees
    from rlnode.cubes.wall import isolation

    srv = tmp_path / "srv"
    paths = {"run": srv / "run", "curve": srv / "keys" / "curve", "hf": srv / "hf"}
    for p in paths.values():
        p.mkdir(parents=True)
    (srv / "keys" / "http.token").write_text("t")
    monkeypatch.setattr(constants, "HF_HOME", str(paths["hf"]))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(paths["hf"] / "token"))
    monkeypatch.setattr(isolation, "_guarded", {})
    cfg = load_config(None, [f"run.run_dir={paths['run']}", f"link.curve_dir={paths['curve']}",
                             f"http.token_file={srv / 'keys' / 'http.token'}"])
    isolation.guard_paths(no_box_sees(cfg))
    return srv, cfg


@pytest.mark.parametrize("shows, key", [
    ("cwd holds it", "run.run_dir"),
    ("ro_paths inside it", "link.curve_dir"),
    ("command names it", "http.token_file"),
    ("PYTHONPATH holds it", "HF_HOME"),
    ("agent file inside it", "run.run_dir"),
])
async def test_a_path_shown_to_agents_that_would_show_a_guarded_one_is_refused_at_start(shows, key, guarded, tmp_path):
    """cwd, ro_paths, a file the command names, a PYTHONPATH folder and a
    function agent's file are bound into every box: one that is, holds or
    lies inside the run dir, the key folder, the token file or the Hugging
    Face cache would show them (a unit's box has the daemon's kernel uid,
    so only the bind view keeps them out). The cube refuses at start,
    naming its option and the guarded key."""
    guarded, _ = guarded
    options = {"tasks": tasks_file(tmp_path), "command": [sys.executable, str(FIXTURES), "reply"]}
    option = {"cwd holds it": "options.cwd", "ro_paths inside it": "options.ro_paths[0]",
              "command names it": "options.command[3]", "PYTHONPATH holds it": "PYTHONPATH entry",
              "agent file inside it": "options.agent"}[shows]
    if shows == "cwd holds it":
        options["cwd"] = str(guarded)
    elif shows == "ro_paths inside it":
        options["ro_paths"] = [str(guarded / "keys" / "curve")]
    elif shows == "command names it":
        options["command"] += [str(guarded / "keys" / "http.token")]
    elif shows == "PYTHONPATH holds it":
        options["env_vars"] = {"PYTHONPATH": str(guarded / "hf")}
    else:
        agent = guarded / "run" / "agent.py"
        agent.write_text("def play(task, endpoint):\n    return 0.0\n")
        del options["command"]
        options["agent"] = f"{agent}:play"
    with pytest.raises(ConfigError, match=rf"cube 'agent': {re.escape(option)}.* would show {re.escape(key)}"):
        await started(options)


async def test_a_verifiers_cache_inside_a_guarded_path_is_refused_and_no_box_is_built_showing_one(guarded, tmp_path):
    """The verifiers boxes show their cache root (scripts, uv): inside the
    run dir it is refused at start. Below every cube, a box asked to show a
    guarded path is never built (isolation.agent_prefix)."""
    from rlnode.actor.daemon import no_box_sees
    from rlnode.config.actor import CubeConfig
    from rlnode.cubes.wall import isolation
    from rlnode.cubes.registry import open_cubes

    try:
        import verifiers.v1  # noqa: F401
    except ImportError:
        pytest.skip("verifiers is not installed")
    guarded, cfg = guarded
    isolation.guard_paths({})  # set again below, as the actor daemon sets them
    spec = CubeConfig(id="vf", kind="verifiers", options={"env": "rlnode.cubes.vf_guess", "num_train": 2, "num_test": 1,
                                                          "cache_dir": str(guarded / "run" / "vf-cache")})
    with pytest.raises(ConfigError, match=r"options.cache_dir .* would show run.run_dir"):
        await open_cubes([spec], 0, no_box_sees(cfg))
    with pytest.raises(isolation.ShownPathRefused, match="link.curve_dir"):
        isolation.agent_prefix({}, [str(guarded / "keys")], "/tmp/home", 1 << 20)
    with pytest.raises(isolation.ShownPathRefused, match="run.run_dir"):
        isolation.agent_prefix({}, [], str(guarded / "run" / "box"), 1 << 20, rw_paths=(str(guarded / "run" / "box"),))


async def test_agents_output_is_bounded_and_never_the_daemons(gateway, tmp_path, capfd):
    """A function agent's worker floods its stdout and stderr with a forged
    log line, then dies: none of it reaches the daemon's stdout or stderr
    (the journal), the worker-lost log line carries its last bytes, and the
    episode fails alone. A command agent printing 64 MiB on stderr costs the
    daemon its tail only (traced allocations), which its error shows."""
    import tracemalloc

    import structlog

    cube = await started({"agent": f"{FIXTURES}:flood_output", "tasks": tasks_file(tmp_path)})
    capfd.readouterr()
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(Exception, match="agent worker ended"):
            await play(gateway, cube)
    out, err = capfd.readouterr()
    assert "forged.daemon_line" not in out + err and "FLOOD-END" not in out + err
    (lost,) = [e for e in logs if e["event"] == "agent.worker_lost"]
    assert lost["output_tail"].endswith("FLOOD-END") and lost["output_bytes"] > 32 << 20
    await cube.close()

    cube = await started({"command": [sys.executable, str(FIXTURES), "stderr_flood"], "tasks": tasks_file(tmp_path)})
    tracemalloc.start()
    try:
        with pytest.raises(CubeError, match=r"(?s)exited with 3: .*STDERR-END"):
            await play(gateway, cube)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # read whole, it was 64 MiB and more
