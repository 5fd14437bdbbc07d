"""Helpers to run rlnode daemons as real processes in tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """``rlnode --role ...`` in its own process session, stderr to a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path, http_port: int):
        self.name, self.http_port = name, http_port
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlnode", *args, "--log-json"],
                                     stdout=open(log_dir / f"{name}.out", "w"), stderr=open(self.log_path, "w"),
                                     env=env, start_new_session=True)

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{") and f'"event": "{name}"' in line:
                out.append(json.loads(line))
        return out

    def wait(self, pred, timeout: float, what: str):
        return wait_for_status(self, pred, timeout, what)

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        sweep_after_kill()


def sweep_after_kill() -> None:
    """What a daemon killed with -9 leaves in the session's temporary
    directory and its successor would sweep at its start: the gateway's
    agents-socket directory (its engine scratch has its own sweep)."""
    import tempfile

    from rlnode.actor.engine import sweep_dead_dirs
    from rlnode.actor.gateway.server import AGENTS_DIR_PREFIX

    sweep_dead_dirs(tempfile.gettempdir(), AGENTS_DIR_PREFIX)


def wait_for_status(daemon, pred, timeout: float, what: str):
    """Poll ``daemon.status()`` until ``pred(status)`` is truthy and return
    that value; AssertionError (with the log's tail) if the daemon exits,
    or when ``timeout`` passes. ``daemon``: a ``name``, a ``proc``, a
    ``log_path`` and a ``status()``."""
    deadline = time.monotonic() + timeout
    st = None
    while time.monotonic() < deadline:
        if daemon.proc is None or daemon.proc.poll() is not None:
            code = daemon.proc.returncode if daemon.proc is not None else None
            tail = daemon.log_path.read_text()[-3000:] if daemon.log_path else ""
            raise AssertionError(f"{daemon.name} exited ({code}) waiting for {what}:\n{tail}")
        st = daemon.status()
        if st is not None:
            value = pred(st)
            if value:
                return value
        time.sleep(0.5)
    raise AssertionError(f"{daemon.name}: timed out after {timeout:.0f} s waiting for {what}; status={st}")

def daemon_args(role: str, model_dir, run_dir, trainer_port: int, http_port: int, extra=()) -> list[str]:
    args = ["--role", role, "--config", str(ROOT / "conf/demo.toml"),
            "--set", f"model.path={model_dir}", "--set", f"run.run_dir={run_dir}",
            "--set", f"trainer.port={trainer_port}", "--set", "run.progress=false",
            "--set", f"http.trainer_port={http_port}", "--set", f"http.actor_port={http_port}",
            "--set", f"trainer.weights.base_port={free_port()}",
            "--set", "link.heartbeat_s=0.5", "--set", "link.peer_timeout_s=4",
            "--set", "trainer.weights.timeout_s=20",
            # The demo runs sync on one 2-core box; the daemon tests run the
            # product's default, the async pipeline.
            "--set", "trainer.sync=false"]
    if role == "actor":
        args += ["--peers", f"127.0.0.1:{trainer_port}"]
    return args + list(extra)
