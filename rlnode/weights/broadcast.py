"""Trainer side of in-flight weight updates: rank 0 of a stateless group.

Owns: group epochs (rendezvous port, membership, open/close), the bucket
plan for a model's parameters, and the broadcast of the bytes. One
``WeightBroadcaster`` per trainer.

Must not touch: engines or actors (the trainer daemon sends ``GroupSpec`` and
``WeightUpdatePlan`` to actors over ZeroMQ; actors drive their engines with
``rlnode.actor.weight_receiver``), the optimizer, the model's values (it only
reads parameters).

Epochs: membership of a group never changes. An actor joining or leaving
means ``new_epoch(...)`` (fresh port bound to the advertised host, fresh
secret, fresh group) and ``open_group(spec)``, which closes the previous
group first. A failed broadcast (``TransferError``) leaves the epoch
unusable; form a new one.

Blocking: ``open_group``, ``broadcast`` and ``close_group`` wait on the other
ranks (rendezvous, collectives) and are plain functions; the ``*_async``
wrappers run them with ``asyncio.to_thread`` so the daemon's loop keeps going.
The caller must ensure the actors join / receive concurrently. Cancelling a
wrapper does not stop the thread: a broadcast runs to its end or its timeout.
``broadcast`` reads the parameters as they are: the optimizer must not step
until it returns. ``WeightGuard`` is the lock that makes sure of it, and
keeps the version label of a push equal to the weights it read.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from rlnode.config import WeightSyncConfig
from rlnode.log import get_logger
from rlnode.weights.rendezvous import RendezvousError, new_secret, secret_key
from rlnode.weights.plan import (
    AdapterSpec,
    GroupMember,
    GroupSpec,
    PlanMismatch,
    TransferError,
    WeightUpdatePlan,
    dtype_name,
    pack_bucket,
    plan_buckets,
)
from rlnode.weights.comm import WeightComm, agree_on_plan

if TYPE_CHECKING:
    import torch

log = get_logger("rlnode.weights.broadcast")

# How far above the last epoch's port a new epoch looks for a free one.
PORT_SEARCH_SPAN = 1000
# Prefixes that wrappers add to parameter names (DDP, torch.compile); the
# engine knows the checkpoint names only.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class BroadcastStats(msgspec.Struct):
    version: int
    epoch: int
    nbytes: int
    buckets: int
    tensors: int
    agree_s: float  # digest + vote collectives (waits for every receiver to be ready)
    transfer_s: float  # packing + one broadcast per bucket
    # of transfer_s: copying parameters into bucket buffers (bucket k+1 is
    # packed while bucket k is on the wire where the transport allows), and
    # waiting for broadcasts to finish.
    pack_s: float = 0.0
    send_wait_s: float = 0.0


def update_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every parameter, each storage once.

    Tied embeddings: ``named_parameters`` already lists a shared parameter
    once (``model.embed_tokens.weight``; ``lm_head.weight`` is the same
    tensor), and the engine's tied model has no separate lm_head tensor to
    fill. Deduplicating by storage as well keeps a tie that a wrapper exposes
    under two names from travelling twice."""
    out, seen = [], set()
    for name, p in model.named_parameters():
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape))
        if key in seen:
            continue
        seen.add(key)
        for prefix in WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        out.append((name, p.detach()))
    return out


class WeightGuard:
    """The trainer's parameters and the policy version they hold, behind one
    lock (a ``threading.Lock``: optimizer steps and broadcasts run in worker
    threads).

    Optimizer steps run through ``step``: the version moves to v + 1 inside
    the lock, together with the weights. A push reads the parameters inside
    ``reading()``, which yields the version of exactly those weights: it
    never sees a half-stepped model, and the label it sends (which actors
    also use as their prefix-cache salt) never names weights it does not
    carry. A push holds the lock for its whole broadcast (buckets are packed
    from the live parameters one by one): a step that wants to start waits
    for it, at most the group's timeout. In the train loop the push follows
    the step anyway; only a push for a joining actor or a retry can delay a
    step.
    """

    def __init__(self, version: int):
        self._lock = threading.Lock()
        self.version = version
        # monotonic time of the last step's start or end (or of creation):
        # the trainer's stall watch reads it without the lock.
        self.progress_at = time.monotonic()

    def step(self, fn, *args):
        """Blocking: ``fn(*args)`` (an optimizer step returning StepMetrics)
        under the lock; the version moves only when it returns and the
        weights moved (``skipped`` false: a non-finite step left them as
        they were, and a version names weights, not attempts)."""
        with self._lock:
            self.progress_at = time.monotonic()
            try:
                out = fn(*args)
                if not out.skipped:
                    self.version += 1
            finally:
                self.progress_at = time.monotonic()
        return out

    @contextlib.contextmanager
    def reading(self):
        """Blocking: hold the lock; yields the version the parameters hold."""
        with self._lock:
            yield self.version


class EnginePlace(NamedTuple):
    """Where one engine of a group runs, as its actor reported it
    (``wire.EngineInfo``)."""

    actor_id: str  # "<node id>/<engine index>"
    host: str = ""  # weight_ipc.host_identity(); "" = not said (an older actor)
    gpus: tuple[str, ...] = ()  # UUIDs its worker ranks see; () = not said, or a CPU engine


def resolve_backend(cfg: WeightSyncConfig, device: str, engines: Sequence[EnginePlace] = (), *,
                    local_host: str | None = None, trainer_gpu: str | None = None) -> tuple[str, str]:
    """The transport of one group epoch and why, for the log and /status.

    "auto": a CPU trainer -> gloo; a cuda trainer -> cuda_ipc when every
    engine runs on this machine and the trainer's GPU is among the GPUs
    every one of its worker ranks sees (NCCL refuses two ranks on one GPU,
    and a shared GPU is the common single-node case), else nccl: an engine
    that runs elsewhere, that sees only its own GPUs (each engine runs
    under its own CUDA_VISIBLE_DEVICES), or whose actor did not say (an
    older one) could not open the trainer's memory. ``trainer_gpu``: the
    trainer's GPU UUID (None = asked from torch); ``local_host``: this
    machine (None = ``host_identity()``)."""
    from rlnode.weights.ipc import gpu_key, host_identity, own_gpu_uuid, sees_gpu

    if cfg.backend != "auto":
        return cfg.backend, f"weight_sync.backend = {cfg.backend}"
    if not str(device).startswith("cuda"):
        return "gloo", f"the trainer is on {device}"
    if not engines:
        return "nccl", "no engine said where it runs"
    local_host = host_identity() if local_host is None else local_host
    if away := [e.actor_id for e in engines if e.host != local_host]:
        return "nccl", f"engines {away} run on another machine or did not say where (older actors)"
    trainer_gpu = own_gpu_uuid(device) if trainer_gpu is None else trainer_gpu
    if not trainer_gpu:
        return "nccl", f"the UUID of the trainer's GPU ({device}) is unknown"
    if blind := {e.actor_id: list(e.gpus) for e in engines if not sees_gpu(e.gpus, trainer_gpu)}:
        return "nccl", (f"the trainer's GPU GPU-{gpu_key(trainer_gpu)} is not visible to engines {blind} "
                        "(the GPUs each sees; [] = not said: an older actor or no NVML)")
    return "cuda_ipc", f"every engine runs on this machine and sees the trainer's GPU GPU-{gpu_key(trainer_gpu)}"


def _place(actor_id: str, host: str = "", gpus: Sequence[str] = ()) -> EnginePlace:
    """Where a ``new_epoch`` member runs; its rank count lays out the group,
    it has no say in the transport."""
    return EnginePlace(actor_id, host, tuple(gpus))


class WeightBroadcaster:
    """Rank 0: plans and broadcasts weight updates to every engine worker."""

    def __init__(self, cfg: WeightSyncConfig, *, master_host: str, device: str = "cpu",
                 timeout_s: float = 300.0, send_dtype: str | None = None, gpu_uuid: str | None = None,
                 source: str = ""):
        self.cfg = cfg
        # Stamped on every plan (WeightUpdatePlan.source): the trainer's
        # incarnation, so the engines name the weights by it as well as by
        # their version.
        self.source = source
        self.master_host = cfg.master_host or master_host
        self.device = device
        # The configured transport; "auto" is decided per epoch (new_epoch),
        # from where the members run and which GPUs they see.
        self.backend = cfg.backend
        # Why the last epoch got its transport (logged, and in /status).
        self.backend_reason = ""
        # The trainer's GPU UUID; None = asked from torch when an epoch needs it.
        self.gpu_uuid = gpu_uuid
        if self.backend in ("nccl", "cuda_ipc") and not str(device).startswith("cuda"):
            raise ValueError(f"weight_sync.backend = {self.backend} needs the trainer's tensors on cuda")
        self.timeout_s = timeout_s
        # e.g. "bfloat16": halve the bytes when the engine serves bf16 while
        # the trainer keeps fp32 master weights; None = the parameters' dtype.
        self.send_dtype = send_dtype
        self.epoch = 0
        self.spec: GroupSpec | None = None
        self._comm: WeightComm | None = None
        self._broken = False
        self._next_port = cfg.base_port
        # epoch -> bound listening socket, held from new_epoch to open_group
        # so no one else takes the port in between.
        self._reserved: dict[int, socket.socket] = {}
        self._pack_bufs: list[torch.Tensor | None] = [None, None]
        # Held by open_group, broadcast and close_group: the group is never
        # closed under a broadcast. The daemon's shutdown closes it from its
        # own thread, outside the pusher's lock, while a push thread may
        # still be sending (a to_thread call cannot be cancelled); closing
        # then waits for that broadcast to end (or time out) instead of
        # tearing the communicator down under it. Reentrant: open_group
        # closes the previous epoch first.
        self._group_lock = threading.RLock()

    # -- epochs ------------------------------------------------------------

    def new_epoch(self, members: Sequence[tuple]) -> GroupSpec:
        """Describe the next group: ``members`` = (actor_id, num_ranks[,
        host[, gpus]]) in rank order (``gpus``: the UUIDs the engine's
        workers see). Reserves a fresh port; send the spec to the actors,
        then ``open_group(spec)`` while they join."""
        if not members:
            raise ValueError("a group epoch needs at least one engine")
        for sock in self._reserved.values():  # specs planned but never opened
            sock.close()
        self._reserved.clear()
        places = [_place(m[0], *m[2:]) for m in members]  # m[1], the rank count: below
        backend, why = resolve_backend(self.cfg, self.device, places, trainer_gpu=self._gpu_uuid())
        if backend == "cuda_ipc":
            self._check_ipc(places)
        self.epoch += 1
        sock, port = self._reserve_port()
        self._reserved[self.epoch] = sock
        rank, group = 1, []
        for place, member in zip(places, members):
            group.append(GroupMember(place.actor_id, rank, member[1], place.host))
            rank += member[1]
        # A fresh secret per epoch: it reaches the members inside the spec
        # (over the link) only, and a member of an old epoch cannot join.
        spec = GroupSpec(self.epoch, self.master_host, port, rank, backend,  # type: ignore[arg-type]
                         tuple(group), self.timeout_s, secret=new_secret())
        spec.validate()
        self.backend_reason = why
        log.info("weights.backend", epoch=self.epoch, backend=backend, why=why)
        return spec

    def _gpu_uuid(self) -> str | None:
        if self.gpu_uuid is None and str(self.device).startswith("cuda"):
            from rlnode.weights.ipc import own_gpu_uuid

            self.gpu_uuid = own_gpu_uuid(self.device)
        return self.gpu_uuid

    def _check_ipc(self, places: Sequence[EnginePlace]) -> None:
        """cuda_ipc (configured or chosen): every engine must be able to open
        the trainer's memory. An engine that did not report its GPUs (an
        older actor) is let try: the configured choice is the operator's."""
        from rlnode.weights.ipc import host_identity, sees_gpu

        if remote := [p.actor_id for p in places if p.host != host_identity()]:
            raise PlanMismatch(f"weight_sync.backend = cuda_ipc: engines {remote} are not on the trainer's host")
        if (gpu := self._gpu_uuid()) and (blind := {p.actor_id: list(p.gpus) for p in places
                                                    if p.gpus and not sees_gpu(p.gpus, gpu)}):
            raise PlanMismatch(f"weight_sync.backend = cuda_ipc: the trainer's GPU {gpu} is not visible to engines "
                               f"{blind} (the GPUs each sees); use nccl, or give the engines the trainer's GPU")

    def _reserve_port(self) -> tuple[socket.socket, int]:
        for port in range(self._next_port, self._next_port + PORT_SEARCH_SPAN):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((self.master_host, port))
                sock.listen()
            except OSError:
                sock.close()
                continue
            # Next epoch starts above this one: a late worker of the old
            # epoch can never reach the new rendezvous.
            self._next_port = port + 1 if port + 1 < 65000 else self.cfg.base_port
            return sock, port
        raise TransferError(f"no free port in {self._next_port}..{self._next_port + PORT_SEARCH_SPAN}")

    def open_group(self, spec: GroupSpec) -> None:
        """Blocking: rendezvous as rank 0 until every member joined (or
        ``spec.timeout_s``). Closes the previous epoch's group first.
        Members are admitted by proving they hold ``spec.secret``
        (``rlnode.weights.rendezvous``); one that shows a wrong proof fails the epoch
        within seconds, naming its rank."""
        if spec.epoch != self.epoch or spec.epoch not in self._reserved:
            raise PlanMismatch(f"open_group: epoch {spec.epoch} is not the planned epoch {self.epoch}")
        secret_key(spec)  # no unauthenticated epoch: raises RendezvousError without a secret
        with self._group_lock:
            self._open_group(spec)

    def _open_group(self, spec: GroupSpec) -> None:
        self.close_group()
        t0 = time.monotonic()
        sock = self._reserved.pop(spec.epoch)
        try:
            self._comm = WeightComm(spec, 0, self.device, listen_socket=sock)
        except RendezvousError as e:  # keeps its type: it names the rank that failed the epoch
            sock.close()
            raise RendezvousError(f"rendezvous failed: {e}", e.ranks) from e
        except Exception as e:
            sock.close()
            raise TransferError(f"group epoch {spec.epoch}: rendezvous failed: {e!r}") from e
        self.spec, self._broken = spec, False
        log.info("weights.group_opened", epoch=spec.epoch, port=spec.master_port,
                 world_size=spec.world_size, backend=spec.backend, open_s=round(time.monotonic() - t0, 3))

    def close_group(self) -> None:
        """Blocking: waits for a broadcast in flight (see ``_group_lock``)."""
        with self._group_lock:
            if self._comm is None:
                return
            comm, self._comm = self._comm, None
            try:
                comm.close()
            finally:
                log.info("weights.group_closed", epoch=comm.spec.epoch)

    # -- updates -----------------------------------------------------------

    def plan(self, tensors: Sequence[tuple[str, torch.Tensor]], version: int,
             adapter: AdapterSpec | None = None) -> WeightUpdatePlan:
        """The plan for broadcasting ``tensors`` (see ``update_tensors``; a
        LoRA ``adapter``'s: ``lora.adapter_tensors``) as ``version`` on the
        current epoch."""
        if self.spec is None:
            raise TransferError("no open group: new_epoch() + open_group() first")
        metas = [(n, self.send_dtype or dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors]
        buckets = plan_buckets(metas, self.cfg.bucket_mb << 20)
        plan = WeightUpdatePlan(version, self.spec.epoch, buckets, self.spec.backend, source=self.source,
                                adapter=adapter)
        plan.validate()
        return plan

    def broadcast(self, plan: WeightUpdatePlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> BroadcastStats:
        """Blocking: agree on the plan with every receiver, then one
        broadcast per bucket. Raises PlanMismatch when a receiver rejected the
        plan (nothing was sent; the group stays usable), TransferError when
        the group failed (the epoch is unusable)."""
        with self._group_lock:
            return self._broadcast(plan, tensors)

    def _broadcast(self, plan: WeightUpdatePlan, tensors: Iterable[tuple[str, torch.Tensor]]) -> BroadcastStats:
        comm = self._usable_comm(plan)
        # Consumed lazily, bucket by bucket: with FSDP ranks each item is a
        # full tensor gathered on demand, so rank 0 never holds the whole
        # model unsharded (the plan lists tensors in the order they come).
        source, pending = iter(tensors), {}
        t0 = time.monotonic()
        try:
            rejected = agree_on_plan(comm, plan.digest(), reject=False)
        except Exception as e:
            self._broken = True
            raise TransferError(f"epoch {plan.epoch}: plan vote failed: {e!r}") from e
        if rejected:
            raise PlanMismatch(f"version {plan.version}: {rejected} receiver rank(s) rejected the plan")
        t1 = time.monotonic()
        pack_s = wait_s = 0.0
        sending = None  # the broadcast in flight, if any
        try:
            # Two scratch buffers: bucket k+1 is packed into one while bucket
            # k is sent from the other (start_broadcast), so the copies hide
            # under the wire time instead of adding to it.
            size = max(b.nbytes for b in plan.buckets)
            scratch = [self._scratch(i, size)
                       for i in range(2 if comm.sends_in_background and len(plan.buckets) > 1 else 1)]
            for i, bucket in enumerate(plan.buckets):
                names = [t.name for t in bucket.tensors]
                while not all(n in pending for n in names):
                    item = next(source, None)
                    if item is None:
                        break
                    pending[item[0]] = item[1]
                if missing := [n for n in names if n not in pending]:
                    raise ValueError(f"tensors {missing[:3]} of the plan were not given")
                t = time.monotonic()
                buf = pack_bucket(bucket, pending, self.device, out=scratch[i % len(scratch)])
                pack_s += time.monotonic() - t
                for n in names:
                    del pending[n]
                t = time.monotonic()
                if sending is not None:  # the buffer it sends is the next one packed into
                    sending.wait()
                sending = comm.start_broadcast(buf)
                wait_s += time.monotonic() - t
            t = time.monotonic()
            sending.wait()
            wait_s += time.monotonic() - t
        except Exception as e:
            self._broken = True
            if sending is not None:
                # Let a send in flight end (or time out) before the buffer it
                # reads can be packed again; one that failed raises again at
                # once.
                with contextlib.suppress(Exception):
                    sending.wait()
            raise TransferError(f"epoch {plan.epoch}: broadcast failed: {e!r}") from e
        stats = BroadcastStats(plan.version, plan.epoch, plan.nbytes, len(plan.buckets), plan.num_tensors,
                               round(t1 - t0, 4), round(time.monotonic() - t1, 4), round(pack_s, 4),
                               round(wait_s, 4))
        log.info("weights.broadcast", **msgspec.structs.asdict(stats))
        return stats

    def _scratch(self, i: int, nbytes: int) -> torch.Tensor:
        """Packing buffer ``i`` (of two), kept across updates: re-faulting
        hundreds of MiB of fresh pages per update cost more than the copy
        itself."""
        import torch

        if self._pack_bufs[i] is None or self._pack_bufs[i].numel() < nbytes:
            self._pack_bufs[i] = None  # the old one goes before the new one comes
            self._pack_bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._pack_bufs[i]

    def _usable_comm(self, plan: WeightUpdatePlan) -> WeightComm:
        if self._comm is None or self.spec is None:
            raise TransferError("no open group")
        if self._broken:
            raise TransferError(f"group epoch {self.spec.epoch} failed earlier: form a new epoch")
        if plan.epoch != self.spec.epoch or plan.backend != self.spec.backend:
            raise PlanMismatch(f"plan for epoch {plan.epoch}/{plan.backend}, group is {self.spec.epoch}/{self.spec.backend}")
        return self._comm

    # -- async wrappers (the trainer daemon's event loop must keep running) --

    async def open_group_async(self, spec: GroupSpec) -> None:
        await asyncio.to_thread(self.open_group, spec)

    async def broadcast_async(self, plan: WeightUpdatePlan, tensors) -> BroadcastStats:
        return await asyncio.to_thread(self.broadcast, plan, list(tensors))
