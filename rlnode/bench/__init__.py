"""Benchmarks: ``rlnode bench NAME`` prints a table, or one JSON object with
``--json``. Each compares rlnode against a named baseline in the same run."""

from __future__ import annotations

import asyncio
import os
import sys

import msgspec

from rlnode import aio
from rlnode.config import Config


def run_bench(name: str, cfg: Config, args) -> int:
    """Run benchmark ``name``; the exit status (0, or what the bench reports)."""
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}")
    if args.model:
        cfg.model.path = args.model
    # Progress goes to stderr so --json keeps stdout to one object; so do
    # vLLM's logs (stdout by default), here and in the engine processes.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    return BENCHES[name](cfg, args, _log)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _router(cfg: Config, args, log) -> int:
    from rlnode.bench.router import bench_router, print_table

    res = asyncio.run(bench_router(cfg, args.concurrency, args.requests, args.max_tokens, args.rounds, log))
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0


def _transport(cfg: Config, args, log) -> int:
    from rlnode.bench.transport import bench_transport, print_table

    res = asyncio.run(bench_transport(args.samples, log=log))
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0


def _weights(cfg: Config, args, log) -> int:
    from rlnode.bench.weights import backend_refusal, bench_config, bench_weights, build_bench_model, print_table

    if not args.config:
        cfg = bench_config(args.overrides)
    if args.backend:
        cfg.trainer.weights = msgspec.structs.replace(cfg.trainer.weights, backend=args.backend)
    backend = cfg.trainer.weights.backend
    # Refused before any model, engine or CUDA context exists.
    if why := backend_refusal(backend, cfg.trainer.device, cfg.actor.engine):
        what = f"--backend {backend}" if args.backend else f'trainer.weights.backend = "{backend}"'
        print(f"rlnode bench weights: refusing {what}: {why}", file=sys.stderr)
        return 2
    # Built once under the run directory and reused (no temp dirs left behind).
    models = f"{cfg.run.run_dir}/bench-models"
    if args.model or args.config:
        paths = [args.model or cfg.model.path]
    else:
        paths = [build_bench_model(size, f"{models}/{size}") for size in ("tiny", "100m")]
    if args.lora:
        return _weights_lora(cfg, args, paths, log)
    results = {}
    for path in paths:
        log(f"weights: {path}")
        results[path] = asyncio.run(bench_weights(cfg, path, rounds=args.rounds, log=log))
    if args.json:
        print(msgspec.json.encode(results if len(results) > 1 else next(iter(results.values()))).decode())
    else:
        for res in results.values():
            print_table(res)
    return 0


def _weights_lora(cfg: Config, args, paths: list[str], log) -> int:
    """``bench weights --lora``: per model, a LoRA adapter's updates beside
    full-weight updates of the same model, in the same run."""
    from rlnode.bench.weights import bench_weights
    from rlnode.bench.weights_lora import compare, print_comparison

    rank = args.lora_rank or cfg.trainer.lora.rank or 16
    results = {}
    for path in paths:
        log(f"weights: {path}, full weights")
        full = asyncio.run(bench_weights(cfg, path, rounds=args.rounds, log=log))
        log(f"weights: {path}, LoRA rank {rank}")
        lora = asyncio.run(bench_weights(cfg, path, rounds=args.rounds, log=log, lora_rank=rank))
        results[path] = compare(full, lora)
    if args.json:
        print(msgspec.json.encode(results if len(results) > 1 else next(iter(results.values()))).decode())
    else:
        for res in results.values():
            print_comparison(res)
    return 0


def _async(cfg: Config, args, log) -> int:
    from rlnode.bench.asyncrl import bench_async, print_table

    res = bench_async(args.config or "conf/demo.toml", args.steps,
                      [o for o in args.overrides], log=log)
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0


def _fuzz(cfg: Config, args, log) -> int:
    from rlnode.bench.fuzz import bench_fuzz, print_table

    res = bench_fuzz(cfg, args.frames, log)
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0 if res["crashes"] == 0 and res["counts_match"] else 1


def _trainer(cfg: Config, args, log) -> int:
    from rlnode.bench.trainer import bench_trainer, print_table

    res = bench_trainer(cfg, args.tokens_per_step, args.prompt_tokens, args.completion_tokens, args.rounds, log,
                        switches=args.switches, largest=not args.no_largest)
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0


def _gateway(cfg: Config, args, log) -> int:
    from rlnode.bench.gateway import bench_gateway, print_table

    res = aio.run(bench_gateway(cfg, args.concurrency, args.requests, args.max_tokens, args.rounds, log,
                                engine=args.engine, isolation=args.agent_isolation,
                                gateway_host=None if args.gateway_host == "config" else args.gateway_host,
                                gateway_hosts=args.gateway_hosts, protocol=args.protocol))
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0


def _link(cfg: Config, args, log) -> int:
    from rlnode.bench.link_scale import bench_link, print_table

    try:
        actors = [int(n) for n in args.actors.split(",") if n.strip()]
    except ValueError:
        actors = []
    if not actors or min(actors) < 1 or args.seconds <= 0 or args.groups_per_step < 1 or (args.max_lag or 0) < 0:
        print("rlnode bench link: --actors takes positive counts (1,16,128), --seconds > 0, "
              "--groups-per-step >= 1, --max-lag >= 0", file=sys.stderr)
        return 2
    max_lag = 1 if args.max_lag is None else args.max_lag
    res = asyncio.run(bench_link(cfg, actors, args.seconds, args.groups_per_step, max_lag, log=log,
                                 curve=args.curve))
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0 if all(r.lost == 0 for r in res.rows) else 1


def _learn(cfg: Config, args, log) -> int:
    from pathlib import Path

    from rlnode.bench.learn import bench_learn, print_table

    try:
        seeds = [int(n) for n in args.seeds.split(",") if n.strip()]
    except ValueError:
        seeds = []
    max_lag = 2 if args.max_lag is None else args.max_lag
    # The demo's recipe unless --config names another.
    config = args.config or str(Path(__file__).resolve().parents[2] / "conf" / "demo.toml")
    if not args.config:
        from rlnode.config import load_config

        cfg = load_config(config, args.overrides)
    if not seeds or min(seeds) < 0 or max_lag < 1 or not 0 < args.target <= 1:
        print("rlnode bench learn: --seeds takes seeds >= 0 (0,1,2), --max-lag >= 1, --target in (0, 1]",
              file=sys.stderr)
        return 2
    if not Path(cfg.model.path).is_dir():
        print(f"rlnode bench learn: model.path {cfg.model.path!r} is not a directory (the demo's: "
              f"rlnode tiny-model {cfg.model.path})", file=sys.stderr)
        return 2
    lora_rank = (args.lora_rank or cfg.trainer.lora.rank or 16) if args.lora else 0
    if args.lora_overrides and not lora_rank:
        print("rlnode bench learn: --lora-set applies to the LoRA runs: add --lora", file=sys.stderr)
        return 2
    if lora_rank:  # refused now, not after the first full run
        from rlnode.config import ConfigError, load_config

        try:
            load_config(config, [*args.overrides, *args.lora_overrides, f"trainer.lora.rank={lora_rank}"])
        except ConfigError as e:
            print(f"rlnode bench learn: the LoRA runs' config (--set, --lora-set): {e}", file=sys.stderr)
            return 2
    res = bench_learn(config, cfg.run.run_dir, seeds, args.with_async, max_lag, args.target,
                      [f"model.path={cfg.model.path}", *args.overrides], log=log, lora_rank=lora_rank,
                      lora_overrides=args.lora_overrides, metric=args.metric)
    if args.json:
        print(msgspec.json.encode(res).decode())
    else:
        print_table(res)
    return 0


# Each takes (cfg, args, log) and returns the exit status.
BENCHES = {"router": _router, "transport": _transport, "weights": _weights, "async": _async, "fuzz": _fuzz,
           "trainer": _trainer, "gateway": _gateway, "link": _link, "learn": _learn}
