"""The one-command GPU check: whoever first gets a GPU runs this.

    scripts/gpu_check.sh [--out gpu_check.json]            # a CUDA host with vLLM
    scripts/gpu_check.sh --device cpu --out dry.json      # the same steps on CPU (dry run)
    python -m rlnode.tools.gpu_check --plan               # list the steps and commands

Runs, each step in its own process under the real CLI (the way users run
it), against one overall time budget (default 570 s: the lent machine
allows 10 minutes a command):

  environment   torch / CUDA / GPUs (name, memory, UUID) / vLLM / NCCL / Triton versions
  check         ``rlnode check`` of a one-GPU config: vLLM range, API contract, guard, NCCL
  models        the tiny test models (untied qwen2, tied qwen3)
  router        ``rlnode bench router``: engine generate through the admission router vs
                AsyncLLM directly vs ``vllm serve`` (tokens/s, ratios)
  weights_*     ``rlnode bench weights --backend gloo|nccl|cuda_ipc``: an in-flight update,
                its phases, the generation stall, and engine-vs-transformers logprob parity
                after the update (a backend this host cannot run is recorded as refused)
  lora          ``rlnode bench weights --lora --lora-rank 16``: a rank-16 adapter update (a new
                vLLM adapter per version, no pause) beside a full-weight update of the same model
  trainer_*     ``rlnode bench trainer`` at Qwen3-0.6B and -1.7B shapes (random weights,
                real vocabulary), bf16-mixed: tokens/s, MFU, peak memory vs the memory plan
  trainer_mfu   the same at 1.7B with issue 49's switches (varlen, checkpointing from the
                plan, compiled layers, bf16 head), each flipped in the same run: passes at
                MFU >= 0.35 with the peak within the plan
  run           a 20-step ``rlnode --role all`` run of the demo on one device: steps,
                rewards, on-policy logprob gap, wall time

Writes one JSON file (rewritten after every step, so a run cut short still
leaves what it measured): ``{"device", "started", "steps": {name: {"ok",
"seconds", "result" | "error" | "skipped", "cmd"}}}``. Exit status 0 when
every step that ran succeeded (a refused backend counts as a result).

``--device cpu`` runs the same steps with the tiny model only (the Qwen3
shapes and the cuda-only backends are recorded as skipped): the dry run
that CI and a GPU-less developer can do.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
DEMO = REPO / "conf" / "demo.toml"


@dataclass
class Step:
    name: str
    # The commands (argv lists, run in order; the last one's stdout JSON is
    # the result), or None for an in-process step.
    cmds: list[list[str]] = field(default_factory=list)
    cuda_only: bool = False
    # Post-processing of the last command's stdout / of the run directory.
    parse: str = "json"  # json | check | run | none
    timeout_s: float = 300.0


def _rlnode(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlnode.cli", *args]


def _device_sets(device: str, model: str, run_dir: str) -> list[str]:
    sets = [f"model.path={json.dumps(model)}", f"run.run_dir={json.dumps(run_dir)}",
            f'actor.engine.device="{device}"', f'trainer.device="{device}"']
    if device == "cuda":
        # One GPU shared by the engine and the trainer: leave the trainer room.
        sets += ["actor.engine.gpu_memory_utilization=0.35"]
    return [a for s in sets for a in ("--set", s)]


def plan(device: str, work: Path) -> list[Step]:
    tiny, tied = str(work / "tiny"), str(work / "tiny-tied")
    base = ["--config", str(DEMO)]
    steps = [
        Step("environment", parse="none"),
        Step("models", [_rlnode("tiny-model", tiny, "--if-missing"),
                        _rlnode("tiny-model", tied, "--arch", "qwen3", "--tie-embeddings", "--if-missing")],
             parse="none", timeout_s=120),
        Step("check", [_rlnode("check", *base, *_device_sets(device, tiny, str(work / "check")), "--json")],
             parse="check", timeout_s=120),
        Step("router", [_rlnode("bench", "router", *base, *_device_sets(device, tiny, str(work / "router")),
                                "--rounds", "2", "--requests", "64", "--max-tokens", "32", "--json")],
             timeout_s=300),
    ]
    for backend in ("gloo", "nccl", "cuda_ipc"):
        for name, model in (("untied", tiny), ("tied", tied)):
            steps.append(Step(f"weights_{backend}_{name}", [_rlnode(
                "bench", "weights", *base, *_device_sets(device, model, str(work / f"weights-{backend}")),
                "--model", model, "--backend", backend, "--rounds", "2", "--json")],
                cuda_only=backend != "gloo", timeout_s=240))
    # Issue 38: a LoRA update (rank 16 adapter served as a new vLLM adapter,
    # no pause) beside a full-weight one: update time, bytes, stall, largest
    # token gap, logprob parity. vLLM has LoRA kernels on CPU too.
    steps.append(Step("lora", [_rlnode(
        "bench", "weights", *base, *_device_sets(device, tiny, str(work / "weights-lora")),
        "--set", "trainer.parallel.ranks=1", "--model", tiny, "--lora", "--lora-rank", "16", "--rounds", "2",
        "--json")], timeout_s=240))
    for preset in ("qwen3-0.6b", "qwen3-1.7b"):
        path = str(work / preset)
        steps.append(Step(f"trainer_{preset}", [
            _rlnode("tiny-model", path, "--preset", preset, "--if-missing"),
            _rlnode("bench", "trainer", *base, *_device_sets(device, path, str(work / "trainer")),
                    "--set", 'trainer.precision="bf16-mixed"', "--set", "trainer.activation_checkpointing=true",
                    "--rounds", "2", "--tokens-per-step", "16384", "--json")],
            cuda_only=True, timeout_s=300))
    # Issue 49: the trainer at Qwen3-1.7B shapes, 16k tokens a step, with
    # what keeps the GPU busy (packed varlen attention, checkpointing from
    # the plan, compiled layers, the head in bf16), each switch flipped in
    # the same run, and the transformers baseline: MFU >= MFU_MIN with the
    # peak within the memory plan.
    path = str(work / "qwen3-1.7b")
    steps.append(Step("trainer_mfu", [
        _rlnode("tiny-model", path, "--preset", "qwen3-1.7b", "--if-missing"),
        _rlnode("bench", "trainer", *base, *_device_sets(device, path, str(work / "trainer")),
                "--set", 'trainer.precision="bf16-mixed"', "--set", 'trainer.head_precision="bf16"',
                "--set", "trainer.micro_batch_tokens=16384", "--set", "model.max_model_len=2048",
                "--rounds", "3", "--tokens-per-step", "16384", "--switches", "--no-largest", "--json")],
        cuda_only=True, parse="trainer_mfu", timeout_s=480))
    steps.append(Step("trainer_tiny", [_rlnode("bench", "trainer", *base, *_device_sets(device, tiny, str(work / "trainer")),
                                               "--rounds", "2", "--tokens-per-step", "2048",
                                               "--prompt-tokens", "256", "--completion-tokens", "256", "--json")],
                      timeout_s=180))
    # Issue 21's figure with cores to spare for the agent's processes: the
    # openai-SDK agent through the gateway vs the native agent loop at one
    # token per call (README's gateway bench; 0.43 on the lent H200).
    steps.append(Step("gateway", [_rlnode("bench", "gateway", *base, *_device_sets(device, tiny, str(work / "gateway")),
                                          "--max-tokens", "1", "--rounds", "3", "--json",
                                          "--agent-isolation", "bwrap" if shutil.which("bwrap") else "none")],
                      timeout_s=240))
    # Issue 35's capacity goal (3,000 calls/s per node, <= 0.3 ms of daemon
    # loop per call) where there are cores for it: the null engine (no
    # model), agents unsandboxed (the gateway's figures, not bubblewrap's),
    # four gateway host processes.
    steps.append(Step("gateway_capacity", [_rlnode("bench", "gateway", *base,
                                                   *_device_sets(device, tiny, str(work / "gateway")),
                                                   "--engine", "null", "--gateway-host", "process",
                                                   "--gateway-hosts", "4", "--concurrency", "256",
                                                   "--requests", "1024", "--max-tokens", "1", "--rounds", "3",
                                                   "--agent-isolation", "none", "--json")],
                      timeout_s=300))
    run_dir = str(work / "run")
    steps.append(Step("run", [_rlnode("--role", "all", *base, *_device_sets(device, tiny, run_dir),
                                      "--set", "trainer.max_steps=20", "--run-dir", run_dir,
                                      "--log-level", "warning")], parse="run", timeout_s=420))
    return steps


def environment() -> dict:
    out: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["gpus"] = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                out["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                    "uuid": str(p.uuid), "capability": f"{p.major}.{p.minor}"})
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["torch_error"] = repr(e)
    try:
        from rlnode.actor.vllm_compat import installed_version

        out["vllm"] = installed_version()
    except Exception as e:  # noqa: BLE001
        out["vllm_error"] = repr(e)
    try:
        from rlnode.ops.stack import nccl_version

        out["nccl"] = nccl_version()
    except Exception as e:  # noqa: BLE001
        out["nccl_error"] = str(e)[:300]
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        out["triton"] = None
    out["env"] = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "TRITON_F32_DEFAULT", "PYTHONPATH")
                  if k in os.environ}
    return out


def _last_json(text: str):
    """The JSON a command printed: all of stdout, or else its last JSON line."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") or line.startswith("["):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def summarize_run(run_dir: Path) -> dict:
    """What a --role all run wrote: steps, rewards and the on-policy gap."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    steps = [r for r in rows if "step" in r and "reward_mean" in r]

    def col(key):
        return [r[key] for r in steps if r.get(key) is not None]

    diffs, rewards, step_s = col("logprob_diff_on_policy_max"), col("reward_mean"), col("step_s")
    # Means over 5 steps: one step's reward of a random tiny model is mostly
    # 0 (the first GPU run read 0.0 first and last, 0.05 between).
    return {"steps": len(steps), "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "reward_first5_mean": statistics.fmean(rewards[:5]) if rewards else None,
            "reward_last5_mean": statistics.fmean(rewards[-5:]) if rewards else None,
            "on_policy_logprob_diff_max": max(diffs) if diffs else None,
            "step_s_median": statistics.median_high(step_s) if step_s else None}


# Issue 49's bar for the trainer at Qwen3-1.7B shapes on one GPU.
MFU_MIN = 0.35
# Measured peak over the memory plan's prediction that still counts as "within the plan".
PLAN_SLACK = 1.10


def mfu_verdict(res: dict | None) -> tuple[bool, str]:
    """trainer_mfu: the configured trainer's MFU >= MFU_MIN and its peak
    memory within PLAN_SLACK of the plan's prediction."""
    if not res:
        return False, "no result"
    ours, planned = res["rlnode"], res.get("predicted_peak_gib")
    mfu, peak = ours.get("mfu"), ours.get("peak_mem_gib")
    if mfu is None or peak is None or planned is None:
        return False, f"MFU {mfu}, peak {peak} GiB, plan {planned} GiB: not measured"
    ok = mfu >= MFU_MIN and peak <= PLAN_SLACK * planned
    return ok, (f"MFU {mfu:.3f} ({'>=' if mfu >= MFU_MIN else '<'} {MFU_MIN}), peak {peak:.1f} GiB vs plan "
                f"{planned:.1f} GiB ({'within' if peak <= PLAN_SLACK * planned else 'over'} {PLAN_SLACK:.2f}x)")


def run_step(step: Step, device: str, budget_end: float, work: Path) -> dict:
    t0 = time.monotonic()
    if step.cuda_only and device != "cuda":
        return {"ok": True, "skipped": "needs cuda (dry run on cpu)", "seconds": 0.0}
    if step.name == "environment":
        return {"ok": True, "result": environment(), "seconds": round(time.monotonic() - t0, 2)}
    left = budget_end - time.monotonic()
    if left < 20:
        return {"ok": False, "skipped": "time budget spent", "seconds": 0.0}
    env = dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stderr")
    rec: dict = {"cmd": [shlex.join(c) for c in step.cmds]}
    out = None
    for cmd in step.cmds:
        left = budget_end - time.monotonic()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env,
                                 timeout=max(10.0, min(step.timeout_s, left)))
        except subprocess.TimeoutExpired as e:
            rec.update(ok=False, error=f"timed out after {e.timeout:.0f} s",
                       stderr_tail=(e.stderr or b"")[-2000:].decode(errors="replace")
                       if isinstance(e.stderr, bytes) else (e.stderr or "")[-2000:])
            break
        if step.parse == "check" and _last_json(out.stdout) is not None:
            # rlnode check exits 1 on a FAIL finding: the findings are the result.
            rec["result"] = _last_json(out.stdout)
            rec["ok"] = bool(rec["result"].get("ok"))
            break
        if out.returncode != 0:
            tail = out.stderr.strip()[-2000:]
            refused = "refus" in tail.lower() or "cannot run" in tail.lower()
            rec.update(ok=refused, error=tail.splitlines()[-1] if tail else f"exit {out.returncode}",
                       stderr_tail=tail, refused=refused)
            break
    else:
        rec["ok"] = True
        if step.parse in ("json", "check"):
            rec["result"] = _last_json(out.stdout)
            rec["ok"] = rec["result"] is not None
        elif step.parse == "trainer_mfu":
            rec["result"] = res = _last_json(out.stdout)
            rec["ok"], rec["verdict"] = mfu_verdict(res)
        elif step.parse == "run":
            rec["result"] = summarize_run(work / "run")
            rec["ok"] = rec["result"]["steps"] >= 20
    rec["seconds"] = round(time.monotonic() - t0, 2)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="gpu_check.json", help="the JSON file (default gpu_check.json)")
    p.add_argument("--work", default="runs/gpu-check", help="models and run directories (default runs/gpu-check)")
    p.add_argument("--budget-s", type=float, default=570.0, help="overall time budget in seconds (default 570)")
    p.add_argument("--only", default="",
                   help="comma-separated step names, run in this order (default: all, in plan order); "
                        "on a short lease put what matters most first")
    p.add_argument("--plan", action="store_true", help="print the steps and their commands, run nothing")
    a = p.parse_args(argv)
    work = Path(a.work).resolve()
    steps = plan(a.device, work)
    if a.only:
        wanted = list(dict.fromkeys(s.strip() for s in a.only.split(",") if s.strip()))
        by_name = {s.name: s for s in steps}
        unknown = [n for n in wanted if n not in by_name]
        if unknown:
            p.error(f"--only: unknown step(s) {', '.join(unknown)}; steps: {', '.join(by_name)}")
        steps = [by_name[n] for n in wanted]
    if a.plan:
        for s in steps:
            skip = "  [cuda only]" if s.cuda_only else ""
            print(f"{s.name}{skip}")
            for c in s.cmds:
                print(f"    {shlex.join(c)}")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    report = {"device": a.device, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "budget_s": a.budget_s, "steps": {}}
    end = time.monotonic() + a.budget_s
    out = Path(a.out)
    for s in steps:
        print(f"gpu-check: {s.name} ...", file=sys.stderr, flush=True)
        report["steps"][s.name] = rec = run_step(s, a.device, end, work)
        state = "ok" if rec["ok"] else "FAILED"
        why = rec.get("skipped") or rec.get("error") or ""
        print(f"gpu-check: {s.name} {state} in {rec['seconds']} s {why}".rstrip(), file=sys.stderr, flush=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, out)
    failed = [n for n, r in report["steps"].items() if not r["ok"]]
    print(f"gpu-check: wrote {out}; {len(report['steps']) - len(failed)} ok, failed: {', '.join(failed) or 'none'}",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
