"""Step metrics (rlnode/trainer/metrics.py): each figure combines over
micro-batches and ranks by its declared rule, and metrics.jsonl is strict
JSON, on hand-made parts and on real steps of the tiny model."""

from __future__ import annotations

import json
import math

import pytest

from test_learner import group, make_sample
from rlnode.config import AdvantageConfig, load_config
from rlnode.trainer.buffer import BufferCounters, build_batch
from rlnode.trainer.checkpoint import MetricsWriter
from rlnode.trainer.learner import Learner
from rlnode.trainer.loss import LOG_RATIO_MAX
from rlnode.trainer.metrics import REDUCE, Ratio, Reduce, combine, reduction, strict_record


def strict_loads(line: str):
    """json.loads as a strict (RFC 8259) reader: NaN and Infinity refused."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


# ------------------------------------------------------------ the table
def test_parts_combine_by_their_declared_rule():
    # A small micro-batch (or rank) with a large ratio beside a large one near 1.
    small = {"tokens": 10.0, "ratio_max": 5.0, "ratio_mean": 2.0, "clip_fraction": 0.5, "nonfinite_skip": 0.0,
             "micro_batches": 1.0, "pad_tokens": 2.0, "forward_tokens": 12.0, "pad_fraction": 2 / 12}
    large = {"tokens": 90.0, "ratio_max": 1.5, "ratio_mean": 1.0, "clip_fraction": 0.0, "nonfinite_skip": 1.0,
             "micro_batches": 3.0, "pad_tokens": 0.0, "forward_tokens": 188.0, "pad_fraction": 0.0}
    out = combine([small, large])
    assert out["ratio_max"] == 5.0  # the max, not the token mean (1.85)
    assert out["tokens"] == 100.0 and out["micro_batches"] == 4.0
    assert out["ratio_mean"] == pytest.approx((10 * 2.0 + 90 * 1.0) / 100)
    assert out["clip_fraction"] == pytest.approx(0.05)
    assert out["nonfinite_skip"] == 1.0
    assert out["pad_fraction"] == pytest.approx(2 / 200)  # of the sums, not a mean of shares
    assert combine([large, small]) == pytest.approx(out)  # order does not matter


def test_families_weigh_by_their_own_tokens_and_nan_propagates():
    # Per-lag mismatch figures from two ranks: lag1 weighs by lag1/tokens.
    r0 = {"tokens": 10.0, "lag1/tokens": 1.0, "lag1/mismatch_kl": 0.4, "lag1/logprob_absdiff_max": 0.9,
          "logprob_absdiff_p99": 0.5, "is_ess": 0.8}
    r1 = {"tokens": 2.0, "lag1/tokens": 3.0, "lag1/mismatch_kl": 0.0, "lag1/logprob_absdiff_max": 0.1,
          "logprob_absdiff_p99": 0.7, "is_ess": math.nan}
    out = combine([r0, r1])
    assert out["lag1/tokens"] == 4.0
    assert out["lag1/mismatch_kl"] == pytest.approx(0.1)  # (1 * 0.4 + 3 * 0) / 4
    assert out["lag1/logprob_absdiff_max"] == 0.9 and out["logprob_absdiff_p99"] == 0.7
    assert math.isnan(out["is_ess"])
    assert math.isnan(combine([{"ratio_max": math.nan}, {"ratio_max": 2.0}])["ratio_max"])
    assert math.isnan(combine([{"ratio_max": 2.0}, {"ratio_max": math.nan}])["ratio_max"])
    # A part without tokens carries no weight (0 * inf would be NaN); a
    # figure only some parts have combines over those.
    assert combine([{"tokens": 0.0, "kl": math.inf}, {"tokens": 4.0, "kl": 1.0, "entropy": 2.0}]) == {
        "tokens": 4.0, "kl": 1.0, "entropy": 2.0}


def test_unknown_names_go_by_their_suffix():
    assert reduction("new_max") is Reduce.MAX and reduction("lag3/new_max") is Reduce.MAX
    assert reduction("new_min") is Reduce.MIN
    assert reduction("lag2/tokens") is Reduce.SUM and reduction("new_tokens") is Reduce.SUM
    assert reduction("new_share") is Reduce.TOKEN_MEAN
    assert reduction("pad_fraction") == Ratio("pad_tokens", "forward_tokens")


# ------------------------------------------------------------ real steps
def test_a_step_merges_its_micro_batches_by_the_table(tiny_model_dir, hf_model):
    # Two micro-batches: 8 on-policy tokens (r = 1), and 1 token sampled 0.5
    # nats below the trainer (r = e^0.5). Every regulariser on, so that every
    # figure a step reports is there to be checked against the table.
    cfg = load_config(None, [f"model.path={tiny_model_dir}", 'trainer.device="cpu"', "trainer.micro_batch_size=1",
                             "trainer.loss.kl_coef=0.01", "trainer.loss.entropy_coef=0.01",
                             "trainer.loss.entropy_floor=0.3", "trainer.loss.max_token_lag=1"])
    learner = Learner(cfg)
    long = make_sample(hf_model, [5, 6], [40, 41, 42, 43, 44, 45, 46, 47], "g/e0", 0)
    short = make_sample(hf_model, [5, 6], [50], "g/e1", 0, behaviour_shift=-0.5)
    batch = build_batch([group("g", [1.0, 0.0], [long, short])], 0, 1, AdvantageConfig(), BufferCounters())
    m = learner.train_step(batch)
    assert m.extra["micro_batches"] == 2
    assert m.extra["ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-4)  # not (8 + e^0.5) / 9
    assert m.extra["ratio_mean"] == pytest.approx((8 + math.exp(0.5)) / 9, rel=1e-4)
    assert m.extra["tokens"] == m.tokens == 9
    assert m.logprob_diff_mean == pytest.approx(0.5 / 9, abs=1e-5)
    undeclared = [k for k in [*m.extra, *m.mismatch] if k.rpartition("/")[2] not in REDUCE]
    assert undeclared == []


def test_an_overflowing_ratio_writes_strict_json(tiny_model_dir, hf_model, tmp_path):
    # Behaviour logprobs 1e4 below the trainer's: exp(logpi - logmu)
    # overflows. The step's record, built and written by the trainer's own
    # code, must parse as strict JSON; what is not finite is null and named.
    from rlnode.trainer.daemon import TrainerDaemon

    cfg = load_config(None, [f"model.path={tiny_model_dir}", 'trainer.device="cpu"', f"run.run_dir={tmp_path}"])
    learner = Learner(cfg)
    far = make_sample(hf_model, [5, 6], [40, 41], "g/e0", 0, behaviour_shift=-1e4)
    fresh = make_sample(hf_model, [5, 6], [50, 51], "g/e1", 0)
    batch = build_batch([group("g", [1.0, 0.0], [far, fresh])], 0, 1, AdvantageConfig(), BufferCounters())
    m = learner.train_step(batch)
    daemon = TrainerDaemon(cfg)
    daemon.metrics = MetricsWriter(tmp_path)
    try:
        daemon._write_step_metrics(batch, m, 0.0, False, m.step_s)
    finally:
        daemon.metrics.close()
    [line] = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rec = strict_loads(line)
    # The ratio figures read the bounded ratio: finite, at the bound.
    assert rec["loss/ratio_max"] == pytest.approx(math.exp(LOG_RATIO_MAX), rel=1e-5)
    assert rec["loss/ratio_mean"] == pytest.approx((math.exp(LOG_RATIO_MAX) * 2 + 2) / 4, rel=1e-5)
    assert rec["logprob_diff_on_policy_max"] == pytest.approx(1e4) and not rec["loss/nonfinite_skip"]
    # The mismatch figures' r_t = e^d overflows even in float64 (d ~ 1e4):
    # k3 = r - 1 - d is inf and the ESS inf / inf. Null, and named.
    bad = ["offpolicy/mismatch_kl", "offpolicy/is_ess", "offpolicy/lag0/mismatch_kl", "offpolicy/lag0/is_ess"]
    assert rec["nonfinite"] == bad
    assert [rec[k] for k in bad] == [None] * 4


def test_strict_record_nulls_and_names_every_nonfinite_value(tmp_path):
    rec = {"a": math.nan, "b": [1.0, math.inf], "h": {"x": -math.inf, "y": 2}, "ok": 1.5, "s": "nan"}
    assert strict_record(rec) == {"a": None, "b": [1.0, None], "h": {"x": None, "y": 2}, "ok": 1.5, "s": "nan",
                                  "nonfinite": ["a", "b[1]", "h.x"]}
    assert math.isnan(rec["a"])  # the caller's record is left as it was
    assert "nonfinite" not in strict_record({"ok": 1.0})
    seen = []

    class Sink:
        name = "t"

        def write(self, record):
            seen.append(record)

        def close(self):
            pass

    w = MetricsWriter(tmp_path, [Sink()])
    w.write(rec)
    w.close()
    assert strict_loads((tmp_path / "metrics.jsonl").read_text())["nonfinite"] == ["a", "b[1]", "h.x"]
    assert seen == [rec]  # the trackers chart the values as they are
