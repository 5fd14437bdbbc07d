"""Actor side of in-flight weight updates: the driver, in the actor daemon,
of the engine workers that receive the trainer's broadcast and load it
while the engine keeps its requests. The workers' half runs inside vLLM
(``rlnode.weights.worker``; engines start with ``EXTENSION``).

``join_group`` / ``apply_weight_update`` drive one ``Engine`` (STYLE
point 8); joining an epoch leaves the previous one:

    lock -> receive (engine keeps generating) -> pause(keep) -> load
         -> tag version -> resume (in finally) -> log every phase

The bytes are received *before* the pause: a vLLM utility call blocks the
engine-core loop, so the receive runs on a worker thread, which sends its
outcome to the driver's notice socket when it ends (the driver also polls
every few seconds, for a worker that died); generation stops only for the
load itself.

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

Owns: the per-engine update lock and weight record, the notice socket.
Must not touch: the admission router, requests (they are kept, never
aborted), the trainer's group epochs (rank 0 decides them).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from rlnode.actor import vllm_compat
from rlnode.log import get_logger
from rlnode.weights.plan import (
    GroupSpec,
    LoadError,
    PlanMismatch,
    TransferError,
    WeightUpdateError,
    WeightUpdatePlan,
    encode,
    weights_label,
)
from rlnode.weights.worker import EXTENSION

__all__ = ["EXTENSION", "apply_weight_update", "join_group", "load_failure", "prepare_engine",
           "probe_engine", "receives_while_generating"]

if TYPE_CHECKING:
    from rlnode.actor.engine import Engine

log = get_logger("rlnode.actor.weights")



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
    receive_paused: bool = False  # the bytes came in with generation paused (weight_receive)
    # receive_s, split (the slowest worker's; see rlnode_receive):
    receive_rpc_s: float = 0.0  # the call that starts the job returned
    receive_vote_s: float = 0.0  # plan agreement with every rank (waits for the slowest)
    receive_alloc_s: float = 0.0  # staging buffers allocated
    receive_transfer_s: float = 0.0  # broadcasts: waiting for the sender, the bytes, staging copies
    receive_first_bucket_s: float = 0.0  # of which: until the first bucket was in (the sender's pack + its bytes)
    receive_poll_s: float = 0.0  # job finished -> the driver's poll saw it
    receive_store_s: float = 0.0  # LoRA: the adapter's files written (on the job's thread)
    adapter: bool = False  # a LoRA adapter, served as a new one: no pause (load_s: add_lora)


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


def _verdict(engine: Engine, kind: str, outcomes: list[tuple[str, str, dict]]) -> list[dict[str, float]] | None:
    """Every worker's job as one outcome, from (state, message, phases) per
    worker, polled or noticed: a vote against the plan raises PlanMismatch,
    any other failure TransferError; all done: each worker's phases, with
    how long ago its job finished (``poll_s``); else None (still running)."""
    errors = "; ".join(m for _, m, _ in outcomes if m)
    states = [s for s, _, _ in outcomes]
    if "failed" in states:
        raise TransferError(f"engine {engine.engine_id} {kind} failed: {errors}")
    if "rejected" in states:
        raise PlanMismatch(f"engine {engine.engine_id} {kind} rejected: {errors}")
    if not all(s == "done" for s in states):
        return None
    seen = time.time()
    return [dict(p, poll_s=seen - p["job_done"]) if "job_done" in p else p for _, _, p in outcomes]


async def _poll(engine: Engine, kind: str) -> list[tuple[str, str, dict]]:
    """Every worker's (state, message, phases) for its ``kind`` job."""
    states = await _rpc(engine, "rlnode_poll")
    if any(k != kind for k, _, _, _ in states):
        raise TransferError(f"engine {engine.engine_id}: expected a {kind} job, workers report {states}")
    return [(s, m, p) for _, s, m, p in states]


async def _wait_job(engine: Engine, kind: str, timeout_s: float) -> list[dict[str, float]]:
    """Poll every worker's background job until all are done (returns each
    worker's phases); see ``_verdict`` for what a failure raises."""
    deadline, delay = time.monotonic() + timeout_s, POLL_MIN_S
    while (phases := _verdict(engine, kind, await _poll(engine, kind))) is None:
        if time.monotonic() > deadline:
            raise TransferError(f"engine {engine.engine_id}: {kind} still running after {timeout_s:.0f} s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)
    return phases


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
        if (phases := _verdict(engine, "receive", await _poll(engine, "receive"))) is not None:
            return phases
    return _verdict(engine, "receive", list(got.values()))


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


async def probe_engine(engine: Engine, timeout_s: float) -> None:
    """Return within ``timeout_s`` only if ``engine`` could take a weight
    command now: no join or update holds its lock (one stuck behind a
    frozen engine core would hold up the next join), it loaded every update
    it began, and its engine core and every worker answer a call. Raises
    TransferError otherwise (the trainer keeps the node benched)."""
    if why := load_failure(engine):
        raise TransferError(f"engine {engine.engine_id}: {why}")
    try:
        async with asyncio.timeout(timeout_s), _lock(engine):
            await _rpc(engine, "rlnode_poll")
    except TimeoutError:
        raise TransferError(f"engine {engine.engine_id}: no answer within {timeout_s:g} s "
                            "(a weight job in the way, or the engine core does not answer)") from None


def receives_while_generating(engine: Engine) -> bool:
    """Whether ``engine`` takes in an update's bytes while it keeps
    decoding (``actor.engine.weight_receive``)."""
    return engine.cfg.weight_receive == "generating"


async def apply_weight_update(engine: Engine, plan: WeightUpdatePlan, timeout_s: float = 300.0,
                              overlap_transfer: bool | None = None, source: str = "") -> UpdateTimings:
    """Receive ``plan``'s broadcast (the trainer sends it concurrently) and
    load it. Requests in flight are kept; tokens after the load are tagged
    ``weights_label(plan.version, source)`` in ``Completion.weight_versions``,
    and new requests get it as their prefix-cache salt.

    source: who sends it (the trainer's incarnation): ``plan.source`` when
    the plan names one, else this argument (a trainer that predates it). A
    plan older than the version the engine holds from the same source is
    refused (PlanMismatch; voted down before any bytes flow). A different
    source may go back: a restarted trainer resumes from its last
    checkpoint, and its versions name other weights than the lost ones.

    overlap_transfer: True receives while the engine keeps generating;
    False pauses first, so the transfer counts as stall too (for NCCL with
    tensor parallelism, where a second communicator running beside the
    model's own is not verified to be safe). None:
    ``actor.engine.weight_receive`` decides (``receives_while_generating``).

    Raises PlanMismatch (nothing loaded, group usable), TransferError
    (nothing loaded, epoch unusable) or LoadError (the engine stays paused
    and must restart)."""
    plan.validate()
    source = plan.source or source
    label = weights_label(plan.version, source)
    if plan.adapter is not None:
        return await _apply_adapter(engine, plan, label, source, timeout_s)
    if overlap_transfer is None:
        overlap_transfer = receives_while_generating(engine)
    held = _weights(engine)
    async with held.lock:
        if held.failed:
            raise LoadError(f"engine {engine.engine_id} failed loading earlier and must restart: {held.failed}")
        refuse = _older(held, source, plan.version)
        t0 = time.monotonic()
        split: dict[str, float] = {}
        try:
            if overlap_transfer:
                split = await _receive(engine, plan, timeout_s, refuse)
                received_s = time.monotonic() - t0
                phases = await _pause_load_resume(engine, plan.version, label)
                phases["receive_s"] = received_s
            else:
                phases = await _pause_load_resume(engine, plan.version, label,
                                                  lambda: _receive(engine, plan, timeout_s, refuse, split))
        except Exception as e:
            log.warning("weights.update_failed", engine=engine.engine_id, version=plan.version,
                        epoch=plan.epoch, error_type=type(e).__name__, error=str(e))
            raise
        held.source, held.version = source, plan.version
        timings = UpdateTimings(plan.version, plan.epoch, plan.nbytes, total_s=time.monotonic() - t0, **phases,
                                receive_paused=not overlap_transfer,
                                **{f"receive_{k}": v for k, v in split.items()})
    _log_updated(engine, label, timings)
    return timings


def _older(held: _EngineWeights, source: str, version: int) -> str:
    """Why a plan of ``version`` from ``source`` is refused: older than what
    the engine holds from the same source ("" when it is not)."""
    if held.source == source and version < held.version:
        return f"version {version} is older than version {held.version} that the engine holds"
    return ""


def _log_updated(engine: Engine, label: str, timings: UpdateTimings) -> None:
    log.info("weights.updated", engine=engine.engine_id, label=label,
             **{k: round(v, 4) if isinstance(v, float) else v for k, v in msgspec.structs.asdict(timings).items()})


async def _apply_adapter(engine: Engine, plan: WeightUpdatePlan, label: str, source: str,
                         timeout_s: float) -> UpdateTimings:
    """A LoRA run's update: the adapter's bytes come in while the engine
    generates, the worker writes them as peft's files, and the engine
    serves them as a new adapter (engine_adapters.py). Nothing pauses:
    requests in flight finish on the adapter they started with."""
    held = _weights(engine)
    async with held.lock:
        if engine.adapters is None:
            refuse, path = (f"engine {engine.engine_id} serves no LoRA adapters: the actor started with "
                            "trainer.lora.rank = 0, the trainer sends an adapter"), ""
        else:
            refuse, path = _older(held, source, plan.version), engine.adapters.next_path()[1]
        t0 = time.monotonic()
        try:
            split = await _receive(engine, plan, timeout_s, refuse, adapter_path=path)
            t1 = time.monotonic()
            await engine.serve_adapter(label, path)
        except Exception as e:
            log.warning("weights.update_failed", engine=engine.engine_id, version=plan.version,
                        epoch=plan.epoch, error_type=type(e).__name__, error=str(e))
            raise
        t2 = time.monotonic()
        held.source, held.version = source, plan.version
        timings = UpdateTimings(plan.version, plan.epoch, plan.nbytes, receive_s=t1 - t0, pause_s=0.0,
                                load_s=t2 - t1, reload_s=0.0, resume_s=0.0, stalled_s=0.0, total_s=t2 - t0,
                                adapter=True, **{f"receive_{k}": v for k, v in split.items()})
    _log_updated(engine, label, timings)
    return timings


async def _receive(engine: Engine, plan: WeightUpdatePlan, timeout_s: float, refuse: str = "",
                   split: dict[str, float] | None = None, adapter_path: str = "") -> dict[str, float]:
    """Vote (against, with reason ``refuse``, when set) + transfer into the
    workers' staging buffers; on any failure (or cancellation) the staged
    bytes are dropped. Returns where the time went (the slowest worker's
    phases; also into ``split`` when given)."""
    split = {} if split is None else split
    try:
        notices = _notices(engine)
        nonce = f"{plan.epoch}/{plan.version}/{time.monotonic_ns()}"
        t0 = time.monotonic()
        await _rpc(engine, "rlnode_receive", encode(plan), refuse, notices.addr if notices else "", nonce,
                   *((adapter_path,) if adapter_path else ()))
        split["rpc_s"] = time.monotonic() - t0
        workers = await _wait_notices(engine, notices, nonce, timeout_s - split["rpc_s"])
        for key in ("vote_s", "alloc_s", "transfer_s", "first_bucket_s", "poll_s", "store_s"):
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


async def _pause_load_resume(engine: Engine, version: int, label: str, receive=None) -> dict:
    """pause(keep) -> [receive] -> load -> tag the weights' ``label`` -> resume; the
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
        await engine.set_weight_version(label)
    finally:
        t3 = time.monotonic()
        if not _weights(engine).failed:
            await asyncio.shield(llm.resume_generation())
    t4 = time.monotonic()
    return {"pause_s": t1 - t0, "receive_s": t2 - t1, "load_s": t3 - t2,
            "reload_s": max(r["reload_s"] for r in results), "resume_s": t4 - t3, "stalled_s": t4 - t0,
            "retied": int(results[0]["retied"])}
