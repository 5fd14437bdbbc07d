"""``rlnode eval``: score a model on the test split of the configured cubes,
with no trainer. How a user scores a checkpoint, and how anyone checks that
a cube works before training on it.

Owns nothing long-lived: it starts the actor's engines, runs the scheduler's
evaluation, prints a table (or one JSON object) and shuts everything down.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import msgspec

from rlnode.config import Config, ConfigError


async def run_eval(cfg: Config, cube_ids: list[str], episodes: int | None, show_progress: bool) -> dict[str, dict]:
    from msgspec.structs import replace

    from rlnode.actor.daemon import ActorDaemon

    missing = set(cube_ids) - {c.id for c in cfg.actor.cubes}
    if missing:
        raise SystemExit(f"rlnode eval: no cube with id {', '.join(sorted(missing))} in the config")
    specs = [c for c in cfg.actor.cubes if (c.id in cube_ids if cube_ids else c.eval)]
    if not specs:
        raise SystemExit("rlnode eval: no cubes to evaluate (add [[actor.cubes]] to the config)")
    n = episodes or cfg.actor.scheduler.eval_episodes
    # Evaluation only: no cube is trained on, and all of this node's episode
    # capacity goes to evaluation.
    actor_cfg = replace(cfg.actor, cubes=[replace(c, weight=0.0, eval=True) for c in specs],
                        scheduler=replace(cfg.actor.scheduler, eval_share=1.0))
    actor = ActorDaemon(replace(cfg, actor=actor_cfg))
    # SIGTERM (a job's end, kill) ends the evaluation as Ctrl-C does: the
    # actor shuts down, its boxes, engines and cache folders with it.
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    await actor.start()
    try:
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=n * len(specs), desc="eval", unit="ep", file=sys.stderr)
        report = await actor.scheduler.evaluate(0, n, on_episode=(lambda _cid: bar.update()) if bar else None)
        if bar:
            bar.close()
        return report.cubes
    finally:
        await actor.shutdown()


def print_eval_table(results: dict[str, dict]) -> None:
    print(f"{'cube':<20}{'episodes':>10}{'success':>10}{'reward':>10}{'turns':>8}{'errors':>8}")
    for cid, r in results.items():
        print(f"{cid:<20}{r['episodes']:>10}{r['success_rate']:>10.3f}{r['reward_mean']:>10.3f}"
              f"{r['turns_mean']:>8.2f}{r['errors']:>8}")


def main_eval(cfg: Config, args) -> int:
    if args.model:
        cfg.model.path = args.model
    try:
        results = asyncio.run(run_eval(cfg, args.cube or [], args.episodes, show_progress=not args.json))
    except asyncio.CancelledError:
        print("rlnode eval: stopped (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except ConfigError as e:
        # A cube refused its options at start (a verifiers environment that
        # cannot be imported, a runtime that cannot run here): the message
        # names the cube and the key; a traceback would bury it.
        print(f"rlnode eval: config error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(msgspec.json.encode(results).decode())
    else:
        print_eval_table(results)
    return 0
