"""``rlnode check``'s look at the software stack a GPU run depends on.

What the first GPU contact broke before (issue 19), each turned into a
check that runs in seconds, before any engine starts:

    ok    vllm      vllm 0.26.0 (in vllm>=0.26,<0.33): 31 uses of its API, all present
    ok    lora      trainer.lora rank 16, alpha 32, targets q_proj,...; engines: enable_lora, max_loras 4, ...
    FAIL  nccl      trainer.weights.backend = "nccl" needs NCCL, which does not load here: ...
    FAIL  guard     rlnode's engine guard is not registered with vLLM ...
    ok    ipc       every engine sees the trainer's GPU GPU-8f3a...: weights by CUDA IPC
    FAIL  memory    trainer memory plan: qwen3 4.02B, 1 rank(s), bf16-mixed, foreach AdamW ... does NOT fit ...

Owns: these findings. Must not start engines, initialise CUDA in a way a
later fork would trip on (NVML and ``dlopen`` only), or write anything.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlnode.config import Config
from rlnode.ops.findings import FAIL, OK, WARN, Finding


def check_vllm() -> list[Finding]:
    """The installed vLLM: version in the supported range, and every vLLM
    use in rlnode's source (``rlnode.tools.vllm_contract``) present in it,
    read from its source the way CI reads the wheels."""
    from rlnode.actor import vllm_compat

    try:
        version = vllm_compat.installed_version()
        vllm_compat.check_version(version)
    except vllm_compat.UnsupportedVLLM as e:
        return [Finding(FAIL, "vllm", str(e))]
    site = _vllm_site()
    if site is None:
        return [Finding(FAIL, "vllm", f"vLLM {version} has metadata but no importable package")]
    from rlnode.tools.vllm_api_snapshot import snapshot_release
    from rlnode.tools.vllm_contract import contract, violations

    uses = contract()
    try:
        snap = snapshot_release(str(site), uses)
        snap["vllm"] = version  # the dist-info found beside it may be another vllm*'s
        problems = violations(uses, snap)
        detected = vllm_compat.api()
    except vllm_compat.UnsupportedVLLM as e:
        return [Finding(FAIL, "vllm", str(e))]
    except Exception as e:  # a broken install: say so rather than crash the check
        return [Finding(FAIL, "vllm", f"could not read vLLM {version}'s API: {e!r}")]
    if problems:
        return [Finding(FAIL, "vllm", p) for p in problems]
    paths = "weight versions from vLLM" if detected.weight_versions else "weight versions tracked by rlnode"
    return [Finding(OK, "vllm", f"vllm {version} (in vllm{vllm_compat.SUPPORTED}): {len({u.key for u in uses})} "
                    f"uses of its API, all present; {paths}")]


def _vllm_site() -> Path | None:
    """The folder the installed ``vllm`` package is in (its source is read
    there, not imported); None when it cannot be imported."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def check_lora(cfg: Config) -> list[Finding]:
    """A LoRA run (``trainer.lora.rank`` > 0): the adapter the trainer
    trains, the adapter arguments every engine starts with
    (``config.engine_lora_rank``), and whether the installed vLLM has what
    the LoRA path uses (``vllm_contract.DECLARED``: the engine arguments,
    ``LoRARequest``, ``AsyncLLM.add_lora`` / ``remove_lora``,
    ``generate(lora_request=)``, this rank among ``MaxLoRARanks``). Nothing
    when LoRA is off."""
    from rlnode.config import engine_lora_rank

    lora, eng = cfg.trainer.lora, cfg.actor.engine
    if lora.rank == 0:
        return []
    rank = engine_lora_rank(cfg)
    said = (f"trainer.lora rank {lora.rank}, alpha {lora.alpha:g}, targets {','.join(lora.target_modules)}; "
            f"engines: enable_lora, max_loras {eng.max_loras}, max_lora_rank {rank}")
    from rlnode.actor import vllm_compat
    from rlnode.tools.vllm_api_snapshot import snapshot_release
    from rlnode.tools.vllm_contract import DECLARED, violations

    site = _vllm_site()
    if site is None:
        return [Finding(FAIL, "lora", f"{said}: no importable vLLM to serve adapters")]
    uses = [u._replace(keywords=(str(rank),)) if u.kind == "values" else u for u in DECLARED]
    try:
        version = vllm_compat.installed_version()
        snap = snapshot_release(str(site), uses)
        snap["vllm"] = version
        problems = violations(uses, snap)
    except Exception as e:  # noqa: BLE001 - the vllm finding says what is wrong with the install
        return [Finding(FAIL, "lora", f"{said}: could not read vLLM's LoRA API: {e!r}")]
    if problems:
        return [Finding(FAIL, "lora", f"{said}: {p}") for p in problems]
    return [Finding(OK, "lora", f"{said}: vLLM {version} has them (LoRARequest, add_lora/remove_lora, "
                    f"generate(lora_request=), rank {rank})")]


def check_guard() -> list[Finding]:
    from rlnode.actor.engine_guard import EngineGuardMissing, check_registered

    try:
        check_registered()
    except EngineGuardMissing as e:
        return [Finding(FAIL, "guard", str(e))]
    return [Finding(OK, "guard", "engine guard registered as a vLLM plugin (engines end with their daemon)")]


def cuda_roles(cfg: Config, gpus: int) -> tuple[bool, bool]:
    """(trainer on cuda, engines on cuda) on a machine with ``gpus`` visible
    GPUs: "auto" means cuda when there is one."""
    t, e = cfg.trainer, cfg.actor.engine
    return (t.device == "cuda" or (t.device == "auto" and gpus > 0),
            e.device == "cuda" or (e.device == "auto" and gpus > 0))


def nccl_needed(cfg: Config, role: str, gpus: int) -> str:
    """Why this role needs NCCL on this machine ('' when it does not)."""
    t, e = cfg.trainer, cfg.actor.engine
    trainer_cuda, engine_cuda = cuda_roles(cfg, gpus)
    trainer_cuda &= role in ("trainer", "all")
    engine_cuda &= role in ("actor", "all")
    if cfg.trainer.weights.backend == "nccl" and (trainer_cuda or engine_cuda):
        return "trainer.weights.backend = \"nccl\""
    if cfg.trainer.weights.backend == "auto" and (trainer_cuda or engine_cuda) and role != "all":
        return "weights over nccl between hosts (trainer.weights.backend = \"auto\", cuda)"
    if engine_cuda and e.tensor_parallel_size > 1:
        return f"tensor parallelism ({e.tensor_parallel_size} GPUs per engine)"
    ranks = t.parallel.ranks or (gpus if trainer_cuda else 1)
    if trainer_cuda and ranks > 1 and t.parallel.backend != "gloo":
        return f"FSDP over {ranks} GPUs"
    return ""


def check_nccl(cfg: Config, role: str, gpus: int, load=None) -> list[Finding]:
    """NCCL loadable where the role uses it (``load``: returns the version
    string or raises; tests pass their own)."""
    why = nccl_needed(cfg, role, gpus)
    if not why:
        return [Finding(OK, "nccl", "not needed here (no cuda collective for this role)")]
    try:
        version = (load or nccl_version)()
    except Exception as e:
        return [Finding(FAIL, "nccl", f"{why} needs NCCL, which does not load here: {e} "
                        "(install the nvidia-nccl-cu* wheel that vLLM's torch pins, or set VLLM_NCCL_SO_PATH)")]
    return [Finding(OK, "nccl", f"NCCL {version} loads ({why})")]


def nccl_version() -> str:
    """The NCCL library vLLM would load, by its version; raises where none loads."""
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return NCCLLibrary().ncclGetVersion()


def check_ipc(cfg: Config, role: str, gpus: int, physical: tuple[str, ...] | None = None) -> list[Finding]:
    """``--role all`` on CUDA: can each engine open the trainer's GPU memory
    (CUDA IPC needs the trainer's GPU among the engine process's visible
    ones, matched by UUID), hence which transport "auto" will pick.
    ``physical``: every GPU's UUID in NVML order (default: read from NVML)."""
    from rlnode.weights import ipc as weight_ipc
    from rlnode.actor.engine import cuda_env, engine_gpu_assignment

    trainer_cuda, engine_cuda = cuda_roles(cfg, gpus)
    backend = cfg.trainer.weights.backend
    if role != "all" or not (trainer_cuda and engine_cuda) or backend in ("gloo", "nccl"):
        return []
    try:
        physical = weight_ipc.nvml_gpu_uuids() if physical is None else physical
    except Exception as e:  # noqa: BLE001 - no driver: said, not fatal here (gpus already failed)
        return [Finding(WARN, "ipc", f"cannot read the GPUs' UUIDs through NVML ({e}): the trainer will send "
                        "weights over NCCL unless every engine reports the trainer's GPU")]
    visible = weight_ipc.visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), physical)
    if not visible:
        return [Finding(FAIL, "ipc", "CUDA_VISIBLE_DEVICES names no GPU NVML knows")]
    trainer_gpu = visible[0]  # the trainer's rank 0 takes the first visible GPU
    try:
        slices = engine_gpu_assignment(cfg.actor.engine, len(visible))
    except ValueError:
        return []  # check_devices reported it
    blind = []
    for i, s in enumerate(slices):
        seen = weight_ipc.visible_gpus(cuda_env(s)["CUDA_VISIBLE_DEVICES"], physical)
        if not weight_ipc.sees_gpu(seen, trainer_gpu):
            blind.append(i)
    if not blind:
        return [Finding(OK, "ipc", f"every engine sees the trainer's GPU {trainer_gpu}: weights by CUDA IPC")]
    if backend == "cuda_ipc":
        return [Finding(FAIL, "ipc", f'trainer.weights.backend = "cuda_ipc" but engine(s) {blind} do not see the '
                        f"trainer's GPU {trainer_gpu} (their CUDA_VISIBLE_DEVICES hide it): use \"auto\" (NCCL "
                        "for them) or put the engines on the trainer's GPU")]
    return [Finding(OK, "ipc", f"engine(s) {blind} do not see the trainer's GPU {trainer_gpu}: \"auto\" sends "
                    "them weights over NCCL")]


def check_memory(cfg: Config, role: str, gpus: int, here: bool = True,
                 gpu_bytes: int | None = None) -> list[Finding]:
    """The trainer's memory plan (``trainer/memory_plan.py``) against one GPU:
    ``gpu_bytes`` (``--gpu-gib``) or this machine's first visible GPU. With
    ``--role all`` on a shared GPU the engine's ``gpu_memory_utilization``
    share is taken off first."""
    from rlnode.trainer.memory_plan import UnsupportedModel, plan_for_config

    trainer_cuda, engine_cuda = cuda_roles(cfg, gpus)
    if role not in ("trainer", "all") or not trainer_cuda:
        return []
    if gpu_bytes is None:
        if not here or gpus == 0:
            return [Finding(WARN, "memory", "trainer memory plan not checked: give --gpu-gib (memory per GPU)")]
        import torch

        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    room, note = gpu_bytes, ""
    e = cfg.actor.engine
    if role == "all" and engine_cuda and 0 in (list(e.gpu_ids) or [0]):
        room = int(gpu_bytes * (1 - e.gpu_memory_utilization))
        note = f" (the engine takes {e.gpu_memory_utilization:g} of this GPU)"
    ranks = cfg.trainer.parallel.ranks or max(1, gpus)
    try:
        plan = plan_for_config(cfg, room, ranks=ranks)
    except (UnsupportedModel, OSError, ValueError) as err:
        return [Finding(WARN, "memory", f"trainer memory plan not computed: {err}")]
    level = {"fits": OK, "may_not_fit": WARN, "does_not_fit": FAIL}[plan.verdict]
    return [Finding(level, "memory", plan.describe() + note)]


def check_attention(cfg: Config, role: str, gpus: int) -> list[Finding]:
    """Which attention kernel a cuda trainer gets (``trainer.attention``)."""
    import importlib.util

    trainer_cuda, _ = cuda_roles(cfg, gpus)
    t = cfg.trainer
    if role not in ("trainer", "all") or not trainer_cuda or t.attention in ("sdpa", "eager"):
        return []
    has_fa = importlib.util.find_spec("flash_attn") is not None
    low = t.precision in ("bf16", "bf16-mixed")
    if t.attention == "flash_attention_2" and not has_fa:
        return [Finding(FAIL, "attention", 'trainer.attention = "flash_attention_2" but flash_attn is not installed '
                        "(no PyPI wheels: build it for this torch/CUDA, or use \"auto\": PyTorch's own varlen kernel)")]
    if low and (t.attention == "flash_attention_2" or (t.attention == "auto" and has_fa)):
        return [Finding(OK, "attention", "flash_attention_2: micro-batches packed into varlen rows")]
    if low:
        return [Finding(OK, "attention", "varlen (PyTorch's FlashAttention kernel, torch.nn.attention.varlen): "
                        "micro-batches packed into one sequence per micro-batch, no padding")]
    return [Finding(OK, "attention", f'sdpa (trainer.precision = "{t.precision}" computes in fp32): micro-batches '
                    "of right-padded rows bucketed by length, no mask")]


def check_stack(cfg: Config, role: str, gpus: int, here: bool = True,
                gpu_bytes: int | None = None) -> list[Finding]:
    """``here``: the GPUs are this machine's (False: ``--gpus N`` describes
    another machine, whose libraries this one cannot load for it)."""
    out = check_vllm()
    out += check_lora(cfg)
    if role in ("actor", "all"):
        out += check_guard()
    if here:
        out += check_nccl(cfg, role, gpus)
        out += check_ipc(cfg, role, gpus)
    elif why := nccl_needed(cfg, role, gpus):
        out.append(Finding(WARN, "nccl", f"{why} needs NCCL: not loaded here "
                           "(--gpus describes another machine; run `rlnode check` there)"))
    out += check_attention(cfg, role, gpus)
    out += check_memory(cfg, role, gpus, here, gpu_bytes)
    return out


__all__ = ["FAIL", "OK", "WARN", "check_attention", "check_guard", "check_ipc", "check_lora", "check_memory",
           "check_nccl", "check_stack", "check_vllm", "cuda_roles", "nccl_needed", "nccl_version"]
