"""`rlnode --role ...` as a real process: starts the engine, stops cleanly on
SIGTERM (exit 0), leaves no engine process behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine


def _session(sid: int) -> set[int]:
    """Every live process of the daemon's session (it is started as a
    session leader, and the engine processes inherit the session)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-s", str(sid)], capture_output=True, text=True).stdout
    return {int(pid) for pid, stat in (l.split() for l in out.splitlines()) if not stat.startswith("Z")}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(role: str, model_dir, tmp_path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "rlnode", "--role", role, "--config", str(ROOT / "conf/demo.toml"),
        "--set", f"model.path={model_dir}", "--set", f"run.run_dir={tmp_path}", "--log-json",
        "--set", "http.trainer_port=0", "--set", "http.actor_port=0", "--set", f"trainer.port={free_port()}",
    ]
    env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)


def _wait_for_event(proc: subprocess.Popen, event: str, timeout: float) -> list[str]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if f'"event": "{event}"' in line:
            return seen
    raise AssertionError(f"no {event!r} event; exit={proc.poll()}; last lines:\n{''.join(seen[-20:])}")


# SIGTERM of `--role all` mid-run (exit 0, a checkpoint, nothing left
# running) is test_ops.test_notify_order_and_sigterm_midrun; SIGTERM during
# the engine start is test_engine_lifetime.test_sigterm_during_engine_start.
def test_sigterm_stops_cleanly(tiny_model_dir, tmp_path):
    proc = _start("actor", tiny_model_dir, tmp_path)
    try:
        _wait_for_event(proc, "ready", timeout=240)
        assert len(_session(proc.pid)) >= 2, "the engine core should run in a child process"
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, rest[-3000:]
    assert '"event": "exit"' in rest and '"code": 0' in rest
    assert '"event": "engine.stopped"' in rest
    _assert_session_gone(proc.pid)


def _assert_session_gone(sid: int) -> None:
    for _ in range(50):
        left = _session(sid)
        if not left:
            return
        time.sleep(0.2)
    os.killpg(sid, signal.SIGKILL)
    raise AssertionError(f"processes left running after exit: {left}")


def test_bad_config_exits_2_naming_the_key(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "rlnode", "--role", "actor", "--config", str(ROOT / "conf/demo.toml"),
         "--set", "actor.router.llm_max_rollouts=-3"],
        capture_output=True, text=True,
    )
    assert r.returncode == 2
    assert "actor.router.llm_max_rollouts" in r.stderr and "expected `int` >= 1" in r.stderr
