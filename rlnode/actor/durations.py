"""Where an episode's time goes, per cube: each phase's seconds as a sum
and count (means, Prometheus counters) and its recent values (percentiles).

Phases come from the episode (``EpisodeResult.phases``: ``agent_s``,
``evaluate_s`` and what the task reports, e.g. a verifiers harness's
``harness_start_s``, ``rubric_s``, ``teardown_s``) and from every LLM call
(its lease: ``llm_lease_wait_s`` for a permit, ``llm_call_s`` generating).

Owns: the aggregation. Must not time anything itself.
"""

from __future__ import annotations

import collections

# Recent values kept per phase for percentiles: a long run's summary
# describes its last RECENT episodes (or calls), its sums all of them.
RECENT = 1024


class PhaseDurations:
    def __init__(self) -> None:
        self.sum_s: dict[str, float] = collections.defaultdict(float)
        self.count: dict[str, int] = collections.defaultdict(int)
        self.recent: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=RECENT))

    def add(self, phase: str, seconds: float) -> None:
        self.sum_s[phase] += seconds
        self.count[phase] += 1
        self.recent[phase].append(seconds)

    def record(self, phases: dict[str, float], samples) -> None:
        """One finished episode: its phases and its samples' LLM calls."""
        for name, seconds in phases.items():
            self.add(name, seconds)
        for s in samples:
            self.add("llm_lease_wait_s", s.lease.lease_wait_s)
            self.add("llm_call_s", s.lease.llm_latency_s)

    def summary(self) -> dict[str, dict[str, float]]:
        """{phase: {count, mean, p50, p90, max}} (percentiles over the recent values)."""
        out = {}
        for name in sorted(self.count):
            vals = sorted(self.recent[name])
            out[name] = {"count": self.count[name], "mean": self.sum_s[name] / self.count[name],
                         "p50": _pct(vals, 0.5), "p90": _pct(vals, 0.9), "max": vals[-1]}
        return out


def _pct(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty sorted list."""
    return sorted_vals[min(len(sorted_vals) - 1, max(0, int(q * len(sorted_vals) + 0.5) - 1))]


__all__ = ["PhaseDurations", "RECENT"]
