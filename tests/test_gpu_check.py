"""The one-command GPU check (scripts/gpu_check.sh, rlnode/tools/gpu_check.py)
dry-runs on CPU: the steps it would run on a GPU, a few run for real on the
CPU with the JSON report they write, and the offline plugin registration the
lent machine's bundle needs (rlnode not installed there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def test_the_plan_names_every_step_and_marks_the_cuda_ones():
    out = subprocess.run([str(SCRIPT), "--plan", "--device", "cpu"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if not line.startswith(" ")]
    assert steps == ["environment", "models", "check", "router",
                     "weights_gloo_untied", "weights_gloo_tied",
                     "weights_nccl_untied  [cuda only]", "weights_nccl_tied  [cuda only]",
                     "weights_cuda_ipc_untied  [cuda only]", "weights_cuda_ipc_tied  [cuda only]", "lora",
                     "trainer_qwen3-0.6b  [cuda only]", "trainer_qwen3-1.7b  [cuda only]",
                     "trainer_mfu  [cuda only]", "trainer_tiny", "gateway", "gateway_capacity", "run"]
    assert "--backend cuda_ipc" in out.stdout and "--preset qwen3-1.7b" in out.stdout
    assert "trainer.max_steps=20" in out.stdout
    (lora,) = [line for line in out.stdout.splitlines() if " weights " in line and "--lora" in line]
    assert "--lora --lora-rank 16" in lora and "--json" in lora and "trainer.parallel.ranks=1" in lora
    assert "bench gateway" in out.stdout and "--max-tokens 1" in out.stdout
    (mfu,) = [line for line in out.stdout.splitlines() if " bench trainer " in line and "--switches" in line]
    assert "--preset" not in mfu and "qwen3-1.7b" in mfu and "--tokens-per-step 16384" in mfu


def test_trainer_mfu_passes_at_the_bar_with_the_peak_within_the_plan():
    """Issue 49's device check: MFU >= 0.35 and peak <= 1.1x the plan's."""
    from rlnode.tools.gpu_check import mfu_verdict

    def res(mfu, peak, plan=93.1):
        return {"rlnode": {"mfu": mfu, "peak_mem_gib": peak}, "predicted_peak_gib": plan}

    ok, why = mfu_verdict(res(0.390, 63.5))  # the H200's figures of 2026-11-28
    assert ok and why.startswith("MFU 0.390 (>= 0.35)") and "within" in why
    assert mfu_verdict(res(0.34, 63.5)) == (False, "MFU 0.340 (< 0.35), peak 63.5 GiB vs plan 93.1 GiB (within 1.10x)")
    assert not mfu_verdict(res(0.39, 63.5, plan=35.6))[0]  # over the plan: the plan is wrong
    assert not mfu_verdict(res(None, None))[0] and not mfu_verdict(None)[0]


def test_a_cpu_dry_run_writes_one_report(tmp_path):
    """--only runs its steps in the order given (a short lease runs what
    matters most first), not in plan order."""
    report = tmp_path / "gpu_check.json"
    out = subprocess.run([str(SCRIPT), "--device", "cpu", "--only",
                          "environment,models,check,trainer_tiny,weights_nccl_untied",
                          "--out", str(report), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = json.loads(report.read_text())["steps"]
    assert list(steps) == ["environment", "models", "check", "trainer_tiny", "weights_nccl_untied"]
    assert steps["environment"]["result"]["vllm"] == "0.32.0"
    findings = {f["what"]: f["level"] for f in steps["check"]["result"]["findings"]}
    assert findings["vllm"] == findings["guard"] == findings["nccl"] == "ok"
    assert steps["weights_nccl_untied"]["skipped"] == "needs cuda (dry run on cpu)"
    trainer = steps["trainer_tiny"]["result"]
    assert steps["trainer_tiny"]["ok"] and trainer  # the bench's own JSON, parsed
    assert not (tmp_path / "gpu_check.json.tmp").exists()


def test_the_script_registers_the_plugin_where_rlnode_is_not_installed(tmp_path):
    """The lent machine runs the checkout with vLLM on PYTHONPATH: no installed
    rlnode, so no entry point. The script writes the metadata that registers it."""
    import shutil

    # A checkout as the device machine gets it: tracked files only (this
    # one's editable install left rlnode.egg-info beside the package).
    repo = tmp_path / "repo"
    for part in ("rlnode", "scripts", "conf"):
        shutil.copytree(REPO / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    base = Path(sys.base_prefix) / "bin" / "python3"  # this Python without the venv: no rlnode installed
    env = dict(os.environ, PYTHON=str(base), RLNODE_GPU_CHECK_META=str(tmp_path / "meta"))
    env.pop("PYTHONPATH", None)
    out = subprocess.run([str(repo / "scripts" / "gpu_check.sh"), "--only", "environment", "--out",
                          str(tmp_path / "r.json"), "--work", str(tmp_path / "w")], capture_output=True, text=True,
                         timeout=120, cwd=repo, env=env)
    assert out.returncode == 0, out.stderr
    assert "registered its vLLM plugin" in out.stderr
    probe = "from rlnode.actor.engine_guard import check_registered; check_registered(); print('registered')"
    ok = subprocess.run([str(base), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                        env=dict(env, PYTHONPATH=f"{repo}:{tmp_path / 'meta'}"))
    assert ok.stdout.strip() == "registered", ok.stderr
    missing = subprocess.run([str(base), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env=dict(env, PYTHONPATH=str(repo)))
    assert "EngineGuardMissing" in missing.stderr


def test_the_run_summary_reads_the_metrics_file(tmp_path):
    """The run step's result: steps, first/last rewards and their 5-step
    means, the largest on-policy logprob gap (rows without a step, like the
    held-out evaluation's, are not steps)."""
    from rlnode.tools.gpu_check import summarize_run

    rows = [{"version": 0, "episodes": 64, "eval": True}]
    rows += [{"step": i, "reward_mean": r, "logprob_diff_on_policy_max": d, "step_s": s}
             for i, (r, d, s) in enumerate(zip([0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 1.0],
                                               [1e-7, 3e-7, 2e-7, 1e-7, 1e-7, 1e-7, 1e-7],
                                               [0.3, 0.1, 0.2, 0.1, 0.1, 0.1, 0.1]), start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = summarize_run(tmp_path)
    assert got["steps"] == 7
    assert got["reward_first"] == 0.0 and got["reward_last"] == 1.0
    assert got["reward_first5_mean"] == 0.2 and got["reward_last5_mean"] == 0.3
    assert got["on_policy_logprob_diff_max"] == 3e-7
    assert got["step_s_median"] == 0.1
