"""Where episodes' time goes: the per-cube phase summary that `rlnode eval
--json`, /status and /metrics report, and its form on the link."""

from __future__ import annotations

import msgspec

from rlnode.actor.daemon import flat_summary
from rlnode.actor.durations import RECENT, PhaseDurations
from rlnode.actor.scheduler import CubeStats
from rlnode.wire import EvalReport, LeaseMetadata, ToTrainer


class Sample:
    def __init__(self, wait_s: float, call_s: float):
        self.lease = LeaseMetadata(0, 0, wait_s, call_s)


def test_phases_and_llm_calls_are_summed_counted_and_ranked():
    d = PhaseDurations()
    for i in range(1, 11):  # ten episodes, agent 1..10 s, two LLM calls each
        d.record({"agent_s": float(i), "rubric_s": 0.5}, [Sample(0.1, 0.2 * i), Sample(0.0, 0.1)])
    s = d.summary()
    assert s["agent_s"] == {"count": 10, "mean": 5.5, "p50": 5.0, "p90": 9.0, "max": 10.0}
    assert s["rubric_s"]["mean"] == 0.5 and s["llm_call_s"]["count"] == 20
    assert abs(s["llm_lease_wait_s"]["mean"] - 0.05) < 1e-12 and s["llm_call_s"]["max"] == 2.0


def test_percentiles_describe_the_recent_values_and_sums_all_of_them():
    d = PhaseDurations()
    for _ in range(RECENT):
        d.add("agent_s", 100.0)
    for _ in range(RECENT):
        d.add("agent_s", 1.0)
    s = d.summary()["agent_s"]
    assert s["count"] == 2 * RECENT and s["mean"] == 50.5 and s["max"] == 1.0


def test_an_eval_summary_with_phases_crosses_the_link_as_numbers():
    stats = CubeStats()
    stats.durations.record({"harness_start_s": 2.0, "agent_s": 3.0}, [Sample(0.25, 1.0)])
    summary = stats.summary()
    assert summary["phases_s"]["harness_start_s"]["p90"] == 2.0
    flat = flat_summary(summary)
    assert flat["harness_start_mean_s"] == 2.0 and flat["llm_call_p90_s"] == 1.0 and "phases_s" not in flat
    frame = msgspec.msgpack.encode(EvalReport("n1", 3, {"vf": flat}))
    back = msgspec.msgpack.Decoder(ToTrainer).decode(frame)
    assert back.cubes["vf"]["llm_lease_wait_mean_s"] == 0.25


def test_a_cubes_summary_counts_each_calls_tokens():
    from types import SimpleNamespace

    stats = CubeStats()
    calls = [SimpleNamespace(lease=LeaseMetadata(0, 0, 0.0, 0.5, prompt_tokens=p, completion_tokens=c),
                             finish_reason="stop") for p, c in ((1000, 40), (1100, 60))]
    stats.record(SimpleNamespace(phases={"agent_s": 2.0}, samples=calls, success=True, agent_errors=0, reward=0.5,
                                 num_turns=2))
    s = stats.summary()
    assert (s["prompt_tokens_mean"], s["completion_tokens_mean"]) == (1050.0, 50.0)
    assert s["phases_s"]["llm_call_s"]["count"] == 2 and s["phases_s"]["agent_s"]["mean"] == 2.0
