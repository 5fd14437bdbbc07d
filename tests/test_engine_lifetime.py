"""No engine outlives its daemon: an actor daemon (its own process session)
is killed -9 once its engine serves, stopped by SIGTERM while its engine is
still starting, and fails while starting it; each time every process of its
session (vLLM's engine core and worker, multiprocessing's resource tracker)
must be gone within seconds, and the shared memory they mapped with them.
The engine guard itself is tested on plain processes first (fast)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import session_pids
from daemons import ROOT, Daemon, free_port
from rlnode.actor import engine_guard
from rlnode.actor.engine import SCRATCH_PREFIX, sweep_engine_scratch

# The daemon is gone: every process of its session must follow within this.
EXIT_DEADLINE_S = 30.0
# A stop requested while the engine starts: the daemon is gone within this
# (a liveness bound, not a speed target: measured 0.3 s alone, 17 s before
# the half-built engine was killed; CI boxes are shared).
STOP_DEADLINE_S = 60.0


def actor_args(model_dir, run_dir, http_port: int) -> list[str]:
    """An actor with a cube and no trainer: the engine starts, episodes wait."""
    return ["--role", "actor", "--config", str(ROOT / "conf/demo.toml"),
            "--set", f"model.path={model_dir}", "--set", f"run.run_dir={run_dir}",
            "--set", "run.progress=false", "--set", f"http.actor_port={http_port}"]


def shm_files(pids) -> set[str]:
    """/dev/shm files mapped by ``pids`` (vLLM's message queues)."""
    files = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        files |= {line.split(None, 5)[5].removesuffix(" (deleted)")
                  for line in maps.splitlines() if "/dev/shm/" in line and len(line.split(None, 5)) == 6}
    return files


def wait_for(pred, timeout: float, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(poll)
    return pred()


def wait_session_gone(sid: int, timeout: float) -> tuple[float, dict[int, str]]:
    t0 = time.monotonic()
    wait_for(lambda: not session_pids(sid), timeout)
    return time.monotonic() - t0, session_pids(sid)


def cleanup(d: Daemon, shm: set[str]) -> None:
    # What is left (after a failure) dies by SIGKILL, resource tracker
    # included, so nothing unlinks its shared memory: do it here.
    shm = shm | shm_files(session_pids(d.proc.pid))
    d.kill()  # SIGKILL to the whole process group, then reap the daemon
    for f in shm:
        Path(f).unlink(missing_ok=True)
    for left in scratch_dirs(d.proc.pid):  # after a failure; the next engine start would sweep it
        shutil.rmtree(left, ignore_errors=True)


def scratch_dirs(daemon_pid: int) -> list[Path]:
    """The engine scratch directories of a daemon (engine.make_engine_scratch)."""
    return sorted(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{daemon_pid}-*"))


def has_engine_core(sid: int) -> bool:
    return any("EngineCor" in name for name in session_pids(sid).values())


# A stand-in for a vLLM process: loads the guard as vLLM would, then idles.
GUARDED = ("import time; from rlnode.actor import engine_guard; engine_guard.install(); "
           "print('installed', flush=True); time.sleep(120)")


def guarded_child(owner_token: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != engine_guard.OWNER_ENV}
    if owner_token is not None:
        env[engine_guard.OWNER_ENV] = owner_token
    return subprocess.Popen([sys.executable, "-c", GUARDED], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def test_guard_ends_its_process_with_the_owner():
    owner = subprocess.Popen(["sleep", "120"])
    child = guarded_child(engine_guard.owner_token(owner.pid))
    try:
        assert child.stdout.readline() == "installed\n"
        time.sleep(0.2)  # the watcher thread waits on the owner's pidfd
        assert child.poll() is None
        t0 = time.monotonic()
        owner.kill()
        owner.wait()
        assert child.wait(10) == -signal.SIGTERM  # no handler of its own: SIGTERM ends it
        print(f"guarded process gone {time.monotonic() - t0:.2f} s after its owner")
    finally:
        for p in (owner, child):
            p.kill()
            p.wait()
        child.stdout.close()


def test_guard_ends_its_process_when_nobody_reads_its_stderr():
    """The daemon that read an engine's stderr is gone (killed, or its
    pipe's reader closed): the guard's notice on stderr fails with EPIPE.
    Seen: the guard thread died on that BrokenPipeError before stopping its
    process, and the engine core and its worker outlived their daemon by an
    hour. The notice is best effort; the stop is not."""
    owner = subprocess.Popen(["sleep", "120"])
    env = {**os.environ, engine_guard.OWNER_ENV: engine_guard.owner_token(owner.pid)}
    child = subprocess.Popen([sys.executable, "-c", GUARDED], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "installed\n"
        child.stderr.close()  # no reader left: a write to the child's stderr gets EPIPE
        owner.kill()
        owner.wait()
        assert child.wait(10) == -signal.SIGTERM
    finally:
        for p in (owner, child):
            p.kill()
            p.wait()
        child.stdout.close()


def test_guard_sees_a_reused_pid_as_gone():
    # A live pid with another start time: the owner died and its pid was reused.
    child = guarded_child(f"{os.getpid()}:1")
    try:
        assert child.wait(10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_guard_leaves_other_processes_alone(monkeypatch):
    # No owner named (a user's own `vllm serve`), or the owner itself (the
    # daemon also loads vLLM's plugins): no watcher.
    monkeypatch.delenv(engine_guard.OWNER_ENV, raising=False)
    engine_guard.install()
    monkeypatch.setenv(engine_guard.OWNER_ENV, engine_guard.owner_token())
    engine_guard.install()
    assert not [t for t in threading.enumerate() if t.name == "rlnode-engine-guard"]
    assert not engine_guard._installed


def test_guard_joins_an_operators_plugin_allow_list(monkeypatch):
    monkeypatch.delenv(engine_guard.OWNER_ENV, raising=False)  # restored afterwards
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    engine_guard.mark_owner()
    assert os.environ["VLLM_PLUGINS"] == f"lora_filesystem_resolver,{engine_guard.PLUGIN_NAME}"
    assert os.environ[engine_guard.OWNER_ENV] == engine_guard.owner_token()


def test_guard_is_a_registered_vllm_plugin():
    from importlib.metadata import entry_points

    [ep] = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == engine_guard.PLUGIN_NAME]
    assert ep.load() is engine_guard.install


@pytest.mark.engine
def test_kill9_daemon_takes_its_engine_processes(tiny_model_dir, tmp_path):
    port = free_port()
    d = Daemon("actor", actor_args(tiny_model_dir, tmp_path / "run", port), tmp_path, port)
    sid, shm = d.proc.pid, set()
    try:
        wait_for(lambda: d.events("engine.started") or d.proc.poll() is not None, 180, poll=0.5)
        assert d.events("engine.started"), d.log_path.read_text()[-3000:]
        procs = session_pids(sid)
        assert any("EngineCor" in n for n in procs.values()), procs  # the engine runs in its own processes
        shm = shm_files(procs)
        # vLLM's sockets are in the engine's scratch directory, not loose in /tmp.
        [scratch] = scratch_dirs(d.proc.pid)
        assert any(p.is_socket() for p in scratch.iterdir()), list(scratch.iterdir())

        d.proc.kill()  # kill -9: no shutdown code runs in the daemon
        d.proc.wait()
        took = assert_all_gone(sid, shm, "kill -9 of the daemon")
        print(f"engine processes gone {took:.1f} s after kill -9 of the daemon")
        # Nothing ran at exit to remove it; the next engine start on this
        # host does (its daemon's pid is gone), and leaves live ones alone.
        assert scratch.is_dir()
        assert sweep_engine_scratch(tempfile.gettempdir()) == [scratch.name]
        assert not scratch.exists()
    finally:
        cleanup(d, shm)


def assert_all_gone(sid: int, shm: set, after: str) -> float:
    """No process of the daemon's session and none of its shared memory
    left; returns how long the processes took to go."""
    took, left = wait_session_gone(sid, EXIT_DEADLINE_S)
    assert not left, f"still alive {EXIT_DEADLINE_S:.0f} s after {after}: {left}"
    assert wait_for(lambda: not any(os.path.exists(f) for f in shm), 5), \
        f"shared memory left behind: {[f for f in shm if os.path.exists(f)]}"
    return took


@pytest.mark.engine
def test_sigterm_during_engine_start(tiny_model_dir, tmp_path):
    port = free_port()
    d = Daemon("actor", actor_args(tiny_model_dir, tmp_path / "run", port), tmp_path, port)
    sid, shm = d.proc.pid, set()
    try:
        # The engine core process exists, the engine has not started yet.
        assert wait_for(lambda: has_engine_core(sid) or d.proc.poll() is not None, 120) and d.proc.poll() is None, \
            d.log_path.read_text()[-3000:]
        assert not d.events("engine.started")
        shm = shm_files(session_pids(sid))
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(120)
        stop_s = time.monotonic() - t0
        assert code == 0, d.log_path.read_text()[-3000:]
        assert "stopped during startup" in d.log_path.read_text()
        # Without waiting for the engine start to finish (10-30 s here).
        assert stop_s < STOP_DEADLINE_S, f"the daemon took {stop_s:.1f} s to stop during its engine start"
        took = assert_all_gone(sid, shm, "the daemon stopped")
        print(f"daemon stopped {stop_s:.1f} s after SIGTERM, its session empty {took:.1f} s later")
        assert scratch_dirs(sid) == []  # the abandoned start removed its scratch directory
    finally:
        cleanup(d, shm)


@pytest.mark.engine
def test_engine_start_failure_leaves_no_process(tiny_model_dir, tmp_path):
    # The engine's worker fails during start: its weights file is corrupt
    # (the engine core and the worker are up by then).
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    port = free_port()
    d = Daemon("actor", actor_args(broken, tmp_path / "run", port), tmp_path, port)
    sid = d.proc.pid
    try:
        assert d.proc.wait(180) == 1, d.log_path.read_text()[-3000:]  # EXIT_FATAL
        took, left = wait_session_gone(sid, EXIT_DEADLINE_S)
        assert not left, f"still alive {EXIT_DEADLINE_S:.0f} s after the daemon failed: {left}"
        assert scratch_dirs(sid) == []  # the failed start removed its scratch directory
    finally:
        cleanup(d, set())


@pytest.mark.engine
async def test_an_engine_whose_core_died_turns_the_actor_red(tiny_model_dir, engine_config):
    """The engine core killed under a running engine: every request fails
    at once. After Engine.FAILING_AFTER failures in a row the actor's
    health names the engine (and a restart would help, so the watchdog lets
    systemd restart it) instead of dropping group after group behind a
    green /healthz."""
    import types

    import psutil

    from rlnode.actor.daemon import ActorDaemon
    from rlnode.actor.engine import Engine, EngineError, SamplingSettings
    from rlnode.config import ModelConfig

    def engine_cores() -> set[psutil.Process]:
        return {p for p in psutil.Process().children(recursive=True) if "EngineCor" in p.name()}

    others = engine_cores()  # the suite's shared engine may be up: not this test's to kill
    eng = Engine(0, ModelConfig(path=str(tiny_model_dir), max_model_len=512), engine_config)
    await eng.start()
    try:
        me = types.SimpleNamespace(engines=[eng])
        assert ActorDaemon._local_fault(me) == ""
        await eng.generate([1, 2, 3], SamplingSettings(max_tokens=2))
        cores = list(engine_cores() - others)
        assert len(cores) == 1, cores
        cores[0].kill()
        cores[0].wait(10)
        for _ in range(Engine.FAILING_AFTER):
            with pytest.raises(EngineError):
                await asyncio.wait_for(eng.generate([1, 2, 3], SamplingSettings(max_tokens=2)), 30)
        why = ActorDaemon._local_fault(me)
        assert why.startswith("engines failing every request: {0: ") and "its last 16 requests failed" in why
        assert "EngineDeadError" in why
    finally:
        await eng.shutdown()


def test_engine_scratch_is_private_swept_when_its_daemon_is_gone_and_fits_a_socket(monkeypatch):
    """What make_engine_scratch and sweep_engine_scratch promise, without an
    engine: vLLM's sockets and temporary files of one engine go into one
    directory named after its daemon's pid; a directory whose daemon is gone
    is removed at the next start, a running one's never; a parent directory
    too long for vLLM's socket paths is refused with the way out."""
    # Short: vLLM's socket paths must fit under it (tmp_path's do not).
    tmp_path = Path(tempfile.mkdtemp(prefix="sc-"))
    try:
        _check_scratch(tmp_path, monkeypatch)
    finally:
        shutil.rmtree(tmp_path)


def _check_scratch(tmp_path: Path, monkeypatch) -> None:
    from rlnode.actor.engine import inductor_home, make_engine_scratch, scratch_env

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{SCRATCH_PREFIX}{dead.pid}-0-abc").mkdir()
    (tmp_path / f"{SCRATCH_PREFIX}{dead.pid}-0-abc" / "sock").write_text("")
    alive = tmp_path / f"{SCRATCH_PREFIX}1-0-def"  # pid 1 is always running
    alive.mkdir()
    other = tmp_path / "rlnode-enginexyz"
    other.mkdir()
    mine = make_engine_scratch(3)
    assert Path(mine).parent == tmp_path and Path(mine).name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-3-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([Path(mine).name, alive.name, other.name])
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = scratch_env(mine)
    assert (env["VLLM_RPC_BASE_PATH"], env["TMPDIR"]) == (mine, mine)
    # Inductor's compile cache outlives the engine: where it was, not in the scratch.
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(tempfile.gettempdir() + "/torchinductor_")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/opt/cache")  # the operator's choice stays theirs
    assert "TORCHINDUCTOR_CACHE_DIR" not in scratch_env(mine)
    # Inductor's precompiled header follows TMPDIR: the scratch links it to
    # the host's directory (test_engine's ..._header_outlives_the_engine).
    link = Path(mine) / Path(inductor_home()).name
    assert link.is_symlink() and link.resolve() == Path(inductor_home()).resolve()
    assert sweep_engine_scratch(str(tmp_path)) == []  # its own is not swept either

    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(deep))
    with pytest.raises(ValueError, match="too long for vLLM's unix sockets.*TMPDIR or VLLM_RPC_BASE_PATH"):
        make_engine_scratch(0)
    assert list(deep.iterdir()) == []


def _make_unregistered_segments(ready, ours: str) -> None:
    """A child that made a shared-memory segment and a named semaphore and
    was killed before telling the resource tracker about them (the window
    an abandoned engine start can hit), and maps the parent's ``ours``."""
    import _multiprocessing
    from multiprocessing import resource_tracker, shared_memory

    seg = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(seg._name, "shared_memory")
    sem = _multiprocessing.SemLock(1, 1, 1, "/mp-rlnodetest" + seg.name[4:], False)
    kept = shared_memory.SharedMemory(name=ours)  # noqa: F841 (mapped while the child lives)
    ready.put((seg.name, sem.name))
    time.sleep(120)


def test_an_abandoned_start_removes_the_shared_memory_its_processes_made():
    """kill_children_since (a stop during an engine start) removes the
    segments its killed processes made and nobody would: SIGKILL between
    making one and registering it leaves it in /dev/shm for good. A segment
    of a live process (ours, which the child maps too) stays."""
    import multiprocessing
    from multiprocessing import shared_memory

    ctx = multiprocessing.get_context("spawn")
    ours = shared_memory.SharedMemory(create=True, size=4096)
    ready = ctx.Queue()
    made: set[str] = set()
    before = engine_guard.spawned_children()
    child = ctx.Process(target=_make_unregistered_segments, args=(ready, ours.name), daemon=True)
    try:
        child.start()
        seg, sem = ready.get(timeout=60)
        made = {f"/dev/shm/{seg.lstrip('/')}", f"/dev/shm/sem.{sem.lstrip('/')}"}
        assert all(os.path.exists(f) for f in made), made
        assert engine_guard.kill_children_since(before) == [child.pid]
        assert not [f for f in made if os.path.exists(f)]
        assert os.path.exists(f"/dev/shm/{ours.name.lstrip('/')}")  # a live process maps it
        child.join(5)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        for path in made:
            Path(path).unlink(missing_ok=True)
        ours.close()
        ours.unlink()
