"""Experiment trackers (rlnode/trainer/trackers.py) in their local modes:
what the trainer writes to metrics.jsonl is read back from TensorBoard's
event files and from W&B's offline run file. The daemon's own wiring is
checked on a running job in test_ops."""

from __future__ import annotations

import json

import pytest

from rlnode.config import ConfigError, load_config
from rlnode.trainer.checkpoint import MetricsWriter
from rlnode.trainer.trackers import TensorBoardSink, WandbSink, open_sinks
from tracker_files import tensorboard_scalars, wandb_history

STEPS = [{"step": i + 1, "version": i + 1, "time": 1e9 + i, "reward_mean": 0.1 * i, "loss": -0.5 + i,
          "weights_pushed": True, "group_ids": ["g"], "offpolicy/mismatch_kl": 1e-9 * i,
          "offpolicy/lag1/is_ess": 0.9, "token_lag_hist": {"0": 10 + i, "1": 2}} for i in range(3)]
EVAL = {"eval": True, "version": 2, "cube_id": "guess", "time": 1e9 + 9, "eval_reward_mean": 0.7,
        "eval_success": 0.75, "episodes": 8, "turns_mean": 2.0}


def _write(tmp_path, sinks) -> MetricsWriter:
    w = MetricsWriter(tmp_path, sinks)
    for rec in STEPS[:2] + [EVAL, {"no_step": True, "version": 3, "time": 1e9}] + STEPS[2:]:
        w.write(rec)
    w.close()
    return w


def test_tensorboard_event_files_hold_every_figure_by_version(tmp_path):
    _write(tmp_path, [TensorBoardSink(tmp_path / "tensorboard")])
    got = tensorboard_scalars(tmp_path / "tensorboard")
    assert [v for _, v in got["reward_mean"]] == pytest.approx([0.0, 0.1, 0.2])
    assert [s for s, _ in got["reward_mean"]] == [1, 2, 3]  # x = version
    assert got["offpolicy/lag1/is_ess"][0][1] == pytest.approx(0.9)
    assert got["token_lag/0"] == [(1, 10.0), (2, 11.0), (3, 12.0)]
    assert got["eval/guess/success"] == [(2, 0.75)]
    assert "weights_pushed" not in got and "time" not in got  # flags and clocks are not figures


def test_wandb_offline_run_holds_every_figure_by_version(tmp_path):
    cfg = load_config(None, ["run.name=\"trk\"", "trainer.trackers.wandb=true"])
    _write(tmp_path, [WandbSink(cfg, tmp_path)])
    rows = wandb_history(tmp_path, want=4)
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert [r["reward_mean"] for r in steps] == pytest.approx([0.0, 0.1, 0.2])
    assert [r["token_lag/1"] for r in steps] == [2, 2, 2]
    assert [(r["version"], r["eval/guess/success"]) for r in rows if "eval/guess/success" in r] == [(2, 0.75)]


class _Broken:
    name = "broken"
    closed = False

    def write(self, record):
        raise OSError("disk full")

    def close(self):
        self.closed = True


def test_a_failing_tracker_is_dropped_and_metrics_jsonl_keeps_everything(tmp_path):
    broken = _Broken()
    w = _write(tmp_path, [broken, TensorBoardSink(tmp_path / "tb")])
    assert broken.closed and w.sink_failures == 1
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 5
    assert len(tensorboard_scalars(tmp_path / "tb")["reward_mean"]) == 3  # the healthy one kept going


def test_a_tracker_without_its_package_is_a_config_error_naming_the_key(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(None, ["trainer.trackers.wandb=true"])
    with pytest.raises(ConfigError, match=r"trainer\.trackers\.wandb: needs the wandb package"):
        open_sinks(cfg, tmp_path)
    assert open_sinks(load_config(None, []), tmp_path) == []  # off by default
