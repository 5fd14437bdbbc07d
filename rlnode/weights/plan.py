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
  * the names of weights (``weights_label``: version + trainer incarnation),
    which engines tag tokens and salt their prefix cache with;
  (``WeightComm``, the transport that moves these bytes, is in
  ``weight_comm``: it needs the rendezvous and IPC modules, which need this
  one.)

Must not touch: sockets other than the group's rendezvous, engines, models.
Importing this module does not import torch (config and wire code import it);
torch and vLLM are imported inside the functions that need them.

Schema evolution: append fields with defaults only (STYLE point 3).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    import torch

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


# --------------------------------------------------------------------------
# Names of weights.


def weights_label(version: int, source: str = "") -> str:
    """The name of the weights an engine holds: ``"{version}@{source}"``,
    ``source`` being the trainer incarnation that pushed them, or
    ``"{version}"`` for weights no trainer pushed (``INITIAL_WEIGHTS``, the
    model on disk). A version number alone is not a name: a trainer resumed
    from its v100 checkpoint makes a v101 unlike the one its killed
    predecessor made. The engine tags tokens with it (``weight_versions``
    spans) and salts its prefix cache with it."""
    return f"{version}@{source}" if source else str(version)


# What an engine holds before any push: the model on disk, version 0 of
# every trainer incarnation (a fresh trainer starts from the same files).
INITIAL_WEIGHTS = weights_label(0)
_SOURCE_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def parse_weights_label(label: str) -> tuple[int, str] | None:
    """(version, source) of a ``weights_label`` (source "" for a bare
    version: the initial weights, or an actor that predates sources), or
    None for a label that names no weights (vLLM's "default", a malformed
    one). At most 18 digits are parsed: int() refuses a hostile label of
    more than 4,300 digits with an exception; a source is 1-64 letters and
    digits, like the incarnations that fill it. (ASCII digits only: "²"
    is a digit to str.isdigit and an error to int().)"""
    number, at, source = label.partition("@")
    if len(number) > 18 or not (number.isascii() and number.lstrip("-").isdigit()):
        return None
    if at and not (0 < len(source) <= 64 and _SOURCE_CHARS.issuperset(source)):
        return None
    return int(number), source


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


# Bounds on an adapter plan from the network (AdapterSpec.validate): vLLM's
# largest rank, and how many target module names a receiver takes.
MAX_ADAPTER_RANK = 512
MAX_ADAPTER_TARGETS = 64
# peft's names: "base_model.model." + the module + ".lora_A.weight" / ".lora_B.weight".
ADAPTER_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class AdapterSpec(msgspec.Struct, array_like=True, frozen=True):
    """The LoRA adapter a plan carries (trainer.lora): its tensors are the
    adapter's, named as in peft's ``adapter_model.safetensors``; with this
    the receiver writes peft's ``adapter_config.json`` and the engine serves
    it as a new adapter (weights/lora.py)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def validate(self) -> None:
        if not 0 < self.rank <= MAX_ADAPTER_RANK:
            raise PlanMismatch(f"adapter: rank {self.rank} is not in 1..{MAX_ADAPTER_RANK}")
        if not 0 < self.alpha < 1e6:
            raise PlanMismatch(f"adapter: alpha {self.alpha} is not in (0, 1e6)")
        if not 0 < len(self.target_modules) <= MAX_ADAPTER_TARGETS or any(
                not (0 < len(m) <= 128 and m.replace("_", "").replace(".", "").isalnum())
                for m in self.target_modules):
            raise PlanMismatch(f"adapter: target modules {list(self.target_modules)[:8]!r} are not "
                               f"1-{MAX_ADAPTER_TARGETS} module names")

    def module_of(self, name: str) -> tuple[str, str] | None:
        """(module, "A" | "B") of an adapter tensor's name, or None for a
        name that is not one."""
        if not name.startswith(ADAPTER_PREFIX):
            return None
        for suffix in ADAPTER_SUFFIXES:
            if name.endswith(suffix):
                return name[len(ADAPTER_PREFIX):-len(suffix)], suffix[6]
        return None


class WeightUpdatePlan(msgspec.Struct, frozen=True):
    """Trainer -> actor: the next broadcast on group ``epoch``. The bytes
    follow on the group as one broadcast per bucket, in order."""

    version: int  # policy version the weights belong to
    epoch: int  # group epoch the broadcast runs on
    buckets: tuple[Bucket, ...]
    backend: Backend
    # The sending trainer's incarnation (TrainerLink.incarnation, random per
    # start, resume included): with ``version`` it names the weights
    # (``label``). "" = a trainer that predates it (the actor then takes
    # the incarnation its link was welcomed by).
    source: str = ""
    # Set: the tensors are a LoRA adapter on the engine's base model, which
    # the engine serves as a new adapter (no pause); None: full weights.
    adapter: AdapterSpec | None = None

    @property
    def label(self) -> str:
        """The name the engines give these weights (``weights_label``)."""
        return weights_label(self.version, self.source)

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
        if self.adapter is not None:  # an adapter is read otherwise than full weights
            layout = (*layout, msgspec.structs.astuple(self.adapter))
        h = hashlib.blake2b(msgspec.msgpack.encode(layout), digest_size=8).digest()
        return int.from_bytes(h, "little", signed=True)

    def validate(self) -> None:
        """Check internal consistency (not the fit to a model)."""
        if self.version < 0 or self.epoch < 0:
            raise PlanMismatch(f"plan: negative version/epoch {self.version}/{self.epoch}")
        if parse_weights_label(self.label) is None:
            raise PlanMismatch(f"plan: source {self.source[:80]!r} is not 1-64 letters and digits")
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
        if self.adapter is not None:
            self._validate_adapter(self.adapter)

    def _validate_adapter(self, adapter: AdapterSpec) -> None:
        """Every tensor is one of the adapter's two matrices (A: rank x in,
        B: out x rank) of a module, and every module has both."""
        adapter.validate()
        halves: dict[str, set[str]] = {}
        for t in self.tensors():
            found = adapter.module_of(t.name)
            if found is None or len(t.shape) != 2:
                raise PlanMismatch(f"adapter plan: tensor {t.name!r} {list(t.shape)} is not a peft LoRA matrix")
            module, half = found
            if (t.shape[0] if half == "A" else t.shape[1]) != adapter.rank:
                raise PlanMismatch(f"adapter plan: {t.name!r} {list(t.shape)} does not have rank {adapter.rank}")
            halves.setdefault(module, set()).add(half)
        if lone := sorted(m for m, h in halves.items() if h != {"A", "B"}):
            raise PlanMismatch(f"adapter plan: modules without both lora_A and lora_B: {lone[:4]}")


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
