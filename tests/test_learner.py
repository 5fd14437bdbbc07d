"""The trainer's scoring, batch building and optimizer step on a tiny model
(no engine: samples are drawn from the transformers model itself)."""

import math

import pytest
import torch

from conftest import reference_logprobs
from rlnode.actor.router import LeaseMetadata
from rlnode.config import AdvantageConfig, load_config
from rlnode.trainer.buffer import BufferCounters, build_batch
from rlnode.trainer.learner import Learner, lr_factor, pack_episodes
from rlnode.wire import EpisodeSummary, GroupDelivery, TrainingSample, pack_f32, pack_i32


def make_sample(model, prompt, completion, episode_id, version, temperature=1.0, behaviour_shift=0.0, step=0):
    lp = reference_logprobs(model, prompt, completion, temperature) + behaviour_shift
    return TrainingSample(
        sample_id=f"{episode_id}/{step}", group_id=episode_id.split("/")[0], episode_id=episode_id, cube_id="c",
        task_id="t", step_index=step, prompt_ids=pack_i32(prompt), completion_ids=pack_i32(completion),
        logprobs=pack_f32(lp.tolist()), loss_mask=bytes([1]) * len(completion), reward=0.0,
        finish_reason="stop", termination_reason="done", policy_version=version, temperature=temperature,
        lease=LeaseMetadata(1, 0, 0.0, 0.0),
    )


def group(gid, rewards, samples):
    eps = [EpisodeSummary(f"{gid}/e{i}", r, r > 0, 1, "done") for i, r in enumerate(rewards)]
    return GroupDelivery(gid, "n", "c", "t", 0, eps, samples)


def test_scores_at_sampling_temperature(tiny_model_dir, hf_model):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\""])
    learner = Learner(cfg)
    prompt, comp = [5, 6, 7, 8], [40, 41, 42]
    for T in (1.0, 0.6):
        s = make_sample(hf_model, prompt, comp, "g/e0", 0, temperature=T)
        with torch.no_grad():
            logp, mask, ent = learner.token_logprobs(learner.model, [s, make_sample(hf_model, [9], [50], "g/e1", 0, T)])
        ref = reference_logprobs(hf_model, prompt, comp, T)
        assert (logp[0, :3] - ref).abs().max() < 1e-5
        assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
        # Entropy of the whole distribution at T, at each completion token.
        ids = torch.tensor([prompt + comp])
        lsm = torch.log_softmax(hf_model(ids).logits[0, len(prompt) - 1 : -1].float() / T, -1)
        assert (ent[0, :3] - (-(lsm.exp() * lsm).sum(-1))).abs().max() < 1e-4
        assert ent[1, 1:].abs().max() == 0


def test_episodes_pack_into_one_row_with_the_same_logprobs(tiny_model_dir, hf_model):
    # A 3-call episode (each prompt = previous prompt + completion + a new
    # message), a second episode, and a call whose prompt was cut (it does
    # not extend its episode: it must get a row of its own).
    p0, c0 = [5, 6, 7], [40, 41]
    p1, c1 = p0 + c0 + [8, 9], [42]
    p2, c2 = p1 + c1 + [10, 11, 12], [43, 44, 45]
    cut = p2[2:] + c2 + [13]
    samples = [
        make_sample(hf_model, p2, c2, "g/e0", 0, step=2, temperature=0.7),  # order must not matter
        make_sample(hf_model, [9, 9], [50], "g/e1", 0),
        make_sample(hf_model, p0, c0, "g/e0", 0, step=0),
        make_sample(hf_model, p1, c1, "g/e0", 0, step=1),
        make_sample(hf_model, cut, [46], "g/e0", 0, step=3),
    ]
    rows = pack_episodes(samples)
    assert sorted(sorted(k for k, _, _ in r.spans) for r in rows) == [[0, 2, 3], [1], [4]]
    packed = next(r for r in rows if len(r.spans) == 3)
    assert packed.tokens.tolist() == p2 + c2
    assert sorted(packed.spans) == [(0, len(p2), 3), (2, len(p0), 2), (3, len(p1), 1)]

    scores = {}
    for pack in (True, False):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\"",
                                 f"trainer.pack_episodes={str(pack).lower()}"])
        learner = Learner(cfg)
        with torch.no_grad():
            scores[pack], mask, _ = learner.token_logprobs(learner.model, samples)
        assert mask.sum().item() == 3 + 1 + 2 + 1 + 1
        for k, s in enumerate(samples):
            ref = reference_logprobs(hf_model, s.prompt_token_ids.tolist(), s.completion_token_ids.tolist(),
                                     s.temperature)
            assert (scores[pack][k, : len(ref)] - ref).abs().max() < 1e-5
    assert (scores[True] - scores[False]).abs().max() < 1e-5


def test_batch_drops_stale_and_skips_zero_signal(hf_model):
    counters = BufferCounters()
    fresh = group("g1", [1.0, 0.0], [make_sample(hf_model, [5], [6], "g1/e0", 3),
                                     make_sample(hf_model, [5], [7], "g1/e1", 1)])
    silent = group("g2", [1.0, 1.0], [make_sample(hf_model, [5], [6], "g2/e0", 3),
                                      make_sample(hf_model, [5], [6], "g2/e1", 3)])
    batch = build_batch([fresh, silent], version=4, max_lag=1, adv_cfg=AdvantageConfig(), counters=counters)
    assert [s.episode_id for s in batch.samples] == ["g1/e0"]  # g1/e1 has lag 3 > 1
    assert batch.advantages == [0.5] and batch.lags == [1]
    assert batch.dropped_stale == 1 and counters.samples_dropped_stale == 1
    assert batch.zero_signal_groups == 1 and counters.groups_zero_signal == 1
    assert batch.rewards == [1.0, 0.0, 1.0, 1.0] and batch.group_ids == ["g1", "g2"]
    # The normaliser counts the silent group's fresh samples (1 token each),
    # not the stale one: g1/e0 + g2/e0 + g2/e1.
    assert (batch.norm_samples, batch.norm_tokens) == (3, 3)


def test_step_baseline_trains_a_group_that_always_fails(hf_model):
    """advantage.zero_signal_baseline = "step": a group whose episodes all
    failed is trained with a negative advantage (the other group's mean is
    higher), still counted as zero-signal and as all-failed; under the
    default it is skipped."""
    def groups():
        return [group("g1", [1.0, 0.0], [make_sample(hf_model, [5], [6], "g1/e0", 0),
                                         make_sample(hf_model, [5], [7], "g1/e1", 0)]),
                group("g2", [-0.5, -0.5], [make_sample(hf_model, [5], [8], "g2/e0", 0),
                                           make_sample(hf_model, [5], [8], "g2/e1", 0)])]
    counters = BufferCounters()
    batch = build_batch(groups(), 0, 1, AdvantageConfig(zero_signal_baseline="step"), counters)
    assert [s.episode_id for s in batch.samples] == ["g1/e0", "g1/e1", "g2/e0", "g2/e1"]
    assert batch.advantages == pytest.approx([0.5, -0.5, -1.0, -1.0])  # g2: -0.5 - mean(1, 0)
    assert (batch.zero_signal_groups, batch.groups_all_failed, batch.groups_all_solved) == (1, 1, 0)
    assert counters.groups_zero_signal == 1 and counters.groups_trained == 2
    default = build_batch(groups(), 0, 1, AdvantageConfig(), BufferCounters())
    assert [s.episode_id for s in default.samples] == ["g1/e0", "g1/e1"]
    assert (default.zero_signal_groups, default.groups_all_failed) == (1, 1)


def test_train_step_moves_logprob_with_the_advantage(tiny_model_dir, hf_model):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\"", "trainer.optim.lr=1e-2",
                             "trainer.micro_batch_size=1"])
    learner = Learner(cfg)
    good = make_sample(hf_model, [5, 6], [40, 41], "g/e0", 0)
    bad = make_sample(hf_model, [5, 6], [50, 51], "g/e1", 0)
    batch = build_batch([group("g", [1.0, 0.0], [good, bad])], 0, 1, AdvantageConfig(), BufferCounters())
    with torch.no_grad():
        before = learner.token_logprobs(learner.model, [good, bad]).logprobs
    m = learner.train_step(batch)
    with torch.no_grad():
        after = learner.token_logprobs(learner.model, [good, bad]).logprobs
    assert after[0].sum() > before[0].sum() and after[1].sum() < before[1].sum()
    assert m.samples == 2 and m.tokens == 4 and m.grad_norm > 0
    # On-policy samples: the trainer's and the engine's logprobs agree.
    assert m.logprob_diff_mean < 1e-5
    assert m.lr == 1e-2


def test_on_policy_parity_metric_counts_only_lag0_samples(tiny_model_dir, hf_model):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\"", "trainer.micro_batch_size=1"])
    learner = Learner(cfg)
    # Version 3: e0 was sampled by version 3 (exact logprobs), e1 by version 2
    # (its behaviour logprobs differ by 0.5 nats per token).
    on = make_sample(hf_model, [5, 6], [40, 41], "g/e0", 3)
    off = make_sample(hf_model, [5, 6], [50, 51], "g/e1", 2, behaviour_shift=0.5)
    batch = build_batch([group("g", [1.0, 0.0], [on, off])], 3, 1, AdvantageConfig(), BufferCounters())
    m = learner.train_step(batch)
    assert m.on_policy_diff_max is not None and m.on_policy_diff_max < 1e-5
    assert abs(m.logprob_diff_mean - 0.25) < 1e-4  # 0.5 on half of the tokens
    only_stale = build_batch([group("h", [1.0, 0.0], [make_sample(hf_model, [5], [6], "h/e0", 2),
                                                      make_sample(hf_model, [5], [7], "h/e1", 2)])],
                             3, 1, AdvantageConfig(), BufferCounters())
    assert learner.train_step(only_stale).on_policy_diff_max is None


def test_each_token_gets_the_lag_of_the_weights_that_produced_it(tiny_model_dir, hf_model):
    """A call that started at version 2 and took a push (version 3) after its
    first token: that token is 1 version behind a trainer at 3, the second
    is on policy. The step counts tokens per lag, the mismatch per lag, and
    with loss.max_token_lag = 0 masks the stale token only."""
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\"", "trainer.micro_batch_size=1",
                             "trainer.loss.max_token_lag=0"])
    learner = Learner(cfg)
    mixed = make_sample(hf_model, [5, 6], [40, 41, 42], "g/e0", 2, behaviour_shift=0.5)
    mixed.weight_versions = [("2", 0, 1), ("3", 1, 3)]
    fresh = make_sample(hf_model, [5, 6], [50, 51], "g/e1", 3)
    batch = build_batch([group("g", [1.0, 0.0], [mixed, fresh])], 3, 1, AdvantageConfig(), BufferCounters())
    assert [t.tolist() for t in batch.token_lags] == [[1, 0, 0], [0, 0]] and batch.lags == [1, 0]
    m = learner.train_step(batch)
    assert m.token_lag_hist == {0: 4, 1: 1}
    f = m.mismatch
    assert (f["tokens"], f["lag0/tokens"], f["lag1/tokens"]) == (5, 4, 1)
    # mixed's tokens are all 0.5 nats off (d = -0.5): k3 = e^-0.5 - 1 + 0.5
    k3 = math.exp(-0.5) - 0.5
    assert abs(f["lag1/mismatch_kl"] - k3) < 1e-5 and abs(f["lag1/logprob_absdiff_max"] - 0.5) < 1e-5
    assert abs(f["lag0/mismatch_kl"] - 2 * k3 / 4) < 1e-5  # two of the four lag-0 tokens are mixed's
    assert abs(f["masked_fraction"] - 1 / 5) < 1e-6 and m.extra["lag_masked_fraction"] == pytest.approx(1 / 5)
    # Spans without a version label (or none at all) fall back to the call's start.
    mixed.weight_versions = [("default", 0, 3)]
    assert build_batch([group("g", [1.0, 0.0], [mixed, fresh])], 3, 1, AdvantageConfig(),
                       BufferCounters()).token_lags[0].tolist() == [1, 1, 1]


def silent_group(hf_model):
    """Two attempts that agree token for token and in reward: no policy gradient."""
    return group("s", [1.0, 1.0], [make_sample(hf_model, [5, 6], [40], "s/e0", 0),
                                    make_sample(hf_model, [5, 6], [40], "s/e1", 0)])


def step_entropy(learner: Learner, batch) -> tuple:
    """(entropy at the batch's first token before, the step's metrics, after)."""
    with torch.no_grad():
        before = learner.token_logprobs(learner.model, batch.samples).entropy[0, 0].item()
    m = learner.train_step(batch)
    with torch.no_grad():
        after = learner.token_logprobs(learner.model, batch.samples).entropy[0, 0].item()
    return before, m, after


def test_entropy_bonus_trains_on_zero_signal_groups(tiny_model_dir, hf_model):
    # All attempts agree: no policy gradient. Without a regulariser the group
    # is skipped; with entropy_coef it is trained with advantage 0 and the
    # step raises the entropy there.
    skipped = build_batch([silent_group(hf_model)], 0, 1, AdvantageConfig(), BufferCounters())
    assert skipped.samples == [] and skipped.zero_signal_groups == 1
    counters = BufferCounters()
    kept = build_batch([silent_group(hf_model)], 0, 1, AdvantageConfig(), counters, keep_zero_signal=True)
    assert len(kept.samples) == 2 and kept.advantages == [0.0, 0.0]
    assert kept.zero_signal_groups == 1 and counters.groups_zero_signal == 1
    # (A small step: the random model is already near the maximum, ln 264.)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\"", "trainer.optim.lr=1e-4",
                             "trainer.loss.entropy_coef=0.1"])
    before, m, after = step_entropy(Learner(cfg), kept)
    assert m.grad_norm > 0 and after > before, (before, after)
    assert abs(m.extra["entropy"] - before) < 1e-4


def test_entropy_floor_trains_only_states_below_it(tiny_model_dir, hf_model):
    # A zero-signal group (advantage 0) with no mean bonus (entropy_coef 0):
    # only the floor can act. The random model's entropy is ~ln 264 = 5.6
    # nats: a floor under it leaves the step without any gradient, a floor
    # over it raises the entropy there (the learner must compute entropy
    # with its gradient for the floor alone).
    kept = build_batch([silent_group(hf_model)], 0, 1, AdvantageConfig(), BufferCounters(), keep_zero_signal=True)
    for floor, raised in ((1.0, False), (10.0, True)):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "trainer.device=\"cpu\"", "trainer.optim.lr=1e-4",
                                 f"trainer.loss.entropy_floor={floor}", "trainer.loss.entropy_floor_coef=1.0"])
        before, m, after = step_entropy(Learner(cfg), kept)
        assert m.extra["entropy_below_floor"] == float(raised)
        if raised:
            assert m.grad_norm > 0 and after > before, (before, after)
        else:
            assert m.grad_norm == 0 and after == before, (m.grad_norm, before, after)


@pytest.mark.parametrize("setting, kept", [(None, False), ("trainer.loss.entropy_coef=0.01", True),
                                            ("trainer.loss.entropy_floor=0.3", True),
                                            ("trainer.loss.kl_coef=0.01", True)])
def test_the_trainer_keeps_zero_signal_groups_for_any_regulariser(tiny_model_dir, tmp_path, setting, kept):
    # A zero-signal group reaches the loss only when a term acts on it;
    # without one it is counted and skipped (build_batch above).
    from rlnode.trainer.daemon import TrainerDaemon

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run.run_dir={tmp_path}", "trainer.device=\"cpu\""]
                      + ([setting] if setting else []))
    assert TrainerDaemon(cfg).buffer.keep_zero_signal is kept


def test_lr_schedule():
    assert lr_factor(0, 4, 100, "cosine", 0.1) == 0.25
    assert lr_factor(3, 4, 100, "cosine", 0.1) == 1.0
    assert abs(lr_factor(100, 4, 100, "cosine", 0.1) - 0.1) < 1e-9
    assert abs(lr_factor(52, 4, 100, "linear", 0.0) - 0.5) < 1e-9
    assert lr_factor(50, 0, 100, "constant", 0.1) == 1.0
