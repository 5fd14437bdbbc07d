"""Trainer state on disk without pickle: tensors in safetensors, the rest JSON.

``torch.save``/``torch.load(weights_only=False)`` run arbitrary code from the
file: anyone who can write a run directory (a shared filesystem, a copied
checkpoint) could take over the trainer on ``--resume``. The optimizer state,
lr scheduler and RNG states are nested dicts/lists of tensors, numpy arrays
and plain scalars, so they split cleanly:

    state.safetensors   every tensor and array, under a generated key "t<N>"
    state.json          the structure, with {"__tensor__": "t<N>"} (torch) or
                        {"__ndarray__": "t<N>"} (numpy) where one was, and
                        {"__tuple__": [...]} for tuples (random.setstate needs them)

Loading parses JSON and reads tensors: no code runs. Dict keys must be str or
int (int keys, e.g. optimizer param indices, are tagged so they come back as
ints).

Owns: the encoding. Must not know what the state means (checkpoint.py does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

TENSORS = "state.safetensors"
STRUCTURE = "state.json"


class StateFormatError(ValueError):
    """The state cannot be written (an unsupported type) or read (a file is
    missing or does not match)."""


def _flatten(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        # safetensors stores contiguous, non-shared storage; a 0-d tensor (an
        # AdamW step count) is fine.
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        out = {}
        int_keys = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise StateFormatError(f"{where}: dict key {k!r} is not str or int")
            if isinstance(k, int):
                int_keys.append(k)
            out[str(k)] = _flatten(v, tensors, f"{where}.{k}")
        if int_keys:
            return {"__intkeys__": out}
        return out
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise StateFormatError(f"{where}: {type(obj).__name__} cannot be stored without pickle")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag in ("__tensor__", "__ndarray__"):
            if value not in tensors:
                raise StateFormatError(f"{STRUCTURE} names tensor {value!r} that {TENSORS} lacks")
            t = tensors[value]
            return t if tag == "__tensor__" else t.numpy()
        if tag == "__tuple__":
            return tuple(_unflatten(v, tensors) for v in value)
        if tag == "__intkeys__":
            return {(int(k) if k.lstrip("-").isdigit() else k): _unflatten(v, tensors) for k, v in value.items()}
    return {k: _unflatten(v, tensors) for k, v in obj.items()}


def save_state(directory: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` as ``state.safetensors`` + ``state.json`` in ``directory``
    (the caller fsyncs and renames the directory: checkpoint.py)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(state, tensors, "state")
    d = Path(directory)
    save_file(tensors, str(d / TENSORS))
    (d / STRUCTURE).write_text(json.dumps(structure))


def load_state(directory: str | os.PathLike) -> dict[str, Any]:
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / STRUCTURE).is_file() or not (d / TENSORS).is_file():
        raise StateFormatError(f"{d}: no {STRUCTURE} + {TENSORS}")
    return _unflatten(json.loads((d / STRUCTURE).read_text()), load_file(str(d / TENSORS)))
