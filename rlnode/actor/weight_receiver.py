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
    # Where the last job's time went (s), on its own thread: returned by
    # rlnode_poll once the job is done (the driver's UpdateTimings).
    phases: dict[str, float] = field(default_factory=dict)
    # The driver's notice socket (see _Notices), used only on the job thread.
    notify_addr: str = ""
    notify_sock: object = None
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

    def rlnode_receive(self, plan_bytes: bytes, refuse: str = "", notify: str = "", nonce: str = "") -> None:
        """Start receiving ``plan`` into staging buffers (engine keeps
        generating). A plan that does not fit the model, or that the driver
        ``refuse``s (its reason), is voted down on the group, so the trainer
        and every other rank skip it too. When the job ends, its outcome
        goes to ``notify`` (the driver's socket) tagged ``nonce``: the
        driver learns it at once, not at its next poll through the busy
        engine core (one engine step per call)."""
        state = self._rlnode_state()
        plan = decode_plan(plan_bytes)
        comm = state.comm
        if comm is None or state.broken or plan.epoch != state.epoch:
            raise TransferError(f"rlnode: no usable group for epoch {plan.epoch} (have {state.epoch})")
        reason = refuse or self._rlnode_check(plan)
        state.staged, state.phases = None, {}

        def receive() -> None:
            t0 = time.perf_counter()
            try:
                self._rlnode_bind_device()
                if agree_on_plan(comm, plan.digest(), reject=bool(reason)):
                    raise PlanMismatch(reason or "another rank rejected the plan")
                state.phases["vote_s"] = time.perf_counter() - t0
                try:
                    state.staged = (plan, self._rlnode_receive_buckets(comm, plan, state.phases))
                except Exception:
                    state.broken = True
                    raise
            except Exception as e:
                self._rlnode_notify(notify, nonce, _job_state(e), f"{type(e).__name__}: {e}")
                raise
            state.phases["job_s"] = time.perf_counter() - t0
            state.phases["job_done"] = time.time()
            self._rlnode_notify(notify, nonce, "done", "")

        self._rlnode_submit("receive", receive)

    def _rlnode_check(self, plan: WeightUpdatePlan) -> str:
        expected = self._rlnode_state().checkpoint
        if not expected:  # not a safetensors checkpoint: nothing to check against
            return ""
        return plan_mismatch(plan, expected, self._rlnode_tied())

    def _rlnode_tied(self) -> bool:
        text_config = self.vllm_config.model_config.hf_config.get_text_config()
        return bool(getattr(text_config, "tie_word_embeddings", False))

    def _rlnode_receive_buckets(self, comm: WeightComm, plan: WeightUpdatePlan, phases: dict) -> list:
        import contextlib

        import torch

        side = torch.cuda.Stream(comm.device) if comm.device.type == "cuda" else None
        bufs = []
        alloc_s = transfer_s = 0.0
        # A side stream keeps the transfer off the stream the model runs on,
        # so decoding continues meanwhile.
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for bucket in plan.buckets:
                t0 = time.perf_counter()
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=comm.device)
                t1 = time.perf_counter()
                comm.broadcast(buf)  # waits for the trainer's send, then the bytes (and a staging copy)
                transfer_s += time.perf_counter() - t1
                alloc_s += t1 - t0
                bufs.append(buf)
            ready = side.record_event() if side is not None else None
        phases.update(alloc_s=alloc_s, transfer_s=transfer_s)
        # WeightComm synchronises the side stream per bucket already; the
        # event makes the load (another thread, another stream) wait for the
        # bytes even if a transport stops doing so: rlnode_load waits on it.
        return bufs, ready

    def _rlnode_notify(self, addr: str, nonce: str, job_state: str, message: str) -> None:
        """Tell the driver how the job ended (on the job thread, which owns
        the socket). Best effort: a driver that hears nothing polls."""
        if not addr:
            return
        state = self._rlnode_state()
        try:
            import zmq

            if state.notify_addr != addr:
                if state.notify_sock is not None:
                    state.notify_sock.close(0)
                state.notify_sock = zmq.Context.instance().socket(zmq.PUSH)
                state.notify_sock.linger, state.notify_sock.sndhwm = 1000, 16
                state.notify_sock.connect(addr)
                state.notify_addr = addr
            state.notify_sock.send(msgspec.msgpack.encode(
                (nonce, self._rlnode_local_rank(), job_state, message, state.phases)), zmq.NOBLOCK)
        except Exception as e:  # noqa: BLE001 - the poll still finds the outcome
            log.warning("weights.notify_failed", error=repr(e))

    def rlnode_poll(self) -> tuple[str, str, str, dict[str, float]]:
        """(kind, state, message, phases); state: idle | running | done |
        rejected | failed; phases: where a done job's time went (s), and
        when it finished (``job_done``, wall clock)."""
        state = self._rlnode_state()
        job = state.job
        if job is None:
            return ("", "idle", "", {})
        if not job.done():
            return (state.job_kind, "running", "", {})
        err = job.exception()
        if err is None:
            return (state.job_kind, "done", "", dict(state.phases))
        return (state.job_kind, _job_state(err), f"{type(err).__name__}: {err}", {})

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


def _job_state(err: BaseException) -> str:
    return "rejected" if isinstance(err, PlanMismatch) else "failed"


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
    # receive_s, split (the slowest worker's; see rlnode_receive):
    receive_rpc_s: float = 0.0  # the call that starts the job returned
    receive_vote_s: float = 0.0  # plan agreement with every rank (waits for the slowest)
    receive_alloc_s: float = 0.0  # staging buffers allocated
    receive_transfer_s: float = 0.0  # broadcasts: waiting for the sender, the bytes, staging copies
    receive_poll_s: float = 0.0  # job finished -> the driver's poll saw it


@dataclass
class _EngineWeights:
    """What the driver knows about one engine's weights."""

    # Updates, joins and leaves never interleave on an engine.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    source: str | None = None  # who sent the weights it holds (None: loaded from disk)
    version: int = 0  # their version
    failed: str = ""  # why a load failed: the engine is half-loaded, paused for good
    notices: _Notices | None = None


class _Notices:
    """Where an engine's workers report the end of a receive job: a ZeroMQ
    PULL socket in the engine's scratch directory. Polling through the
    engine core costs an engine step per call while it generates (measured
    0.08-0.13 s on the tiny model); a notice arrives when the job ends."""

    def __init__(self, scratch: str):
        import zmq
        import zmq.asyncio

        self.scratch = scratch
        self.sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self.sock.linger = 0
        self.addr = f"ipc://{scratch}/weights-notices"
        self.sock.bind(self.addr)

    async def collect(self, nonce: str, got: dict[int, tuple], workers: int, timeout_s: float) -> bool:
        """Read notices into ``got`` (worker -> (state, message, phases))
        until ``workers`` are tagged ``nonce`` (True) or ``timeout_s`` passed.
        Stale notices (a cancelled update's) are dropped."""
        deadline = time.monotonic() + timeout_s
        while len(got) < workers:
            left = deadline - time.monotonic()
            if left <= 0 or not await self.sock.poll(left * 1000):
                return False
            try:
                tag, rank, job_state, message, phases = msgspec.msgpack.decode(await self.sock.recv())
            except (ValueError, msgspec.DecodeError):
                continue  # not one of our workers' notices
            if tag == nonce:
                got[rank] = (job_state, message, phases)
        return True

    def close(self) -> None:
        self.sock.close(0)


def _notices(engine: Engine) -> _Notices | None:
    """The engine's notice socket (None: no scratch directory to put it in,
    the driver polls). A restarted engine has a new scratch directory."""
    held = _weights(engine)
    if held.notices is not None and held.notices.scratch != engine.scratch:
        held.notices.close()
        held.notices = None
    if held.notices is None and engine.scratch:
        held.notices = _Notices(engine.scratch)
        weakref.finalize(engine, held.notices.close)
    return held.notices


_engines: weakref.WeakKeyDictionary[Engine, _EngineWeights] = weakref.WeakKeyDictionary()
# Poll interval bounds for the worker thread's job (s).
POLL_MIN_S, POLL_MAX_S = 0.002, 0.05
# While waiting for its workers' notices, the driver polls this often
# anyway (a worker that died sends none).
NOTICE_CHECK_S = 2.0


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


async def _wait_job(engine: Engine, kind: str, timeout_s: float) -> list[dict[str, float]]:
    """Poll every worker's background job until all are done (returns each
    worker's phases); map a vote against the plan to PlanMismatch and
    anything else to TransferError."""
    deadline, delay = time.monotonic() + timeout_s, POLL_MIN_S
    while True:
        states = await _rpc(engine, "rlnode_poll")
        if any(k != kind for k, _, _, _ in states):
            raise TransferError(f"engine {engine.engine_id}: expected a {kind} job, workers report {states}")
        done = [s for _, s, _, _ in states]
        errors = "; ".join(m for _, s, m, _ in states if m)
        if "failed" in done:
            raise TransferError(f"engine {engine.engine_id} {kind} failed: {errors}")
        if "rejected" in done:
            raise PlanMismatch(f"engine {engine.engine_id} {kind} rejected: {errors}")
        if all(s == "done" for s in done):
            seen = time.time()
            return [dict(p, poll_s=seen - p["job_done"]) if "job_done" in p else p for _, _, _, p in states]
        if time.monotonic() > deadline:
            raise TransferError(f"engine {engine.engine_id}: {kind} still running after {timeout_s:.0f} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


async def _wait_notices(engine: Engine, notices: _Notices | None, nonce: str,
                        timeout_s: float) -> list[dict[str, float]]:
    """The receive job's outcome on every worker (each one's phases): from
    their notices as they come; every NOTICE_CHECK_S without all of them, one
    poll through the engine (a worker that died sends nothing, and a notice
    may not have been sendable): it fails fast or finds them done."""
    if notices is None:
        return await _wait_job(engine, "receive", timeout_s)
    got: dict[int, tuple] = {}
    workers, deadline = engine_num_ranks(engine), time.monotonic() + timeout_s
    while not await notices.collect(nonce, got, workers, min(NOTICE_CHECK_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            raise TransferError(f"engine {engine.engine_id}: receive still running after {timeout_s:.0f} s")
        states = await _rpc(engine, "rlnode_poll")
        if any(s in ("failed", "rejected") for _, s, _, _ in states) or all(s == "done" for _, s, _, _ in states):
            return await _wait_job(engine, "receive", 0.0)  # its verdict, from the polled states
    heard = list(got.values())
    seen = time.time()
    errors = "; ".join(m for _, m, _ in heard if m)
    if any(s == "failed" for s, _, _ in heard):
        raise TransferError(f"engine {engine.engine_id} receive failed: {errors}")
    if any(s == "rejected" for s, _, _ in heard):
        raise PlanMismatch(f"engine {engine.engine_id} receive rejected: {errors}")
    return [dict(p, poll_s=seen - p["job_done"]) if "job_done" in p else p for _, _, p in heard]


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
        split: dict[str, float] = {}
        try:
            if overlap_transfer:
                split = await _receive(engine, plan, timeout_s, refuse)
                received_s = time.monotonic() - t0
                phases = await _pause_load_resume(engine, plan.version)
                phases["receive_s"] = received_s
            else:
                phases = await _pause_load_resume(engine, plan.version,
                                                  lambda: _receive(engine, plan, timeout_s, refuse, split))
        except Exception as e:
            log.warning("weights.update_failed", engine=engine.engine_id, version=plan.version,
                        epoch=plan.epoch, error_type=type(e).__name__, error=str(e))
            raise
        held.source, held.version = source, plan.version
        timings = UpdateTimings(plan.version, plan.epoch, plan.nbytes, total_s=time.monotonic() - t0, **phases,
                                **{f"receive_{k}": v for k, v in split.items()})
    log.info("weights.updated", engine=engine.engine_id,
             **{k: round(v, 4) if isinstance(v, float) else v for k, v in msgspec.structs.asdict(timings).items()})
    return timings


async def _receive(engine: Engine, plan: WeightUpdatePlan, timeout_s: float, refuse: str = "",
                   split: dict[str, float] | None = None) -> dict[str, float]:
    """Vote (against, with reason ``refuse``, when set) + transfer into the
    workers' staging buffers; on any failure (or cancellation) the staged
    bytes are dropped. Returns where the time went (the slowest worker's
    phases; also into ``split`` when given)."""
    split = {} if split is None else split
    try:
        notices = _notices(engine)
        nonce = f"{plan.epoch}/{plan.version}/{time.monotonic_ns()}"
        t0 = time.monotonic()
        await _rpc(engine, "rlnode_receive", encode(plan), refuse, notices.addr if notices else "", nonce)
        split["rpc_s"] = time.monotonic() - t0
        workers = await _wait_notices(engine, notices, nonce, timeout_s - split["rpc_s"])
        for key in ("vote_s", "alloc_s", "transfer_s", "poll_s"):
            split[key] = max((w.get(key, 0.0) for w in workers), default=0.0)
        return split
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
