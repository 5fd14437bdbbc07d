"""Actor side of in-flight weight updates: engine workers receive the
trainer's broadcast and load it while the engine keeps its requests.

Two halves, two processes:

* ``WeightReceiverExtension`` runs inside vLLM's worker (the engine-core
  child process; pass ``worker_extension_cls=EXTENSION``). It joins a
  stateless group as rank ``first_rank + worker index``, receives buckets
  into staging buffers on a background thread, and loads them with the
  worker's layerwise reload. Its methods are reached only through
  ``collective_rpc`` with plain data (msgspec-encoded bytes), and are named
  ``rlnode_*`` so they never shadow a vLLM worker method.
* ``join_group`` / ``apply_weight_update`` / ``leave_group`` run in the actor
  daemon and drive one ``Engine`` (STYLE point 8):

      lock -> receive (engine keeps generating) -> pause(keep) -> load
           -> tag version -> resume (in finally) -> log every phase

  The bytes are received *before* the pause: a vLLM utility call blocks the
  engine-core loop, so the receive runs on a worker thread and the driver
  polls it; generation stops only for the load itself.

Two refusals keep an engine's weights trustworthy:

* monotonic: an engine refuses a plan older than the version it holds from
  the same source (trainer incarnation). The refusal is a reject vote in the
  plan agreement every rank takes part in before any bucket flows, so the
  trainer and the other ranks skip the buckets and the group stays usable:
  a refusal can never leave a collective waiting;
* no half-loaded engine serves: when the load itself fails (``LoadError``)
  the engine stays paused, refuses every later update, and
  ``load_failure(engine)`` says why: the actor daemon then exits non-zero
  so that it is restarted from the checkpoint on disk.

Owns: the worker's group membership and staged weights, the per-engine
update lock and weight record. Must not touch: the admission router,
requests (they are kept, never aborted), the trainer's group epochs (rank 0
decides them).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from rlnode.actor import vllm_compat
from rlnode.actor.engine_weights import refresh_fp32_head, set_fp32_head, weight_digest
from rlnode.log import get_logger
from rlnode.weights.plan import (
    GroupSpec,
    LoadError,
    PlanMismatch,
    TransferError,
    WeightUpdateError,
    WeightUpdatePlan,
    decode_plan,
    decode_spec,
    encode,
    unpack_bucket,
)
from rlnode.weights.comm import WeightComm, agree_on_plan

if TYPE_CHECKING:
    import torch

    from rlnode.actor.engine import Engine

EXTENSION = "rlnode.actor.weight_receiver.WeightReceiverExtension"
log = get_logger("rlnode.actor.weights")


class _RotaryReloadNoise(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load
    weights" on every update: the rotary cos/sin cache is a buffer computed
    at start, never in a checkpoint, and the reload puts it back unchanged.
    One line per update per worker hides real warnings; drop exactly it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and record.args[0] == "RotaryEmbedding")


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNoise())


# ==========================================================================
# Worker side (inside the engine-core process)


@dataclass
class _WorkerState:
    """What one worker holds between RPCs."""

    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="rlnode-weights"))
    comm: WeightComm | None = None
    epoch: int = -1
    broken: bool = False  # a transfer failed: the epoch is unusable
    job: Future | None = None
    job_kind: str = ""
    staged: tuple[WeightUpdatePlan, list] | None = None
    checkpoint: dict[str, tuple[int, ...]] | None = None  # name -> shape


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model's safetensors checkpoint: what a
    plan must match (read from the file headers; no tensor data)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def plan_mismatch(plan: WeightUpdatePlan, expected: dict[str, tuple[int, ...]], tied: bool) -> str:
    """Why ``plan`` does not fit the checkpoint layout ('' when it fits).

    The plan must be complete: a fused layer (qkv, gate_up) that got only
    some of its parts would be processed with garbage in the others."""
    if tied:  # the engine's lm_head *is* embed_tokens: nothing to send for it
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    got = {t.name: t.shape for t in plan.tensors() if not (tied and t.name == "lm_head.weight")}
    missing = sorted(expected.keys() - got.keys())
    unknown = sorted(got.keys() - expected.keys())
    shapes = sorted(f"{n}: plan {got[n]} != model {expected[n]}"
                    for n in got.keys() & expected.keys() if tuple(got[n]) != expected[n])
    problems = []
    for label, items in (("missing", missing), ("unknown", unknown), ("shape", shapes)):
        if items:
            problems.append(f"{len(items)} {label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}")
    return "; ".join(problems)


def refresh_tied_heads(model: torch.nn.Module) -> list[str]:
    """Re-run weight post-processing for modules that share their weight
    with an earlier module (a tied ``lm_head``); returns their names.

    Why: vLLM ties ``lm_head.weight`` to ``embed_tokens.weight`` (one
    Parameter). On CPU, ``UnquantizedEmbeddingMethod.process_weights_after_loading``
    then builds a GEMM kernel for the lm_head from the weight's values at
    that time (``dispatch_cpu_unquantized_gemm``: a oneDNN handle or an
    sgl-kernel packed copy), and logits come from that kernel, not from
    ``layer.weight``. The layerwise reload copies new values into the shared
    Parameter through ``embed_tokens`` (the only name the checkpoint
    carries), and re-processes only layers that received tensors, so the
    lm_head's packed copy keeps the *old* embedding: stale logits. Rebuilding
    the kernel from the (already updated) shared weight fixes it. On GPU the
    method is a no-op, so this costs nothing there."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    first_owner: dict[int, str] = {}
    refreshed = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if first_owner.setdefault(id(weight), name) == name:
            continue  # the first owner is the one the reload loaded and processed
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
            refreshed.append(name)
        elif method is not None:
            # A quantised tied head would need its own re-quantisation;
            # refuse rather than serve stale logits silently.
            raise LoadError(f"tied module {name} uses {type(method).__name__}: cannot refresh it")
    return refreshed


class WeightReceiverExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: it has
    ``model_runner``, ``device``, ``vllm_config``). Every method returns
    plain data; nothing here blocks the engine loop for long except
    ``rlnode_load``, which the driver calls while generation is paused."""

    def _rlnode_state(self) -> _WorkerState:
        # The worker's __init__ is vLLM's; state is attached on first use.
        state = self.__dict__.get("_rlnode_worker_state")
        if state is None:
            state = self.__dict__["_rlnode_worker_state"] = _WorkerState()
        return state

    def _rlnode_local_rank(self) -> int:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp = get_tp_group()
        return tp.rank_in_group + tp.world_size * get_pp_group().rank_in_group

    def _rlnode_comm_device(self, backend: str):
        # Buckets land on the engine's device before the pause: NCCL and
        # cuda_ipc write there; gloo receives into CPU memory and copies
        # (WeightComm stages it), so the load itself copies device to device.
        if backend == "cuda_ipc" and self.device.type != "cuda":
            raise PlanMismatch(f"weight backend cuda_ipc needs a cuda engine (this one runs on {self.device})")
        return self.device

    def _rlnode_submit(self, kind: str, fn, *args) -> None:
        state = self._rlnode_state()
        if state.job is not None and not state.job.done():
            raise RuntimeError(f"rlnode: a {state.job_kind} is still running")
        state.job, state.job_kind = state.pool.submit(fn, *args), kind

    def rlnode_join(self, spec_bytes: bytes, first_rank: int) -> int:
        """Start joining group ``spec``; returns this worker's rank. The
        rendezvous runs on the worker thread: poll with ``rlnode_poll``."""
        spec = decode_spec(spec_bytes)
        rank = first_rank + self._rlnode_local_rank()
        if not 0 < rank < spec.world_size:
            raise PlanMismatch(f"rank {rank} outside group epoch {spec.epoch} (world {spec.world_size})")
        self.rlnode_leave()
        state = self._rlnode_state()
        if state.checkpoint is None:
            state.checkpoint = checkpoint_shapes(self.vllm_config.model_config.model)
        device = self._rlnode_comm_device(spec.backend)

        def join() -> None:
            self._rlnode_bind_device()
            state.comm, state.epoch, state.broken = WeightComm(spec, rank, device), spec.epoch, False

        self._rlnode_submit("join", join)
        return rank

    def _rlnode_bind_device(self) -> None:
        # A new thread starts on CUDA device 0; NCCL buffers must be on ours.
        if self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)

    def rlnode_receive(self, plan_bytes: bytes, refuse: str = "") -> None:
        """Start receiving ``plan`` into staging buffers (engine keeps
        generating). A plan that does not fit the model, or that the driver
        ``refuse``s (its reason), is voted down on the group, so the trainer
        and every other rank skip it too."""
        state = self._rlnode_state()
        plan = decode_plan(plan_bytes)
        comm = state.comm
        if comm is None or state.broken or plan.epoch != state.epoch:
            raise TransferError(f"rlnode: no usable group for epoch {plan.epoch} (have {state.epoch})")
        reason = refuse or self._rlnode_check(plan)
        state.staged = None

        def receive() -> None:
            self._rlnode_bind_device()
            if agree_on_plan(comm, plan.digest(), reject=bool(reason)):
                raise PlanMismatch(reason or "another rank rejected the plan")
            try:
                state.staged = (plan, self._rlnode_receive_buckets(comm, plan))
            except Exception:
                state.broken = True
                raise

        self._rlnode_submit("receive", receive)

    def _rlnode_check(self, plan: WeightUpdatePlan) -> str:
        expected = self._rlnode_state().checkpoint
        if not expected:  # not a safetensors checkpoint: nothing to check against
            return ""
        return plan_mismatch(plan, expected, self._rlnode_tied())

    def _rlnode_tied(self) -> bool:
        text_config = self.vllm_config.model_config.hf_config.get_text_config()
        return bool(getattr(text_config, "tie_word_embeddings", False))

    def _rlnode_receive_buckets(self, comm: WeightComm, plan: WeightUpdatePlan) -> list:
        import contextlib

        import torch

        side = torch.cuda.Stream(comm.device) if comm.device.type == "cuda" else None
        bufs = []
        # A side stream keeps the transfer off the stream the model runs on,
        # so decoding continues meanwhile.
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for bucket in plan.buckets:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=comm.device)
                comm.broadcast(buf)
                bufs.append(buf)
            ready = side.record_event() if side is not None else None
        # WeightComm synchronises the side stream per bucket already; the
        # event makes the load (another thread, another stream) wait for the
        # bytes even if a transport stops doing so: rlnode_load waits on it.
        return bufs, ready

    def rlnode_poll(self) -> tuple[str, str, str]:
        """(kind, state, message); state: idle | running | done | rejected | failed."""
        state = self._rlnode_state()
        job = state.job
        if job is None:
            return ("", "idle", "")
        if not job.done():
            return (state.job_kind, "running", "")
        err = job.exception()
        if err is None:
            return (state.job_kind, "done", "")
        return (state.job_kind, "rejected" if isinstance(err, PlanMismatch) else "failed", f"{type(err).__name__}: {err}")

    def rlnode_load(self, version: int) -> dict[str, float]:
        """Load the staged weights of ``version`` (the driver has paused
        generation). Layerwise reload: each layer is re-processed as soon as
        all its tensors arrived, into the same storage (cudagraphs stay)."""
        state = self._rlnode_state()
        if state.staged is None or state.staged[0].version != version:
            raise LoadError(f"rlnode: no staged weights for version {version}")
        plan, (bufs, ready) = state.staged
        state.staged = None
        if ready is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_event(ready)
        # A tied model has no lm_head tensor of its own; a plan may still
        # carry one (a trainer that sends its state_dict): never load it.
        skip = "lm_head.weight" if self._rlnode_tied() else None

        def weights():
            for bucket, buf in zip(plan.buckets, bufs):
                for name, tensor in unpack_bucket(bucket, buf):
                    if name != skip:
                        yield name, tensor

        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        t1 = time.perf_counter()
        refreshed = refresh_tied_heads(self.model_runner.get_model())
        refresh_fp32_head(self.model_runner.get_model())
        if self.device.type == "cuda":
            import torch

            # The staging buffers (allocated on the receive stream) are freed
            # on return: the copies out of them must be finished by then.
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        return {"reload_s": t1 - t0, "retie_s": t2 - t1, "retied": float(len(refreshed))}

    def rlnode_fp32_lm_head(self, enable: bool) -> bool:
        """Compute the lm_head in fp32 from an fp32 copy of its weight
        (``actor.engine.fp32_lm_head``); False: back to the model dtype.
        Returns whether an fp32 head is installed."""
        return set_fp32_head(self.model_runner.get_model(), enable)

    def rlnode_weight_digest(self) -> dict[str, tuple[float, float, str]]:
        """checkpoint name -> (float64 sum, float64 sum of squares, blake2b
        of the bytes) of the weights the engine computes with (see
        ``weight_digest``): compare with ``tensor_digest`` of what the
        trainer sent. Differences mean the engine holds other weights; equal
        digests with differing logprobs mean the kernels differ."""
        return weight_digest(self.model_runner.get_model())

    def rlnode_discard(self) -> None:
        self._rlnode_state().staged = None

    def rlnode_leave(self) -> None:
        """Close this worker's group (a running transfer then fails)."""
        state = self._rlnode_state()
        comm, state.comm, state.staged, state.epoch = state.comm, None, None, -1
        if comm is not None:
            comm.close()


# ==========================================================================
# Driver side (actor daemon, event loop)


class UpdateTimings(msgspec.Struct):
    """One applied update, as logged (seconds)."""

    version: int
    epoch: int
    nbytes: int
    receive_s: float  # vote + transfer into staging (generating unless overlap_transfer=False)
    pause_s: float  # pause_generation(mode="keep") returned
    load_s: float  # collective_rpc load (layerwise reload + tied-head refresh)
    reload_s: float  # of which: vLLM's reload_weights in the worker
    resume_s: float
    stalled_s: float  # pause requested -> resume returned: generation held
    total_s: float
    retied: int = 0  # tied heads whose CPU kernel was rebuilt (see refresh_tied_heads)


@dataclass
class _EngineWeights:
    """What the driver knows about one engine's weights."""

    # Updates, joins and leaves never interleave on an engine.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    source: str | None = None  # who sent the weights it holds (None: loaded from disk)
    version: int = 0  # their version
    failed: str = ""  # why a load failed: the engine is half-loaded, paused for good


_engines: weakref.WeakKeyDictionary[Engine, _EngineWeights] = weakref.WeakKeyDictionary()
# Poll interval bounds for the worker thread's job (s).
POLL_MIN_S, POLL_MAX_S = 0.002, 0.05


def _weights(engine: Engine) -> _EngineWeights:
    if engine not in _engines:
        _engines[engine] = _EngineWeights()
    return _engines[engine]


def _lock(engine: Engine) -> asyncio.Lock:
    return _weights(engine).lock


def load_failure(engine: Engine) -> str:
    """'' unless loading an update failed: then the engine holds partly
    updated weights, is paused, and must be restarted."""
    return _weights(engine).failed


def engine_num_ranks(engine: Engine) -> int:
    """Ranks an engine's workers take in a group (one per model-parallel worker)."""
    pc = engine.llm.vllm_config.parallel_config
    return pc.tensor_parallel_size * pc.pipeline_parallel_size


async def _rpc(engine: Engine, method: str, *args) -> list:
    if engine.llm is None:
        raise TransferError(f"engine {engine.engine_id} is not running")
    try:
        return await engine.llm.collective_rpc(method, args=args)
    except WeightUpdateError:
        raise
    except Exception as e:
        # Worker exceptions arrive re-raised by the engine client; the
        # message is what survives the process boundary.
        raise TransferError(f"engine {engine.engine_id}: {method} failed: {e}") from e


async def _wait_job(engine: Engine, kind: str, timeout_s: float) -> None:
    """Poll every worker's background job until all are done; map a vote
    against the plan to PlanMismatch and anything else to TransferError."""
    deadline, delay = time.monotonic() + timeout_s, POLL_MIN_S
    while True:
        states = await _rpc(engine, "rlnode_poll")
        if any(k != kind for k, _, _ in states):
            raise TransferError(f"engine {engine.engine_id}: expected a {kind} job, workers report {states}")
        done = [s for _, s, _ in states]
        errors = "; ".join(m for _, s, m in states if m)
        if "failed" in done:
            raise TransferError(f"engine {engine.engine_id} {kind} failed: {errors}")
        if "rejected" in done:
            raise PlanMismatch(f"engine {engine.engine_id} {kind} rejected: {errors}")
        if all(s == "done" for s in done):
            return
        if time.monotonic() > deadline:
            raise TransferError(f"engine {engine.engine_id}: {kind} still running after {timeout_s:.0f} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


async def join_group(engine: Engine, spec: GroupSpec, first_rank: int) -> None:
    """Join group epoch ``spec`` (leaving the previous one). Returns once the
    rendezvous with the trainer (rank 0, opening the group concurrently) and
    every other member is complete."""
    spec.validate()
    num_ranks = engine_num_ranks(engine)
    if not any(m.first_rank == first_rank and m.num_ranks == num_ranks for m in spec.members):
        raise PlanMismatch(f"group epoch {spec.epoch}: no member at rank {first_rank} with {num_ranks} rank(s)")
    async with _lock(engine):
        t0 = time.monotonic()
        await _rpc(engine, "rlnode_join", encode(spec), first_rank)
        await _wait_job(engine, "join", spec.timeout_s + 5.0)
        log.info("weights.joined", engine=engine.engine_id, epoch=spec.epoch, first_rank=first_rank,
                 world_size=spec.world_size, join_s=round(time.monotonic() - t0, 3))


async def prepare_engine(engine: Engine) -> None:
    """After ``engine.start()``: install what the worker extension adds to
    the model (the fp32 lm_head when ``cfg.fp32_lm_head``). The engine must
    have been started with ``worker_extension_cls=EXTENSION``."""
    from rlnode.actor.engine import fp32_lm_head_enabled

    if fp32_lm_head_enabled(engine.cfg, engine.model_cfg):
        await _rpc(engine, "rlnode_fp32_lm_head", True)
        log.info("engine.fp32_lm_head", engine=engine.engine_id)


async def weight_digest_of(engine: Engine) -> dict[str, tuple[float, float, str]]:
    """The engine's weight digests (worker 0's; see rlnode_weight_digest)."""
    return (await _rpc(engine, "rlnode_weight_digest"))[0]


async def leave_group(engine: Engine) -> None:
    async with _lock(engine):
        await _rpc(engine, "rlnode_leave")
        log.info("weights.left", engine=engine.engine_id)


async def apply_weight_update(engine: Engine, plan: WeightUpdatePlan, timeout_s: float = 300.0,
                              overlap_transfer: bool = True, source: str = "") -> UpdateTimings:
    """Receive ``plan``'s broadcast (the trainer sends it concurrently) and
    load it. Requests in flight are kept; tokens after the load are tagged
    ``str(plan.version)`` in ``Completion.weight_versions``.

    source: who sends it (the trainer's incarnation). A plan older than the
    version the engine holds from the same source is refused (PlanMismatch;
    voted down before any bytes flow). A different source may go back: a
    restarted trainer resumes from its last checkpoint.

    overlap_transfer: receive while the engine keeps generating (default);
    False pauses first, so the transfer counts as stall too (for NCCL with
    tensor parallelism, where a second communicator running beside the
    model's own is not verified to be safe).

    Raises PlanMismatch (nothing loaded, group usable), TransferError
    (nothing loaded, epoch unusable) or LoadError (the engine stays paused
    and must restart)."""
    plan.validate()
    held = _weights(engine)
    async with held.lock:
        if held.failed:
            raise LoadError(f"engine {engine.engine_id} failed loading earlier and must restart: {held.failed}")
        refuse = ""
        if held.source == source and plan.version < held.version:
            refuse = f"version {plan.version} is older than version {held.version} that the engine holds"
        t0 = time.monotonic()
        try:
            if overlap_transfer:
                await _receive(engine, plan, timeout_s, refuse)
                received_s = time.monotonic() - t0
                phases = await _pause_load_resume(engine, plan.version)
                phases["receive_s"] = received_s
            else:
                phases = await _pause_load_resume(engine, plan.version,
                                                  lambda: _receive(engine, plan, timeout_s, refuse))
        except Exception as e:
            log.warning("weights.update_failed", engine=engine.engine_id, version=plan.version,
                        epoch=plan.epoch, error_type=type(e).__name__, error=str(e))
            raise
        held.source, held.version = source, plan.version
        timings = UpdateTimings(plan.version, plan.epoch, plan.nbytes, total_s=time.monotonic() - t0, **phases)
    log.info("weights.updated", engine=engine.engine_id,
             **{k: round(v, 4) if isinstance(v, float) else v for k, v in msgspec.structs.asdict(timings).items()})
    return timings


async def _receive(engine: Engine, plan: WeightUpdatePlan, timeout_s: float, refuse: str = "") -> None:
    """Vote (against, with reason ``refuse``, when set) + transfer into the
    workers' staging buffers; on any failure (or cancellation) the staged
    bytes are dropped."""
    try:
        await _rpc(engine, "rlnode_receive", encode(plan), refuse)
        await _wait_job(engine, "receive", timeout_s)
    except BaseException:
        await asyncio.shield(_discard(engine))
        raise


async def _discard(engine: Engine) -> None:
    try:
        await _rpc(engine, "rlnode_discard")
    except Exception as e:  # the engine may be gone; nothing staged survives it
        log.warning("weights.discard_failed", engine=engine.engine_id, error=repr(e))


async def _pause_load_resume(engine: Engine, version: int, receive=None) -> dict:
    """pause(keep) -> [receive] -> load -> tag the version -> resume; the
    resume runs whatever happened after the pause was requested, except a
    failed load: a half-loaded engine must not serve, so it stays paused
    (its requests wait, and are aborted when the daemon stops it)."""
    llm = engine.llm
    t0 = time.monotonic()
    t1 = t2 = t0
    try:
        await vllm_compat.pause_keep(llm)
        t1 = t2 = time.monotonic()
        if receive is not None:
            await receive()
            t2 = time.monotonic()
        try:
            results = await _rpc(engine, "rlnode_load", version)
        except Exception as e:
            err = LoadError(f"engine {engine.engine_id}: loading version {version} failed: {e!r}")
            _weights(engine).failed = str(err)
            log.error("weights.load_failed", engine=engine.engine_id, version=version, error=repr(e))
            raise err from e
        # Tokens from here on are produced by the new weights; requests
        # submitted from here on get the new prefix-cache salt.
        await engine.set_weight_version(str(version))
    finally:
        t3 = time.monotonic()
        if not _weights(engine).failed:
            await asyncio.shield(llm.resume_generation())
    t4 = time.monotonic()
    return {"pause_s": t1 - t0, "receive_s": t2 - t1, "load_s": t3 - t2,
            "reload_s": max(r["reload_s"] for r in results), "resume_s": t4 - t3, "stalled_s": t4 - t0,
            "retied": int(results[0]["retied"])}
