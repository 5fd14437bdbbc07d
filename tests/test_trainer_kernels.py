"""Issue 49's trainer switches on the tiny model, on CPU: PyTorch's own
packed varlen attention, checkpointing from the memory plan, the fused
log-prob head. Each gives the reference path's log-probs and gradients.
The compiled decoder layer, with every switch on at once, is checked
against the real engine's samples in tests/test_engine.py."""

import inspect

import pytest
import torch

from rlnode.config import ConfigError, load_config
from rlnode.trainer import attention
from rlnode.trainer.learner import Learner, attention_implementation
from test_learner import make_sample
from test_learner_scale import assert_same_grads, grads_after_step, learner, step_batch


def test_varlen_attention_packs_rows_into_one_sequence_and_matches_padded_sdpa(tiny_model_dir, hf_model):
    """A packed micro-batch (one [1, S] sequence, positions restarting per
    row, attention kept inside each row) scores and trains exactly like
    right-padded rows under sdpa, in fp32."""
    batch = step_batch(hf_model)
    common = ["trainer.optim.lr=1e-3", "trainer.loss.entropy_coef=0.01", "trainer.micro_batch_tokens=26"]
    ref = learner(tiny_model_dir, *common, 'trainer.attention="sdpa"')
    var = learner(tiny_model_dir, *common, 'trainer.attention="varlen"')
    assert var.attn_impl == attention.VARLEN and var.varlen and not ref.varlen
    # First-fit decreasing into one sequence per micro-batch: [40], [18, 5], [5, 5, 5].
    assert [[len(r.tokens) for r in mb.rows] for mb in var.micro_batches(batch.samples)] == [[40], [18, 5], [5, 5, 5]]
    calls = []
    real = attention._per_row
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_per_row", lambda q, k, v, cu, s: calls.append(cu.tolist()) or real(q, k, v, cu, s))
        with torch.no_grad():
            a = ref.token_logprobs(ref.model, batch.samples)
            b = var.token_logprobs(var.model, batch.samples, rows=var.forward_rows(batch.samples))
    # Every decoder layer got the one packed sequence with its row boundaries.
    layers = var.model.config.num_hidden_layers
    assert len(calls) == layers and all(c == calls[0] for c in calls)
    assert sorted(b - a for a, b in zip(calls[0], calls[0][1:])) == [5, 5, 5, 5, 18, 40]
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5 and (a.entropy - b.entropy).abs().max() < 1e-5
    m_ref, g_ref = grads_after_step(ref, batch)
    m_var, g_var = grads_after_step(var, batch)
    assert m_var.extra["pad_tokens"] == 0 and m_var.extra["forward_tokens"] == 78 and m_var.extra["micro_batches"] == 3
    assert abs(m_ref.loss - m_var.loss) < 1e-6
    assert_same_grads(g_ref, g_var, 1e-5)


def test_varlen_attention_without_a_token_budget_still_packs(tiny_model_dir, hf_model):
    """micro_batch_size micro-batches run packed too: the kernel takes no
    padded batch."""
    batch = step_batch(hf_model)
    ref = learner(tiny_model_dir, 'trainer.attention="sdpa"', "trainer.micro_batch_size=4")
    var = learner(tiny_model_dir, 'trainer.attention="varlen"', "trainer.micro_batch_size=4")
    m_ref, g_ref = grads_after_step(ref, batch)
    m_var, g_var = grads_after_step(var, batch)
    assert m_var.extra["pad_tokens"] == 0 and m_ref.extra["pad_tokens"] > 0
    assert_same_grads(g_ref, g_var, 1e-5)


def test_the_cuda_kernel_is_called_causal_by_this_torchs_signature():
    """The contract with torch.nn.attention.varlen.varlen_attn (cuda only):
    causal through window_size=(-1, 0) (torch 2.11+) or is_causal (2.9,
    2.10), GQA where the signature has it; anything else is refused naming
    the key."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    for name in ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "scale"):
        assert name in params
    kwargs = attention._cuda_varlen_kwargs(varlen_attn)
    assert kwargs.get("window_size") == (-1, 0) or kwargs.get("is_causal") is True
    assert set(kwargs) <= set(params)

    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        pass

    def neither(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        pass

    assert attention._cuda_varlen_kwargs(old) == {"is_causal": True}
    with pytest.raises(RuntimeError, match='trainer.attention = "sdpa"'):
        attention._cuda_varlen_kwargs(neither)


def test_which_kernel_each_choice_gets():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention_implementation("auto", cpu, "fp32") == "sdpa"
    assert attention_implementation("auto", cuda, "fp32") == "sdpa"
    # No flash_attn wheel here: PyTorch's own kernel.
    assert attention_implementation("auto", cuda, "bf16-mixed") == attention.VARLEN
    assert attention_implementation("varlen", cpu, "fp32") == attention.VARLEN
    with pytest.raises(ConfigError, match='trainer.attention: "varlen" on cuda .* trainer.precision = "bf16-mixed"'):
        attention_implementation("varlen", cuda, "fp32")
    with pytest.raises(ConfigError, match='trainer.attention: "varlen" on cuda'):
        load_config(None, ['trainer.device="cuda"', 'trainer.attention="varlen"', 'trainer.precision="fp32"'])


def test_auto_checkpointing_recomputes_the_layers_the_plan_chose(tiny_model_dir, hf_model, monkeypatch):
    """The learner checkpoints exactly the plan's checkpoint_layers (the
    plan itself is cuda-only: tests/test_memory_plan.py), and the gradients
    are those of no checkpointing."""
    import rlnode.trainer.learner as learner_mod
    from rlnode.trainer.learner import decoder_layers

    batch = step_batch(hf_model)
    _, ref = grads_after_step(learner(tiny_model_dir, "trainer.activation_checkpointing=false"), batch)
    assert learner(tiny_model_dir).checkpoint_layers == 0  # "auto" on cpu: no plan, nothing recomputed

    class Plan:
        checkpoint_layers = 1

    monkeypatch.setattr(learner_mod, "check_learner_memory", lambda *a: Plan())
    lrn = learner(tiny_model_dir, 'trainer.activation_checkpointing="auto"')
    assert lrn.checkpoint_layers == 1
    assert [layer.gradient_checkpointing for layer in decoder_layers(lrn.model)] == [True, False]
    recomputed = []
    for i, layer in enumerate(decoder_layers(lrn.model)):
        # A pre-hook: the recompute stops once it has what backward needs
        # (checkpoint's early stop), before any forward hook would run.
        layer.register_forward_pre_hook(lambda mod, args, i=i: recomputed.append(i))
    _, got = grads_after_step(lrn, batch)
    # Layer 0 ran twice per micro-batch (forward, recompute in backward), layer 1 once.
    assert recomputed.count(0) == 2 * recomputed.count(1) > 0
    assert_same_grads(ref, got, 1e-5)


@pytest.mark.parametrize("knobs", [
    [],
    ["trainer.loss.entropy_coef=0.05", 'trainer.loss.normalize="sequences"'],
    ['trainer.loss.kind="tis_reinforce"', "trainer.loss.kl_coef=0.1", "trainer.loss.max_token_lag=0",
     "trainer.loss.entropy_floor=2.0"],
])
def test_the_fused_head_gives_the_chunked_heads_loss_figures_and_gradients(tiny_model_dir, hf_model, knobs):
    """trainer.logprob_head = "fused" (each chunk's backward in its forward,
    no recompute) against "chunked" (checkpointed chunks), in fp32: the same
    loss, figures and gradients to 1e-4, with the entropy in the loss, KL,
    the lag mask and both normalisations. Small chunks: many per micro-batch."""
    batch = step_batch(hf_model)
    common = ["trainer.micro_batch_size=3", "trainer.logprob_chunk_tokens=5", *knobs]
    m_ref, g_ref = grads_after_step(learner(tiny_model_dir, *common, 'trainer.logprob_head="chunked"'), batch)
    fused = learner(tiny_model_dir, *common, 'trainer.logprob_head="fused"')
    assert fused.fused_head
    m_fu, g_fu = grads_after_step(fused, batch)
    assert abs(m_ref.loss - m_fu.loss) < 1e-6 and abs(m_ref.grad_norm - m_fu.grad_norm) < 1e-4 * m_ref.grad_norm
    for key, value in m_ref.extra.items():
        assert m_fu.extra[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert m_ref.on_policy_diff_max == pytest.approx(m_fu.on_policy_diff_max, abs=1e-6)
    assert_same_grads(g_ref, g_fu, 1e-4)


def test_the_fused_head_computes_the_head_once_per_chunk(tiny_model_dir, hf_model):
    """No recompute: the head runs once per chunk (chunked: twice)."""
    batch = step_batch(hf_model)
    calls = {}
    for head in ("chunked", "fused"):
        lrn = learner(tiny_model_dir, "trainer.micro_batch_size=64", "trainer.logprob_chunk_tokens=8",
                      f'trainer.logprob_head="{head}"')
        n = []
        lrn.model.get_output_embeddings().register_forward_pre_hook(lambda mod, args: n.append(args[0].shape[0]))
        grads_after_step(lrn, batch)
        calls[head] = n
    tokens = sum(len(s.completion_token_ids) for s in batch.samples)
    assert sum(calls["fused"]) == tokens and sum(calls["chunked"]) == 2 * tokens


def test_fused_head_is_refused_where_it_cannot_split_the_loss(tiny_model_dir):
    with pytest.raises(ConfigError, match='trainer.logprob_head: "fused" cannot run with loss.kind = "gspo"'):
        learner(tiny_model_dir, 'trainer.logprob_head="fused"', 'trainer.loss.kind="gspo"')
    assert not learner(tiny_model_dir, 'trainer.loss.kind="gspo"').fused_head  # "auto" falls back
    assert learner(tiny_model_dir).fused_head
