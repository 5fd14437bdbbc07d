"""``rlnode bench gateway``: what training an agent through the gateway costs.

The same game played two ways on one engine, in one run:

  (a) native:  rlnode's own agent loop (``run_episode``) calling the
      LLMClient in-process;
  (b) gateway: the ``openai``-SDK agent of ``examples/guess_openai_sdk.py``
      (``play``, run by ``run_agent_episode``), which reaches the policy over
      HTTP through the OpenAI-compatible gateway: JSON requests, history
      matching, the template tokens of new messages, one openai client and
      one httpx client per episode, each guess posted to the env URL.

Same model, cube (``guessing``: the config's guessing options, else the
demo's), task ids, sampling and episode concurrency. The native task
advertises the agent's ``guess`` tool, so both render the same first prompt
(tool block included) and differ only in the path a completion takes. Every
call generates exactly ``max_tokens`` (ignore_eos) so tokens/s compare; how
many calls an episode takes still depends on when a guess hits (reported).
Modes alternate round by round so drift on a shared host hits both alike;
the ratio is the median of the per-round ratios gateway / native.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Awaitable, Callable, NamedTuple

import msgspec

from rlnode.actor.agent_episode import run_agent_episode
from rlnode.actor.engine import Engine, SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeResult, EpisodeSettings, run_episode
from rlnode.actor.gateway import Gateway
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.config import Config
from rlnode.cubes.base import CubeTask, ToolSpec
from rlnode.cubes.registry import make_cube

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "guess_openai_sdk.py"
DEMO_GAME = {"max_number": 5, "max_turns": 3, "feedback": "range"}
MODES = ("native", "gateway")


class GatewayBenchResult(msgspec.Struct):
    tokens_per_s: float  # gateway, median over rounds
    native_tokens_per_s: float
    ratio: float  # gateway / native tokens/s, median of the paired rounds (goal >= 0.9)
    episodes_per_s: float
    native_episodes_per_s: float
    calls_per_episode: float  # mean LLM calls per episode
    native_calls_per_episode: float
    history_resets: int  # gateway calls that did not extend their episode's history (must be 0)
    episodes_per_round: int
    concurrency: int
    max_tokens: int
    rounds: int
    game: dict
    rounds_tokens_per_s: dict[str, list[float]]


class RoundStats(NamedTuple):
    wall_s: float
    tokens: int
    episodes: int
    calls: int


class Advertised(CubeTask):
    """A task that offers the agent ``tools`` (the native loop renders them
    into the first prompt) and is otherwise the wrapped task."""

    def __init__(self, inner: CubeTask, tools: list[ToolSpec]):
        self.inner, self.ref, self._tools = inner, inner.ref, tools

    async def reset(self):
        return await self.inner.reset()

    def tools(self) -> list[ToolSpec]:
        return self._tools

    async def step(self, action):
        return await self.inner.step(action)

    async def evaluate(self):
        return await self.inner.evaluate()

    async def close(self) -> None:
        await self.inner.close()


def load_example(path: Path = EXAMPLE):
    if not path.is_file():
        raise SystemExit(f"bench gateway: {path} not found (the benchmark plays the repository's example agent)")
    spec = importlib.util.spec_from_file_location("rlnode_bench_guess_openai_sdk", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def game_options(cfg: Config) -> dict:
    return next((dict(c.options) for c in cfg.actor.cubes if c.kind == "guessing"), dict(DEMO_GAME))


async def play_round(play_one: Callable[[int], Awaitable[EpisodeResult]], episodes: int,
                     concurrency: int) -> RoundStats:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> EpisodeResult:
        async with sem:
            return await play_one(i)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(episodes)))
    wall = time.perf_counter() - t0
    tokens = sum(len(s.completion_ids) // 4 for r in results for s in r.samples)  # int32 ids
    return RoundStats(wall, tokens, len(results), sum(len(r.samples) for r in results))


async def compare(client: LLMClient, renderer: ChatRenderer, settings: EpisodeSettings, game: dict, seed: int,
                  episodes: int, concurrency: int, rounds: int, log=print) -> GatewayBenchResult:
    """Both modes on an engine the caller started (tests reuse theirs)."""
    example = load_example()
    tools = [ToolSpec(**example.GUESS_TOOL["function"])]
    native_cube = make_cube("bench", "guessing", game, seed)
    agent_cube = make_cube("bench", "openai-agent", {"agent": f"{EXAMPLE}:play",
                                                     "env": {"kind": "guessing", "options": game}}, seed)
    await native_cube.start(), await agent_cube.start()
    ids = await native_cube.task_ids("train")
    gateway = Gateway(client, renderer, settings, model_name="bench")
    per_mode: dict[str, list[RoundStats]] = {m: [] for m in MODES}
    try:
        async with gateway.serve():
            def player(mode: str, tag: str) -> Callable[[int], Awaitable[EpisodeResult]]:
                async def native(i: int) -> EpisodeResult:
                    task = Advertised(await native_cube.open_task(ids[i % len(ids)]), tools)
                    return await run_episode(client, renderer, task, settings, f"{tag}-{i}", tag)

                async def agent(i: int) -> EpisodeResult:
                    task = await agent_cube.open_task(ids[i % len(ids)])
                    return await run_agent_episode(gateway, task, settings, f"{tag}-{i}", tag)

                return native if mode == "native" else agent

            for mode in MODES:  # warm-up, untimed
                await play_round(player(mode, f"warm-{mode}"), concurrency, concurrency)
            for r in range(rounds):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    st = await play_round(player(mode, f"r{r}-{mode}"), episodes, concurrency)
                    per_mode[mode].append(st)
                    log(f"  {mode:<7} round {r}: {st.episodes} episodes, {st.calls} calls, {st.tokens} tokens "
                        f"in {st.wall_s:.2f}s = {st.tokens / st.wall_s:.0f} tok/s")
    finally:
        await native_cube.close(), await agent_cube.close()
    return _result(per_mode, gateway.stats.history_resets, episodes, concurrency, settings, rounds, game)


def _result(per_mode: dict[str, list[RoundStats]], resets: int, episodes: int, concurrency: int,
            settings: EpisodeSettings, rounds: int, game: dict) -> GatewayBenchResult:
    tok = {m: [s.tokens / s.wall_s for s in v] for m, v in per_mode.items()}
    eps = {m: statistics.median(s.episodes / s.wall_s for s in v) for m, v in per_mode.items()}
    calls = {m: sum(s.calls for s in v) / sum(s.episodes for s in v) for m, v in per_mode.items()}
    return GatewayBenchResult(
        tokens_per_s=statistics.median(tok["gateway"]),
        native_tokens_per_s=statistics.median(tok["native"]),
        ratio=statistics.median(g / n for g, n in zip(tok["gateway"], tok["native"])),
        episodes_per_s=eps["gateway"], native_episodes_per_s=eps["native"],
        calls_per_episode=calls["gateway"], native_calls_per_episode=calls["native"],
        history_resets=resets, episodes_per_round=episodes, concurrency=concurrency,
        max_tokens=settings.sampling.max_tokens, rounds=rounds, game=game, rounds_tokens_per_s=tok,
    )


async def bench_gateway(cfg: Config, concurrency: int, episodes: int, max_tokens: int, rounds: int,
                        log=print) -> GatewayBenchResult:
    from transformers import AutoTokenizer

    s = cfg.actor.sampling
    settings = EpisodeSettings(
        SamplingSettings(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, ignore_eos=True),
        max_turns=cfg.actor.episode.max_turns, max_model_len=cfg.model.max_model_len,
        min_completion_tokens=cfg.actor.episode.min_completion_tokens)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path))
    engine = Engine(0, cfg.model, cfg.actor.engine)
    await engine.start()
    try:
        client = LLMClient([engine], AdmissionRouter(1, concurrency))
        return await compare(client, renderer, settings, game_options(cfg), cfg.run.seed, episodes, concurrency,
                             rounds, log)
    finally:
        await engine.shutdown()


def print_table(res: GatewayBenchResult) -> None:
    g = res.game
    print(f"\ngateway benchmark: {res.episodes_per_round} episodes per round of guessing (1..{g.get('max_number')}, "
          f"{g.get('max_turns')} guesses), concurrency {res.concurrency}, {res.max_tokens} tokens per call, "
          f"median of {res.rounds} rounds")
    print(f"{'path':<36}{'tokens/s':>10}{'episodes/s':>12}{'calls/ep':>10}{'vs native':>11}")
    rows = [("native agent loop (run_episode)", res.native_tokens_per_s, res.native_episodes_per_s,
             res.native_calls_per_episode, 1.0),
            ("openai-SDK agent via the gateway", res.tokens_per_s, res.episodes_per_s, res.calls_per_episode,
             res.tokens_per_s / res.native_tokens_per_s)]
    for name, tps, eps, calls, rel in rows:
        print(f"{name:<36}{tps:>10.0f}{eps:>12.2f}{calls:>10.2f}{rel:>11.3f}")
    print(f"ratio gateway/native = {res.ratio:.3f} (goal >= 0.9, median of paired rounds)   "
          f"history resets = {res.history_resets}")
