"""Step metrics: how each one combines, and how a record is written.

Owns: the table that says, for every figure of an optimizer step, how the
figures of parts of that step combine into the step's (``REDUCE``), the one
function that does it (``combine``), and turning a record into strict JSON
(``strict_record``). The learner merges its micro-batches with ``combine``
(parts = ``policy_loss`` metrics), the FSDP ranks merge their gathered
``StepMetrics`` with the same call (rank.py), so a figure combines the same
way at both levels and a 2-rank step reports what the 1-rank step does.

Must not compute any figure itself (loss.py does) nor know where records go.
"""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple


class Reduce(enum.Enum):
    """How the values v_p of one figure over parts p (micro-batches, ranks)
    combine into the step's value."""

    SUM = "sum"  # sum_p v_p: counts
    # sum_p n_p v_p / sum_p n_p, n_p = the part's trained tokens: means and
    # shares over tokens. Parts with n_p = 0 carry no weight (their value is
    # that of no token); when every n_p is 0, the plain mean of the values.
    TOKEN_MEAN = "token_mean"
    MAX = "max"  # max_p v_p: maxima (NaN if any part is NaN)
    MIN = "min"  # min_p v_p: minima (NaN if any part is NaN)


class Ratio(NamedTuple):
    """A share whose numerator and denominator are figures of their own:
    recomputed from the combined figures, never averaged."""

    num: str
    den: str


# Every figure the trainer reports per step (learner.StepMetrics: its
# fields, ``extra`` = policy_loss's metrics + the learner's own, and
# ``mismatch`` = loss.mismatch_figures + the learner's fractions).
REDUCE: dict[str, Reduce | Ratio] = {
    # StepMetrics fields (grad_norm and lr are one value for the whole step)
    "loss": Reduce.SUM,  # each part's loss is its share of the step's
    "samples": Reduce.SUM,
    "tokens": Reduce.SUM,  # trained tokens: the weight of every TOKEN_MEAN
    "logprob_diff_mean": Reduce.TOKEN_MEAN,
    "on_policy_diff_max": Reduce.MAX,
    "step_s": Reduce.MAX,  # the ranks run in parallel
    # policy_loss
    "ratio_mean": Reduce.TOKEN_MEAN,
    "ratio_max": Reduce.MAX,
    "clip_fraction": Reduce.TOKEN_MEAN,
    "dual_clip_fraction": Reduce.TOKEN_MEAN,
    "kl": Reduce.TOKEN_MEAN,
    "entropy": Reduce.TOKEN_MEAN,
    "entropy_below_floor": Reduce.TOKEN_MEAN,
    "lag_masked_fraction": Reduce.TOKEN_MEAN,
    # the learner's step figures
    "nonfinite_skip": Reduce.MAX,  # 1 on every rank when the step was skipped
    "nonfinite_skips_total": Reduce.MAX,  # each rank counts the same skips
    "micro_batches": Reduce.SUM,
    "forward_tokens": Reduce.SUM,
    "pad_tokens": Reduce.SUM,
    "pad_fraction": Ratio("pad_tokens", "forward_tokens"),
    # mismatch_figures, overall and per "lag{k}/" family
    "mismatch_kl": Reduce.TOKEN_MEAN,
    "logprob_absdiff_mean": Reduce.TOKEN_MEAN,
    # An upper bound across ranks: the exact p99 needs every token in one place.
    "logprob_absdiff_p99": Reduce.MAX,
    "logprob_absdiff_max": Reduce.MAX,
    "is_ess": Reduce.TOKEN_MEAN,  # approximate across ranks (not a mean of ESS)
    "truncated_fraction": Reduce.TOKEN_MEAN,
    "masked_fraction": Reduce.TOKEN_MEAN,
}


def reduction(name: str) -> Reduce | Ratio:
    """How figure ``name`` combines. A name "family/base" (the per-lag
    figures "lag{k}/...") combines like "base", its token weights read
    from "family/tokens". Names not in REDUCE go by their suffix: "_max"
    -> MAX, "_min" -> MIN, "tokens" -> SUM, anything else TOKEN_MEAN (a
    figure over a micro-batch's tokens is a mean or share of them)."""
    base = name.rpartition("/")[2]
    if (how := REDUCE.get(base)) is not None:
        return how
    if base.endswith("_max"):
        return Reduce.MAX
    if base.endswith("_min"):
        return Reduce.MIN
    if base.endswith("tokens"):
        return Reduce.SUM
    return Reduce.TOKEN_MEAN


def combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """The step's figures from its parts' (micro-batches' or ranks'), each
    figure by ``reduction(name)``; a part lacking a figure does not count
    for it. TOKEN_MEAN weighs part p by p["tokens"] (p["family/tokens"]
    for "family/..." names), 0 where the part has none."""
    out: dict[str, float] = {}
    ratios: dict[str, Ratio] = {}
    for name in dict.fromkeys(k for p in parts for k in p):  # first-seen order
        how = reduction(name)
        if isinstance(how, Ratio):
            ratios[name] = how
            continue
        values = [float(p[name]) for p in parts if name in p]
        if how is Reduce.TOKEN_MEAN:
            family = name.rpartition("/")[0]
            weight_key = f"{family}/tokens" if family else "tokens"
            weights = [float(p.get(weight_key, 0.0)) for p in parts if name in p]
            out[name] = _token_mean(values, weights)
        else:
            out[name] = _REDUCERS[how](values)
    for name, (num, den) in ratios.items():
        out[name] = out.get(num, 0.0) / max(1.0, out.get(den, 0.0))
    return out


def _token_mean(values: list[float], weights: list[float]) -> float:
    total = sum(weights)
    if total <= 0:
        return math.fsum(values) / len(values)
    # A 0-weight part is skipped, not multiplied: 0 * inf would be NaN.
    return math.fsum(v * w for v, w in zip(values, weights) if w > 0) / total


def _extreme(pick):
    def reduce(values: list[float]) -> float:
        # Python's max/min keep or drop a NaN by its position: propagate it.
        return math.nan if any(math.isnan(v) for v in values) else pick(values)
    return reduce


_REDUCERS = {Reduce.SUM: math.fsum, Reduce.MAX: _extreme(max), Reduce.MIN: _extreme(min)}


# ---------------------------------------------------------------------------
# Records: metrics.jsonl is strict JSON (RFC 8259 has no NaN or Infinity;
# Python's json writes them by default and strict readers refuse the line).

NONFINITE_KEY = "nonfinite"


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` with every non-finite float (at any depth) as
    None, and under NONFINITE_KEY the names of those values, in order
    ("outer.inner" for a nested one); the key is absent when all are finite."""
    bad: list[str] = []
    clean = _finite(record, "", bad)
    if bad:
        clean[NONFINITE_KEY] = bad
    return clean


def _finite(value: Any, path: str, bad: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path)
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{path}[{i}]", bad) for i, v in enumerate(value)]
    return value
