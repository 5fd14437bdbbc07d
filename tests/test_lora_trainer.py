"""LoRA on the trainer's side (issue 38, trainer.lora): the learner trains
an adapter on a frozen base, checkpoints hold the adapter in peft's format,
which transformers loads unchanged (vLLM too: tests/test_lora_updates.py,
on its running engine), and --resume goes on from it. Real components: the
tiny model, peft, transformers."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from conftest import reference_logprobs
from rlnode.config import AdvantageConfig, ConfigError, load_config
from rlnode.trainer.buffer import BufferCounters, build_batch
from rlnode.trainer.checkpoint import ADAPTER_DIR, CheckpointManager
from rlnode.trainer.learner import Learner
from rlnode.weights import lora
from test_learner import group, make_sample
from test_push_safety import _stale_group, _train_loop, _trainer_cfg, _until

RANK = 4  # not one of vLLM's ranks: the engine's max_lora_rank rounds it up (8)


def _cfg(model_dir, *extra: str):
    return load_config(None, [f"model.path={model_dir}", 'trainer.device="cpu"', "trainer.optim.lr=1e-2",
                              "trainer.micro_batch_size=1", f"trainer.lora.rank={RANK}", "trainer.lora.alpha=8",
                              *extra])


def _batch(hf_model):
    good = make_sample(hf_model, [5, 6], [40, 41], "g/e0", 0)
    bad = make_sample(hf_model, [5, 6], [50, 51], "g/e1", 0)
    return build_batch([group("g", [1.0, 0.0], [good, bad])], 0, 1, AdvantageConfig(), BufferCounters())


def _is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _trained(model_dir, hf_model, steps: int = 3, *extra: str) -> Learner:
    learner = Learner(_cfg(model_dir, *extra))
    batch = _batch(hf_model)
    for _ in range(steps):
        assert not learner.train_step(batch).skipped
    return learner


def test_a_step_trains_only_the_adapter(tiny_model_dir, hf_model):
    learner = Learner(_cfg(tiny_model_dir))
    named = dict(learner.model.named_parameters())
    adapter = {n: p for n, p in named.items() if _is_adapter_param(n)}
    # q, k, v, o, gate, up, down in each of the tiny model's layers, A and B.
    assert adapter and len(adapter) == len(lora.adapter_tensors(learner.model))
    opt_params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(adapter)
    assert {id(p) for p in opt_params} == {id(p) for p in adapter.values()}
    assert sum(p.numel() for p in opt_params) == sum(p.numel() for p in adapter.values())
    assert all(p.requires_grad == _is_adapter_param(n) for n, p in named.items())
    before = {n: p.detach().clone() for n, p in named.items()}
    batch = _batch(hf_model)
    with torch.no_grad():
        lp0 = learner.token_logprobs(learner.model, batch.samples).logprobs
    # B = 0 at the start: the wrapped model is the base model (version 0).
    ref = torch.stack([reference_logprobs(hf_model, s.prompt_token_ids.tolist(), s.completion_token_ids.tolist())
                       for s in batch.samples])
    assert (lp0 - ref).abs().max() < 1e-5
    m = learner.train_step(batch)
    assert not m.skipped and m.grad_norm > 0
    changed = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    assert changed and all(_is_adapter_param(n) for n in changed)
    assert any(".lora_B." in n for n in changed)
    for n, p in named.items():
        if not _is_adapter_param(n):
            assert torch.equal(p.detach(), before[n]), f"base weight {n} moved"
    # The step moved the policy the way the advantage points, through the adapter.
    with torch.no_grad():
        lp1 = learner.token_logprobs(learner.model, batch.samples).logprobs
    assert lp1[0].sum() > lp0[0].sum() and lp1[1].sum() < lp0[1].sum()


def test_kl_reference_is_the_base_under_the_adapter(tiny_model_dir, hf_model):
    """With kl_coef > 0 the reference is the base model with the adapter
    switched off (no second copy): after training it still scores what
    the untouched base does, while the policy moved."""
    learner = _trained(tiny_model_dir, hf_model, 3, "trainer.loss.kl_coef=0.1")
    assert learner.ref_model is None
    batch = _batch(hf_model)
    ref = learner.reference_logprobs(batch.samples)
    want = torch.stack([reference_logprobs(hf_model, s.prompt_token_ids.tolist(), s.completion_token_ids.tolist())
                        for s in batch.samples])
    assert (ref - want).abs().max() < 1e-5
    with torch.no_grad():
        policy = learner.token_logprobs(learner.model, batch.samples).logprobs
    assert (policy - want).abs().max() > 1e-3
    assert "kl" in " ".join(learner.train_step(batch).extra)


def test_a_target_that_names_no_linear_layer_is_refused_at_start(tiny_model_dir):
    cfg = _cfg(tiny_model_dir, 'trainer.lora.target_modules=["q_proj", "attn_qkv"]')
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules.*attn_qkv"):
        Learner(cfg)


def _checkpoint(tiny_model_dir, hf_model, tmp_path):
    learner = _trained(tiny_model_dir, hf_model)
    path = CheckpointManager(tmp_path / "run").save(3, 3, learner.model, learner.optimizer, learner.scheduler,
                                                      str(tiny_model_dir), [], {})
    return learner, path


def test_the_checkpoint_holds_the_adapter_that_transformers_loads(tiny_model_dir, hf_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner, path = _checkpoint(tiny_model_dir, hf_model, tmp_path)
    adapter_dir = path / ADAPTER_DIR
    assert sorted(os.listdir(adapter_dir)) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]
    assert not (path / "policy").exists()  # the base is not copied
    assert json.loads((adapter_dir / lora.ADAPTER_CONFIG).read_text())["r"] == RANK
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    learner.model.eval()
    ids = torch.tensor([[5, 6, 7, 8, 40, 41, 42, 9, 10]])
    with torch.no_grad():
        want, got = learner.model(ids).logits, loaded(ids).logits
        plain = hf_model(ids).logits
    assert (got - want).abs().max() < 1e-5
    assert (want - plain).abs().max() > 1e-3  # the adapter is not a no-op


async def test_resume_restores_the_adapter_and_the_version(tiny_model_dir, tmp_path):
    from rlnode.trainer.daemon import TrainerDaemon

    cfg = _trainer_cfg(tiny_model_dir, tmp_path, f"trainer.lora.rank={RANK}", "trainer.optim.lr=1e-2")
    trainer = TrainerDaemon(cfg)
    trainer.buffer.put(_stale_group("g1", 0))
    trainer.buffer.put(_stale_group("g2", 0))
    async with _train_loop(trainer):
        await _until(lambda: trainer.step == 1, 60, "a step")
    saved = {n: t.clone() for n, t in lora.adapter_tensors(trainer.learner.model)}
    assert any(n.endswith("lora_B.weight") and t.abs().max() > 0 for n, t in saved.items())
    path = trainer.checkpoints.latest()
    assert path is not None and (path / ADAPTER_DIR / lora.ADAPTER_WEIGHTS).is_file()
    # final/ is the adapter directory too.
    final = tmp_path / "run" / "final"
    assert sorted(os.listdir(final)) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]

    again = TrainerDaemon(cfg, resume=True)
    try:
        await again.start()
        assert (again.version, again.step) == (trainer.version, 1) and again.version >= 1
        restored = dict(lora.adapter_tensors(again.learner.model))
        assert restored.keys() == saved.keys()
        for n, t in saved.items():
            assert torch.equal(restored[n], t), n
        # The optimizer state came back for the adapter's parameters.
        state = again.learner.optimizer.state_dict()["state"]
        assert len(state) == len(saved) and all(float(s["step"]) == 1 for s in state.values())
    finally:
        await again.shutdown()


async def test_a_full_weight_checkpoint_is_refused_by_a_lora_resume(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir)
    full = Learner(load_config(None, [f"model.path={tiny_model_dir}", 'trainer.device="cpu"']))
    path = await asyncio.to_thread(CheckpointManager(tmp_path).save, 1, 1, full.model, full.optimizer,
                                   full.scheduler, str(tiny_model_dir), [], {})
    learner = Learner(cfg)
    with pytest.raises(RuntimeError, match="full weights"):
        CheckpointManager(tmp_path).load(path, learner.model, learner.optimizer, learner.scheduler)
