"""LoRA adapters (``trainer.lora``): the peft wrap the trainer trains, the
adapter tensors a push carries, and the files an engine serves them from.

Owns:
  * ``wrap``: the base model frozen, an adapter on ``target_modules``
    (peft's ``LoraConfig``), refused with the key named when a target
    names no linear layer of the model;
  * ``adapter_tensors`` / ``adapter_spec``: what a push sends, named as in
    peft's ``adapter_model.safetensors`` (``AdapterSpec`` in plan.py is
    the wire form of the adapter's config);
  * ``write_adapter``: peft's two files (``adapter_config.json``,
    ``adapter_model.safetensors``), written atomically: what an engine
    worker writes for vLLM's ``LoRARequest`` and what a checkpoint holds,
    so ``vllm serve --lora-modules`` and ``PeftModel.from_pretrained`` load
    either unchanged;
  * ``adapter_mismatch``: why an adapter plan does not fit an engine's
    base model (module names and shapes against its checkpoint).

Must not touch: sockets, engines, the trainer's optimizer. torch and peft
are imported inside the functions that need them (config code imports the
weights package).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rlnode.weights.plan import AdapterSpec, WeightUpdatePlan

if TYPE_CHECKING:
    import torch

    from rlnode.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_spec(cfg: LoraConfig) -> AdapterSpec:
    return AdapterSpec(cfg.rank, float(cfg.alpha), tuple(cfg.target_modules))


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every linear layer (what peft matches)."""
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """ConfigError naming ``trainer.lora.target_modules`` for a target that
    is no linear layer of ``model`` (peft would fail later, or adapt nothing)."""
    from rlnode.config import ConfigError

    linear = linear_module_names(model) - {"lm_head"}
    if missing := [t for t in cfg.target_modules if t not in linear]:
        raise ConfigError(f"trainer.lora.target_modules: {missing} name no linear layer of the model "
                          f"(its linear layers: {sorted(linear)})")


def wrap(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` frozen under a fresh adapter (B = 0: the wrapped model
    computes what the base does, so version 0 is the base model)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(model, cfg)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(peft name, tensor) of the adapter of a ``wrap``ped model, detached,
    in a fixed order."""
    from peft import get_peft_model_state_dict

    return [(n, t.detach()) for n, t in get_peft_model_state_dict(model).items()]


def peft_config(spec: AdapterSpec, base: str = "") -> dict:
    """peft's ``adapter_config.json`` for ``spec``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": 0.0, "target_modules": sorted(spec.target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "base_model_name_or_path": base, "inference_mode": True}


def write_adapter(directory: str, spec: AdapterSpec, tensors: Iterable[tuple[str, torch.Tensor]],
                  base: str = "", durable: bool = True) -> None:
    """peft's two files into ``directory`` (replaced whole, atomically: a
    reader sees the old adapter or the new one, never a mix). ``durable``:
    fsync'd before the rename (a checkpoint); an engine's copy, which a
    crash loses with the engine anyway, skips it (7 ms of a 57 ms update
    on 2 cores)."""
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(directory))
    tmp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        # Own storage per tensor: safetensors refuses views into one buffer.
        save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in tensors},
                  os.path.join(tmp, ADAPTER_WEIGHTS))
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_config(spec, base), f, indent=1)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if durable else ():
            fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if os.path.isdir(directory):
            old = tempfile.mkdtemp(prefix=".old-adapter-", dir=parent)
            os.rename(directory, os.path.join(old, "a"))
            os.rename(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def adapter_mismatch(plan: WeightUpdatePlan, checkpoint: dict[str, tuple[int, ...]], max_rank: int) -> str:
    """'' when ``plan``'s adapter fits a base model whose checkpoint has
    ``checkpoint`` (name -> shape) on an engine serving ranks up to
    ``max_rank`` (0: the engine serves no adapters); else why not."""
    spec = plan.adapter
    if spec is None:
        return "not an adapter plan"
    if max_rank == 0:
        return ("the plan is a LoRA adapter but the engine was started without LoRA "
                "(start the actor with trainer.lora.rank > 0 in its config)")
    if spec.rank > max_rank:
        return f"adapter rank {spec.rank} is above the engine's max_lora_rank {max_rank} (actor.engine.max_lora_rank)"
    if not checkpoint:
        return ""
    for t in plan.tensors():
        module, half = spec.module_of(t.name) or ("", "")
        base = checkpoint.get(f"{module}.weight")
        if base is None or len(base) != 2:
            return f"adapter tensor {t.name!r}: the base model has no linear weight {module + '.weight'!r}"
        want = (spec.rank, base[1]) if half == "A" else (base[0], spec.rank)
        if tuple(t.shape) != want:
            return f"adapter tensor {t.name!r}: shape {list(t.shape)}, the base model needs {list(want)}"
    return ""
