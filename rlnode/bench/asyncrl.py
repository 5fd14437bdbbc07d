"""``rlnode bench async``: what pipelining buys over synchronous RL.

Runs the same job twice with ``rlnode --role all`` (trainer + actor on this
machine, real engine, real weight updates): once pipelined (generation for
version v+1 overlaps training of version v, staleness budget ``max_lag``),
once with ``trainer.sync = true`` (train only on the current version;
generation waits for every update). Wall time is measured from the daemon's
``ready`` event to the N-th optimizer step, so engine start-up is excluded.
Evaluation is switched off in both runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import msgspec


class AsyncBenchResult(msgspec.Struct):
    async_s: float
    sync_s: float
    speedup: float  # sync_s / async_s
    steps: int
    async_lag_mean: float
    sync_lag_mean: float
    async_reward_mean: float
    sync_reward_mean: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def run_job(config: str, overrides: list[str], steps: int, sync: bool, run_dir: Path, log) -> tuple[float, list[dict]]:
    args = [sys.executable, "-m", "rlnode", "--role", "all", "--config", config, "--log-json",
            "--set", f"run.run_dir={run_dir}", "--set", f"trainer.max_steps={steps}",
            "--set", f"trainer.sync={'true' if sync else 'false'}", "--set", "actor.scheduler.eval_every=0",
            "--set", "run.progress=false", "--set", "trainer.checkpoint_every=0",
            "--set", f"trainer.port={_free_port()}", "--set", "http.trainer_port=0",
            "--set", f"trainer.weights.base_port={_free_port()}"]
    for o in overrides:
        args += ["--set", o]
    env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0"}
    log(f"  {'sync' if sync else 'async'}: {steps} steps ...")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"rlnode --role all exited {proc.returncode}: {proc.stderr[-2000:]}")
    ready = next(_ts(e["timestamp"]) for e in map(json.loads, _json_lines(proc.stderr)) if e.get("event") == "ready")
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "step" in r]
    wall = steps_[-1]["time"] - ready
    log(f"  {'sync' if sync else 'async'}: {wall:.1f}s to step {steps_[-1]['step']}")
    return wall, steps_


def _json_lines(text: str):
    return (l for l in text.splitlines() if l.startswith("{") and '"event"' in l)


def bench_async(config: str, steps: int, overrides: list[str] = (), log=print) -> AsyncBenchResult:
    with tempfile.TemporaryDirectory(prefix="rlnode-bench-async-") as tmp:
        a_s, a = run_job(config, list(overrides), steps, False, Path(tmp) / "async", log)
        s_s, s = run_job(config, list(overrides), steps, True, Path(tmp) / "sync", log)

    def mean(rs, k):
        return sum(r[k] for r in rs) / len(rs)

    return AsyncBenchResult(a_s, s_s, s_s / a_s, steps, mean(a, "lag_mean"), mean(s, "lag_mean"),
                            mean(a, "reward_mean"), mean(s, "reward_mean"))


def print_table(r: AsyncBenchResult) -> None:
    print(f"\nasync benchmark: wall time from ready to optimizer step {r.steps} (--role all, one machine)")
    print(f"{'mode':<12}{'seconds':>10}{'lag mean':>10}{'reward':>10}")
    print(f"{'pipelined':<12}{r.async_s:>10.1f}{r.async_lag_mean:>10.2f}{r.async_reward_mean:>10.3f}")
    print(f"{'sync':<12}{r.sync_s:>10.1f}{r.sync_lag_mean:>10.2f}{r.sync_reward_mean:>10.3f}")
    print(f"speedup = {r.speedup:.2f}x")
