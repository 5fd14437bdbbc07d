"""``rlnode bench gateway`` at toy size on the shared engine: both modes
play, the numbers add up, the ratio is the paired median. No performance
threshold: this machine's timings say nothing."""

import msgspec
import pytest

from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.bench.gateway import DEMO_GAME, GatewayBenchResult, compare, print_table
from rlnode.cli import build_parser

pytestmark = pytest.mark.engine


async def test_bench_gateway_plays_both_modes(engine, tokenizer, capsys):
    settings = EpisodeSettings(SamplingSettings(max_tokens=4, ignore_eos=True), max_turns=8, max_model_len=2048)
    router = AdmissionRouter(1, 3)
    res = await compare(LLMClient([engine], router), ChatRenderer(tokenizer), settings, DEMO_GAME, seed=0,
                        episodes=6, concurrency=3, rounds=2, log=lambda msg: None)
    assert router.in_flight == [0]
    raw = res.raw_rounds
    assert len(raw["native"]) == len(raw["gateway"]) == 2
    for mode, stats in raw.items():
        for st in stats:
            # ignore_eos: every call produced exactly max_tokens tokens, so the
            # token count is checked against the calls, counted separately.
            assert st.tokens == st.calls * 4 and st.episodes == 6 and st.wall_s > 0
            # CPU is measured per process: the daemon always works; the agent's
            # worker processes only in gateway rounds; the engine in both.
            assert st.daemon_cpu_s > 0 and st.engine_cpu_s > 0
            assert (st.agent_cpu_s > 0) == (mode == "gateway")
    per_round = [(g.tokens / g.wall_s) / (n.tokens / n.wall_s) for g, n in zip(raw["gateway"], raw["native"])]
    assert min(per_round) - 1e-9 <= res.ratio <= max(per_round) + 1e-9
    assert res.overhead_ms_per_call == pytest.approx(res.daemon_ms_per_call["gateway"] - res.daemon_ms_per_call["native"])
    # Every guess is one call; the demo game allows 3 guesses.
    for calls in (res.calls_per_episode, res.native_calls_per_episode):
        assert 1.0 <= calls <= 3.0
    assert res.history_resets == 0
    assert (res.episodes_per_round, res.concurrency, res.max_tokens, res.rounds) == (6, 3, 4, 2)
    assert msgspec.json.decode(msgspec.json.encode(res), type=GatewayBenchResult) == res
    print_table(res)
    out = capsys.readouterr().out
    assert f"ratio gateway/native = {res.ratio:.3f}" in out and "history resets = 0" in out
    assert f"gateway overhead {res.overhead_ms_per_call:+.2f}" in out


def test_bench_gateway_is_a_command():
    args = build_parser().parse_args(["bench", "gateway", "--json", "--requests", "8"])
    assert (args.command, args.name, args.json, args.requests) == ("bench", "gateway", True, 8)
