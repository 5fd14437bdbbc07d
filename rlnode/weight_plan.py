"""Weight updates on the wire: what the trainer tells engine workers about a
broadcast before the bytes flow, and the byte layout both ends share.

Owns:
  * the msgspec Structs the trainer sends to actors inside ZeroMQ messages
    (trainer -> actor): ``GroupSpec`` (who joins which group epoch, where the
    rendezvous is) and ``WeightUpdatePlan`` (which tensors, packed how, into
    which buckets). No pickle and no ``Any``: every field is typed so an actor
    decodes a plan with one typed decoder and rejects anything malformed;
  * the bucket layout (byte offsets inside one flat ``uint8`` buffer per
    bucket) and the pack/unpack helpers for it;
  * ``WeightComm``: the collective transport both ends use on a stateless
    group (gloo, staging CUDA tensors through CPU memory; NCCL through
    vLLM's ``PyNcclCommunicator``; CUDA IPC handles over a gloo control
    channel for engines on the trainer's machine, see ``weight_ipc``).

Must not touch: sockets other than the group's rendezvous, engines, models.
Importing this module does not import torch (config and wire code import it);
torch and vLLM are imported inside the functions that need them.

Schema evolution: append fields with defaults only (STYLE point 3).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    import socket

    import torch

    from rlnode.rendezvous import GlooGroup

Backend = Literal["gloo", "nccl", "cuda_ipc"]

# Byte size of each dtype a plan may carry. Names are torch's
# (``str(torch.float32)`` without the ``torch.`` prefix).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
# Every tensor starts at a multiple of this many bytes inside its bucket, so
# unpacking is a zero-copy ``view(dtype)`` (which needs aligned offsets) and
# device kernels see aligned data.
ALIGN_BYTES = 64


class WeightUpdateError(RuntimeError):
    """A weight update did not happen. Base class."""


class PlanMismatch(WeightUpdateError):
    """The plan does not fit the engine's model (names, shapes, dtypes) or the
    group it was sent on. Recoverable: nothing was loaded, the engine keeps
    generating with its old weights, the group stays usable."""


class TransferError(WeightUpdateError):
    """The broadcast itself failed (peer gone, timeout). The group epoch is
    unusable: close it and form a new one. Engines keep their old weights."""


class LoadError(WeightUpdateError):
    """The engine failed while loading received weights into its model. Fatal
    for that engine: its weights may be partly updated; restart it."""


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    """One tensor inside a bucket (trainer -> actor)."""

    name: str  # checkpoint-format name, e.g. "model.layers.0.mlp.up_proj.weight"
    dtype: str  # a key of DTYPE_BYTES
    shape: tuple[int, ...]
    offset: int  # byte offset inside the bucket's flat buffer, ALIGN_BYTES-aligned

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class Bucket(msgspec.Struct, array_like=True, frozen=True):
    """Tensors packed into one flat uint8 buffer: one collective each."""

    tensors: tuple[TensorMeta, ...]
    nbytes: int  # size of the flat buffer


class WeightUpdatePlan(msgspec.Struct, frozen=True):
    """Trainer -> actor: the next broadcast on group ``epoch``. The bytes
    follow on the group as one broadcast per bucket, in order."""

    version: int  # policy version the weights belong to
    epoch: int  # group epoch the broadcast runs on
    buckets: tuple[Bucket, ...]
    backend: Backend

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    def tensors(self) -> Iterable[TensorMeta]:
        for b in self.buckets:
            yield from b.tensors

    def digest(self) -> int:
        """A signed 64-bit fingerprint both ends compare on the group before
        any bucket flows: a stale or different plan would misread bytes.
        Computed over what decides the byte layout only, so fields appended
        later (that an older peer drops when decoding) do not change it."""
        layout = (self.version, self.epoch, [(b.nbytes, [(t.name, t.dtype, t.shape, t.offset) for t in b.tensors])
                                             for b in self.buckets])
        h = hashlib.blake2b(msgspec.msgpack.encode(layout), digest_size=8).digest()
        return int.from_bytes(h, "little", signed=True)

    def validate(self) -> None:
        """Check internal consistency (not the fit to a model)."""
        if self.version < 0 or self.epoch < 0:
            raise PlanMismatch(f"plan: negative version/epoch {self.version}/{self.epoch}")
        seen: set[str] = set()
        for i, b in enumerate(self.buckets):
            end = 0
            for t in b.tensors:
                if t.dtype not in DTYPE_BYTES:
                    raise PlanMismatch(f"plan bucket {i} tensor {t.name!r}: unknown dtype {t.dtype!r}")
                if t.name in seen:
                    raise PlanMismatch(f"plan: tensor {t.name!r} appears twice")
                seen.add(t.name)
                if t.offset % ALIGN_BYTES or t.offset < end or any(d < 0 for d in t.shape):
                    raise PlanMismatch(f"plan bucket {i} tensor {t.name!r}: bad offset/shape")
                end = t.offset + t.nbytes
            # Exact size: a frame from the network must not make a receiver
            # allocate more than the tensors it describes.
            if not b.tensors or end != b.nbytes:
                raise PlanMismatch(f"plan bucket {i}: tensors end at byte {end}, bucket claims {b.nbytes}")


class GroupMember(msgspec.Struct, array_like=True, frozen=True):
    """One engine in a group epoch: its workers take ranks
    ``first_rank .. first_rank + num_ranks - 1`` (worker i -> first_rank + i)."""

    actor_id: str  # "<node id>/<engine index>": how the actor finds its entry
    first_rank: int
    num_ranks: int = 1  # the engine's model-parallel workers (tp * pp)
    host: str = ""  # the engine's machine (weight_ipc.host_identity); "" = unknown


class GroupSpec(msgspec.Struct, frozen=True):
    """Trainer -> actor: join group ``epoch``. Rank 0 is the trainer. A new
    member or a departed one means a new epoch (new port, new group); an
    epoch's membership never changes."""

    epoch: int
    master_host: str  # the trainer's rendezvous (TCPStore) host
    master_port: int
    world_size: int
    backend: Backend
    members: tuple[GroupMember, ...]
    # Rendezvous and per-collective timeout (s): how long a dead peer can
    # stall the others before the epoch fails.
    timeout_s: float = 300.0
    # Per-epoch rendezvous secret (hex, ``rendezvous.new_secret``): each rank
    # proves it holds it before it joins. Travels only inside this message
    # (over the link, CURVE-encrypted when enabled) and is never logged:
    # ``__repr__`` leaves it out. "" (a trainer that predates it): every
    # rank refuses the epoch.
    secret: str = ""

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f != "secret")
        return f"GroupSpec({fields}, secret=<{'set' if self.secret else 'empty'}>)"

    def __rich_repr__(self):
        for f in self.__struct_fields__:
            yield f, "<hidden>" if f == "secret" else getattr(self, f)

    def member(self, actor_id: str) -> GroupMember:
        for m in self.members:
            if m.actor_id == actor_id:
                return m
        raise PlanMismatch(f"group epoch {self.epoch}: no member {actor_id!r}")

    def validate(self) -> None:
        """Ranks 1..world_size-1 are each taken exactly once."""
        taken = sorted(r for m in self.members for r in range(m.first_rank, m.first_rank + m.num_ranks))
        if taken != list(range(1, self.world_size)) or any(m.num_ranks < 1 for m in self.members):
            raise PlanMismatch(f"group epoch {self.epoch}: member ranks {taken} do not cover 1..{self.world_size - 1}")
        if len({m.actor_id for m in self.members}) != len(self.members):
            raise PlanMismatch(f"group epoch {self.epoch}: duplicate actor ids")
        if not 0 < self.master_port < 65536 or self.timeout_s <= 0:
            raise PlanMismatch(f"group epoch {self.epoch}: bad port/timeout")


_plan_decoder = msgspec.msgpack.Decoder(WeightUpdatePlan)
_spec_decoder = msgspec.msgpack.Decoder(GroupSpec)


def encode(obj: WeightUpdatePlan | GroupSpec) -> bytes:
    return msgspec.msgpack.encode(obj)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str):
    try:
        obj = decoder.decode(data)
    except msgspec.DecodeError as e:  # malformed bytes and wrong shapes alike
        raise PlanMismatch(f"malformed {what}: {e}") from e
    obj.validate()
    return obj


def decode_plan(data: bytes) -> WeightUpdatePlan:
    return _decode(_plan_decoder, data, "weight update plan")


def decode_spec(data: bytes) -> GroupSpec:
    return _decode(_spec_decoder, data, "group spec")


# --------------------------------------------------------------------------
# Layout: which tensors share a bucket, at which offsets.


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def plan_buckets(tensors: Sequence[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Greedy, order-preserving packing of (name, dtype, shape) into buckets
    of at most ``bucket_bytes``; a tensor larger than that travels alone.
    Order is kept because vLLM's layerwise reload processes a layer as soon
    as all its tensors arrived: model order keeps few layers half-loaded."""
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    end = 0
    for name, dtype, shape in tensors:
        meta = TensorMeta(name, dtype, tuple(shape), 0)
        if current and _align(end) + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(current), end))
            current, end = [], 0
        meta = TensorMeta(name, dtype, tuple(shape), _align(end))
        current.append(meta)
        end = meta.offset + meta.nbytes
    if current:
        buckets.append(Bucket(tuple(current), end))
    return tuple(buckets)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    table = {
        "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
        "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
        "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    }
    return table[name]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise PlanMismatch(f"dtype {dtype} cannot travel in a weight update")
    return name


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], device,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """One flat uint8 buffer holding the bucket's tensors at their offsets;
    written into ``out[:nbytes]`` when given (no fresh pages to fault in)."""
    import torch

    if out is not None and out.numel() >= bucket.nbytes:
        buf = out[: bucket.nbytes]
    else:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    end = 0
    for t in bucket.tensors:
        buf[end : t.offset].zero_()  # alignment padding: never send stale memory
        src = tensors[t.name].detach().to(device=device, dtype=torch_dtype(t.dtype)).contiguous()
        buf[t.offset : t.offset + t.nbytes].copy_(src.reshape(-1).view(torch.uint8))
        end = t.offset + t.nbytes
    buf[end:].zero_()
    return buf


def unpack_bucket(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buf`` (no copy): keep ``buf`` alive while they are used."""
    return [
        (t.name, buf[t.offset : t.offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape))
        for t in bucket.tensors
    ]


# --------------------------------------------------------------------------
# Transport: one stateless group, used the same way by rank 0 and the workers.


def indexed_device(device) -> torch.device:
    """``device`` with its index: "cuda" becomes "cuda:<current device>".

    vLLM's ``PyNcclCommunicator`` keeps the device it is given and asserts
    ``tensor.device == self.device`` on every collective, and
    ``torch.device("cuda") != torch.device("cuda", 0)``: an unindexed "cuda"
    makes rank 0 raise right after ``ncclCommInitRank`` while the workers
    wait forever in their warm-up all_reduce. Tensors always carry an index,
    so the communicator must too."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class WeightComm:
    """A stateless torch.distributed group for weight broadcasts.

    Every backend starts with ``rlnode.rendezvous``: an epoch's TCPStore on
    the advertised address, where each rank proves it holds the epoch's
    secret (``GroupSpec.secret``) before any group forms. gloo: a gloo
    backend on that store whose every connection passed a secret check
    (``rendezvous.GlooGroup``; its own ``broadcast``/``allreduce`` with group
    ranks, no global state). nccl: vLLM's ``PyNcclCommunicator``, its
    unique id sealed with the secret in the store (no pickle); buffers live
    on ``device``. cuda_ipc: a gloo group carries
    the vote and, per bucket, the IPC handle of rank 0's buffer and the
    workers' acknowledgement (``weight_ipc``); the bytes never leave the GPU.

    ``device`` is where the data buffers live. gloo moves CPU tensors only:
    a CUDA buffer is staged through (pinned) CPU memory on either end, so a
    gloo group works between a cuda trainer and cuda engines (slower than
    NCCL: two extra copies per bucket). Votes and acknowledgements are CPU
    tensors except on NCCL.

    Blocking: every method waits for the other ranks. Call from a thread.
    """

    # Tests set this to run the CPU staging path with CPU tensors.
    force_staging = False
    # cuda_ipc workers: the trainer's lent buffer, mapped on first use and
    # kept until close (weight_ipc.LentBuffers).
    _borrowed = None

    def __init__(self, spec: GroupSpec, rank: int, device, listen_socket: socket.socket | None = None):
        import torch

        self.spec, self.rank, self.device = spec, rank, indexed_device(device)
        self._pg: GlooGroup | None = None
        self._nccl = None
        self._staging: torch.Tensor | None = None  # gloo: CPU copy of CUDA buckets
        self._ctl_device = self.device if spec.backend == "nccl" else torch.device("cpu")
        from rlnode.rendezvous import Rendezvous

        # Blocks until rank 0 admitted every rank (each proved it holds the
        # epoch's secret) or raises RendezvousError.
        self._rdv = Rendezvous(spec, rank, listen_socket)
        try:
            if spec.backend in ("gloo", "cuda_ipc"):
                self._pg = self._rdv.gloo_group()
            else:
                self._nccl = self._rdv.nccl_communicator(self.device)
                if self._nccl.disabled:
                    raise TransferError("NCCL is not available on this host (PyNcclCommunicator disabled)")
        except BaseException:
            self.close()
            raise

    def broadcast(self, tensor: torch.Tensor) -> None:
        """In place, from rank 0 to every rank (a flat uint8 tensor for
        cuda_ipc and for staged gloo buckets)."""
        if self.spec.backend == "cuda_ipc":
            self._lend(tensor)
        elif self._pg is not None and (tensor.device.type != "cpu" or self.force_staging):
            self._staged_broadcast(tensor)
        elif self._pg is not None:
            self._pg.broadcast(tensor, 0).wait()
        else:
            import torch

            stream = torch.cuda.current_stream(self.device)
            self._nccl.broadcast(tensor, src=0, stream=stream)
            stream.synchronize()

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A CPU buffer kept across buckets and updates; pinned when CUDA is
        there, so the device copies run at full speed."""
        import torch

        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8,
                                        pin_memory=torch.cuda.is_available() and self.device.type == "cuda")
        return self._staging[:nbytes]

    def _staged_broadcast(self, tensor: torch.Tensor) -> None:
        """gloo with a tensor gloo cannot take (CUDA): through CPU memory.
        Synchronous copies (``non_blocking=False``): the staging buffer is
        reused by the next bucket, and a receiver's device buffer must hold
        the bytes when this returns (the load reads it on another stream)."""
        import torch

        flat = tensor.reshape(-1).view(torch.uint8)  # a view: the tensor is contiguous
        stage = self._staging_buffer(flat.numel())
        if self.rank == 0:
            stage.copy_(flat)
        self._pg.broadcast(stage, 0).wait()
        if self.rank != 0:
            flat.copy_(stage)

    def _lend(self, buf: torch.Tensor) -> None:
        """cuda_ipc: rank 0 lends ``buf`` by handle; the others copy it into
        their ``buf`` and acknowledge (module docstring of ``weight_ipc``).
        Rank 0 exports a buffer once for all its buckets and pushes
        (``lend_handle``); a worker maps each export once (``LentBuffers``)."""
        import torch

        from rlnode.weight_ipc import LentBuffers, decode_handle, encode_handle, lend_handle

        if self.rank == 0:
            blob = torch.frombuffer(bytearray(encode_handle(lend_handle(buf))), dtype=torch.uint8)
        size = self.broadcast_int(blob.numel() if self.rank == 0 else 0)
        if self.rank != 0:
            blob = torch.empty(size, dtype=torch.uint8)
        self._pg.broadcast(blob, 0).wait()
        if self.rank != 0:
            try:
                if self._borrowed is None:
                    self._borrowed = LentBuffers()
                lent = self._borrowed.view(decode_handle(blob.numpy().tobytes()))
                if lent.numel() != buf.numel():
                    raise TransferError(f"lent buffer has {lent.numel()} bytes, expected {buf.numel()}")
                buf.copy_(lent)
                if buf.is_cuda:  # the copy is done before the ack lets rank 0 overwrite its buffer
                    torch.cuda.current_stream(buf.device).synchronize()
            except Exception:
                self.sum_int(1)  # the others learn of it in the same ack
                raise
        if self.sum_int(0):
            raise TransferError("a worker could not copy a bucket lent by CUDA IPC")

    def sum_int(self, value: int) -> int:
        """Sum of one int64 over all ranks (the accept/reject vote)."""
        import torch

        t = torch.tensor([value], dtype=torch.int64, device=self._ctl_device)
        if self._pg is not None:
            self._pg.allreduce([t]).wait()
            return int(t.item())
        stream = torch.cuda.current_stream(self.device)
        out = self._nccl.all_reduce(t, stream=stream)
        stream.synchronize()
        return int(out.item())

    def broadcast_int(self, value: int) -> int:
        import torch

        t = torch.tensor([value], dtype=torch.int64, device=self._ctl_device)
        if self._pg is not None:
            self._pg.broadcast(t, 0).wait()
        else:
            self.broadcast(t)
        return int(t.item())

    def close(self) -> None:
        if self._borrowed is not None:
            self._borrowed.close()
        if self._pg is not None:
            pg, self._pg = self._pg, None
            pg.shutdown()
        if self._nccl is not None:
            nccl, self._nccl = self._nccl, None
            nccl.destroy()
        # Last: rank 0's store server goes with it (the port closes).
        self._rdv.close()


@contextlib.contextmanager
def keep_stdout():
    """Restore fd 1 afterwards. vLLM's gloo init wraps itself in a
    ``suppress_stdout`` (dup fd 1, point it at /dev/null, dup back) that is
    not thread-safe: two ranks of one group initialising in threads of one
    process (tests, the raw benchmark) can leave fd 1 on /dev/null for good.
    Daemons open one group at a time and do not need this."""
    saved = os.dup(1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def agree_on_plan(comm: WeightComm, digest: int, reject: bool) -> int:
    """The two small collectives before any bucket: rank 0 broadcasts the
    plan's digest; every rank votes (1 = reject: digest differs, or the plan
    does not fit its model). Returns the number of rejecting ranks; when it
    is non-zero, every rank skips the buckets and the group stays usable."""
    sent = comm.broadcast_int(digest)
    return comm.sum_int(int(reject or sent != digest))
