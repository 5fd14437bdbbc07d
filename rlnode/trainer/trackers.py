"""Experiment trackers: the trainer's metrics mirrored to TensorBoard and
Weights & Biases (trainer.trackers; the ``trackers`` extra).

Owns: turning a metrics.jsonl record into scalars. Step records go out under
their own keys (``reward_mean``, ``loss/clip_fraction``,
``offpolicy/mismatch_kl``, ``token_lag/1`` for the lag histogram, ...);
evaluation records as ``eval/<cube>/success`` and ``eval/<cube>/reward``.
The x axis is the policy version, which names the weights a figure belongs
to (evaluations of version v arrive after later steps). metrics.jsonl stays
the record: a tracker that raises is logged, closed and dropped.

Blocking: construction starts the tracker (wandb spawns its core process),
so build sinks and close them in a worker thread. ``write`` only enqueues
(SummaryWriter's writer thread; wandb's core process).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Protocol

from rlnode.config import Config, ConfigError
from rlnode.log import get_logger

log = get_logger("rlnode.trainer")


class TrackerSink(Protocol):
    name: str

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(version, {name: value}) of a metrics.jsonl record; None for records
    without figures (a step that trained nothing)."""
    version = int(record.get("version", 0))
    if record.get("eval"):
        cube = record["cube_id"]
        return version, {f"eval/{cube}/success": float(record["eval_success"]),
                         f"eval/{cube}/reward": float(record["eval_reward_mean"])}
    if record.get("no_step"):
        return None
    out = {k: float(v) for k, v in record.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("version", "time")}
    out.update({f"token_lag/{lag}": float(n) for lag, n in record.get("token_lag_hist", {}).items()})
    return version, out


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        # Flushed every 10 s (default 120): a live TensorBoard follows the run.
        self._w = SummaryWriter(log_dir=str(log_dir), flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        if (got := scalars(record)) is not None:
            version, values = got
            for k, v in values.items():
                self._w.add_scalar(k, v, global_step=version, walltime=record.get("time"))

    def close(self) -> None:
        self._w.close()


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: Config, run_dir: Path):
        import msgspec
        import wandb

        t = cfg.trainer.trackers
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=t.wandb_project, entity=t.wandb_entity or None, mode=t.wandb_mode,
                               dir=str(run_dir), name=cfg.run.name or None, config=msgspec.to_builtins(cfg),
                               settings=wandb.Settings(console="off", silent=True))
        self._run.define_metric("version")
        self._run.define_metric("*", step_metric="version")

    def write(self, record: dict[str, Any]) -> None:
        if (got := scalars(record)) is not None:
            version, values = got
            self._run.log({"version": version, **values})

    def close(self) -> None:
        import wandb

        self._run.finish()
        # Stop wandb's core process now (it would stay until this process
        # exits) once it has written the run out.
        wandb.teardown()


def open_sinks(cfg: Config, run_dir: Path) -> list[TrackerSink]:
    """The configured trackers, started (blocking: call from a thread). A
    tracker whose package is missing is a ConfigError naming its key."""
    t = cfg.trainer.trackers
    sinks: list[TrackerSink] = []
    for key, enabled, module in (("tensorboard", t.tensorboard, "tensorboard"), ("wandb", t.wandb, "wandb")):
        if not enabled:
            continue
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"trainer.trackers.{key}: needs the {module} package, which is not installed "
                              f"(pip install 'rlnode[trackers]'), or set trainer.trackers.{key} = false")
        sinks.append(TensorBoardSink(run_dir / "tensorboard") if key == "tensorboard" else WandbSink(cfg, run_dir))
    return sinks
