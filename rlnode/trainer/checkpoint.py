"""Checkpoints and the run directory's durable files.

Owns: writing a checkpoint atomically (model, optimizer, lr scheduler,
version, RNG states, the ids of consumed groups; weights and every tensor in
safetensors, the rest JSON/msgpack: nothing is pickled, so loading a
checkpoint never runs code from it), finding and loading the
latest one for ``--resume``, pruning old ones, the final Hugging Face policy
directory, and the append-only ``metrics.jsonl``.

With trainer.lora a checkpoint holds the adapter in ``adapter/`` (peft's
``adapter_config.json`` + ``adapter_model.safetensors``) instead of the
full weights in ``policy/``, and ``final/`` is that adapter directory: the
base stays where model.path names it.

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
from rlnode.model_files import make_readable
from rlnode.trainer.metrics import strict_record
from rlnode.trainer.state_io import load_state, save_state
from rlnode.weights import lora
from rlnode.weights.plan import AdapterSpec

POLICY_DIR = "policy"  # full weights: a Hugging Face model directory
ADAPTER_DIR = "adapter"  # trainer.lora: the adapter in peft's format, instead of policy/
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


def is_adapter(model) -> bool:
    """``model`` is peft's wrap of a frozen base (trainer.lora): what it
    trains, saves and loads is its adapter."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def model_adapter_spec(model) -> AdapterSpec:
    """The AdapterSpec of a peft-wrapped ``model`` (its active adapter)."""
    c = model.peft_config[model.active_adapter]
    return AdapterSpec(int(c.r), float(c.lora_alpha), tuple(sorted(c.target_modules)))


def save_hf_policy(model, model_src: str, out: Path) -> None:
    """A directory transformers and vLLM load: weights + config + tokenizer.
    With trainer.lora, the adapter in peft's format instead (its two files,
    replaced whole: ``PeftModel.from_pretrained(base, out)``, vLLM's
    ``LoRARequest`` / ``vllm serve --lora-modules``); the base stays at
    ``model_src``, named in its adapter_config.json."""
    if is_adapter(model):
        lora.write_adapter(str(out), model_adapter_spec(model), lora.adapter_tensors(model), base=str(model_src))
        return
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(model_src) / name
        if src.exists():
            shutil.copy2(src, out / name)
    make_readable(out)  # for `rlnode eval` and an actor as another user (save_pretrained: 0600)


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
        save_hf_policy(model, model_src, tmp / (ADAPTER_DIR if is_adapter(model) else POLICY_DIR))
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
        """Load weights (or the adapter, trainer.lora) and trainer state in
        place; returns state.json."""
        if is_adapter(model):
            load_adapter(path, model)
        else:
            load_weights(path, model)
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


def load_weights(path: Path, model) -> None:
    """The full weights of checkpoint ``path`` into ``model``, in place."""
    from safetensors.torch import load_file

    if not (path / POLICY_DIR).is_dir() and (path / ADAPTER_DIR).is_dir():
        raise RuntimeError(f"checkpoint {path} holds a LoRA adapter ({ADAPTER_DIR}/), not full weights: "
                           "resume it with its trainer.lora settings")
    weights = {}
    for f in sorted((path / POLICY_DIR).glob("*.safetensors")):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied lm_head is not stored separately; anything else missing is an error.
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing={missing} unexpected={unexpected}")


def load_adapter(path: Path, model) -> None:
    """The adapter of checkpoint ``path`` into the peft-wrapped ``model``,
    in place (the optimizer keeps its parameters): refused unless it has
    the model's adapter tensors, shapes and alpha."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    d = path / ADAPTER_DIR
    if not (d / lora.ADAPTER_WEIGHTS).is_file():
        why = "full weights (policy/)" if (path / POLICY_DIR).is_dir() else "no adapter"
        raise RuntimeError(f"checkpoint {path} holds {why}, not a LoRA adapter ({ADAPTER_DIR}/"
                           f"{lora.ADAPTER_WEIGHTS}): trainer.lora.rank must match the run it was saved by")
    saved = load_file(str(d / lora.ADAPTER_WEIGHTS))
    want = {n: tuple(t.shape) for n, t in lora.adapter_tensors(model)}
    got = {n: tuple(t.shape) for n, t in saved.items()}
    alpha = json.loads((d / lora.ADAPTER_CONFIG).read_text()).get("lora_alpha")
    spec = model_adapter_spec(model)
    if got != want or alpha != spec.alpha:
        missing, unexpected = sorted(set(want) - set(got))[:4], sorted(set(got) - set(want))[:4]
        shapes = sorted(n for n in set(want) & set(got) if want[n] != got[n])[:4]
        raise RuntimeError(f"checkpoint {path}: its adapter does not fit trainer.lora (rank {spec.rank}, "
                           f"alpha {spec.alpha}, target_modules {list(spec.target_modules)}): missing={missing} "
                           f"unexpected={unexpected} other shapes={shapes} alpha={alpha}")
    set_peft_model_state_dict(model, saved)


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
