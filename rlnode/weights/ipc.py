"""CUDA IPC for weight updates on one machine: the trainer lends each packed
bucket to the engine workers as a CUDA IPC handle instead of broadcasting
its bytes, so a trainer and an engine may share one GPU (NCCL refuses two
ranks on one device; docs/design/gpu-h100.md).

Owns:
  * ``host_identity()`` and ``visible_gpus()``: what an actor reports so
    the trainer can tell whether an engine's workers can open its CUDA IPC
    handles (same machine, and the trainer's GPU among those the engine's
    processes see: each engine runs under its own CUDA_VISIBLE_DEVICES);
    GPUs are matched by UUID, never by index (``gpu_key``);
  * ``IpcHandle``: the handle of one CUDA buffer as plain msgspec data
    (trainer -> engine worker, over the weight group's gloo control channel;
    no pickle: torch's own reducer would pickle it);
  * ``export_handle`` (trainer) and ``open_handle`` (worker): the two torch
    calls on either side of it; ``lend_handle`` (trainer) exports a buffer
    once for as long as it lives, ``LentBuffers`` (worker) maps it once.

The GPU path, end to end (``WeightComm.broadcast`` with backend cuda_ipc):
  1. rank 0 packs a bucket into a CUDA buffer it keeps alive (the
     broadcaster's scratch buffer), synchronises its stream so the bytes are
     written, and sends the buffer's handle, exported (``_share_cuda_()``)
     the first time that buffer is lent and reused for every later bucket
     and push: each export takes one of torch's shared reference-counter
     slots, released only with the buffer, so one per bucket piled up;
  2. the handle travels msgspec-encoded on the group's gloo channel;
  3. every worker maps the buffer on the *trainer's* GPU (found by UUID, as
     device indices differ between processes with different
     CUDA_VISIBLE_DEVICES), copies it into its own buffer on its device and
     synchronises. It keeps the mapping while the trainer lends the same
     export (torch's own cache holds one only while a tensor uses it, so
     dropping it per bucket re-opened it per bucket) and drops it for a new
     export or when the epoch closes;
  4. an all-reduce acknowledges: once it returns every worker has its copy,
     so rank 0 may overwrite the buffer with the next bucket. A worker that
     failed votes 1 and every rank raises: the epoch is then unusable, as
     after a failed broadcast. This acknowledgement, not torch's consumer
     counter, is what makes reusing the buffer safe: torch counts one
     consumer per export, and here one export serves many workers and
     buckets.

Must not touch: models, engines, sockets. Importing does not import torch.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch


@functools.cache
def host_identity() -> str:
    """This machine, as seen by every process on it and no other: the
    kernel's boot id (differs between machines and between boots) plus the
    hostname (readable when logged). Containers on one host share the boot
    id; they can open each other's CUDA IPC handles only when they share
    the GPU and the IPC namespace, which the operator must arrange."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


class IpcHandle(msgspec.Struct, array_like=True, frozen=True):
    """One CUDA allocation lent by the trainer (trainer -> engine worker).
    Fields mirror ``torch.UntypedStorage._share_cuda_()``."""

    device_uuid: str  # the trainer's GPU ("GPU-..."), not its index
    nbytes: int  # the buffer's length (uint8 elements)
    handle: bytes  # cudaIpcMemHandle of the allocation
    storage_size_bytes: int
    storage_offset_bytes: int  # the buffer inside that allocation
    ref_counter_handle: bytes  # torch's shared-memory counter of consumers
    ref_counter_offset: int
    event_handle: bytes | None  # producer stream event (torch records it)
    event_sync_required: bool


_handle_decoder = msgspec.msgpack.Decoder(IpcHandle)


def encode_handle(h: IpcHandle) -> bytes:
    return msgspec.msgpack.encode(h)


def decode_handle(data: bytes) -> IpcHandle:
    return _handle_decoder.decode(data)


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


# --------------------------------------------------------------------------
# Which GPUs a process sees, by UUID.

# NVML_DEVICE_UUID_V2_BUFFER_SIZE: room for any UUID NVML writes.
NVML_UUID_BUFFER = 96


def gpu_key(uuid: str) -> str:
    """A GPU UUID in one spelling: NVML and CUDA_VISIBLE_DEVICES write
    "GPU-<hex>", torch's device properties "<hex>"."""
    return uuid.strip().lower().removeprefix("gpu-")


def sees_gpu(visible: Iterable[str], uuid: str) -> bool:
    """Whether ``uuid`` is among ``visible`` (False for an unknown "")."""
    return bool(uuid) and gpu_key(uuid) in {gpu_key(u) for u in visible}


def visible_gpus(cuda_visible_devices: str | None, physical: Sequence[str]) -> tuple[str, ...]:
    """The UUIDs a process started with ``CUDA_VISIBLE_DEVICES`` =
    ``cuda_visible_devices`` sees, in its device order; ``physical``: every
    GPU's UUID in NVML order (``nvml_gpu_uuids``).

    Parsed as the CUDA runtime does: unset = every GPU; an entry is an index
    or a UUID, whole or a unique prefix ("GPU-8f3a"); the list ends at the
    first entry that names no GPU (a MIG instance included: it never takes
    a CUDA IPC handle here); a GPU named twice hides them all. Indices are
    taken in NVML order, which is CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID
    and, by default, on machines with one GPU model (vLLM assumes the same
    and warns on mixed machines)."""
    if cuda_visible_devices is None:
        return tuple(physical)
    out: list[str] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            found = [physical[int(entry)]] if int(entry) < len(physical) else []
        else:
            found = [u for u in physical if entry and u.lower().startswith(entry.lower())]
        if len(found) != 1:
            break
        if found[0] in out:
            return ()
        out.append(found[0])
    return tuple(out)


def nvml_gpu_uuids() -> tuple[str, ...]:
    """Every GPU's UUID ("GPU-..."), in NVML order, read through NVML (the
    driver's management library, as torch counts GPUs without CUDA): no
    CUDA context is created, so the actor daemon can ask before it starts
    its engines (a vLLM engine core forked from a process that initialised
    CUDA fails, docs/design/gpu-h100.md). Raises OSError without an NVIDIA driver,
    RuntimeError when NVML fails."""
    import ctypes

    nvml = ctypes.CDLL("libnvidia-ml.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML: {what} failed (nvmlReturn_t {rc})")

    check(nvml.nvmlInit_v2(), "nvmlInit_v2")
    try:
        count = ctypes.c_uint()
        check(nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        uuids = []
        for i in range(count.value):
            device = ctypes.c_void_p()  # nvmlDevice_t
            check(nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(device)),
                  f"nvmlDeviceGetHandleByIndex_v2({i})")
            buf = ctypes.create_string_buffer(NVML_UUID_BUFFER)
            check(nvml.nvmlDeviceGetUUID(device, buf, ctypes.c_uint(NVML_UUID_BUFFER)), f"nvmlDeviceGetUUID({i})")
            uuids.append(buf.value.decode("ascii"))
        return tuple(uuids)
    finally:
        nvml.nvmlShutdown()


def own_gpu_uuid(device) -> str:
    """The UUID of this process's cuda ``device`` (the trainer's); "" when
    ``device`` is not cuda or CUDA is unavailable. Initialises CUDA."""
    import torch

    from rlnode.weights.plan import indexed_device

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    return device_uuid(indexed_device(device).index)


# --------------------------------------------------------------------------
# Lending (rank 0) and borrowing (workers).


def export_handle(buf: torch.Tensor) -> IpcHandle:
    """Rank 0: the handle of ``buf`` (contiguous uint8, on cuda, starting at
    its storage's first byte). Every call takes a new torch reference-counter
    slot that lives as long as the buffer: call ``lend_handle`` instead."""
    import torch

    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or buf.storage_offset() != 0:
        raise ValueError("export_handle: needs a uint8 cuda tensor at the start of its storage")
    (_, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = buf.untyped_storage()._share_cuda_()
    return IpcHandle(device_uuid(buf.device.index), buf.numel(), bytes(handle), size, offset,
                     bytes(ref_handle), ref_offset, bytes(event_handle) if event_handle else None,
                     bool(event_sync))


# storage id -> (weak reference, data_ptr, nbytes, its export): one export
# per live buffer. Kept per process, not per group epoch, because the export
# belongs to the storage (sharing it again stacks another counter slot on
# it) and the broadcaster's scratch buffer outlives epochs.
_exports: dict[int, tuple[object, int, int, IpcHandle]] = {}
_exports_lock = threading.Lock()


def lend_handle(buf: torch.Tensor) -> IpcHandle:
    """Rank 0, per bucket: the handle of ``buf`` (the first ``numel`` bytes
    of its storage, see ``export_handle``), once its bytes are written.

    The storage is exported the first time only; while it lives, with the
    same address and size, later buckets and pushes reuse that export with
    their own length. A buffer that replaced it (grown, or freed and another
    one allocated at the same address: the weak reference tells) gets a new
    export. The caller keeps ``buf`` alive and unchanged until every worker
    acknowledged its copy."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    if buf.is_cuda:  # workers read on their own streams: the packing must be finished
        torch.cuda.current_stream(buf.device).synchronize()
    storage = buf.untyped_storage()
    with _exports_lock:
        for key in [k for k, e in _exports.items() if e[0].expired()]:
            del _exports[key]
        entry = _exports.get(storage._cdata)
        if entry is None or entry[1:3] != (storage.data_ptr(), storage.nbytes()):
            entry = (StorageWeakRef(storage), storage.data_ptr(), storage.nbytes(), export_handle(buf))
            _exports[storage._cdata] = entry
    return msgspec.structs.replace(entry[3], nbytes=buf.numel())


def local_index(uuid: str) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if gpu_key(device_uuid(i)) == gpu_key(uuid):
            return i
    raise RuntimeError(f"the trainer's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")


def open_handle(h: IpcHandle) -> torch.Tensor:
    """Worker: map the trainer's buffer (a uint8 tensor of ``h.nbytes`` on
    the trainer's GPU). torch keeps the mapping only while a tensor made
    from it lives: ``LentBuffers`` keeps one per export."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, (h.nbytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, local_index(h.device_uuid),
        h.handle, h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
        h.ref_counter_offset, h.event_handle, h.event_sync_required)


class LentBuffers:
    """Worker: the trainer's buffer, mapped once per export. Rank 0 lends
    one export for many buckets (``lend_handle``): mapping the whole storage
    once and slicing each bucket out of it saves an IPC open and close per
    bucket. A new export (the trainer's buffer grew) replaces the mapping;
    ``close`` (the epoch ends) drops it. Not thread-safe: one per group."""

    def __init__(self) -> None:
        self._export: IpcHandle | None = None  # the mapped export, nbytes zeroed
        self._mapped: torch.Tensor | None = None  # its whole storage

    def view(self, h: IpcHandle) -> torch.Tensor:
        """The ``h.nbytes`` lent bytes (valid until the next ``view``)."""
        export = msgspec.structs.replace(h, nbytes=0)
        if export != self._export:
            self.close()  # unmapped before the next one is opened
            if h.storage_size_bytes <= 0:
                raise ValueError(f"lent buffer: storage of {h.storage_size_bytes} bytes")
            self._mapped = open_handle(msgspec.structs.replace(h, nbytes=h.storage_size_bytes))
            self._export = export
        if not 0 < h.nbytes <= self._mapped.numel():
            raise ValueError(f"lent buffer: {h.nbytes} bytes asked of a {self._mapped.numel()}-byte storage")
        return self._mapped[: h.nbytes]

    def close(self) -> None:
        self._export = self._mapped = None
