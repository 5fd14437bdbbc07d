"""``rlnode bench gateway``: what training an agent through the gateway costs.

The same game played two ways on one engine, in one run:

  (a) native:  rlnode's own agent loop (``run_episode``) calling the
      LLMClient in-process;
  (b) gateway: an example agent (``play``, run by ``run_agent_episode``)
      that reaches the policy over HTTP through the gateway: JSON requests,
      history matching, the template tokens of new messages, one SDK client
      and one httpx client per episode, each guess posted to the env URL.
      ``--protocol`` picks the API it speaks: ``chat`` (the ``openai`` SDK,
      ``examples/guess_openai_sdk.py``, the default), ``responses`` (the
      ``openai`` SDK's Responses API, ``guess_responses_sdk.py``),
      ``messages`` (the ``anthropic`` SDK, ``guess_anthropic_sdk.py``) or
      ``completions`` (a raw transcript, ``guess_completions.py``; the
      native loop then offers no tool either).

Same model, cube (``guessing``: the config's guessing options, else the
demo's), task ids, sampling and episode concurrency. The native task
advertises the agent's ``guess`` tool, so both render the same first prompt
(tool block included) and differ only in the path a completion takes. Every
call generates exactly ``max_tokens`` (ignore_eos) so tokens/s compare; how
many calls an episode takes still depends on when a guess hits (reported).
Modes alternate round by round so drift on a shared host hits both alike;
the ratio is the median of the per-round ratios gateway / native.

Where the time goes, per LLM call: the CPU of the daemon's process (the
engine client, the agent loop or the gateway's HTTP serving, history
matching and tokenizing), of the agent's worker processes (the agent's own
code: the openai SDK building and parsing requests) and of the engine's
processes is measured per round (process CPU time). ``overhead_ms_per_call``
is the daemon CPU a gateway call costs beyond a native one: the gateway's
own price. The agent's CPU is the user's program, which the native loop
does not run; on a host with cores to spare it runs beside the engine, on a
2-core host it competes with it (and the ratio shows that). The daemon's CPU
is also split: its event-loop thread (``loop_ms_per_call``: the HTTP
serving, history matching, tokenizing, the agent loop; one core at most, so
1000 / loop ms is the most calls/s one daemon can serve) and its other
threads (the rest of ``daemon_ms_per_call``: vLLM's client threads, the
thread pool).

Gateway capacity (``--engine null``): the same run on a ``NullEngine``
(``null_engine.py``), which answers every request at once with
``max_tokens`` tokens (the guessing game's numbers, padded) and no model.
The engine then costs nothing and the figures are the gateway's own:
``calls_per_s`` is what one node carries through it (given the cores left
to the agents), the CPU ms per call of each process where it goes.

``--gateway-host process`` (``actor.gateway_host``): the gateway's HTTP side
and text work run in a host process of their own; ``host_ms_per_call`` is
its CPU, the daemon's (and its loop thread's) what is left in the daemon.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import statistics
import time
from pathlib import Path
from typing import Awaitable, Callable

import msgspec

from rlnode.actor.agent_episode import run_agent_episode
from rlnode.actor.engine import Engine, SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeResult, EpisodeSettings, make_renderer, run_episode
from rlnode.actor.gateway import Gateway, HostedGateway
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.bench.null_engine import NullEngine, guess_replies, space_id, uniform_logprob
from rlnode.config import Config, ModelConfig
from rlnode.cubes.base import CubeTask, ToolSpec
from rlnode.cubes.registry import make_cube

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "guess_openai_sdk.py"
# The example agent that plays the game through each API the gateway speaks
# (--protocol): the same game and tool, the API its SDK speaks.
PROTOCOL_AGENTS = {"chat": "guess_openai_sdk.py", "responses": "guess_responses_sdk.py",
                   "messages": "guess_anthropic_sdk.py", "completions": "guess_completions.py"}
DEMO_GAME = {"max_number": 5, "max_turns": 3, "feedback": "range"}
MODES = ("native", "gateway")
ENGINES = ("vllm", "null")


class GatewayBenchResult(msgspec.Struct):
    tokens_per_s: float  # gateway, median over rounds
    native_tokens_per_s: float
    ratio: float  # gateway / native tokens/s, median of the paired rounds (goal >= 0.9)
    episodes_per_s: float
    native_episodes_per_s: float
    calls_per_episode: float  # mean LLM calls per episode
    native_calls_per_episode: float
    history_resets: int  # gateway calls that did not extend their episode's history (must be 0)
    daemon_ms_per_call: dict[str, float]  # per mode: daemon process CPU per LLM call (median of rounds)
    agent_ms_per_call: float  # the agent's worker processes, CPU per gateway call
    engine_ms_per_call: dict[str, float]  # per mode: the engine's processes, CPU per call
    overhead_ms_per_call: float  # daemon CPU of a gateway call beyond a native one: the gateway's own cost
    episodes_per_round: int
    concurrency: int
    max_tokens: int
    rounds: int
    game: dict
    rounds_tokens_per_s: dict[str, list[float]]
    raw_rounds: dict[str, list[RoundStats]] = {}
    calls_per_s: float = 0.0  # gateway LLM calls per second, median over rounds
    native_calls_per_s: float = 0.0
    loop_ms_per_call: dict[str, float] = {}  # per mode: the daemon's event-loop thread, CPU per call
    engine: str = "vllm"  # "vllm" | "null" (NullEngine: the gateway's capacity)
    gateway_calls: int = 0  # chat completions the gateway answered, warm-up rounds included
    gateway_host: str = "inline"  # actor.gateway_host: "inline" | "process"
    host_ms_per_call: float = 0.0  # the gateway host processes, CPU per gateway call (process only)
    gateway_hosts: int = 0  # actor.gateway_hosts (process only)
    protocol: str = "chat"  # the API the agent speaks (PROTOCOL_AGENTS)


class RoundStats(msgspec.Struct, array_like=True):
    wall_s: float
    tokens: int
    episodes: int
    calls: int
    daemon_cpu_s: float = 0.0  # this process, all threads (event loop, HTTP, tokenizer, engine client)
    agent_cpu_s: float = 0.0  # the agent's worker processes
    engine_cpu_s: float = 0.0  # the engine's processes (core and workers)
    loop_cpu_s: float = 0.0  # of daemon_cpu_s: the event-loop thread
    host_cpu_s: float = 0.0  # the gateway host process (actor.gateway_host = "process")


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


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) of live processes ``pids``, from /proc."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _descendants(roots: list[int]) -> list[int]:
    """The live descendants of processes ``roots`` (not the roots), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], list(roots)
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _engine_pids() -> list[int]:
    """This process's descendants that are not agent workers: the engine."""
    return _descendants([os.getpid()])


async def play_round(play_one: Callable[[int], Awaitable[EpisodeResult]], episodes: int,
                     concurrency: int, agent_pids: Callable[[], list[int]] = lambda: [],
                     engine_pids: Callable[[], list[int]] = _engine_pids,
                     host_pids: Callable[[], list[int]] = lambda: []) -> RoundStats:
    """One round; runs on (and so measures) the daemon's event-loop thread."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> EpisodeResult:
        async with sem:
            return await play_one(i)

    # A worker's whole tree: a sandboxed one is its sandbox (bwrap) with the
    # interpreter inside it.
    roots = agent_pids()
    agents = set(roots) | set(_descendants(roots))
    hosts = host_pids()
    engine = [p for p in engine_pids() if p not in agents and p not in hosts]
    cpu0 = (time.process_time(), _cpu_s(agents), _cpu_s(engine), time.thread_time(), _cpu_s(hosts))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(episodes)))
    wall = time.perf_counter() - t0
    cpu1 = (time.process_time(), _cpu_s(agents), _cpu_s(engine), time.thread_time(), _cpu_s(hosts))
    tokens = sum(len(s.completion_ids) // 4 for r in results for s in r.samples)  # int32 ids
    return RoundStats(wall, tokens, len(results), sum(len(r.samples) for r in results),
                      *(b - a for a, b in zip(cpu0, cpu1)))


async def compare(client: LLMClient, renderer: ChatRenderer, settings: EpisodeSettings, game: dict, seed: int,
                  episodes: int, concurrency: int, rounds: int, log=print, engine: str = "vllm",
                  agent_workers: int = 2, isolation: str = "bwrap", gateway_host: str = "inline",
                  model: ModelConfig | None = None, gateway_hosts: int = 1,
                  protocol: str = "chat") -> GatewayBenchResult:
    """Both modes on an engine the caller started (tests reuse theirs).
    ``engine``: what ``client`` runs on, "vllm" (its processes are this
    process's children) or "null" (no processes: engine CPU is 0).
    ``gateway_host``: "inline" or "process" (then ``model``: the host's
    tokenizer, template and parsers, those ``renderer`` was made with;
    ``gateway_hosts`` of them). ``protocol``: the API of the agent played
    through the gateway; the native loop offers the same tool (none for
    "completions", whose agent writes a raw transcript)."""
    example = load_example()
    tools = [] if protocol == "completions" else [ToolSpec(**example.GUESS_TOOL["function"])]
    agent_path = EXAMPLES / PROTOCOL_AGENTS[protocol]
    engine_pids = _engine_pids if engine == "vllm" else (lambda: [])
    native_cube = make_cube("bench", "guessing", game, seed)
    agent_cube = make_cube("bench", "openai-agent", {"agent": f"{agent_path}:play", "workers": agent_workers,
                                                     "env": {"kind": "guessing", "options": game},
                                                     "isolation": isolation}, seed)
    await native_cube.start(), await agent_cube.start()
    ids = await native_cube.task_ids("train")
    if gateway_host == "process":
        gateway = HostedGateway(client, model, settings, model_name="bench", hosts=gateway_hosts)
    else:
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

            def agent_pids() -> list[int]:
                return [w.proc.pid for w in agent_cube.workers.workers]

            def host_pids() -> list[int]:
                return list(gateway.host_pids) if gateway_host == "process" else []

            for mode in MODES:  # warm-up, untimed
                await play_round(player(mode, f"warm-{mode}"), concurrency, concurrency, engine_pids=engine_pids)
            for r in range(rounds):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    st = await play_round(player(mode, f"r{r}-{mode}"), episodes, concurrency, agent_pids,
                                          engine_pids, host_pids)
                    per_mode[mode].append(st)
                    log(f"  {mode:<7} round {r}: {st.episodes} episodes, {st.calls} calls, {st.tokens} tokens "
                        f"in {st.wall_s:.2f}s = {st.calls / st.wall_s:.0f} calls/s, {st.tokens / st.wall_s:.0f} "
                        f"tok/s; CPU ms/call: daemon {1e3 * st.daemon_cpu_s / st.calls:.2f} (loop thread "
                        f"{1e3 * st.loop_cpu_s / st.calls:.2f}), host {1e3 * st.host_cpu_s / st.calls:.2f}, "
                        f"agent {1e3 * st.agent_cpu_s / st.calls:.2f}, "
                        f"engine {1e3 * st.engine_cpu_s / st.calls:.2f}")
    finally:
        await native_cube.close(), await agent_cube.close()
    res = _result(per_mode, gateway.stats.history_resets, episodes, concurrency, settings, rounds, game, engine)
    res.gateway_calls = gateway.stats.calls
    res.protocol = protocol
    res.gateway_host = gateway_host
    res.gateway_hosts = gateway_hosts if gateway_host == "process" else 0
    res.host_ms_per_call = statistics.median(1e3 * s.host_cpu_s / s.calls for s in per_mode["gateway"])
    return res


def _result(per_mode: dict[str, list[RoundStats]], resets: int, episodes: int, concurrency: int,
            settings: EpisodeSettings, rounds: int, game: dict, engine_kind: str = "vllm") -> GatewayBenchResult:
    tok = {m: [s.tokens / s.wall_s for s in v] for m, v in per_mode.items()}
    cps = {m: statistics.median(s.calls / s.wall_s for s in v) for m, v in per_mode.items()}
    loop = {m: statistics.median(1e3 * s.loop_cpu_s / s.calls for s in v) for m, v in per_mode.items()}
    eps = {m: statistics.median(s.episodes / s.wall_s for s in v) for m, v in per_mode.items()}
    calls = {m: sum(s.calls for s in v) / sum(s.episodes for s in v) for m, v in per_mode.items()}
    daemon = {m: statistics.median(1e3 * s.daemon_cpu_s / s.calls for s in v) for m, v in per_mode.items()}
    engine = {m: statistics.median(1e3 * s.engine_cpu_s / s.calls for s in v) for m, v in per_mode.items()}
    return GatewayBenchResult(
        tokens_per_s=statistics.median(tok["gateway"]),
        native_tokens_per_s=statistics.median(tok["native"]),
        ratio=statistics.median(g / n for g, n in zip(tok["gateway"], tok["native"])),
        episodes_per_s=eps["gateway"], native_episodes_per_s=eps["native"],
        calls_per_episode=calls["gateway"], native_calls_per_episode=calls["native"],
        history_resets=resets, daemon_ms_per_call=daemon,
        agent_ms_per_call=statistics.median(1e3 * s.agent_cpu_s / s.calls for s in per_mode["gateway"]),
        engine_ms_per_call=engine, overhead_ms_per_call=daemon["gateway"] - daemon["native"],
        episodes_per_round=episodes, concurrency=concurrency,
        max_tokens=settings.sampling.max_tokens, rounds=rounds, game=game, rounds_tokens_per_s=tok,
        raw_rounds=per_mode, calls_per_s=cps["gateway"], native_calls_per_s=cps["native"], loop_ms_per_call=loop,
        engine=engine_kind,
    )


def null_engine(renderer: ChatRenderer, game: dict) -> NullEngine:
    """A NullEngine that answers the guessing game's numbers in turn (padded
    with spaces to max_tokens), so episodes play as with a model."""
    tok = renderer.tok
    return NullEngine(0, guess_replies(tok, int(game.get("max_number", DEMO_GAME["max_number"]))), space_id(tok),
                      renderer.eos_id, uniform_logprob(len(tok)))


async def bench_gateway(cfg: Config, concurrency: int, episodes: int, max_tokens: int, rounds: int,
                        log=print, engine: str = "vllm", isolation: str = "bwrap",
                        gateway_host: str | None = None, gateway_hosts: int = 0,
                        protocol: str = "chat") -> GatewayBenchResult:
    """``engine``: "vllm" (the configured engine) or "null" (``NullEngine``:
    the gateway's own capacity). ``isolation``: the agent cube's.
    ``gateway_host``: "inline" | "process"; None: ``actor.gateway_host``.
    ``gateway_hosts``: host processes (0: ``actor.gateway_hosts``)."""
    from transformers import AutoTokenizer

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    s = cfg.actor.sampling
    settings = EpisodeSettings(
        SamplingSettings(max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, ignore_eos=True),
        max_turns=cfg.actor.episode.max_turns, max_model_len=cfg.model.max_model_len,
        min_completion_tokens=cfg.actor.episode.min_completion_tokens)
    renderer = make_renderer(AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path), cfg.model)
    game = game_options(cfg)
    eng = Engine(0, cfg.model, cfg.actor.engine) if engine == "vllm" else null_engine(renderer, game)
    await eng.start()
    try:
        client = LLMClient([eng], AdmissionRouter(1, concurrency))
        return await compare(client, renderer, settings, game, cfg.run.seed, episodes, concurrency, rounds, log,
                             engine=engine, isolation=isolation, gateway_host=gateway_host or cfg.actor.gateway_host,
                             model=cfg.model, gateway_hosts=gateway_hosts or cfg.actor.gateway_hosts,
                             protocol=protocol)
    finally:
        await eng.shutdown()


def print_table(res: GatewayBenchResult) -> None:
    g = res.game
    engine = "vLLM engine" if res.engine == "vllm" else "null engine (no model: the gateway's own capacity)"
    print(f"\ngateway benchmark on the {engine}: {res.episodes_per_round} episodes per round of guessing "
          f"(1..{g.get('max_number')}, {g.get('max_turns')} guesses), concurrency {res.concurrency}, "
          f"{res.max_tokens} tokens per call, median of {res.rounds} rounds")
    print(f"{'path':<36}{'calls/s':>10}{'tokens/s':>10}{'episodes/s':>12}{'calls/ep':>10}{'vs native':>11}")
    rows = [("native agent loop (run_episode)", res.native_calls_per_s, res.native_tokens_per_s,
             res.native_episodes_per_s, res.native_calls_per_episode, 1.0),
            (f"{res.protocol} agent via the gateway", res.calls_per_s, res.tokens_per_s, res.episodes_per_s,
             res.calls_per_episode, res.tokens_per_s / res.native_tokens_per_s)]
    for name, cps, tps, eps, calls, rel in rows:
        print(f"{name:<36}{cps:>10.0f}{tps:>10.0f}{eps:>12.2f}{calls:>10.2f}{rel:>11.3f}")
    print(f"ratio gateway/native = {res.ratio:.3f} (goal >= 0.9, median of paired rounds)   "
          f"history resets = {res.history_resets}")
    d, e, lp = res.daemon_ms_per_call, res.engine_ms_per_call, res.loop_ms_per_call
    eng = (f"engine {e['native']:.2f} native / {e['gateway']:.2f} gateway" if res.engine == "vllm"
           else "engine none (null)")
    print(f"CPU ms per LLM call: daemon {d['native']:.2f} native / {d['gateway']:.2f} gateway "
          f"(gateway overhead {res.overhead_ms_per_call:+.2f}); of which its event-loop thread "
          f"{lp.get('native', 0.0):.2f} native / {lp.get('gateway', 0.0):.2f} gateway; "
          f"agent processes {res.agent_ms_per_call:.2f}; {eng}")
    if res.gateway_host == "process":
        print(f"gateway host process (actor.gateway_host = \"process\"): {res.host_ms_per_call:.2f} ms per call")
    if lp.get("gateway"):
        print(f"one daemon event loop serves at most {1e3 / lp['gateway']:.0f} gateway calls/s "
              f"(1000 / loop ms per call)")
