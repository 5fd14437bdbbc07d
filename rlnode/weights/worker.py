"""Inside vLLM's worker process: ``WeightReceiverExtension``, mixed into
the worker class (``worker_extension_cls=EXTENSION``).

It joins a stateless group as rank ``first_rank + worker index``, receives
buckets into staging buffers on a background thread while the engine keeps
generating, tells the driver when the job ended (a notice on the driver's
socket), and loads the staged weights with the worker's layerwise reload
while the driver holds generation paused. Its methods are reached only
through ``collective_rpc`` with plain data (msgspec-encoded bytes), and are
named ``rlnode_*`` so they never shadow a vLLM worker method.

The driver, in the actor daemon, is ``rlnode.actor.weight_receiver``; what
the engine's kernels compute with (digests, the fp32 head) is
``engine_model``. Must not touch: the engine loop, requests, the actor's
sockets other than the driver's notice socket.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from rlnode.log import get_logger
from rlnode.weights import cpu_lora_ops
from rlnode.weights.comm import WeightComm, agree_on_plan
from rlnode.weights.engine_model import refresh_fp32_head, set_fp32_head, weight_digest
from rlnode.weights.lora import adapter_mismatch, write_adapter
from rlnode.weights.plan import (
    LoadError,
    PlanMismatch,
    TransferError,
    WeightUpdatePlan,
    decode_plan,
    decode_spec,
    unpack_bucket,
)

if TYPE_CHECKING:
    import torch

EXTENSION = "rlnode.weights.worker.WeightReceiverExtension"
log = get_logger("rlnode.weights.worker")

# vLLM's CPU LoRA ops copy an adapter's matrix for every token; grouped by
# adapter instead (cpu_lora_ops.py). The worker imports this module before
# it runs the model; GPUs' Triton ops are untouched.
cpu_lora_ops.install()


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


# The job thread's kernel name (/proc/PID/task/TID/comm; top -H, py-spy,
# gdb show it): an operator looking at a stuck receive finds it by name
# among vLLM's threads, and so does the cluster test that wedges it.
JOB_THREAD_NAME = b"rlnode-weights"


def _name_job_thread() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, JOB_THREAD_NAME, 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is cosmetic
        pass


@dataclass
class _WorkerState:
    """What one worker holds between RPCs."""

    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="rlnode-weights",
                                                   initializer=_name_job_thread))
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
    # The staging buffers, one per bucket, kept from one update to the next
    # (every update of a group has the same bucket sizes): fresh buffers
    # cost page faults on every byte received on CPU (freed large blocks go
    # back to the OS), and the peak memory is the same either way. Dropped
    # when the bucket sizes change and when the worker leaves its group.
    staging: list = field(default_factory=list)

    def staging_for(self, plan: WeightUpdatePlan, device) -> list:
        import torch

        sizes = [b.nbytes for b in plan.buckets]
        if [b.numel() for b in self.staging] != sizes or any(b.device != device for b in self.staging):
            self.staging = []  # the old ones go before the new ones come
            self.staging = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        return self.staging


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
    ``rlnode_load``, which the driver calls while generation is paused.
    In particular no method waits for a collective: join and leave hand a
    group with a job still in flight to a thread that closes it
    (``_retire``)."""

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
        state = self._rlnode_state()  # a fresh one: the old group's job may still be running on its own
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

    def rlnode_receive(self, plan_bytes: bytes, refuse: str = "", notify: str = "", nonce: str = "",
                       adapter_path: str = "") -> None:
        """Start receiving ``plan`` into staging buffers (engine keeps
        generating). A plan that does not fit the model, or that the driver
        ``refuse``s (its reason), is voted down on the group, so the trainer
        and every other rank skip it too. When the job ends, its outcome
        goes to ``notify`` (the driver's socket) tagged ``nonce``: the
        driver learns it at once, not at its next poll through the busy
        engine core (one engine step per call). A LoRA adapter's plan is
        written, still on the job's thread, as peft's files into
        ``adapter_path`` (by local rank 0), which the driver then hands to
        the engine as a new adapter: nothing is staged and no load follows."""
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
                    state.staged = (plan, self._rlnode_receive_buckets(comm, plan, state))
                except Exception:
                    state.broken = True
                    raise
                if plan.adapter is not None:
                    self._rlnode_store_adapter(state, adapter_path)
            except Exception as e:
                self._rlnode_notify(notify, nonce, _job_state(e), f"{type(e).__name__}: {e}")
                raise
            state.phases["job_s"] = time.perf_counter() - t0
            state.phases["job_done"] = time.time()
            self._rlnode_notify(notify, nonce, "done", "")

        self._rlnode_submit("receive", receive)

    def _rlnode_check(self, plan: WeightUpdatePlan) -> str:
        expected = self._rlnode_state().checkpoint
        lora = getattr(self.vllm_config, "lora_config", None)
        max_rank = lora.max_lora_rank if lora is not None else 0
        if plan.adapter is not None:
            return adapter_mismatch(plan, expected or {}, max_rank)
        if max_rank:
            return ("a full-weight plan to an engine that serves LoRA adapters (trainer.lora.rank > 0 at "
                    "its start): the trainer and the actor disagree on trainer.lora.rank")
        if not expected:  # not a safetensors checkpoint: nothing to check against
            return ""
        return plan_mismatch(plan, expected, self._rlnode_tied())

    def _rlnode_store_adapter(self, state: _WorkerState, path: str) -> None:
        """The staged adapter, as peft's files in ``path`` (on the job's
        thread; local rank 0 writes, every rank drops its staged bytes)."""
        plan, (bufs, ready) = state.staged
        state.staged = None
        if self._rlnode_local_rank() != 0:
            return
        if not path:
            raise LoadError("rlnode: an adapter plan with no adapter_path to write it to")
        if ready is not None:
            ready.synchronize()
        t0 = time.perf_counter()
        tensors = [t for bucket, buf in zip(plan.buckets, bufs) for t in unpack_bucket(bucket, buf)]
        write_adapter(path, plan.adapter, tensors, base=self.vllm_config.model_config.model, durable=False)
        state.phases["store_s"] = time.perf_counter() - t0

    def _rlnode_tied(self) -> bool:
        text_config = self.vllm_config.model_config.hf_config.get_text_config()
        return bool(getattr(text_config, "tie_word_embeddings", False))

    def _rlnode_receive_buckets(self, comm: WeightComm, plan: WeightUpdatePlan, state: _WorkerState) -> list:
        import contextlib

        import torch

        side = torch.cuda.Stream(comm.device) if comm.device.type == "cuda" else None
        # A side stream keeps the transfer off the stream the model runs on,
        # so decoding continues meanwhile.
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            bufs = state.staging_for(plan, comm.device)
            t1 = time.perf_counter()
            first_s = 0.0
            for i, buf in enumerate(bufs):
                comm.broadcast(buf)  # waits for the trainer's send, then the bytes (and a staging copy)
                if i == 0:
                    first_s = time.perf_counter() - t1
            ready = side.record_event() if side is not None else None
        # transfer_s = first_s (waiting for the trainer's first bucket: its
        # pack, plus the bytes of one bucket) + the rest of the bytes.
        state.phases.update(alloc_s=t1 - t0, transfer_s=time.perf_counter() - t1, first_bucket_s=first_s)
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
        """Leave this worker's group: the worker starts over with a fresh
        state (no group, no job, no staged bytes). The old group is closed
        here when it has no job in flight, else on a thread of its own
        (``_retire``): a job in flight cannot be cut short, gloo's close
        waits for its collective to end or to reach the group's timeout
        (measured: a receive waiting for a silent sender held close for the
        whole 20 s timeout), and this call runs on the engine core, which
        must not stop generating for that long. The old job's outcome goes
        nowhere: it wrote only to the old state, and its notice carries the
        old update's nonce, which the driver drops."""
        old = self._rlnode_state()
        self.__dict__["_rlnode_worker_state"] = _WorkerState(checkpoint=old.checkpoint)
        if old.job is None or old.job.done():
            _retire(old)
            return
        log.warning("weights.leave_in_background", job=old.job_kind, epoch=old.epoch)
        threading.Thread(target=_retire, args=(old,), name="rlnode-weights-retire", daemon=True).start()


def _retire(state: _WorkerState) -> None:
    """Release what a left group's state holds: wait for its job (a
    collective in flight ends by the group's timeout at the latest; a join
    that completes meanwhile leaves its group here too), then close the
    group, the job thread and the notice socket (the job thread, which
    owned the socket, is done by then)."""
    t0 = time.monotonic()
    if state.job is not None:
        wait_futures([state.job])
    try:
        if state.comm is not None:
            state.comm.close()
    except Exception as e:  # noqa: BLE001 - a broken group still goes; the worker keeps serving
        log.warning("weights.close_failed", epoch=state.epoch, error=repr(e))
    finally:
        state.comm, state.staged, state.staging = None, None, []
        state.pool.shutdown(wait=False)
        if state.notify_sock is not None:
            state.notify_sock.close(0)
            state.notify_sock = None
    if state.job is not None:
        log.info("weights.group_retired", epoch=state.epoch, job=state.job_kind,
                 waited_s=round(time.monotonic() - t0, 3))


def _job_state(err: BaseException) -> str:
    return "rejected" if isinstance(err, PlanMismatch) else "failed"
