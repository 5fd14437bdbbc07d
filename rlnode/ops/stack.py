"""``rlnode check``'s look at the software stack a GPU run depends on.

What the first GPU contact broke before (issue 19), each turned into a
check that runs in seconds, before any engine starts:

    ok    vllm      vllm 0.26.0 (in vllm>=0.26,<0.33): 31 uses of its API, all present
    FAIL  nccl      the trainer and the engines need NCCL (weights over nccl); libnccl not loadable: ...
    FAIL  guard     rlnode's engine guard is not registered with vLLM ...

Owns: these findings. Must not start engines, initialise CUDA in a way a
later fork would trip on (NVML and ``dlopen`` only), or write anything.
"""

from __future__ import annotations

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
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return [Finding(FAIL, "vllm", f"vLLM {version} has metadata but no importable package")]
    site = Path(list(spec.submodule_search_locations)[0]).parent
    from rlnode.tools.vllm_api_snapshot import snapshot_release
    from rlnode.tools.vllm_contract import scan, violations

    uses = scan()
    try:
        snap = snapshot_release(str(site), uses)
        snap["vllm"] = version  # the dist-info found beside it may be another vllm*'s
        problems = violations(uses, snap)
        detected = vllm_compat.detect(vllm_compat.live_snapshot())
    except vllm_compat.UnsupportedVLLM as e:
        return [Finding(FAIL, "vllm", str(e))]
    except Exception as e:  # a broken install: say so rather than crash the check
        return [Finding(FAIL, "vllm", f"could not read vLLM {version}'s API: {e!r}")]
    if problems:
        return [Finding(FAIL, "vllm", p) for p in problems]
    paths = "weight versions from vLLM" if detected.weight_versions else "weight versions tracked by rlnode"
    return [Finding(OK, "vllm", f"vllm {version} (in vllm{vllm_compat.SUPPORTED}): {len({u.key for u in uses})} "
                    f"uses of its API, all present; {paths}")]


def check_guard() -> list[Finding]:
    from rlnode.actor.engine_guard import EngineGuardMissing, check_registered

    try:
        check_registered()
    except EngineGuardMissing as e:
        return [Finding(FAIL, "guard", str(e))]
    return [Finding(OK, "guard", "engine guard registered as a vLLM plugin (engines end with their daemon)")]


def nccl_needed(cfg: Config, role: str, gpus: int) -> str:
    """Why this role needs NCCL on this machine ('' when it does not)."""
    t, e = cfg.trainer, cfg.actor.engine
    trainer_cuda = role in ("trainer", "all") and (t.device == "cuda" or (t.device == "auto" and gpus > 0))
    engine_cuda = role in ("actor", "all") and (e.device == "cuda" or (e.device == "auto" and gpus > 0))
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
        version = (load or _load_nccl)()
    except Exception as e:
        return [Finding(FAIL, "nccl", f"{why} needs NCCL, which does not load here: {e} "
                        "(install the nvidia-nccl-cu* wheel that vLLM's torch pins, or set VLLM_NCCL_SO_PATH)")]
    return [Finding(OK, "nccl", f"NCCL {version} loads ({why})")]


def _load_nccl() -> str:
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    return NCCLLibrary().ncclGetVersion()


def check_stack(cfg: Config, role: str, gpus: int, here: bool = True) -> list[Finding]:
    """``here``: the GPUs are this machine's (False: ``--gpus N`` describes
    another machine, whose libraries this one cannot load for it)."""
    out = check_vllm()
    if role in ("actor", "all"):
        out += check_guard()
    if here:
        out += check_nccl(cfg, role, gpus)
    elif nccl_needed(cfg, role, gpus):
        out.append(Finding(WARN, "nccl", f"{nccl_needed(cfg, role, gpus)} needs NCCL: not loaded here "
                           "(--gpus describes another machine; run `rlnode check` there)"))
    return out


__all__ = ["FAIL", "OK", "WARN", "check_guard", "check_nccl", "check_stack", "check_vllm", "nccl_needed"]
