"""CUDA IPC weight lending, the parts that run without a GPU:

* which engines may borrow the trainer's memory: the trainer lends only to
  engines on its machine whose processes see its GPU (by UUID), as the
  actor reports them through NVML; everything else gets NCCL, and the
  choice says why (faked visibility maps; the real link carries them);
* how often the memory is exported and mapped: once per trainer buffer, not
  once per bucket, over real gloo groups with CPU tensors standing in for
  the CUDA buffers (only the two torch IPC calls are faked).
"""

from __future__ import annotations

import os
import queue
import random
import threading

import msgspec
import pytest
import torch

from rlnode.weights import ipc as weight_ipc
from rlnode.actor.engine import engine_visible_gpus
from rlnode.config import LinkConfig, WeightSyncConfig
from rlnode.link import ActorLink, TrainerLink
from rlnode.trainer.weight_push import WeightPusher
from rlnode.weights.broadcast import EnginePlace, WeightBroadcaster, WeightGuard, resolve_backend, update_tensors
from rlnode.weights.ipc import IpcHandle, host_identity, visible_gpus
from rlnode.weights.plan import PlanMismatch, decode_plan, encode, unpack_bucket
from rlnode.weights.comm import WeightComm, agree_on_plan, keep_stdout
from rlnode.wire import EngineInfo, Register

# Three GPUs of one machine, as NVML spells them; the trainer's in torch's
# spelling (no "GPU-" prefix, as get_device_properties().uuid prints it).
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
GPU_C = "GPU-cccccccc-0000-0000-0000-000000000003"
TRAINER_ON_A = "AAAAAAAA-0000-0000-0000-000000000001"
HERE = host_identity()


def _choose(*engines: EnginePlace, device: str = "cuda:0", backend: str = "auto") -> tuple[str, str]:
    return resolve_backend(WeightSyncConfig(backend=backend), device, engines, local_host=HERE,
                           trainer_gpu=TRAINER_ON_A)


def test_ipc_only_for_engines_that_see_the_trainers_gpu():
    # Trainer on GPU a, engines on GPU b (each engine sees only its own GPU).
    backend, why = _choose(EnginePlace("n/0", HERE, (GPU_B,)), EnginePlace("n/1", HERE, (GPU_C,)))
    assert backend == "nccl"
    assert why == (f"the trainer's GPU {GPU_A} is not visible to engines "
                   f"{{'n/0': ['{GPU_B}'], 'n/1': ['{GPU_C}']}} (the GPUs each sees; [] = not said: "
                   "an older actor or no NVML)")
    # Engines that see GPU a (among others, in any spelling) can open its memory.
    backend, why = _choose(EnginePlace("n/0", HERE, (GPU_B, GPU_A)), EnginePlace("n/1", HERE, (GPU_A.lower(),)))
    assert (backend, why) == ("cuda_ipc", f"every engine runs on this machine and sees the trainer's GPU "
                                          f"{GPU_A}")
    # One engine that cannot is enough for NCCL: a group has one transport.
    assert _choose(EnginePlace("n/0", HERE, (GPU_A,)), EnginePlace("n/1", HERE, (GPU_B,)))[0] == "nccl"
    # An older actor reports no GPUs: the safe choice.
    backend, why = _choose(EnginePlace("n/0", HERE))
    assert backend == "nccl" and "{'n/0': []}" in why
    # Another machine, whatever it sees (its GPU a is not ours).
    backend, why = _choose(EnginePlace("far/0", "other-host/boot", (GPU_A,)))
    assert (backend, why) == ("nccl", "engines ['far/0'] run on another machine or did not say where "
                                      "(older actors)")
    assert _choose(EnginePlace("n/0", "", (GPU_A,)))[0] == "nccl"
    # The trainer's own GPU unknown: nothing to match.
    assert resolve_backend(WeightSyncConfig(), "cuda:0", [EnginePlace("n/0", HERE, (GPU_A,))], local_host=HERE,
                           trainer_gpu="")[0] == "nccl"
    assert _choose(EnginePlace("n/0", HERE, (GPU_A,)), device="cpu") == ("gloo", "the trainer is on cpu")
    assert _choose(EnginePlace("n/0", HERE, (GPU_B,)), backend="gloo") == ("gloo", "weight_sync.backend = gloo")


def test_epochs_use_the_reported_gpus_and_a_forced_ipc_refuses_blind_engines():
    def broadcaster(backend: str) -> WeightBroadcaster:
        return WeightBroadcaster(WeightSyncConfig(backend=backend, base_port=random.randrange(30000, 60000)),
                                 master_host="127.0.0.1", device="cuda:0", gpu_uuid=TRAINER_ON_A)

    auto, ipc = broadcaster("auto"), broadcaster("cuda_ipc")
    try:
        spec = auto.new_epoch([("n/0", 2, HERE, [GPU_A, GPU_B]), ("n/1", 1, HERE, [GPU_A])])
        assert spec.backend == "cuda_ipc" and [(m.first_rank, m.num_ranks) for m in spec.members] == [(1, 2), (3, 1)]
        assert auto.new_epoch([("n/0", 2, HERE, [GPU_B, GPU_C])]).backend == "nccl"
        assert "not visible to engines {'n/0'" in auto.backend_reason
        with pytest.raises(PlanMismatch, match=f"the trainer's GPU {TRAINER_ON_A} is not visible to engines "
                                               r"\{'n/0': \['GPU-bbbb"):
            ipc.new_epoch([("n/0", 1, HERE, [GPU_B])])
        # Configured by the operator, for an actor that did not say: let it try.
        assert ipc.new_epoch([("n/0", 1, HERE)]).backend == "cuda_ipc"
    finally:
        for b in (auto, ipc):
            for sock in b._reserved.values():
                sock.close()


def test_visible_gpus_follow_cuda_visible_devices():
    physical = (GPU_A, GPU_B, GPU_C)
    assert visible_gpus(None, physical) == physical
    assert visible_gpus("2,0", physical) == (GPU_C, GPU_A)
    assert visible_gpus(" 1 ", physical) == (GPU_B,)
    assert visible_gpus(f"{GPU_C},GPU-aaaa", physical) == (GPU_C, GPU_A)  # UUIDs, whole or a unique prefix
    assert visible_gpus("1,7,0", physical) == (GPU_B,)  # ends at the first entry that names no GPU
    assert visible_gpus("GPU-,0", physical) == ()  # a prefix of every GPU names none
    assert visible_gpus("MIG-aaaa-1-2", physical) == ()
    assert visible_gpus("0,0", physical) == ()  # a GPU named twice hides them all
    assert visible_gpus("", physical) == ()


def test_engine_reports_what_its_processes_see(monkeypatch):
    """engine i runs under cuda_env(gpus): its GPUs, counted inside this
    process's own CUDA_VISIBLE_DEVICES (indices or UUIDs)."""
    monkeypatch.setattr(weight_ipc, "nvml_gpu_uuids", lambda: (GPU_A, GPU_B, GPU_C))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_visible_gpus([1]) == (GPU_B,)
    assert engine_visible_gpus([0, 2]) == (GPU_A, GPU_C)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    assert engine_visible_gpus([0]) == (GPU_C,)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{GPU_B},{GPU_A}")
    assert engine_visible_gpus([1]) == (GPU_A,)
    assert engine_visible_gpus(None) == ()  # a CPU engine


def test_no_nvml_reports_nothing():
    """Without an NVIDIA driver the NVML lookup fails, and the engine
    reports no GPUs (the trainer will not lend it memory)."""
    try:
        weight_ipc.nvml_gpu_uuids()
    except OSError:
        pass
    else:
        pytest.skip("this host has an NVIDIA driver")
    assert engine_visible_gpus([0]) == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nvml_names_the_gpus_torch_sees():
    """NVML's order and spelling against torch's (which creates a context)."""
    seen = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), weight_ipc.nvml_gpu_uuids())
    assert [weight_ipc.gpu_key(u) for u in seen] == [
        weight_ipc.gpu_key(weight_ipc.device_uuid(i)) for i in range(torch.cuda.device_count())]


def test_gpus_travel_in_the_registration_and_old_peers_decode():
    class EngineInfoV2(msgspec.Struct, array_like=True, omit_defaults=True):  # before gpus
        engine_id: int
        num_workers: int
        host: str = ""

    new = EngineInfo(0, 2, HERE, [GPU_A, GPU_B])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=EngineInfo) == new
    # An older trainer reads a new actor's engines (the extra field is ignored) ...
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=EngineInfoV2) == EngineInfoV2(0, 2, HERE)
    # ... and a new trainer an older actor's: no GPUs said.
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(EngineInfoV2(1, 1, HERE)), type=EngineInfo)
    assert old == EngineInfo(1, 1, HERE, [])
    reg = Register("n", "i", [new, EngineInfo(1, 1)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reg), type=Register).engines == [new, EngineInfo(1, 1)]


@pytest.mark.parametrize("sees, expected", [([GPU_B, GPU_A], "cuda_ipc"), ([GPU_B], "nccl"), ([], "nccl")])
async def test_reported_gpus_decide_the_pushers_epoch(sees, expected):
    """Over the real link: what the actor registers is what the trainer's
    pusher hands the broadcaster when it forms an epoch."""
    fast = LinkConfig(heartbeat_s=0.1, peer_timeout_s=2.0)
    trainer = TrainerLink("tcp://127.0.0.1:*", fast)
    await trainer.start()
    actor = ActorLink(trainer.endpoint, "n1", [EngineInfo(0, 1, HERE, sees)], fast)
    bc = WeightBroadcaster(WeightSyncConfig(base_port=random.randrange(30000, 60000)), master_host="127.0.0.1",
                           device="cuda:0", gpu_uuid=TRAINER_ON_A)
    formed = []

    def new_epoch(members):  # stop before any rendezvous: no engine is there to join
        formed.append(WeightBroadcaster.new_epoch(bc, members))
        raise PlanMismatch("stop here")

    bc.new_epoch = new_epoch
    try:
        await actor.start()
        assert await actor.wait_connected(5)
        pusher = WeightPusher(trainer, bc, torch.nn.Linear(2, 2), WeightGuard(0))
        assert not await pusher.push()
        assert [s.backend for s in formed] == [expected]
        assert ("n1/0" in bc.backend_reason) == (expected == "nccl")
    finally:
        for sock in bc._reserved.values():
            sock.close()
        await actor.close()
        await trainer.close()


# --------------------------------------------------------------------------
# Exports and mappings


class FakeIpc:
    """The two torch IPC calls, faked for CPU tensors in one process: an
    "export" names the storage, an "open" hands back that storage's bytes."""

    def __init__(self):
        self.exports: list[int] = []  # data_ptr of each exported storage
        self.opens = 0
        self._storages: dict[bytes, torch.Tensor] = {}

    def export(self, buf: torch.Tensor) -> IpcHandle:
        storage = buf.untyped_storage()
        self.exports.append(storage.data_ptr())
        handle = str(storage.data_ptr()).encode()
        self._storages[handle] = torch.empty(0, dtype=torch.uint8).set_(storage)
        return IpcHandle(GPU_A, buf.numel(), handle, storage.nbytes(), 0, b"/torch_ref", len(self.exports), None, False)

    def open(self, h: IpcHandle) -> torch.Tensor:
        self.opens += 1
        return self._storages[h.handle][: h.nbytes]


def test_lend_handle_exports_each_buffer_once(monkeypatch):
    ipc = FakeIpc()
    monkeypatch.setattr(weight_ipc, "export_handle", ipc.export)
    scratch = torch.zeros(4096, dtype=torch.uint8)
    handles = [weight_ipc.lend_handle(scratch[:n]) for n in (4096, 100, 3000, 100)]
    assert len(ipc.exports) == 1 and [h.nbytes for h in handles] == [4096, 100, 3000, 100]
    assert {msgspec.structs.replace(h, nbytes=0) for h in handles} == {msgspec.structs.replace(handles[0], nbytes=0)}
    grown = torch.zeros(8192, dtype=torch.uint8)
    assert weight_ipc.lend_handle(grown[:5000]).storage_size_bytes == 8192
    assert len(ipc.exports) == 2
    del scratch, handles
    ipc._storages.clear()  # the fake's own reference to the first buffer
    weight_ipc.lend_handle(grown[:10])
    assert len(ipc.exports) == 2 and len(weight_ipc._exports) == 1  # the dead buffer's entry is gone


def test_buckets_and_pushes_share_one_export_per_buffer(monkeypatch):
    """Three pushes over a cuda_ipc group (gloo control channel, CPU
    buffers): rank 0 exports its scratch buffer once, the worker maps it
    once, until a plan with a larger bucket makes the trainer grow the
    buffer: one more export, one more mapping. Every byte arrives."""
    ipc = FakeIpc()
    monkeypatch.setattr(weight_ipc, "export_handle", ipc.export)
    monkeypatch.setattr(weight_ipc, "open_handle", ipc.open)
    small = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 2000)).to(torch.bfloat16)
    large = torch.nn.Sequential(small, torch.nn.Linear(1024, 1024).to(torch.bfloat16))  # a 2 MiB tensor
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=30)
    # The lending path with CPU tensors: the spec says cuda_ipc, the device is cpu.
    spec = msgspec.structs.replace(bc.new_epoch([("n/0", 1, HERE)]), backend="cuda_ipc")
    plans: queue.Queue = queue.Queue()
    got: list[dict] = []

    def receiver():
        comm = WeightComm(spec, 1, "cpu")
        try:
            while (blob := plans.get(timeout=30)) is not None:
                plan = decode_plan(blob)
                assert not agree_on_plan(comm, plan.digest(), reject=False)
                got.append({})
                for bucket in plan.buckets:
                    buf = torch.full((bucket.nbytes,), 7, dtype=torch.uint8)
                    comm.broadcast(buf)
                    got[-1].update((n, t.clone()) for n, t in unpack_bucket(bucket, buf))
        finally:
            comm.close()

    thread = threading.Thread(target=receiver)
    sent, buckets = [], 0
    try:
        with keep_stdout():
            thread.start()
            bc.open_group(spec)
        for version, model in enumerate((small, small, large), start=1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            tensors = update_tensors(model)
            plan = bc.plan(tensors, version)
            plans.put(encode(plan))
            bc.broadcast(plan, tensors)
            sent.append({n: t.clone() for n, t in tensors})
            buckets += len(plan.buckets)
    finally:
        plans.put(None)
        thread.join(60)
        bc.close_group()
    assert buckets == 3 + 3 + 5
    assert len(ipc.exports) == 2 and ipc.opens == 2  # one per buffer, not per bucket
    assert bc._pack_bufs[0].numel() == 2 << 20 and bc._pack_bufs[1] is None  # cuda_ipc sends one at a time
    assert len(got) == 3
    for want, have in zip(sent, got):
        assert have.keys() == want.keys() and all(torch.equal(have[n], t) for n, t in want.items())
