"""``rlnode bench learn``: does the recipe learn on every seed, and does the
pipelined (async) loop learn as well as the synchronous one?

Runs the whole job, ``rlnode --role all --config CONFIG`` (trainer + actor on
this machine, real engine, real weight updates, the config's evaluation
schedule), once per seed, one run at a time (each takes the machine). Per run
it reads back the held-out success at every evaluated version, the final
one, the first version at or above ``--target`` (default 0.8) and the lowest
success after it (a late collapse shows there), and the wall time from the
daemon's ``ready`` to each figure. The table adds min / median / max over the
seeds.

``--async``: each seed runs twice at equal steps and equal samples (the
config's max_steps, groups_per_step and attempts): ``trainer.sync = true``
(the baseline) and pipelined with ``actor.scheduler.max_lag`` =
``--max-lag`` (default 2), and the table compares them per seed and over the
seeds (final success, versions to the target). The runs stay under
``<run_dir>/bench-learn/<mode>-seed<N>`` (metrics.jsonl, logs).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import msgspec

from rlnode.bench.asyncrl import _free_port, _json_lines, _ts


FINAL_EVAL_WAIT_S = 1800  # run.final_eval_wait_s of every run


class LearnRun(msgspec.Struct):
    mode: str  # "sync" | "async" | "lora" (sync, trainer.lora on)
    seed: int
    max_lag: int
    steps: int
    # (version, held-out success) at every evaluation, in version order
    evals: list[tuple[int, float]]
    final_success: float
    first_at_target: int | None  # first evaluated version with success >= target
    first_at_target_s: float | None  # wall time from ready to that evaluation's record
    min_after_target: float | None  # lowest success at or after first_at_target
    wall_s: float  # ready -> last optimizer step
    lag_mean: float
    mismatch_kl_mean: float  # offpolicy/mismatch_kl over the steps
    run_dir: str
    # The metric at the last evaluation minus at the first (v0: the start
    # the run learned from, e.g. an SFT checkpoint).
    rise: float = 0.0


class Spread(msgspec.Struct):
    mode: str
    final_min: float
    final_median: float
    final_max: float
    # seeds whose success reached the target and stayed there to the end
    held: int
    seeds: int
    first_at_target_median: float | None  # versions; None when any seed never got there
    wall_s_median: float


class LearnBenchResult(msgspec.Struct):
    config: str
    target: float
    runs: list[LearnRun]
    spread: list[Spread]
    # async / sync medians (final success; versions to the target), --async only
    async_vs_sync_final: float | None = None
    async_vs_sync_versions_to_target: float | None = None
    # --lora: the adapter's rank, and per seed the LoRA run's final success
    # minus the full fine-tuning run's (sync both, equal steps and samples).
    lora_rank: int = 0
    lora_minus_full_final: list[float] = []
    # --lora-set: the overrides only the LoRA runs took (their learning rate, say)
    lora_overrides: list[str] = []
    # What the figures are: the held-out success rate, or the held-out mean
    # reward (partial-credit rewards: an LCS ratio). "final_success" and
    # the other success fields hold this metric.
    metric: str = "success"
    rise_median: float = 0.0  # over the seeds, of the first --seeds' mode


# The metrics.jsonl field of each --metric.
METRIC_FIELDS = {"success": "eval_success", "reward": "eval_reward_mean"}


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM (the daemon's clean shutdown,
    engines included) when the bench's process ends, however it ends."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != parent:
        os._exit(1)  # no such guard, or the bench already gone: do not start an unowned run


def run_child(args: list[str], stderr, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One run of the recipe, which must not outlive the bench: a run takes
    7-15 minutes and both cores, and a bench stopped by SIGTERM or kill -9
    used to leave it training. The bench calls this from its main thread,
    so the parent-death signal fires when the process ends (it fires when
    the forking *thread* ends). Ctrl-C or an exception here stops the run
    the same way."""
    guard = (lambda parent=os.getpid(): _end_with_parent(parent)) if sys.platform == "linux" else None
    with subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, text=True, env=env,
                          preexec_fn=guard) as proc:
        try:
            proc.wait(timeout=timeout)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    return subprocess.CompletedProcess(args, proc.returncode)


def run_recipe(config: str, overrides: list[str], seed: int, sync: bool, max_lag: int, run_dir: Path,
               target: float, log, lora_rank: int = 0, metric: str = "success") -> LearnRun:
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start clean
    run_dir.mkdir(parents=True)
    args = [sys.executable, "-m", "rlnode", "--role", "all", "--config", config, "--log-json"]
    for o in overrides:  # first: the bench's own settings below win (a --set run.run_dir must not merge runs)
        args += ["--set", o]
    args += ["--set", f"run.run_dir={run_dir}", "--set", f"run.seed={seed}", "--set", "run.progress=false",
            "--set", f"trainer.sync={'true' if sync else 'false'}",
            "--set", f"trainer.port={_free_port()}", "--set", "http.trainer_port=0",
            "--set", f"trainer.weights.base_port={_free_port()}",
            # The final version's evaluation is the figure this bench reports:
            # wait for it (200 episodes of a slow policy can pass the default 120 s).
            "--set", f"run.final_eval_wait_s={FINAL_EVAL_WAIT_S}"]
    if not sync:
        args += ["--set", f"actor.scheduler.max_lag={max_lag}"]
    if lora_rank:
        args += ["--set", f"trainer.lora.rank={lora_rank}"]
    mode = "lora" if lora_rank else "sync" if sync else "async"
    log(f"  {mode} seed {seed}: running (log: {run_dir}/daemon.log) ...")
    with open(run_dir / "daemon.log", "w") as err:
        proc = run_child(args, err, timeout=7200, env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"})
    text = (run_dir / "daemon.log").read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"rlnode --role all (seed {seed}, {mode}) exited {proc.returncode}: {text[-2000:]}")
    ready = next(_ts(e["timestamp"]) for e in map(json.loads, _json_lines(text)) if e.get("event") == "ready")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    field = METRIC_FIELDS[metric]
    evals = sorted((r["version"], r[field], r["time"]) for r in records if r.get("eval"))
    if not steps or not evals:
        raise RuntimeError(f"seed {seed} ({mode}): {len(steps)} steps, {len(evals)} evaluations in {run_dir}: "
                           "the config needs trainer.max_steps and actor.scheduler.eval_every")
    if evals[-1][0] != steps[-1]["version"]:
        raise RuntimeError(f"seed {seed} ({mode}): no evaluation of the final version v{steps[-1]['version']} "
                           f"(the last is v{evals[-1][0]}) in {run_dir}: the config's trainer.max_steps should be "
                           "a multiple of actor.scheduler.eval_every, and the evaluation end within "
                           f"{FINAL_EVAL_WAIT_S} s of the last step")
    hit = next((i for i, (_, s, _) in enumerate(evals) if s >= target), None)
    wall = steps[-1]["time"] - ready
    run = LearnRun(
        mode, seed, 0 if sync else max_lag, len(steps), [(v, s) for v, s, _ in evals], evals[-1][1],
        None if hit is None else evals[hit][0], None if hit is None else evals[hit][2] - ready,
        None if hit is None else min(s for _, s, _ in evals[hit:]), wall, statistics.fmean(r["lag_mean"] for r in steps),
        statistics.fmean(r.get("offpolicy/mismatch_kl", 0.0) for r in steps), str(run_dir),
        rise=evals[-1][1] - evals[0][1])
    log(f"  {mode} seed {seed}: final {metric} {run.final_success:.2f} (v{evals[0][0]} {evals[0][1]:.2f}), "
        f">= {target} at v{run.first_at_target}, {wall / 60:.1f} min")
    return run


def spread(mode: str, runs: list[LearnRun], target: float) -> Spread:
    finals = [r.final_success for r in runs]
    firsts = [r.first_at_target for r in runs]
    return Spread(mode, min(finals), statistics.median(finals), max(finals),
                  sum(r.min_after_target is not None and r.min_after_target >= target for r in runs), len(runs),
                  None if None in firsts else statistics.median(firsts), statistics.median(r.wall_s for r in runs))


def bench_learn(config: str, run_dir: str, seeds: list[int], with_async: bool, max_lag: int, target: float,
                overrides: list[str] = (), log=print, lora_rank: int = 0,
                lora_overrides: list[str] = (), metric: str = "success") -> LearnBenchResult:
    """``lora_rank``: each seed also runs sync with ``trainer.lora.rank``
    set (and ``trainer.lora.*`` / everything else from the config,
    ``overrides`` and then ``lora_overrides``, which only these runs take),
    beside full fine-tuning."""
    base = Path(run_dir) / "bench-learn"
    runs: list[LearnRun] = []
    full = [*overrides, "trainer.lora.rank=0"] if lora_rank else list(overrides)  # the baseline: full weights
    for seed in seeds:  # per seed, sync then the others: a drift of the machine hits all
        runs.append(run_recipe(config, full, seed, True, 0, base / f"sync-seed{seed}", target, log, metric=metric))
        if with_async:
            runs.append(run_recipe(config, full, seed, False, max_lag, base / f"async-seed{seed}", target, log,
                                   metric=metric))
        if lora_rank:
            runs.append(run_recipe(config, [*overrides, *lora_overrides], seed, True, 0, base / f"lora-seed{seed}",
                                   target, log, lora_rank=lora_rank, metric=metric))
    modes = ["sync", *(["async"] if with_async else []), *(["lora"] if lora_rank else [])]
    sp = [spread(m, [r for r in runs if r.mode == m], target) for m in modes]
    res = LearnBenchResult(config, target, runs, sp, lora_rank=lora_rank,
                           lora_overrides=list(lora_overrides) if lora_rank else [], metric=metric,
                           rise_median=statistics.median(r.rise for r in runs if r.mode == modes[0]))
    if lora_rank:
        full = {r.seed: r.final_success for r in runs if r.mode == "sync"}
        res.lora_minus_full_final = [r.final_success - full[r.seed] for r in runs if r.mode == "lora"]
    if with_async:
        s, a = sp[0], sp[1]
        res.async_vs_sync_final = a.final_median / s.final_median if s.final_median else None
        if s.first_at_target_median and a.first_at_target_median:
            res.async_vs_sync_versions_to_target = a.first_at_target_median / s.first_at_target_median
    return res


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def print_table(r: LearnBenchResult) -> None:
    versions = sorted({v for run in r.runs for v, _ in run.evals})
    what = "success" if r.metric == "success" else "mean reward"
    print(f"\nlearn benchmark: {r.config}, held-out {what} per evaluated version "
          f"(--role all on this machine, one run at a time)")
    head = f"{'mode':<6}{'seed':>5}" + "".join(f"{'v' + str(v):>6}" for v in versions)
    head += (f"{'final':>7}{'rise':>7}{'>=' + str(r.target):>8}{'min after':>10}{'to target':>11}{'wall':>8}"
             f"{'lag':>6}{'k3 KL':>9}")
    print(head)
    for run in r.runs:
        by_v = dict(run.evals)
        row = f"{run.mode:<6}{run.seed:>5}" + "".join(f"{_f(by_v.get(v)):>6}" for v in versions)
        to = "-" if run.first_at_target_s is None else f"{run.first_at_target_s / 60:.1f}m"
        row += (f"{run.final_success:>7.2f}{run.rise:>+7.2f}{_f(run.first_at_target, 'd'):>8}"
                f"{_f(run.min_after_target):>10}"
                f"{to:>11}{run.wall_s / 60:>7.1f}m{run.lag_mean:>6.2f}{run.mismatch_kl_mean:>9.1e}")
        print(row)
    print(f"\nover the seeds (final {what} min / median / max; seeds that reached {r.target} and stayed; "
          f"rise from the first evaluation, median {r.rise_median:+.2f})")
    for s in r.spread:
        print(f"{s.mode:<6} final {s.final_min:.2f} / {s.final_median:.2f} / {s.final_max:.2f}   "
              f"held {s.held}/{s.seeds}   versions to {r.target} (median) {_f(s.first_at_target_median, '.0f')}   "
              f"wall (median) {s.wall_s_median / 60:.1f} min")
    if r.lora_rank:
        diffs = ", ".join(f"{d:+.2f}" for d in r.lora_minus_full_final)
        extra = f"; LoRA runs also took {' '.join(r.lora_overrides)}" if r.lora_overrides else ""
        print(f"LoRA (rank {r.lora_rank}) - full fine-tuning, final success per seed: {diffs} "
              f"(equal steps and samples, both sync{extra})")
    if r.async_vs_sync_final is not None:
        print(f"async / sync: final success {r.async_vs_sync_final:.2f}x, versions to {r.target} "
              f"{_f(r.async_vs_sync_versions_to_target)}x (equal steps and samples)")
