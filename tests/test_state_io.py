"""Checkpoints hold no pickle: trainer state round-trips through safetensors + JSON."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from rlnode.trainer.checkpoint import TRAINER_STATE, CheckpointManager, rng_state, set_rng_state
from rlnode.trainer.state_io import StateFormatError, load_state, save_state


def _trained_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_optimizer_scheduler_and_rng_round_trip(tmp_path):
    model, opt, sched = _trained_optimizer()
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state()}
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())
    save_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "state.safetensors"]

    back = load_state(tmp_path)
    model2, opt2, sched2 = _trained_optimizer()
    for g in opt2.param_groups:  # make sure loading, not the identical rebuild, sets them
        g["lr"] = 123.0
    opt2.load_state_dict(back["optimizer"])
    sched2.load_state_dict(back["scheduler"])
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95) and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for k, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(opt2.state_dict()["state"][k][name], v), (k, name)
    assert sched2.last_epoch == sched.last_epoch
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    set_rng_state(back["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws


def test_unsupported_values_are_refused_not_pickled(tmp_path):
    with pytest.raises(StateFormatError, match="object cannot be stored"):
        save_state(tmp_path, {"x": [object()]})
    with pytest.raises(StateFormatError, match="dict key"):
        save_state(tmp_path, {"x": {(1, 2): 3}})


class _Payload:
    """Unpickling this creates a marker file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickled_trainer_state_is_never_loaded(tmp_path):
    model, opt, sched = _trained_optimizer()
    ckpt = tmp_path / "step-1"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    marker = tmp_path / "pwned"
    (ckpt / "trainer_state.pt").write_bytes(pickle.dumps({"optimizer": _Payload(marker)}))

    class _Model(torch.nn.Module):
        config = type("C", (), {"tie_word_embeddings": False})()

    with pytest.raises(RuntimeError, match="pickle"):
        CheckpointManager(tmp_path).load(ckpt, _Model(), opt, sched)
    assert not marker.exists()
    assert TRAINER_STATE == "trainer_state"
