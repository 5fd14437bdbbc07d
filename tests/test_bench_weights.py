"""`rlnode bench weights` measures the configured job: its backend, trainer
device and precision; a backend this host cannot run is refused at once,
before any model, engine or CUDA context exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlnode.bench.weights import backend_refusal
from rlnode.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = ("nccl needs a CUDA GPU and NCCL; this host has no visible GPU (torch.cuda.is_available() is False); "
          "use --backend gloo")


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlnode", "bench", "weights", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_nccl_on_a_cpu_host_is_refused_at_once(tmp_path):
    t0 = time.monotonic()
    r = _bench("--backend", "nccl", "--set", f"run.run_dir={tmp_path}", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"rlnode bench weights: refusing --backend nccl: {NO_GPU}"
    assert time.monotonic() - t0 < 30
    assert not any(tmp_path.iterdir())  # no model was built
    r = _bench("--config", str(ROOT / "conf/demo.toml"), "--set", 'trainer.weights.backend="cuda_ipc"', timeout=60)
    assert r.returncode == 2 and 'refusing trainer.weights.backend = "cuda_ipc": cuda_ipc needs a CUDA GPU;' in r.stderr


def test_refusals_on_a_two_gpu_host(monkeypatch):
    """The rules, on a faked host with two GPUs (counted without CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    on = lambda *gpus: EngineConfig(device="cuda", gpu_ids=list(gpus))  # noqa: E731
    assert backend_refusal("nccl", "cuda:0", on(1)) == ""
    assert backend_refusal("nccl", "cuda", on(0)) == (
        "NCCL refuses two ranks on one GPU: the trainer (cuda:0) and the engine (GPUs [0]) would share it; "
        "use --backend cuda_ipc, or give the engine another GPU (actor.engine.gpu_ids)")
    assert backend_refusal("cuda_ipc", "auto", on(0)) == ""
    assert backend_refusal("cuda_ipc", "cuda:1", on(0)) == (
        "cuda_ipc needs the trainer's GPU visible to the engine: the trainer is on cuda:1, the engine sees only "
        "GPUs [0] (actor.engine.gpu_ids); use --backend nccl")
    assert backend_refusal("cuda_ipc", "cpu", on(0)).startswith(
        'cuda_ipc needs the trainer and the engine on cuda (trainer.device = "cpu", actor.engine.device = "cuda")')
    assert "not among the 2 visible GPUs" in backend_refusal("nccl", "cuda:0", on(5))
    assert backend_refusal("gloo", "cpu", EngineConfig(device="cpu")) == ""
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert "this torch has none" in backend_refusal("nccl", "cuda:0", on(1))


@pytest.mark.engine
def test_bench_weights_runs_the_configured_job_and_an_adapter_beside_it(tiny_model_dir, tmp_path):
    """The demo's job (CPU trainer in fp32, CPU engine) with the tiny model:
    updates over gloo, exact on the updated weights; with --lora (issue 38)
    a rank-8 adapter's updates of the same model follow in the same run:
    a fraction of the bytes, no pause, each version a new adapter, old
    ones removed, exact logprobs."""
    r = _bench("--config", str(ROOT / "conf/demo.toml"), "--model", str(tiny_model_dir),
               "--set", f"run.run_dir={tmp_path}", "--backend", "gloo", "--lora", "--lora-rank", "8",
               "--rounds", "1", "--json", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    both = json.loads(r.stdout)
    res = both["full"]
    assert (res["backend"], res["backend_reason"]) == ("gloo", "weight_sync.backend = gloo")
    assert (res["trainer_device"], res["precision"], res["engine_device"]) == ("cpu", "fp32", "cpu")
    assert res["rounds"] == 1 and res["buckets"] >= 1 and res["update_s"] > 0
    # The receive is explained: its parts are measured, none negative, and
    # they are parts of it (one round: no medians in between; the job starts
    # while its RPC returns, so the two may overlap by that return trip).
    split = {k: res[f"receive_{k}"] for k in ("rpc_s", "vote_s", "alloc_s", "transfer_s", "poll_s")}
    assert all(v >= 0 for v in split.values()) and split["transfer_s"] > 0 and split["vote_s"] > 0, split
    assert sum(split.values()) <= res["receive_s"] + 0.02, (split, res["receive_s"])
    assert 0 < res["receive_first_bucket_s"] <= split["transfer_s"]
    # The engine takes the bytes in while it generates (the default
    # actor.engine.weight_receive): the stall holds the load, not the receive.
    assert res["receive_mode"] == "generating"
    assert res["load_s"] - 0.02 <= res["generation_stall_s"] < res["update_s"]
    # The trainer's side: packing and waiting for the sends, within its update.
    assert res["trainer_pack_s"] > 0 and res["trainer_send_wait_s"] > 0
    assert res["trainer_pack_s"] + res["trainer_send_wait_s"] <= res["update_s"]
    assert res["trainer_rss_mib_first"] > 100 and res["engine_rss_mib_first"] > 100
    assert res["max_abs_logprob_diff_after_update"] < 1e-3
    assert 0 <= res["max_abs_logprob_diff_before_update"] < 1e-3
    # --lora: the adapter's updates, beside the full ones.
    full, lora = both["full"], both["lora"]
    assert (full["lora_rank"], lora["lora_rank"]) == (0, 8) and full["rounds"] == lora["rounds"] == 1
    # 2 layers x 7 projections x (A, B), fp32: rank x (in + out) each.
    assert lora["nbytes"] < full["nbytes"] and both["bytes_ratio"] == lora["nbytes"] / full["nbytes"]
    assert lora["params"] == sum(8 * (i + o) for i, o in [(128, 128), (128, 64), (128, 64), (128, 128),
                                                          (128, 256), (128, 256), (256, 128)]) * 2
    assert full["generation_stall_s"] > 0 and lora["generation_stall_s"] == 0.0 and lora["load_s"] > 0
    assert 0 < lora["update_s"] <= lora["update_to_first_token_s"]
    assert both["update_ratio"] == lora["update_to_first_token_s"] / full["update_to_first_token_s"]
    # The warm-up update and the timed one: 2 adapters, the older removed once idle.
    assert lora["adapters_removed"] == 1 and 1 <= lora["adapters_loaded_max"] <= 2
    assert lora["max_abs_logprob_diff_after_update"] < 1e-4 and both["parity"]
    assert both["no_pause"] and isinstance(both["update_within_goal"], bool) and isinstance(both["gap_within_usual"], bool)
    assert both["lora_gap_added_s"] == lora["max_token_gap_s"] - lora["control_token_gap_s"]
