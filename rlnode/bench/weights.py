"""``rlnode bench weights``: what an in-flight weight update costs, and
whether the engine serves the new weights exactly afterwards.

What users run: the engine from ``actor.engine`` and ``model``, the trainer
(rank 0, a thread of this process) on ``trainer.device`` at
``trainer.precision``, the transport from ``trainer.weights`` or
``--backend`` (its "auto" decided as the trainer decides it). Without
``--config``: the defaults, with a quick eager engine (``BENCH_DEFAULTS``).
A backend this host cannot run is refused before anything starts
(``backend_refusal``).

One run, one model:

  (a) rlnode: trainer -> stateless group -> engine worker (receive while
      generating, then pause(keep) -> layerwise reload -> resume), with
      ``in_flight`` streaming requests decoding across every update;
  (b) raw: the same buckets (same byte sizes, same count) broadcast over a
      bare gloo group between two threads in CPU memory, no engine: the
      floor of the CPU transport, a reference for the others.

Reported: update_s (trainer starts -> engine resumed and trainer done),
raw_broadcast_s, overhead_ratio = update_s / raw_broadcast_s,
generation_stall_s (pause requested -> resume returned in the engine), the
largest gap between streamed tokens of the in-flight requests during the
update (what a client actually saw) next to the usual gap, and
max_abs_logprob_diff_before_update / _after_update (engine vs transformers
on the weights read from disk, then on the updated weights). Medians over
``rounds`` updates.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from rlnode.actor.engine import Engine, SamplingSettings, engine_gpu_assignment, resolve_device
from rlnode.actor.weight_receiver import (
    EXTENSION,
    UpdateTimings,
    apply_weight_update,
    engine_num_ranks,
    join_group,
)
from rlnode.config import VLLM_LORA_RANKS, Config, EngineConfig, LoraConfig, load_config
from rlnode.weights.rendezvous import new_secret
from rlnode.weights.broadcast import BroadcastStats, WeightBroadcaster, update_tensors
from rlnode.weights.ipc import host_identity
from rlnode.weights.lora import adapter_spec, adapter_tensors, wrap
from rlnode.weights.plan import AdapterSpec, GroupMember, GroupSpec, WeightUpdatePlan
from rlnode.weights.comm import WeightComm, keep_stdout

# (layers, hidden) of the models the benchmark can build for itself.
BENCH_SIZES = {"tiny": (2, 128), "100m": (20, 768)}
# Without --config: a quick eager engine, and a context long enough for the
# requests that stream through the updates (--set still wins).
BENCH_DEFAULTS = ["actor.engine.enforce_eager=true", "actor.engine.max_num_seqs=64", "model.max_model_len=4096"]
# Tokens each in-flight request asks for (capped by the context): it must
# still be decoding when the update is over.
STREAM_TOKENS = 4000


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
    usual_token_gap_s: float  # median gap between streamed tokens, away from the updates
    max_abs_logprob_diff_after_update: float
    rounds_update_s: list[float]
    backend: str = ""  # the transport the updates took
    backend_reason: str = ""  # why (configured, or what "auto" found)
    trainer_device: str = ""
    precision: str = ""  # trainer.precision
    engine_device: str = ""
    # Engine vs transformers on the weights both loaded from disk: the floor
    # the update must not raise (on CUDA, kernel differences; docs/design/gpu-h100.md).
    max_abs_logprob_diff_before_update: float = -1.0
    # Resident memory (MiB) of the trainer (this process) and of the
    # engine's processes (core + workers), after the first update (buffers
    # and groups exist by then) and after the last: a push that leaks shows
    # here as growth, rounds after rounds (peers have leaked GiBs per sync).
    # receive_s, split (UpdateTimings.receive_*): the RPC that starts it,
    # the plan vote, staging allocation, the broadcasts, and the poll's lag.
    receive_rpc_s: float = 0.0
    receive_vote_s: float = 0.0
    receive_alloc_s: float = 0.0
    receive_transfer_s: float = 0.0
    receive_poll_s: float = 0.0
    receive_first_bucket_s: float = 0.0  # of the broadcasts: until the first bucket was in
    receive_store_s: float = 0.0  # LoRA: the adapter's files written by the worker
    # "generating" or "paused": whether the engine took the bytes in while
    # decoding (actor.engine.weight_receive).
    receive_mode: str = ""
    # The trainer's side of the broadcasts: packing parameters into bucket
    # buffers, and waiting for the sends (the wire, and the slowest receiver).
    trainer_pack_s: float = 0.0
    trainer_send_wait_s: float = 0.0
    trainer_rss_mib_first: float = 0.0
    trainer_rss_mib_last: float = 0.0
    engine_rss_mib_first: float = 0.0
    engine_rss_mib_last: float = 0.0
    # The trainer starts the update -> a request submitted once the engine
    # took it in has its first token, on the new version: what a client
    # waits before the new policy answers.
    update_to_first_token_s: float = 0.0
    # 99th percentile of the gaps between streamed tokens away from the
    # updates (and their probes): the engine's own jitter, which an
    # update's largest gap is compared with.
    token_gap_p99_s: float = 0.0
    # The largest gap in a window as long as the update just before it (the
    # engine without an update), median over the rounds: what
    # max_token_gap_s is compared with.
    control_token_gap_s: float = 0.0
    # > 0: a LoRA run of that rank (trainer.lora): the pushes carry the
    # adapter (params, nbytes: the adapter's) and the engine serves each as
    # a new vLLM adapter, without pausing.
    lora_rank: int = 0
    # Largest adapters loaded at once on the engine (current + ones still
    # running requests), and how many old ones were removed.
    adapters_loaded_max: int = 0
    adapters_removed: int = 0


def bench_config(overrides: list[str]) -> Config:
    """The job to measure when no --config names one: the defaults with
    ``BENCH_DEFAULTS``, then ``overrides`` (--set)."""
    return load_config(None, [*BENCH_DEFAULTS, *overrides])


def backend_refusal(backend: str, trainer_device: str, engine_cfg: EngineConfig) -> str:
    """Why this host cannot run weight updates over ``backend`` between the
    benchmark's trainer (this process, on ``trainer_device``) and its one
    engine (engine 0 of ``engine_cfg``, on this host); "" when it can.
    Starts nothing and creates no CUDA context (GPUs are counted through
    NVML), so the engine can still start after it."""
    if backend not in ("nccl", "cuda_ipc"):
        return ""
    import torch

    if not torch.cuda.is_available():
        need = "a CUDA GPU and NCCL" if backend == "nccl" else "a CUDA GPU"
        return (f"{backend} needs {need}; this host has no visible GPU (torch.cuda.is_available() is False); "
                "use --backend gloo")
    trainer = torch.device("cuda" if trainer_device == "auto" else trainer_device)
    if trainer.type != "cuda" or resolve_device(engine_cfg.device) != "cuda":
        return (f"{backend} needs the trainer and the engine on cuda (trainer.device = \"{trainer_device}\", "
                f"actor.engine.device = \"{engine_cfg.device}\"); use --backend gloo")
    try:
        gpus = engine_gpu_assignment(engine_cfg, torch.cuda.device_count())[0]
    except ValueError as e:
        return str(e)
    # Both counted among this process's visible GPUs; the engine's processes
    # see exactly its own (actor.engine.cuda_env).
    here = trainer.index or 0
    if backend == "nccl":
        if not torch.distributed.is_nccl_available():
            return "nccl needs NCCL; this torch has none (torch.distributed.is_nccl_available() is False)"
        if here in gpus:
            return (f"NCCL refuses two ranks on one GPU: the trainer (cuda:{here}) and the engine (GPUs {gpus}) "
                    "would share it; use --backend cuda_ipc, or give the engine another GPU "
                    "(actor.engine.gpu_ids)")
    elif here not in gpus:
        return (f"cuda_ipc needs the trainer's GPU visible to the engine: the trainer is on cuda:{here}, the "
                f"engine sees only GPUs {gpus} (actor.engine.gpu_ids); use --backend nccl")
    return ""


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


async def _stream(engine: Engine, prompt: list[int], seed: int, stamps: list[float]) -> None:
    """One in-flight request; appends the arrival time of every token."""
    from vllm.sampling_params import RequestOutputKind

    max_tokens = min(STREAM_TOKENS, engine.model_cfg.max_model_len - len(prompt) - 1)
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
    """Gaps between consecutive distinct arrivals: (touching [lo, hi], the
    others: the engine's usual rhythm)."""
    times = sorted(set(stamps))
    pairs = list(zip(times, times[1:]))
    return [b - a for a, b in pairs if b >= lo and a <= hi], [b - a for a, b in pairs if b < lo or a > hi]


@dataclass
class _Round:
    """One timed update (_one_update)."""

    wall_s: float  # the trainer starts -> the engine took the update in
    timings: UpdateTimings
    plan: WeightUpdatePlan
    stats: BroadcastStats
    max_gap_s: float  # the largest gap between a stream's tokens during the update
    # The same for a window as long just before the update: what the engine
    # does without one (on 2 shared cores its steps vary by themselves).
    control_gap_s: float
    usual_gaps: list[float]  # every gap away from the update and its probe
    first_token_s: float  # the trainer starts -> first token of a new request, on the new version


async def _one_update(engine, bc, hf, version, prompts, warm_s: float, adapter: AdapterSpec | None = None) -> _Round:
    """Perturb the trainer's weights (a LoRA ``adapter``'s only), start
    streaming requests, update while they decode, then time a new request's
    first token."""
    import torch

    # Small steps, as a trainer's are: large ones turn the model
    # deterministic within a few rounds (every sampled logprob 0.0, which
    # makes the parity figure say nothing). An adapter starts at B = 0.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if adapter is None:
                p.add_(torch.randn_like(p) * 0.05 * p.std().nan_to_num(0.02))
            elif "lora_" in name:
                p.add_(torch.randn_like(p) * 0.005)
    stamps: list[list[float]] = [[] for _ in prompts]
    streams = [asyncio.create_task(_stream(engine, p, i, s)) for i, (p, s) in enumerate(zip(prompts, stamps))]
    try:
        await asyncio.sleep(warm_s)
        tensors = adapter_tensors(hf) if adapter is not None else update_tensors(hf)
        plan = bc.plan(tensors, version, adapter=adapter)
        t0 = time.perf_counter()
        stats, timings = await asyncio.gather(bc.broadcast_async(plan, tensors), apply_weight_update(engine, plan))
        t1 = time.perf_counter()
        first = await engine.generate(prompts[0][:8], SamplingSettings(max_tokens=1, seed=version))
        t2 = time.perf_counter()
        if [v for v, _, _ in first.weight_versions] != [str(version)]:
            raise RuntimeError(f"a request after update {version} ran on {first.weight_versions}")
        await asyncio.sleep(warm_s)
    finally:
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    during, control, every = [], [], []
    for s in stamps:
        during += _gaps(s, t0, t1)[0]
        control += _gaps(s, 2 * t0 - t1 - 0.05, t0 - 0.05)[0]
        every += _gaps(s, t0, t2)[1]  # the usual rhythm: away from the update and its probe
    return _Round(t1 - t0, timings, plan, stats, max(during, default=0.0), max(control, default=0.0), every, t2 - t0)


async def _warm_up(engine: Engine, prompts: list[list[int]]) -> None:
    """The first batch of each size builds kernels and compiles vLLM's
    sampler for it (torch.compile of gather_logprobs: seconds of FX graph
    hashing on 2 cores, seen inside timed updates): every batch size the
    updates see (the streams, with the probe, alone) once before."""
    for batch in (prompts, [*prompts, prompts[0]], prompts[:1]):
        await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=64, seed=i, ignore_eos=True))
                               for i, p in enumerate(batch)))


def _p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else 0.0


async def _logprob_diff(engine: Engine, hf, prompts: list[list[int]]) -> float:
    import torch

    outs = await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=16, seed=i, ignore_eos=True))
                                  for i, p in enumerate(prompts)))
    device = next(hf.parameters()).device
    worst = 0.0
    for p, c in zip(prompts, outs):
        ids = torch.tensor([p + c.token_ids], device=device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 : -1].float().cpu()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def rss_mib(engine: Engine | None = None) -> float:
    """Resident memory (MiB) of this process, or with ``engine``, of that
    engine's processes (the children this process spawned for it)."""
    import psutil

    if engine is None:
        return psutil.Process().memory_info().rss / 2**20
    total = 0
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM::"):
                total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def _trainer_model(cfg: Config, model_path: str, lora_rank: int):
    """(the trainer's model, its AdapterSpec or None, the parameters a push
    moves). Loaded on the CPU, moved once the engine runs: its processes
    start before this one initialises CUDA (docs/design/gpu-h100.md)."""
    from transformers import AutoModelForCausalLM

    from rlnode.trainer.learner import PARAM_DTYPE

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=PARAM_DTYPE[cfg.trainer.precision]).eval()
    adapter = None
    if lora_rank:
        lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank, target_modules=cfg.trainer.lora.target_modules)
        hf, adapter = wrap(hf, lora).eval(), adapter_spec(lora)
    return hf, adapter, sum(p.numel() for _, p in (adapter_tensors(hf) if adapter else update_tensors(hf)))


async def bench_weights(cfg: Config, model_path: str, *, rounds: int = 5, in_flight: int = 8,
                        warm_s: float = 0.5, log=print, lora_rank: int = 0) -> WeightsBenchResult:
    """Run ``rounds`` in-flight updates of ``model_path`` on one fresh
    engine, set up as ``cfg`` sets up a job (module docstring); with
    ``lora_rank``, of a LoRA adapter of that rank on it (the engine serves
    each as a new adapter)."""
    from rlnode.trainer.learner import resolve_trainer_device

    t = cfg.trainer
    model_cfg = msgspec.structs.replace(cfg.model, path=model_path)
    device = resolve_trainer_device(t.device)
    hf, adapter, params = _trainer_model(cfg, model_path, lora_rank)
    log(f"model {model_path}: {params / 1e6:.2f}M parameters{' (adapter)' if adapter else ''}; starting the engine")
    engine = Engine(0, model_cfg, cfg.actor.engine, worker_extension_cls=EXTENSION,
                    lora_rank=next((r for r in VLLM_LORA_RANKS if r >= lora_rank), lora_rank) if lora_rank else 0)
    await engine.start()
    bc = None
    try:
        hf.to(device)
        bc = WeightBroadcaster(t.weights, master_host="127.0.0.1", device=str(device), timeout_s=t.weights.timeout_s)
        spec = bc.new_epoch([("bench/0", engine_num_ranks(engine), host_identity(), engine.visible_gpus)])
        log(f"weights over {spec.backend} ({bc.backend_reason}); trainer on {device} ({t.precision}), "
            f"engine on {engine.device}")
        await asyncio.gather(bc.open_group_async(spec), join_group(engine, spec, first_rank=1))
        rng = random.Random(0)
        prompts = [[rng.randrange(40, 200) for _ in range(32)] for _ in range(in_flight)]
        await _warm_up(engine, prompts)
        before = await _logprob_diff(engine, hf, prompts[:4])
        # Update 1 warms up too (the engine's first add_lora took 0.9 s): untimed.
        await _one_update(engine, bc, hf, 1, prompts, warm_s, adapter)
        runs, memory = [], []
        for version in range(2, rounds + 2):
            runs.append(await _one_update(engine, bc, hf, version, prompts, warm_s, adapter))
            memory.append((rss_mib(), await asyncio.to_thread(rss_mib, engine)))
            log(f"update {version}: {runs[-1].wall_s:.3f} s (stall {runs[-1].timings.stalled_s:.3f} s), "
                f"rss trainer {memory[-1][0]:.0f} MiB, engine {memory[-1][1]:.0f} MiB")
        diff = await _logprob_diff(engine, hf, prompts[:4])
        slots = engine.adapters
        if slots is not None:
            await slots.drain()
    finally:
        if bc is not None:
            bc.close_group()
        await engine.shutdown()
    plan = runs[-1].plan
    raw = raw_broadcast_s(plan)
    update_s = statistics.median(r.wall_s for r in runs)

    def med(field: str) -> float:
        return statistics.median(getattr(r.timings, field) for r in runs)

    return WeightsBenchResult(
        model=model_path, params=params, nbytes=plan.nbytes, buckets=len(plan.buckets), rounds=rounds,
        update_s=update_s, raw_broadcast_s=raw, overhead_ratio=update_s / raw,
        receive_s=med("receive_s"), load_s=med("load_s"),
        **{f"receive_{k}": med(f"receive_{k}") for k in ("rpc_s", "vote_s", "alloc_s", "transfer_s", "first_bucket_s",
                                                          "poll_s", "store_s")},
        generation_stall_s=med("stalled_s"),
        receive_mode="paused" if runs[-1].timings.receive_paused else "generating",
        trainer_pack_s=statistics.median(r.stats.pack_s for r in runs),
        trainer_send_wait_s=statistics.median(r.stats.send_wait_s for r in runs),
        max_token_gap_s=statistics.median(r.max_gap_s for r in runs),
        control_token_gap_s=statistics.median(r.control_gap_s for r in runs),
        usual_token_gap_s=statistics.median([g for r in runs for g in r.usual_gaps] or [0.0]),
        max_abs_logprob_diff_after_update=diff, rounds_update_s=[round(r.wall_s, 4) for r in runs],
        backend=spec.backend, backend_reason=bc.backend_reason, trainer_device=str(device),
        precision=t.precision, engine_device=engine.device, max_abs_logprob_diff_before_update=before,
        trainer_rss_mib_first=round(memory[0][0], 1), trainer_rss_mib_last=round(memory[-1][0], 1),
        engine_rss_mib_first=round(memory[0][1], 1), engine_rss_mib_last=round(memory[-1][1], 1),
        update_to_first_token_s=statistics.median(r.first_token_s for r in runs), lora_rank=lora_rank,
        token_gap_p99_s=_p99([g for r in runs for g in r.usual_gaps]),
        adapters_loaded_max=slots.loaded_max if slots else 0, adapters_removed=slots.removed if slots else 0)


def print_table(res: WeightsBenchResult) -> None:
    print(f"\nweight update benchmark: {res.model}")
    print(f"  over {res.backend} ({res.backend_reason}); trainer on {res.trainer_device} ({res.precision}), "
          f"engine on {res.engine_device}")
    print(f"  {res.params / 1e6:.1f}M params, {res.nbytes / 2**20:.1f} MiB in {res.buckets} bucket(s), "
          f"median of {res.rounds} updates with requests in flight")
    rows = [
        ("update (trainer -> engine resumed)", res.update_s),
        ("  trainer: pack parameters into buckets", res.trainer_pack_s),
        ("  trainer: wait for the sends", res.trainer_send_wait_s),
        (f"  engine: receive into staging ({res.receive_mode})", res.receive_s),
        ("    start RPC", res.receive_rpc_s),
        ("    plan vote", res.receive_vote_s),
        ("    staging buffers (reused)", res.receive_alloc_s),
        ("    broadcasts (wait + bytes + copies)", res.receive_transfer_s),
        ("      of which until bucket 1 was in", res.receive_first_bucket_s),
        ("    job done -> driver saw it", res.receive_poll_s),
        ("  engine: load while paused", res.load_s),
        ("raw gloo broadcast (CPU), same buckets", res.raw_broadcast_s),
        ("generation stall (pause -> resume)", res.generation_stall_s),
        ("max token gap during update", res.max_token_gap_s),
        ("usual token gap", res.usual_token_gap_s),
    ]
    for name, value in rows:
        print(f"  {name:<44}{value:>10.4f} s")
    print(f"  resident memory after update 1 -> {res.rounds}: trainer {res.trainer_rss_mib_first:.0f} -> "
          f"{res.trainer_rss_mib_last:.0f} MiB, engine processes {res.engine_rss_mib_first:.0f} -> "
          f"{res.engine_rss_mib_last:.0f} MiB")
    print(f"  overhead_ratio = {res.overhead_ratio:.2f}   "
          f"max |logprob engine - transformers| before update = {res.max_abs_logprob_diff_before_update:.2e}, "
          f"after = {res.max_abs_logprob_diff_after_update:.2e}")


if __name__ == "__main__":  # python -m rlnode.bench.weights [tiny|100m|PATH ...]
    import sys

    for arg in sys.argv[1:] or ["tiny", "100m"]:
        path = build_bench_model(arg) if arg in BENCH_SIZES else arg
        print_table(asyncio.run(bench_weights(bench_config([]), path)))
