"""``rlnode bench gateway`` at toy size on the shared engine: both modes
play, the numbers add up, the ratio is the paired median. No performance
threshold: this machine's timings say nothing."""

import statistics

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
    rounds = res.rounds_tokens_per_s
    assert len(rounds["native"]) == len(rounds["gateway"]) == 2 and min(rounds["native"] + rounds["gateway"]) > 0
    assert res.ratio == statistics.median(g / n for g, n in zip(rounds["gateway"], rounds["native"]))
    assert res.tokens_per_s == statistics.median(rounds["gateway"])
    # Every guess is one call; the demo game allows 3 guesses.
    for calls in (res.calls_per_episode, res.native_calls_per_episode):
        assert 1.0 <= calls <= 3.0
    assert res.history_resets == 0
    assert (res.episodes_per_round, res.concurrency, res.max_tokens, res.rounds) == (6, 3, 4, 2)
    assert msgspec.json.decode(msgspec.json.encode(res), type=GatewayBenchResult) == res
    print_table(res)
    out = capsys.readouterr().out
    assert f"ratio gateway/native = {res.ratio:.3f}" in out and "history resets = 0" in out


def test_bench_gateway_is_a_command():
    args = build_parser().parse_args(["bench", "gateway", "--json", "--requests", "8"])
    assert (args.command, args.name, args.json, args.requests) == ("bench", "gateway", True, 8)
