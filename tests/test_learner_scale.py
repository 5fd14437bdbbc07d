"""The Learner's knobs for real models, on the tiny model: token-budget
packed micro-batches, chunked scoring, activation checkpointing and
precision give the gradients (or the updates) they promise."""

import torch

from rlnode.config import AdvantageConfig, load_config
from rlnode.trainer.buffer import BufferCounters, build_batch
from rlnode.trainer.learner import Learner
from test_learner import group, make_sample


def learner(tiny_model_dir, *overrides):
    return Learner(load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\"", *overrides]))


def step_batch(hf_model):
    """Two groups: a 3-call episode (one packed row of 24 tokens), short
    single-call episodes, and one 40-token sample (longer than the budget)."""
    p0, c0 = [5, 6, 7], [40, 41]
    p1, c1 = p0 + c0 + [8, 9], [42, 43, 44]
    p2, c2 = p1 + c1 + [10, 11, 12, 13], [45, 46, 47, 48]
    long_p, long_c = list(range(60, 90)), list(range(100, 110))
    g1 = group("a", [1.0, 0.0, 0.5], [
        make_sample(hf_model, p2, c2, "a/e0", 0, step=2, temperature=0.7),
        make_sample(hf_model, p0, c0, "a/e0", 0, step=0, temperature=0.7),
        make_sample(hf_model, p1, c1, "a/e0", 0, step=1, temperature=0.7),
        make_sample(hf_model, [9, 9, 9], [50, 51], "a/e1", 0),
        make_sample(hf_model, long_p, long_c, "a/e2", 0, behaviour_shift=0.1)])
    g2 = group("b", [0.0, 1.0, 1.0], [make_sample(hf_model, [7, 8], [60, 61, 62], "b/e0", 0),
                                      make_sample(hf_model, [7, 8, 9, 10], [63], "b/e1", 0, temperature=1.2),
                                      make_sample(hf_model, [7], [64, 65, 66, 67], "b/e2", 0)])
    return build_batch([g1, g2], 0, 1, AdvantageConfig(), BufferCounters())


def grads_after_step(lrn, batch):
    m = lrn.train_step(batch)
    return m, {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b, tol):
    assert a.keys() == b.keys() and len(a) > 0
    for n in a:
        assert (a[n] - b[n]).abs().max() <= tol * max(1.0, a[n].abs().max()), (n, (a[n] - b[n]).abs().max())


def test_token_budget_packing_equals_the_padded_per_sample_path(tiny_model_dir, hf_model):
    batch = step_batch(hf_model)
    for normalize in ("tokens", "sequences"):
        common = ["trainer.optim.lr=1e-3", f"trainer.loss.normalize=\"{normalize}\"", "trainer.loss.entropy_coef=0.01"]
        # Reference: one padded row per sample, one micro-batch.
        ref = learner(tiny_model_dir, *common, "trainer.pack_episodes=false", "trainer.micro_batch_size=64")
        packed = learner(tiny_model_dir, *common, "trainer.micro_batch_tokens=26")
        mbs = packed.micro_batches(batch.samples)
        # Rows of 40 (over budget: alone), 18 (the episode), 5, 5, 5, 5
        # tokens; sdpa on CPU, so padded length buckets: [40], [18] (18 + 18
        # slots > 26), [5, 5, 5, 5] (first-fit decreasing, the varlen
        # layout, would give [40], [18, 5], [5, 5, 5]).
        assert not packed.varlen
        assert [[len(r.tokens) for r in mb.rows] for mb in mbs] == [[40], [18], [5, 5, 5, 5]]
        assert sorted(i for mb in mbs for i in mb.samples) == list(range(len(batch.samples)))
        with torch.no_grad():
            a = ref.token_logprobs(ref.model, batch.samples)
            b = packed.token_logprobs(packed.model, batch.samples)
        assert (a.logprobs - b.logprobs).abs().max() < 1e-5 and (a.entropy - b.entropy).abs().max() < 1e-5
        assert torch.equal(a.mask, b.mask)
        m_ref, g_ref = grads_after_step(ref, batch)
        m_pk, g_pk = grads_after_step(packed, batch)
        assert m_pk.extra["micro_batches"] == len(mbs) and m_ref.extra["micro_batches"] == 1
        # No padding: 78 forward tokens instead of 8 rows of 40 (93 real).
        assert m_pk.extra["forward_tokens"] == 78 and m_ref.extra["forward_tokens"] == 8 * 40
        assert m_pk.extra["pad_fraction"] == 0 and m_ref.extra["pad_tokens"] == 8 * 40 - 93
        assert abs(m_ref.loss - m_pk.loss) < 1e-6 and abs(m_ref.grad_norm - m_pk.grad_norm) < 1e-5
        assert_same_grads(g_ref, g_pk, 1e-5)


def test_chunked_scoring_and_checkpointing_leave_gradients_unchanged(tiny_model_dir, hf_model):
    batch = step_batch(hf_model)
    common = ["trainer.loss.entropy_coef=0.05", "trainer.micro_batch_size=3"]
    _, ref = grads_after_step(learner(tiny_model_dir, *common, "trainer.logprob_chunk_tokens=4096"), batch)
    for knobs in (["trainer.logprob_chunk_tokens=3"],  # does not divide any micro-batch's tokens
                  ["trainer.activation_checkpointing=true"],
                  ["trainer.activation_checkpointing=true", "trainer.micro_batch_tokens=32",
                   "trainer.logprob_chunk_tokens=5"]):
        lrn = learner(tiny_model_dir, *common, *knobs)
        assert lrn.model.is_gradient_checkpointing == ("trainer.activation_checkpointing=true" in knobs)
        _, got = grads_after_step(lrn, batch)
        assert_same_grads(ref, got, 1e-5)


def test_bf16_mixed_moves_weights_at_a_small_lr_where_bf16_does_not(tiny_model_dir, hf_model):
    batch = step_batch(hf_model)
    moved, logp = {}, {}
    for precision in ("fp32", "bf16-mixed", "bf16"):
        lrn = learner(tiny_model_dir, "trainer.optim.lr=1e-6", f"trainer.precision=\"{precision}\"")
        before = {n: p.detach().clone() for n, p in lrn.model.named_parameters()}
        with torch.no_grad():
            logp[precision] = lrn.token_logprobs(lrn.model, batch.samples).logprobs
        m = lrn.train_step(batch)
        assert not m.skipped
        changed = total = 0
        for n, p in lrn.model.named_parameters():
            if p.grad is None:
                continue
            got = p.grad != 0  # elements that received gradient
            changed += int(((p.detach() != before[n]) & got).sum())
            total += int(got.sum())
        moved[precision] = changed / total
        want = torch.bfloat16 if precision == "bf16" else torch.float32  # master weights
        assert all(p.dtype == want for p in lrn.model.parameters())
    # AdamW's first update is ~lr per element: 1e-6 moves an fp32 weight of
    # size 0.02 (ulp 2e-9) but is below half a bf16 ulp there (6e-5).
    assert moved["fp32"] > 0.99 and moved["bf16-mixed"] > 0.99, moved
    assert moved["bf16"] < 0.05, moved
    # bf16-mixed really computes in bf16 (autocast): close to fp32, not equal.
    d = (logp["bf16-mixed"] - logp["fp32"]).abs().max().item()
    assert 0 < d < 0.1, d
