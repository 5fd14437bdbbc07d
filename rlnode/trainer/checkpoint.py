"""Checkpoints and the run directory's durable files.

Owns: writing a checkpoint atomically (model, optimizer, lr scheduler,
version, RNG states, the ids of consumed groups; weights and every tensor in
safetensors, the rest JSON/msgpack: nothing is pickled, so loading a
checkpoint never runs code from it), finding and loading the
latest one for ``--resume``, pruning old ones, the final Hugging Face policy
directory, and the append-only ``metrics.jsonl``.

Atomicity: a checkpoint is written into ``checkpoints/.tmp-step-N-T``, every
file fsynced, then renamed to ``checkpoints/step-N-T`` (rename is atomic on one
filesystem), then the ``latest`` pointer file is replaced atomically. A crash
at any point leaves either the previous checkpoint or the new one, never a
half-written one that ``--resume`` would pick.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from rlnode.log import get_logger
from rlnode.trainer.metrics import strict_record
from rlnode.trainer.state_io import load_state, save_state

TRAINER_STATE = "trainer_state"  # optimizer, lr scheduler, RNG: safetensors + JSON (state_io.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")

log = get_logger("rlnode.trainer")


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_hf_policy(model, model_src: str, out: Path) -> None:
    """A directory transformers and vLLM load: weights + config + tokenizer."""
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(model_src) / name
        if src.exists():
            shutil.copy2(src, out / name)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.keep = keep

    def save(self, step: int, version: int, model, optimizer, scheduler, model_src: str,
             consumed_ids: dict | list[str], extra: dict[str, Any], buffered: list | None = None) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        # The save time in the name: re-saving the same step (e.g. at shutdown,
        # with new buffered groups) never touches the checkpoint `latest`
        # points at until the new one is complete.
        name = f"step-{step:07d}-{time.time_ns() // 1_000_000}"
        tmp = self.dir / f".tmp-{name}"
        final = self.dir / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_hf_policy(model, model_src, tmp / "policy")
        # No pickle: tensors in safetensors, the rest JSON (state_io.py).
        (tmp / TRAINER_STATE).mkdir()
        save_state(tmp / TRAINER_STATE, {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                         "rng": rng_state()})
        state = {"step": step, "version": version, "saved_at": time.time(),
                 "consumed_group_ids": consumed_ids, **extra}
        (tmp / "state.json").write_text(json.dumps(state))
        # Groups accepted but not trained yet: saved so an acknowledged group
        # survives a trainer restart (its actor may already have forgotten it).
        (tmp / "buffer.msgpack").write_bytes(msgspec.msgpack.encode(buffered or []))
        _fsync_tree(tmp)
        os.rename(tmp, final)
        _atomic_write_text(self.dir / "latest", name)
        self._prune(keep_name=name)
        return final

    def _prune(self, keep_name: str) -> None:
        done = sorted(p for p in self.dir.glob("step-*") if p.is_dir())
        for old in done[: -self.keep]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        pointer = self.dir / "latest"
        if not pointer.exists():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if (path / "state.json").exists() else None

    def load(self, path: Path, model, optimizer, scheduler) -> dict[str, Any]:
        """Load weights and trainer state in place; returns state.json."""
        from safetensors.torch import load_file

        weights = {}
        for f in sorted((path / "policy").glob("*.safetensors")):
            weights.update(load_file(f))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # Tied lm_head is not stored separately; anything else missing is an error.
        missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {path} does not fit the model: missing={missing} unexpected={unexpected}")
        if not (path / TRAINER_STATE).is_dir() and (path / "trainer_state.pt").exists():
            # Written by rlnode before 0.x: a pickle, which can run code on load.
            raise RuntimeError(
                f"checkpoint {path} keeps its optimizer state in trainer_state.pt (pickle), which rlnode no "
                "longer loads: loading a pickle runs whatever code the file holds. Start a new run from its "
                f"weights instead (model.path = {path / 'policy'})")
        trainer_state = load_state(path / TRAINER_STATE)
        optimizer.load_state_dict(trainer_state["optimizer"])
        scheduler.load_state_dict(trainer_state["scheduler"])
        set_rng_state(trainer_state["rng"])
        return json.loads((path / "state.json").read_text())

    def load_buffer(self, path: Path) -> list:
        from rlnode.wire import GroupDelivery

        f = path / "buffer.msgpack"
        return msgspec.msgpack.decode(f.read_bytes(), type=list[GroupDelivery]) if f.exists() else []


class MetricsWriter:
    """``metrics.jsonl``: one JSON object per line, flushed as written; each
    record also goes to the experiment trackers in ``sinks``
    (trainer/trackers.py). A tracker that raises is logged, closed and
    dropped: the file is the record, and the trainer keeps going."""

    def __init__(self, run_dir: str | Path, sinks: list | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)
        self.sinks = list(sinks or [])
        self.sink_failures = 0

    def write(self, record: dict[str, Any]) -> None:
        """The file gets strict JSON: a non-finite value is written as null
        and named in the record's "nonfinite" list (metrics.strict_record);
        the trackers get ``record`` as it is (they chart NaN and inf)."""
        self._f.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as e:
                self._drop(sink, e)

    def _drop(self, sink, error: Exception) -> None:
        self.sinks.remove(sink)
        self.sink_failures += 1
        log.error("trainer.tracker_failed", tracker=sink.name, error=repr(error),
                  action="dropped; metrics.jsonl keeps every record")
        try:
            sink.close()
        except Exception:
            pass

    def close(self) -> None:
        """Blocking (a tracker flushes): call from a worker thread."""
        self._f.close()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                log.warning("trainer.tracker_close_failed", tracker=sink.name, error=repr(e))
        self.sinks = []
