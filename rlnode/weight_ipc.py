"""CUDA IPC for weight updates on one machine: the trainer lends each packed
bucket to the engine workers as a CUDA IPC handle instead of broadcasting
its bytes, so a trainer and an engine may share one GPU (NCCL refuses two
ranks on one device; DESIGN §10).

Owns:
  * ``host_identity()``: what an actor reports so the trainer can tell
    whether an engine runs on its own machine (the only case where a CUDA
    IPC handle can be opened);
  * ``IpcHandle``: the handle of one CUDA buffer as plain msgspec data
    (trainer -> engine worker, over the weight group's gloo control channel;
    no pickle: torch's own reducer would pickle it);
  * ``export_handle`` (trainer) and ``open_handle`` (worker): the two torch
    calls on either side of it.

The GPU path, end to end (``WeightComm.broadcast`` with backend cuda_ipc):
  1. rank 0 packs a bucket into a CUDA buffer it keeps alive (the
     broadcaster's scratch buffer), synchronises its stream so the bytes are
     written, and exports the buffer's handle (``storage._share_cuda_()``);
  2. the handle travels msgspec-encoded on the group's gloo channel;
  3. every worker maps the buffer on the *trainer's* GPU (found by UUID, as
     device indices differ between processes with different
     CUDA_VISIBLE_DEVICES), copies it into its own buffer on its device,
     synchronises, and drops the mapping;
  4. an all-reduce acknowledges: once it returns every worker has its copy,
     so rank 0 may overwrite the buffer with the next bucket. A worker that
     failed votes 1 and every rank raises: the epoch is then unusable, as
     after a failed broadcast.

Must not touch: models, engines, sockets. Importing does not import torch.
"""

from __future__ import annotations

import functools
import socket
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


def export_handle(buf: torch.Tensor) -> IpcHandle:
    """Rank 0: the handle of ``buf`` (contiguous uint8, on cuda, starting at
    its storage's first byte). The caller keeps ``buf`` alive and unchanged
    until every worker acknowledged its copy."""
    import torch

    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or buf.storage_offset() != 0:
        raise ValueError("export_handle: needs a uint8 cuda tensor at the start of its storage")
    # Workers read on their own streams: the packing must be finished.
    torch.cuda.current_stream(buf.device).synchronize()
    (_, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = buf.untyped_storage()._share_cuda_()
    return IpcHandle(device_uuid(buf.device.index), buf.numel(), bytes(handle), size, offset,
                     bytes(ref_handle), ref_offset, bytes(event_handle) if event_handle else None,
                     bool(event_sync))


def local_index(uuid: str) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise RuntimeError(f"the trainer's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES?)")


def open_handle(h: IpcHandle) -> torch.Tensor:
    """Worker: map the trainer's buffer (a uint8 tensor on the trainer's GPU).
    Drop it as soon as it is copied: the trainer reuses the memory after the
    acknowledgement. torch caches the mapping per handle, so a buffer the
    trainer reuses across updates is mapped once."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, (h.nbytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, local_index(h.device_uuid),
        h.handle, h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
        h.ref_counter_offset, h.event_handle, h.event_sync_required)
