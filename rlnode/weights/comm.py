"""``WeightComm``: the collective transport both ends of a weight update use
on a stateless group (gloo, staging CUDA tensors through CPU memory; NCCL
through vLLM's ``PyNcclCommunicator``; CUDA IPC handles over a gloo control
channel for engines on the trainer's machine, see ``weight_ipc``), and the
plan agreement run over it. The plan and byte layout it moves are
``weight_plan``'s; the group is formed by ``rendezvous``.

Must not touch: sockets other than the group's rendezvous, engines, models.
torch and vLLM are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from rlnode.weights.plan import GroupSpec, TransferError, indexed_device

if TYPE_CHECKING:
    import socket

    import torch

    from rlnode.weights.rendezvous import GlooGroup

class WeightComm:
    """A stateless torch.distributed group for weight broadcasts.

    Every backend starts with ``rlnode.weights.rendezvous``: an epoch's TCPStore on
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
        from rlnode.weights.rendezvous import Rendezvous

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

    def start_broadcast(self, tensor: torch.Tensor):
        """Like ``broadcast``, but returns at once where the transport can
        send in the background (gloo with a CPU tensor: its own threads move
        the bytes); ``wait()`` on the result before touching ``tensor``
        again. Elsewhere it sends before returning (the result's ``wait``
        does nothing). Rank 0 packs the next bucket meanwhile."""
        if self.sends_in_background and tensor.device.type == "cpu":
            return self._pg.broadcast(tensor, 0)
        self.broadcast(tensor)
        return _Sent()

    @property
    def sends_in_background(self) -> bool:
        """``start_broadcast`` returns before the bytes are sent."""
        return (self._pg is not None and self.spec.backend == "gloo" and self.device.type == "cpu"
                and not self.force_staging)

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

        from rlnode.weights.ipc import LentBuffers, decode_handle, encode_handle, lend_handle

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


class _Sent:
    """A broadcast that finished before ``start_broadcast`` returned."""

    def wait(self) -> bool:
        return True


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
