"""``rlnode bench router``: what the in-process admission path costs.

Three ways to run the same requests (same model, prompts, sampling, seeds,
concurrency), measured in one run:

  (a) rlnode: AdmissionRouter lease + Engine wrapper (the path episodes use);
  (b) direct: ``AsyncLLM.generate`` on the same engine, a plain semaphore;
  (c) http:   ``vllm serve`` (OpenAI-compatible server, same engine args) hit
      through aiohttp with token-id prompts, the way PipelineRL and prime-rl
      reach their engines.

(a) and (b) alternate round by round on one engine so drift on a shared host
hits both alike; (c) runs afterwards on its own server (the in-process engine
is shut down first: two engines on one small host would fight for cores).
Every request generates exactly ``max_tokens`` (ignore_eos) so tokens/s is
comparable; prefix caching is off so later rounds get no free hits.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import msgspec

from rlnode.actor.engine import Engine, SamplingSettings, build_engine_args, cpu_env, resolve_device
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.config import Config


class RouterBenchResult(msgspec.Struct):
    tokens_per_s: float
    direct_tokens_per_s: float
    http_tokens_per_s: float
    ratio_vs_direct: float
    ratio_vs_http: float
    concurrency: int
    requests_per_round: int
    max_tokens: int
    rounds: int
    router_max_in_flight: int
    lease_wait_p50_s: float
    rounds_tokens_per_s: dict[str, list[float]]


def make_prompts(n: int, seed: int, vocab_lo: int = 40, vocab_hi: int = 120, length: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_lo, vocab_hi) for _ in range(length)] for _ in range(n)]


async def _round_router(client: LLMClient, prompts, sampling_for) -> tuple[float, int]:
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(client.generate(p, sampling_for(i)) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return wall, sum(len(g.completion.token_ids) for g in gens)


async def _round_direct(engine: Engine, prompts, sampling_for, concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    llm = engine.llm

    async def one(i: int, p: list[int]) -> int:
        params = engine.sampling_params(sampling_for(i))
        async with sem:
            final = None
            async for out in llm.generate({"prompt_token_ids": p}, params, f"direct-{i}-{time.monotonic_ns()}"):
                final = out
        return len(final.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, sum(counts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(cfg: Config, port: int) -> list[str]:
    """``vllm serve`` with the settings build_engine_args gives our engine."""
    a = build_engine_args(cfg.model, cfg.actor.engine)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model,
        "--host", "127.0.0.1", "--port", str(port),
        "--tokenizer", a.tokenizer, "--dtype", a.dtype,
        "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
        "--seed", str(a.seed), "--logprobs-mode", a.logprobs_mode,
        "--disable-log-stats", "--served-model-name", "bench",
    ]
    cmd.append("--enable-prefix-caching" if a.enable_prefix_caching else "--no-enable-prefix-caching")
    if a.enforce_eager:
        cmd.append("--enforce-eager")
    if a.enable_chunked_prefill is False:  # CPU engines prefill whole prompts (build_engine_args says why)
        cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if resolve_device(cfg.actor.engine.device) == "cuda":
        cmd += ["--gpu-memory-utilization", str(a.gpu_memory_utilization),
                "--tensor-parallel-size", str(a.tensor_parallel_size)]
    return cmd


async def _wait_healthy(session, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} (see its log)")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"vllm serve not healthy after {timeout_s}s")


async def _round_http(session, url: str, prompts, sampling_for, concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, p: list[int]) -> int:
        s = sampling_for(i)
        body = {
            "model": "bench", "prompt": p, "max_tokens": s.max_tokens,
            "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
            "ignore_eos": s.ignore_eos, "logprobs": 0, "return_tokens_as_token_ids": True,
        }
        async with sem:
            async with session.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                data = await r.json()
        return data["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, sum(counts)


async def _bench_http(cfg: Config, prompts, sampling_for, concurrency: int, rounds: int, log) -> list[float]:
    import aiohttp

    port = _free_port()
    env = dict(os.environ)
    if resolve_device(cfg.actor.engine.device) == "cpu":
        env = {**cpu_env(cfg.actor.engine), **env}
    serve_log = open(os.path.join(cfg.run.run_dir, "bench-vllm-serve.log"), "w")
    proc = subprocess.Popen(serve_command(cfg, port), stdout=serve_log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    log(f"  http: started vllm serve (log: {serve_log.name})")
    url = f"http://127.0.0.1:{port}"
    rates: list[float] = []
    try:
        conn = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
            await _wait_healthy(session, url, proc, timeout_s=300)
            await _round_http(session, url, prompts[:concurrency], sampling_for, concurrency)  # warm-up
            for r in range(rounds):
                wall, toks = await _round_http(session, url, prompts, sampling_for, concurrency)
                rates.append(toks / wall)
                log(f"  http   round {r}: {toks} tokens in {wall:.2f}s = {toks / wall:.0f} tok/s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        serve_log.close()
    return rates


async def bench_router(cfg: Config, concurrency: int, requests: int, max_tokens: int,
                       rounds: int, log=print) -> RouterBenchResult:
    cfg.actor.engine.enable_prefix_caching = False
    os.makedirs(cfg.run.run_dir, exist_ok=True)
    prompts = make_prompts(requests, seed=cfg.run.seed)

    def sampling_for(i: int) -> SamplingSettings:
        return SamplingSettings(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)

    engine = Engine(0, cfg.model, cfg.actor.engine)
    await engine.start()
    router = AdmissionRouter(1, concurrency)
    client = LLMClient([engine], router)
    per_mode: dict[str, list[float]] = {"rlnode": [], "direct": [], "http": []}
    try:
        # Warm-up: both paths once, untimed.
        await _round_direct(engine, prompts[:concurrency], sampling_for, concurrency)
        await _round_router(client, prompts[:concurrency], sampling_for)
        for r in range(rounds):
            order = ("rlnode", "direct") if r % 2 == 0 else ("direct", "rlnode")
            for mode in order:
                if mode == "rlnode":
                    wall, toks = await _round_router(client, prompts, sampling_for)
                else:
                    wall, toks = await _round_direct(engine, prompts, sampling_for, concurrency)
                per_mode[mode].append(toks / wall)
                log(f"  {mode:<6} round {r}: {toks} tokens in {wall:.2f}s = {toks / wall:.0f} tok/s")
    finally:
        await engine.shutdown()
    per_mode["http"] = await _bench_http(cfg, prompts, sampling_for, concurrency, rounds, log)

    med = {k: statistics.median(v) for k, v in per_mode.items()}
    stats = router.stats()
    return RouterBenchResult(
        tokens_per_s=med["rlnode"],
        direct_tokens_per_s=med["direct"],
        http_tokens_per_s=med["http"],
        # Paired: each rlnode round against the direct round next to it, so
        # slow drift of a shared host cancels out; then the median.
        ratio_vs_direct=statistics.median(a / b for a, b in zip(per_mode["rlnode"], per_mode["direct"])),
        ratio_vs_http=med["rlnode"] / med["http"],
        concurrency=concurrency,
        requests_per_round=requests,
        max_tokens=max_tokens,
        rounds=rounds,
        router_max_in_flight=engine.max_in_flight,
        lease_wait_p50_s=stats.wait_s_p50,
        rounds_tokens_per_s=per_mode,
    )


def print_table(res: RouterBenchResult) -> None:
    rows = [
        ("rlnode (router + engine)", res.tokens_per_s, 1.0),
        ("direct AsyncLLM.generate", res.direct_tokens_per_s, res.direct_tokens_per_s / res.tokens_per_s),
        ("vllm serve over HTTP", res.http_tokens_per_s, res.http_tokens_per_s / res.tokens_per_s),
    ]
    print(f"\nrouter benchmark: {res.requests_per_round} requests x {res.max_tokens} tokens, "
          f"concurrency {res.concurrency}, median of {res.rounds} rounds")
    print(f"{'path':<28}{'tokens/s':>12}{'vs rlnode':>12}")
    for name, rate, rel in rows:
        print(f"{name:<28}{rate:>12.0f}{rel:>12.3f}")
    print(f"ratio_vs_direct = {res.ratio_vs_direct:.3f}   ratio_vs_http = {res.ratio_vs_http:.3f}   "
          f"max in flight on the engine = {res.router_max_in_flight}")
