"""GPU-path defects that can be shown on CPU (issue 19): the NCCL device
index and the engine guard's registration. (The vLLM API contract is in
test_vllm_contract.py; the IPC choice and export, the attention choice and
the memory plan have their own files.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlnode.actor import engine_guard
from rlnode.weights.plan import GroupMember, GroupSpec, indexed_device
from rlnode.weights.comm import WeightComm

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------
# Item 2: NCCL gets an indexed device


def test_an_unindexed_cuda_device_gets_the_current_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device("cuda") == torch.device("cuda", 3)
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed_device("cuda:1") == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")
    # What vLLM's PyNcclCommunicator compares on every collective:
    assert torch.device("cuda") != torch.device("cuda", 0)


def test_weight_comm_hands_nccl_an_indexed_device(monkeypatch):
    """The trainer passes "cuda"; vLLM's PyNcclCommunicator would keep it and
    assert tensor.device == "cuda" (never true: tensors are cuda:N)."""
    import rlnode.weights.rendezvous as rendezvous

    got = []

    class FakeRendezvous:
        def __init__(self, spec, rank, listen_socket=None):
            pass

        def nccl_communicator(self, device):
            got.append(device)
            return type("Comm", (), {"disabled": False})()

        def close(self):
            pass

    monkeypatch.setattr(rendezvous, "Rendezvous", FakeRendezvous)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    spec = GroupSpec(1, "127.0.0.1", 1, 2, "nccl", (GroupMember("a", 1),), 5.0, secret="00")
    comm = WeightComm(spec, 0, "cuda")
    assert got == [torch.device("cuda", 0)] and comm.device == torch.device("cuda", 0)


def test_the_nccl_communicator_refuses_an_unindexed_device():
    from rlnode.weights.rendezvous import Rendezvous

    with pytest.raises(ValueError, match=r"needs an indexed device \(cuda:N\), got cuda"):
        Rendezvous.nccl_communicator(object(), "cuda")


# --------------------------------------------------------------------------
# Item 9: the engine guard fails loudly when vLLM would not load it


def test_the_guard_is_registered_in_this_environment():
    engine_guard.check_registered()  # make setup installs rlnode (editable)


def test_an_unregistered_guard_stops_the_engine_start(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    monkeypatch.delenv(engine_guard.OWNER_ENV, raising=False)
    with pytest.raises(engine_guard.EngineGuardMissing, match="not registered with vLLM.*pip install -e"):
        engine_guard.mark_owner()
    assert engine_guard.OWNER_ENV not in os.environ  # nothing half-done


def test_a_source_tree_without_metadata_is_refused(tmp_path):
    """rlnode imported from a copied source tree, with no installed metadata
    (the real failure: vLLM finds plugins through distributions only)."""
    import shutil

    shutil.copytree(REPO / "rlnode", tmp_path / "rlnode", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from rlnode.actor import engine_guard as g\n"
            "try:\n    g.check_registered()\nexcept g.EngineGuardMissing as e:\n    print('REFUSED', e)\n")
    # -S: no site-packages (no installed distribution, rlnode from the cwd)
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "not registered with vLLM" in out.stdout


def test_a_plugin_pointing_elsewhere_is_refused(monkeypatch):
    import importlib.metadata

    ep = importlib.metadata.EntryPoint(engine_guard.PLUGIN_NAME, "other_rlnode.guard:install",
                                       "vllm.general_plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [ep])
    with pytest.raises(engine_guard.EngineGuardMissing, match="points at 'other_rlnode.guard:install'"):
        engine_guard.check_registered()


# --------------------------------------------------------------------------
# Item 6: an fp32 lm_head by default on cuda engines with a low-precision model


@pytest.mark.parametrize("device, dtype, setting, expected", [
    ("cuda", "bfloat16", "auto", True),  # V2's temperature would run in bf16 without it
    ("cuda", "auto", "auto", True),
    ("cuda", "float32", "auto", False),  # the head is fp32 already
    ("cpu", "bfloat16", "auto", False),
    ("cuda", "bfloat16", False, False),  # the operator's word stands
    ("cpu", "float32", True, True),
])
def test_fp32_lm_head_resolves_per_device_and_dtype(device, dtype, setting, expected):
    from rlnode.actor.engine import fp32_lm_head_enabled
    from rlnode.config import EngineConfig, ModelConfig

    cfg = EngineConfig(device=device, fp32_lm_head=setting)
    assert fp32_lm_head_enabled(cfg, ModelConfig(path="/m", dtype=dtype)) is expected


def test_fp32_lm_head_accepts_only_a_bool_or_auto(tmp_path):
    from rlnode.config import ConfigError, load_config

    path = tmp_path / "c.toml"
    path.write_text('[model]\npath = "/m"\n[actor.engine]\nfp32_lm_head = "yes"\n')
    with pytest.raises(ConfigError, match="fp32_lm_head"):
        load_config(str(path))


# --------------------------------------------------------------------------
# Item 7: exact fp32 dot products in vLLM's Triton attention on cuda


def test_fp32_engines_on_cuda_get_ieee_triton_dots(monkeypatch):
    from rlnode.actor.engine import engine_process_env, fp32_precision_env
    from rlnode.config import EngineConfig, ModelConfig

    fp32, bf16 = ModelConfig(path="/m", dtype="float32"), ModelConfig(path="/m", dtype="bfloat16")
    assert fp32_precision_env(EngineConfig(), fp32) == {"TRITON_F32_DEFAULT": "ieee"}
    assert fp32_precision_env(EngineConfig(fp32_dot_precision="tf32"), fp32) == {"TRITON_F32_DEFAULT": "tf32"}
    assert fp32_precision_env(EngineConfig(), bf16) == {}
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with engine_process_env([0], fp32_precision_env(EngineConfig(), fp32)):
        assert os.environ["TRITON_F32_DEFAULT"] == "ieee"  # what the spawned engine inherits
    assert "TRITON_F32_DEFAULT" not in os.environ
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")  # the operator's choice wins
    with engine_process_env([0], {"TRITON_F32_DEFAULT": "ieee"}):
        assert os.environ["TRITON_F32_DEFAULT"] == "tf32x3"
    with engine_process_env(None, {"TRITON_F32_DEFAULT": "ieee"}):  # CPU: nothing changes
        assert os.environ["TRITON_F32_DEFAULT"] == "tf32x3"
