"""``rlnode bench learn``'s figures from runs (the runs themselves are the
demo's, minutes each: the README has the measured table)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from test_parallel import _pids_alive
from rlnode.bench.learn import LearnBenchResult, LearnRun, print_table, spread


def _run(mode, seed, evals, first=None, min_after=None, wall=600.0):
    return LearnRun(mode, seed, 0 if mode == "sync" else 2, 500, evals, evals[-1][1], first,
                    None if first is None else 300.0, min_after, wall, 0.0, 1e-12, f"runs/{mode}{seed}")


def test_spread_counts_only_seeds_that_reached_the_target_and_stayed():
    runs = [_run("sync", 0, [(250, 0.5), (500, 1.0)], first=500, min_after=1.0),
            _run("sync", 1, [(250, 0.9), (500, 0.7)], first=250, min_after=0.7),  # a late collapse
            _run("sync", 2, [(250, 0.3), (500, 0.6)], wall=700.0)]  # never got there
    s = spread("sync", runs, 0.8)
    assert (s.final_min, s.final_median, s.final_max) == (0.6, 0.7, 1.0)
    assert (s.held, s.seeds) == (1, 3)
    assert s.first_at_target_median is None  # one seed never reached it: no median of versions
    assert s.wall_s_median == 600.0
    s = spread("sync", runs[:2], 0.8)
    assert s.first_at_target_median == 375 and s.held == 1


def test_table_lists_every_evaluated_version_per_run(capsys):
    runs = [_run("sync", 0, [(50, 0.1), (100, 0.9)], first=100, min_after=0.9),
            _run("async", 0, [(50, 0.2), (100, 0.85)], first=100, min_after=0.85)]
    res = LearnBenchResult("conf/demo.toml", 0.8, runs, [spread("sync", runs[:1], 0.8), spread("async", runs[1:], 0.8)],
                           async_vs_sync_final=0.85 / 0.9, async_vs_sync_versions_to_target=1.0)
    print_table(res)
    out = capsys.readouterr().out
    assert "v50" in out and "v100" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("sync ", "async "))]
    assert rows[0][:5] == ["sync", "0", "0.10", "0.90", "0.90"] and rows[1][:5] == ["async", "0", "0.20", "0.85", "0.85"]
    assert "async / sync: final success 0.94x" in out


def _alive(pid: int) -> bool:
    return bool(_pids_alive([pid]))  # a zombie has ended


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_killed_bench_takes_its_run_with_it(tmp_path):
    # A run takes 7-15 minutes and both cores; `kill -9` of the bench (or a
    # plain SIGTERM, whose default action runs no cleanup either) used to
    # leave it training. The run here sleeps instead of training.
    pid_file = tmp_path / "run.pid"
    run = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    bench = subprocess.Popen([sys.executable, "-c", "import os, sys\n"
                              "from rlnode.bench.learn import run_child\n"
                              f"run_child([sys.executable, '-c', {run!r}], None, 600, dict(os.environ))"])
    child = None
    try:
        deadline = time.monotonic() + 60
        while child is None and time.monotonic() < deadline:
            if pid_file.exists() and pid_file.read_text():
                child = int(pid_file.read_text())
            time.sleep(0.05)
        assert child is not None and _alive(child), "the run never started"
        bench.kill()
        bench.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the run outlived the bench that started it"
    finally:
        bench.kill()
        bench.wait(10)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_lora_set_reaches_the_lora_runs_only(monkeypatch, capsys):
    """--lora-set (an adapter's learning rate, say) is taken by the LoRA run
    of each seed, never by its full fine-tuning baseline, and the table says so."""
    import rlnode.bench.learn as learn

    seen = []

    def fake(config, overrides, seed, sync, max_lag, run_dir, target, log, lora_rank=0, metric="success"):
        seen.append((seed, lora_rank, list(overrides)))
        return _run("lora" if lora_rank else "sync", seed, [(0, 0.1), (20, 0.5 if lora_rank else 0.6)])

    monkeypatch.setattr(learn, "run_recipe", fake)
    res = learn.bench_learn("conf/demo.toml", "runs/x", [0, 1], False, 2, 0.5, ["model.path=m"], log=lambda *_: None,
                            lora_rank=16, lora_overrides=["trainer.optim.lr=1e-3"])
    assert seen == [(0, 0, ["model.path=m", "trainer.lora.rank=0"]), (0, 16, ["model.path=m", "trainer.optim.lr=1e-3"]),
                    (1, 0, ["model.path=m", "trainer.lora.rank=0"]), (1, 16, ["model.path=m", "trainer.optim.lr=1e-3"])]
    assert res.lora_overrides == ["trainer.optim.lr=1e-3"]
    assert [round(d, 6) for d in res.lora_minus_full_final] == [-0.1, -0.1]
    print_table(res)
    assert "LoRA runs also took trainer.optim.lr=1e-3" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["--lora-set", "trainer.optim.lr=1e-3"], "add --lora"),
    (["--lora", "--lora-set", "trainer.optim.lr=fast"], "trainer.optim.lr"),
])
def test_lora_set_is_refused_before_any_run(tmp_path, args, says):
    """A --lora-set without --lora, or one the config refuses, stops the
    bench before its first run (minutes of full fine-tuning), naming why."""
    from rlnode.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0)
    out = subprocess.run([sys.executable, "-m", "rlnode", "bench", "learn", "--seeds", "0",
                          "--set", f"model.path={model}", "--set", f"run.run_dir={tmp_path / 'run'}", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert says in out.stderr, out.stderr
    assert not (tmp_path / "run" / "bench-learn").exists()


def test_a_run_whose_final_version_was_not_evaluated_is_refused(monkeypatch, tmp_path):
    """The final success is the eval of the last version. A LoRA run of
    SmolLM2 whose last eval (200 slow episodes) outlasted the daemon's 120 s
    wait was reported with its v10 figure as 'final'. Now every run waits
    (run.final_eval_wait_s) and a missing final eval is an error, not a
    figure from another version."""
    import json

    import rlnode.bench.learn as learn

    seen = []

    def child(args, err, timeout, env):  # what the daemon leaves: a log and metrics, v0 and v10 evaluated
        run_dir = tmp_path / "run"
        seen.extend(args)
        err.write(json.dumps({"event": "ready", "timestamp": "2026-11-27T18:00:00Z"}) + "\n")
        rows = [{"step": v, "version": v, "time": 1e9 + v, "lag_mean": 0.0} for v in range(1, 21)]
        rows += [{"eval": True, "version": v, "eval_success": 0.2, "time": 1e9 + v} for v in (0, 10)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(learn, "run_child", child)
    with pytest.raises(RuntimeError, match="no evaluation of the final version v20"):
        learn.run_recipe("conf/demo.toml", [], 0, True, 0, tmp_path / "run", 0.5, lambda *_: None)
    assert f"run.final_eval_wait_s={learn.FINAL_EVAL_WAIT_S}" in seen


def test_metric_reward_reads_the_mean_reward_and_the_rise_from_the_first_evaluation(monkeypatch, tmp_path, capsys):
    """--metric reward: partial-credit rewards (reverse_text's LCS ratio)
    are judged by the held-out mean reward, not the success rate; the rise
    is the last evaluation's over the first (the SFT start at v0)."""
    import json

    import rlnode.bench.learn as learn

    def child(args, err, timeout, env):
        run_dir = tmp_path / "bench-learn" / "sync-seed0"
        err.write(json.dumps({"event": "ready", "timestamp": "2026-11-28T10:00:00Z"}) + "\n")
        rows = [{"step": v, "version": v, "time": 1e9 + v, "lag_mean": 0.0} for v in range(1, 21)]
        rows += [{"eval": True, "version": v, "eval_success": 1.0, "eval_reward_mean": r, "time": 1e9 + v}
                 for v, r in ((0, 0.31), (10, 0.45), (20, 0.62))]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(learn, "run_child", child)
    res = learn.bench_learn("conf/x.toml", str(tmp_path), [0], False, 2, 0.6, metric="reward", log=lambda *_: None)
    (run,) = res.runs
    assert run.evals == [(0, 0.31), (10, 0.45), (20, 0.62)] and run.final_success == 0.62
    assert abs(run.rise - 0.31) < 1e-12 and abs(res.rise_median - 0.31) < 1e-12 and run.first_at_target == 20
    learn.print_table(res)
    out = capsys.readouterr().out
    assert "held-out mean reward" in out and "+0.31" in out
