"""``rlnode bench gateway`` at toy size on the shared engine: both modes
play, the numbers add up, the ratio is the paired median; and on the null
engine (``--engine null``, the gateway's own capacity). No performance
threshold: this machine's timings say nothing."""

import msgspec
import pytest

from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.bench.gateway import DEMO_GAME, GatewayBenchResult, compare, null_engine, print_table
from rlnode.bench.null_engine import NullEngine
from rlnode.cli import build_parser
from rlnode.config import ModelConfig


@pytest.mark.engine
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
    assert (args.command, args.name, args.json, args.requests, args.engine) == ("bench", "gateway", True, 8, "vllm")
    assert build_parser().parse_args(["bench", "gateway", "--engine", "null"]).engine == "null"


async def test_null_engine_answers_like_an_engine(tokenizer):
    renderer = ChatRenderer(tokenizer)
    eng = null_engine(renderer, DEMO_GAME)
    await eng.start()
    seen, texts = [], []
    for _ in range(5):
        c = await eng.generate([1, 2, 3], SamplingSettings(max_tokens=6, ignore_eos=True), on_tokens=seen.append)
        # ignore_eos: exactly max_tokens valid ids, one logprob each, "length".
        assert len(c.token_ids) == len(c.logprobs) == 6 and c.finish_reason == "length"
        assert all(0 <= t < len(tokenizer) for t in c.token_ids) and all(lp < 0 for lp in c.logprobs)
        assert c.weight_versions == [("0", 0, 6)] and seen[-1] == c.token_ids
        texts.append(renderer.completion_text(c.token_ids, c.finish_reason).strip())
    assert texts == ["1", "2", "3", "4", "5"]  # the game's numbers in turn
    # Without ignore_eos a reply ends at the end of turn, as a model's would.
    c = await eng.generate([1], SamplingSettings(max_tokens=6))
    assert (c.token_ids[-1], c.finish_reason) == (tokenizer.eos_token_id, "stop") and len(c.token_ids) < 6
    c = await eng.generate([1], SamplingSettings(max_tokens=1))
    assert len(c.token_ids) == 1 and c.finish_reason == "length"
    assert eng.requests_total == 7 and eng.in_flight == 0 and eng.failing() == ""


@pytest.mark.parametrize("gateway_host", ["inline", "process"])
async def test_bench_gateway_on_the_null_engine(gateway_host, tokenizer, capsys):
    n = 4
    settings = EpisodeSettings(SamplingSettings(max_tokens=n, ignore_eos=True), max_turns=8, max_model_len=2048)
    renderer = ChatRenderer(tokenizer)
    eng = null_engine(renderer, DEMO_GAME)
    await eng.start()
    router = AdmissionRouter(1, 6)
    res = await compare(LLMClient([eng], router), renderer, settings, DEMO_GAME, seed=0, episodes=12,
                        concurrency=6, rounds=1, log=lambda msg: None, engine="null", gateway_host=gateway_host,
                        model=ModelConfig(path=tokenizer.name_or_path))
    assert router.in_flight == [0] and eng.in_flight == 0 and isinstance(eng, NullEngine)
    raw = res.raw_rounds
    timed = {m: sum(st.calls for st in raw[m]) for m in raw}
    # The gateway answered the agent's calls (warm-up included), every call
    # reached the engine and got n tokens back.
    assert timed["gateway"] > 0 and res.gateway_calls >= timed["gateway"]
    assert eng.requests_total >= res.gateway_calls + timed["native"]
    assert eng.generated_tokens == n * eng.requests_total
    for mode, stats in raw.items():
        for st in stats:
            assert st.tokens == st.calls * n and st.episodes == 12 and st.wall_s > 0
            # Per process: the daemon (its loop thread a part of it), the
            # agent's workers in gateway rounds only, no engine processes.
            assert 0 < st.loop_cpu_s <= st.daemon_cpu_s + 1e-3
            assert (st.agent_cpu_s > 0) == (mode == "gateway") and st.engine_cpu_s == 0
            assert gateway_host == "process" or st.host_cpu_s == 0  # no host process inline
    assert res.engine == "null" and res.history_resets == 0 and res.gateway_host == gateway_host
    assert res.calls_per_s > 0 and res.native_calls_per_s > 0
    assert res.loop_ms_per_call["gateway"] > 0 and res.agent_ms_per_call > 0
    assert res.engine_ms_per_call == {"native": 0.0, "gateway": 0.0}
    for calls in (res.calls_per_episode, res.native_calls_per_episode):
        assert 1.0 <= calls <= 3.0
    assert msgspec.json.decode(msgspec.json.encode(res), type=GatewayBenchResult) == res
    print_table(res)
    out = capsys.readouterr().out
    assert "null engine" in out and "engine none (null)" in out and "event-loop thread" in out


@pytest.mark.parametrize("protocol", ["responses", "messages", "completions"])
async def test_bench_gateway_plays_each_api_on_the_null_engine(protocol, tokenizer, capsys):
    """``--protocol``: the example agent of each API plays through the
    gateway, its every call extending the last (no history reset)."""
    settings = EpisodeSettings(SamplingSettings(max_tokens=4, ignore_eos=True), max_turns=8, max_model_len=2048)
    renderer = ChatRenderer(tokenizer)
    eng = null_engine(renderer, DEMO_GAME)
    await eng.start()
    res = await compare(LLMClient([eng], AdmissionRouter(1, 4)), renderer, settings, DEMO_GAME, seed=0, episodes=8,
                        concurrency=4, rounds=1, log=lambda msg: None, engine="null", protocol=protocol)
    assert res.protocol == protocol and res.history_resets == 0 and res.gateway_calls > 0
    assert 1.0 <= res.calls_per_episode <= 3.0 and res.calls_per_s > 0
    print_table(res)
    assert f"{protocol} agent via the gateway" in capsys.readouterr().out
