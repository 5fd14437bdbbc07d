"""trainer.attention and the micro-batch layouts it selects: sdpa/eager get
right-padded length buckets with no attention mask (never an [S, S] one),
flash_attention_2 gets one concatenated sequence for its varlen kernel, and
every layout scores the tokens exactly as rows scored one at a time. The
CUDA varlen kernel cannot run here: it is replaced by a per-row sdpa
reference that reads the same cu_seq_lens."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from rlnode.config import ConfigError, load_config
from rlnode.trainer.learner import attention_implementation
from rlnode.trainer.scoring import PackedRow, length_buckets, packed_inputs
from test_learner_scale import learner, step_batch

BUDGET = 26  # tokens: splits step_batch's rows (40, 18, 5, 5, 5, 5) three ways


# ---------------------------------------------------------------------------
# Choosing the kernel


@pytest.fixture
def flash_attn_installed(monkeypatch):
    real = importlib.util.find_spec
    fake = object()  # find_spec only has to answer "found"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "flash_attn" else real(name, *a))


def test_auto_picks_flash_attention_only_for_bf16_compute_on_cuda(flash_attn_installed):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only .type is read
    # fp32 compute: FA2 would raise at the first forward.
    assert attention_implementation("auto", cuda, "fp32") == "sdpa"
    assert attention_implementation("auto", cuda, "bf16-mixed") == "flash_attention_2"
    assert attention_implementation("auto", cuda, "bf16") == "flash_attention_2"
    assert attention_implementation("auto", cpu, "bf16-mixed") == "sdpa"
    assert attention_implementation("flash_attention_2", cuda, "bf16-mixed") == "flash_attention_2"
    assert attention_implementation("eager", cuda, "bf16") == "eager"


def test_auto_falls_back_to_pytorchs_varlen_kernel_without_flash_attn(monkeypatch):
    from rlnode.trainer.attention import VARLEN

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    assert attention_implementation("auto", torch.device("cuda"), "bf16-mixed") == VARLEN
    assert attention_implementation("auto", torch.device("cuda"), "fp32") == "sdpa"
    with pytest.raises(ConfigError, match=r"trainer\.attention.*flash_attn package"):
        attention_implementation("flash_attention_2", torch.device("cuda"), "bf16-mixed")


def test_explicit_flash_attention_that_cannot_run_is_refused(flash_attn_installed, tiny_model_dir):
    with pytest.raises(ConfigError, match=r'trainer\.attention.*fp16/bf16.*trainer\.precision = "fp32"'):
        load_config(None, ['trainer.attention="flash_attention_2"'])
    with pytest.raises(ConfigError, match=r'trainer\.attention.*cuda.*trainer\.device = "cpu"'):
        load_config(None, ['trainer.attention="flash_attention_2"', 'trainer.precision="bf16-mixed"',
                           'trainer.device="cpu"'])
    # device "auto" is only known at start: refused there (no cuda here).
    cfg = load_config(None, ['trainer.attention="flash_attention_2"', 'trainer.precision="bf16-mixed"'])
    assert cfg.trainer.attention == "flash_attention_2"
    with pytest.raises(ConfigError, match=r"trainer\.attention.*fp16/bf16"):
        attention_implementation("flash_attention_2", torch.device("cuda"), "fp32")
    with pytest.raises(ConfigError, match=r"trainer\.attention.*needs a cuda trainer"):
        attention_implementation("flash_attention_2", torch.device("cpu"), "bf16-mixed")
    assert load_config(None, []).trainer.attention == "auto"


# ---------------------------------------------------------------------------
# Layouts


def test_length_buckets_respect_the_budget_and_bound_the_padding():
    lengths = [40, 3, 18, 5, 12, 5, 9, 11, 5, 26, 2, 7]
    bins = length_buckets(lengths, BUDGET)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        slots = len(b) * max(lengths[i] for i in b)
        assert len(b) == 1 or slots <= BUDGET, b
        assert sum(lengths[i] for i in b) > slots / 2, b  # padding under half
    assert [[lengths[i] for i in b] for b in bins] == [[40], [26], [18], [12, 11], [9, 7], [5, 5, 5, 3], [2]]


def test_packed_inputs_refuse_a_kernel_that_would_need_an_s_by_s_mask():
    rows = [PackedRow(torch.arange(4).numpy(), [(0, 1, 3)])]
    with pytest.raises(ValueError, match="varlen"):
        packed_inputs(rows, torch.device("cpu"), "sdpa")
    kw = packed_inputs(rows + rows, torch.device("cpu"), "flash_attention_2").kwargs
    assert kw["cu_seq_lens_q"].tolist() == [0, 4, 8] and kw["max_length_q"] == 4
    assert kw["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]


def test_sdpa_micro_batches_are_padded_rows_with_no_mask(tiny_model_dir, hf_model, monkeypatch):
    batch = step_batch(hf_model)
    for knobs in ([f"trainer.micro_batch_tokens={BUDGET}"], ["trainer.micro_batch_size=3"]):
        lrn = learner(tiny_model_dir, *knobs)
        assert lrn.attn_impl == "sdpa" and not lrn.varlen
        base = lrn.model.base_model
        forwards, kernels = [], []
        real_forward, real_sdpa = base.forward, F.scaled_dot_product_attention

        def forward(**kw):
            forwards.append(kw)
            return real_forward(**kw)

        def sdpa(q, k, v, attn_mask=None, *a, is_causal=False, **kw):
            kernels.append((attn_mask, is_causal, q.shape[0], q.shape[2]))
            return real_sdpa(q, k, v, attn_mask, *a, is_causal=is_causal, **kw)

        monkeypatch.setattr(base, "forward", forward)
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        mbs = lrn.micro_batches(batch.samples)
        m = lrn.train_step(batch)
        monkeypatch.undo()
        assert len(forwards) == len(mbs) == m.extra["micro_batches"]
        for kw, mb in zip(forwards, mbs):
            # [rows, longest row], nothing that could turn into a mask.
            shape = [len(mb.rows), max(len(r.tokens) for r in mb.rows)]
            assert list(kw["input_ids"].shape) == shape
            assert kw.get("attention_mask") is None and kw.get("position_ids") is None
        # Every layer's kernel call: no mask tensor at all, causal by flag.
        assert len(kernels) == len(mbs) * lrn.model.config.num_hidden_layers
        assert all(mask is None and causal for mask, causal, _, _ in kernels)
        assert m.extra["forward_tokens"] == sum(mb.padded_tokens for mb in mbs)
        assert m.extra["pad_fraction"] == pytest.approx(1 - sum(mb.tokens for mb in mbs) / m.extra["forward_tokens"])


def _varlen_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    """Stand-in for the CUDA varlen kernel: causal sdpa on each
    [cu[i], cu[i+1]) segment of the one packed row; [1, H, S, D] in,
    [1, S, H, D] out like transformers' kernels."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert attention_mask is None and query.shape[0] == 1
    cu = kw["cu_seq_lens_q"].tolist()
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, dropout,
                                   scaling, is_causal=True)[0] for a, b in zip(cu, cu[1:])]
    return torch.cat(outs, 1), None


def _as_varlen(lrn, monkeypatch) -> list[int]:
    """The learner as it runs under flash_attention_2, the kernel faked;
    returns the list the fake appends each call's segment count to."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []

    def kernel(*a, **kw):
        calls.append(len(kw["cu_seq_lens_q"]) - 1)
        return _varlen_reference(*a, **kw)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "flash_attention_2", kernel)
    lrn.model.config._attn_implementation = "flash_attention_2"
    lrn.attn_impl, lrn.varlen = "flash_attention_2", True
    return calls


def _score_micro_batches(lrn, samples):
    """[B, T] log-probs and entropy, each micro-batch in its own forward."""
    T = max(len(s.completion_token_ids) for s in samples)
    lp, ent = torch.zeros(len(samples), T), torch.zeros(len(samples), T)
    with torch.no_grad():
        for mb in lrn.micro_batches(samples):
            got = lrn.token_logprobs(lrn.model, [samples[i] for i in mb.samples], rows=mb.rows)
            n = got.logprobs.shape[1]
            lp[mb.samples, :n], ent[mb.samples, :n] = got.logprobs, got.entropy
    return lp, ent


@pytest.mark.parametrize("layout", ["sdpa", "eager", "varlen"])
def test_layouts_score_like_rows_one_at_a_time(layout, tiny_model_dir, hf_model, monkeypatch):
    batch = step_batch(hf_model)
    attention = "eager" if layout == "eager" else "sdpa"
    lrn = learner(tiny_model_dir, f"trainer.micro_batch_tokens={BUDGET}", f'trainer.attention="{attention}"')
    assert lrn.attn_impl == attention
    # Reference: each forward row alone, no padding and nothing packed.
    rows = lrn.forward_rows(batch.samples)
    with torch.no_grad():
        singles = [lrn.token_logprobs(lrn.model, batch.samples, rows=[r]) for r in rows]
    ref_lp, ref_ent = sum(s.logprobs for s in singles), sum(s.entropy for s in singles)
    calls = _as_varlen(lrn, monkeypatch) if layout == "varlen" else []
    if layout == "varlen":
        assert sorted(mb.tokens for mb in lrn.micro_batches(batch.samples)) == [15, 23, 40]  # first-fit decreasing
    lp, ent = _score_micro_batches(lrn, batch.samples)
    if layout == "varlen":  # each layer of each micro-batch: its rows as segments
        assert sorted(set(calls)) == [1, 2, 3] and len(calls) == 3 * lrn.model.config.num_hidden_layers
    # A few fp32 ulps: the kernels block [R, L] and [1, L] differently.
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6)
    assert (ref_lp != 0).sum() == sum(len(s.completion_token_ids) for s in batch.samples)
