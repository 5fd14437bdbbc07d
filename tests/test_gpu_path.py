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
from rlnode.weight_plan import GroupMember, GroupSpec, WeightComm, indexed_device

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
    import rlnode.rendezvous as rendezvous

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
    from rlnode.rendezvous import Rendezvous

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
