"""``rlnode bench weights``: what an in-flight weight update costs, and
whether the engine serves the new weights exactly afterwards.

One run, one model:

  (a) rlnode: trainer (rank 0, a thread of this process) -> stateless gloo
      group -> engine worker (receive into staging while generating, then
      pause(keep) -> layerwise reload -> resume), with ``in_flight`` streaming
      requests decoding across every update;
  (b) raw: the same buckets (same byte sizes, same count) broadcast over a
      bare gloo group between two threads, no engine: the transport floor.

Reported: update_s (trainer starts -> engine resumed and trainer done),
raw_broadcast_s, overhead_ratio = update_s / raw_broadcast_s,
generation_stall_s (pause requested -> resume returned in the engine), the
largest gap between streamed tokens of the in-flight requests during the
update (what a client actually saw) next to the usual gap, and
max_abs_logprob_diff_after_update (engine vs transformers on the updated
fp32 weights). Medians over ``rounds`` updates.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from rlnode.actor.engine import Engine, SamplingSettings
from rlnode.actor.weight_receiver import (
    EXTENSION,
    apply_weight_update,
    engine_num_ranks,
    join_group,
)
from rlnode.config import EngineConfig, ModelConfig, WeightSyncConfig
from rlnode.rendezvous import new_secret
from rlnode.trainer.weights import WeightBroadcaster, update_tensors
from rlnode.weight_plan import GroupMember, GroupSpec, WeightComm, WeightUpdatePlan, keep_stdout

# (layers, hidden) of the models the benchmark can build for itself.
BENCH_SIZES = {"tiny": (2, 128), "100m": (20, 768)}


class WeightsBenchResult(msgspec.Struct):
    model: str
    params: int
    nbytes: int
    buckets: int
    rounds: int
    update_s: float
    raw_broadcast_s: float
    overhead_ratio: float
    receive_s: float  # engine side: vote + transfer into staging (generation continues)
    load_s: float  # engine side: layerwise reload while paused
    generation_stall_s: float  # pause requested -> resume returned
    max_token_gap_s: float  # largest gap between streamed tokens during an update
    usual_token_gap_s: float  # median gap between streamed tokens
    max_abs_logprob_diff_after_update: float
    rounds_update_s: list[float]


def build_bench_model(size: str, out_dir: str | None = None) -> str:
    """A model of ``size`` (a BENCH_SIZES key), built once into out_dir."""
    from rlnode.tiny_model import build_tiny_model

    layers, hidden = BENCH_SIZES[size]
    out = Path(out_dir or tempfile.mkdtemp(prefix=f"rlnode-bench-{size}-"))
    if not (out / "config.json").exists():
        build_tiny_model(out, layers=layers, hidden=hidden, seed=0)
    return str(out)


def raw_broadcast_s(plan: WeightUpdatePlan, repeats: int = 3) -> float:
    """Median time for ``plan``'s bucket sizes over a bare gloo group
    between two threads (rank 0 sends, rank 1 receives)."""
    import socket

    import torch

    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.bind(("127.0.0.1", 0))  # the kernel picks a free port
    listen.listen()
    spec = GroupSpec(0, "127.0.0.1", listen.getsockname()[1], 2, "gloo", (GroupMember("raw", 1),), 60.0,
                     secret=new_secret())
    comms: list = [None, None]

    def join(rank: int) -> None:
        comms[rank] = WeightComm(spec, rank, "cpu", listen_socket=listen if rank == 0 else None)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    with keep_stdout():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    sizes = [b.nbytes for b in plan.buckets]
    send = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    recv = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    times = []
    for _ in range(repeats):
        receiver = threading.Thread(target=lambda: [comms[1].broadcast(b) for b in recv])
        t0 = time.perf_counter()
        receiver.start()
        for b in send:
            comms[0].broadcast(b)
        receiver.join()
        times.append(time.perf_counter() - t0)
    for c in comms:
        c.close()
    return statistics.median(times)


async def _stream(engine: Engine, prompt: list[int], max_tokens: int, seed: int, stamps: list[float]) -> None:
    """One in-flight request; appends the arrival time of every token."""
    from vllm.sampling_params import RequestOutputKind

    params = engine.sampling_params(SamplingSettings(max_tokens=max_tokens, seed=seed, ignore_eos=True))
    params.output_kind = RequestOutputKind.DELTA
    rid = f"bench-weights-{seed}-{time.monotonic_ns()}"
    try:
        async for out in engine.llm.generate({"prompt_token_ids": prompt}, params, rid):
            stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    except asyncio.CancelledError:
        await asyncio.shield(engine.llm.abort(rid))
        raise


def _gaps(stamps: list[float], lo: float, hi: float) -> tuple[list[float], list[float]]:
    """Gaps between consecutive distinct arrivals: (touching [lo, hi], all)."""
    times = sorted(set(stamps))
    pairs = list(zip(times, times[1:]))
    return [b - a for a, b in pairs if b >= lo and a <= hi], [b - a for a, b in pairs]


async def _one_update(engine, bc, hf, version, prompts, warm_s: float):
    """Perturb the trainer's weights, start streaming requests, update while
    they decode. Returns (wall s, UpdateTimings, plan, max gap during the
    update s, all gaps s)."""
    import torch

    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    stamps: list[list[float]] = [[] for _ in prompts]
    streams = [asyncio.create_task(_stream(engine, p, 4000, i, s)) for i, (p, s) in enumerate(zip(prompts, stamps))]
    try:
        await asyncio.sleep(warm_s)
        tensors = update_tensors(hf)
        plan = bc.plan(tensors, version)
        t0 = time.perf_counter()
        _, timings = await asyncio.gather(bc.broadcast_async(plan, tensors), apply_weight_update(engine, plan))
        t1 = time.perf_counter()
        await asyncio.sleep(warm_s)
    finally:
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    during, every = [], []
    for s in stamps:
        d, e = _gaps(s, t0, t1)
        during += d
        every += e
    return t1 - t0, timings, plan, max(during, default=0.0), every


async def _logprob_diff(engine: Engine, hf, prompts: list[list[int]]) -> float:
    import torch

    outs = await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=16, seed=i, ignore_eos=True))
                                  for i, p in enumerate(prompts)))
    worst = 0.0
    for p, c in zip(prompts, outs):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


async def bench_weights(model_path: str, *, engine_cfg: EngineConfig | None = None,
                        sync_cfg: WeightSyncConfig | None = None, rounds: int = 5, in_flight: int = 8,
                        warm_s: float = 0.5, log=print) -> WeightsBenchResult:
    """Run ``rounds`` in-flight updates of ``model_path`` on a fresh engine."""
    import torch
    from transformers import AutoModelForCausalLM

    engine_cfg = engine_cfg or EngineConfig(device="cpu", enforce_eager=True, max_num_seqs=64)
    sync_cfg = sync_cfg or WeightSyncConfig(backend="gloo", base_port=random.randrange(30000, 60000))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    params = sum(p.numel() for _, p in update_tensors(hf))
    log(f"model {model_path}: {params / 1e6:.1f}M parameters; starting the engine")
    engine = Engine(0, ModelConfig(path=model_path, max_model_len=4096), engine_cfg, worker_extension_cls=EXTENSION)
    await engine.start()
    bc = WeightBroadcaster(sync_cfg, master_host="127.0.0.1", timeout_s=120)
    try:
        spec = bc.new_epoch([("bench/0", engine_num_ranks(engine))])
        await asyncio.gather(bc.open_group_async(spec), join_group(engine, spec, first_rank=1))
        rng = random.Random(0)
        prompts = [[rng.randrange(40, 200) for _ in range(32)] for _ in range(in_flight)]
        # Warm-up: first batches of a new size build CPU kernels (seconds),
        # which would otherwise land inside the first timed update.
        await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=64, seed=i, ignore_eos=True))
                               for i, p in enumerate(prompts)))
        runs = []
        for version in range(1, rounds + 1):
            runs.append(await _one_update(engine, bc, hf, version, prompts, warm_s))
            log(f"update {version}: {runs[-1][0]:.3f} s (stall {runs[-1][1].stalled_s:.3f} s)")
        diff = await _logprob_diff(engine, hf, prompts[:4])
    finally:
        bc.close_group()
        await engine.shutdown()
    plan = runs[-1][2]
    raw = raw_broadcast_s(plan)
    update_s = statistics.median(r[0] for r in runs)

    def med(field: str) -> float:
        return statistics.median(getattr(r[1], field) for r in runs)

    return WeightsBenchResult(
        model=model_path, params=params, nbytes=plan.nbytes, buckets=len(plan.buckets), rounds=rounds,
        update_s=update_s, raw_broadcast_s=raw, overhead_ratio=update_s / raw,
        receive_s=med("receive_s"), load_s=med("load_s"), generation_stall_s=med("stalled_s"),
        max_token_gap_s=statistics.median(r[3] for r in runs),
        usual_token_gap_s=statistics.median([g for r in runs for g in r[4]] or [0.0]),
        max_abs_logprob_diff_after_update=diff, rounds_update_s=[round(r[0], 4) for r in runs])


def print_table(res: WeightsBenchResult) -> None:
    print(f"\nweight update benchmark: {res.model}")
    print(f"  {res.params / 1e6:.1f}M params, {res.nbytes / 2**20:.1f} MiB in {res.buckets} bucket(s), "
          f"median of {res.rounds} updates with requests in flight")
    rows = [
        ("update (trainer -> engine resumed)", res.update_s),
        ("  engine: receive into staging", res.receive_s),
        ("  engine: load while paused", res.load_s),
        ("raw gloo broadcast, same buckets", res.raw_broadcast_s),
        ("generation stall (pause -> resume)", res.generation_stall_s),
        ("max token gap during update", res.max_token_gap_s),
        ("usual token gap", res.usual_token_gap_s),
    ]
    for name, value in rows:
        print(f"  {name:<38}{value:>10.4f} s")
    print(f"  overhead_ratio = {res.overhead_ratio:.2f}   "
          f"max |logprob engine - transformers| after update = {res.max_abs_logprob_diff_after_update:.2e}")


if __name__ == "__main__":  # python -m rlnode.bench.weights [tiny|100m|PATH ...]
    import sys

    for arg in sys.argv[1:] or ["tiny", "100m"]:
        path = build_bench_model(arg) if arg in BENCH_SIZES else arg
        print_table(asyncio.run(bench_weights(path)))
