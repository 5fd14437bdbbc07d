"""RL math against values worked out by hand (rlnode/trainer/loss.py).

The shared 2x3 example (row 1 has one padding token, holding garbage that
must not leak):
    logpi  = [[-1, -2, -0.5], [-1, -3, pad]]
    r      = [[ 1,  4,  0.5], [ 2, 0.5, pad]]     (logmu = logpi - ln r)
    A      = [2, -1]
    5 trained tokens, 2 samples.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlnode.config import AdvantageConfig, LossConfig
from rlnode.trainer.loss import (LOG_RATIO_MAX, LossInputs, equal_reward_groups, group_advantages,
                                 next_entropy_coef, policy_loss, zero_signal_groups)

LN2 = math.log(2.0)


def close(actual, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), expected, rtol=tol, atol=tol)


# --------------------------------------------------------------- advantages
def test_advantages_mean_baseline():
    # group 0: mean 0.25 -> [0.75, -0.25, -0.25, -0.25]; group 1: all equal -> 0
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, AdvantageConfig(baseline="mean"))
    close(adv, [[0.75, -0.25, -0.25, -0.25], [0.0, 0.0, 0.0, 0.0]])


def test_advantages_leave_one_out():
    # [3, 1, 2]: 3 - mean(1,2) = 1.5; 1 - mean(3,2) = -1.5; 2 - mean(3,1) = 0
    # [1, 0, 0]: 1 - 0 = 1; 0 - mean(1,0) = -0.5 (twice)
    rewards = torch.tensor([[3.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
    adv = group_advantages(rewards, AdvantageConfig(baseline="leave_one_out"))
    close(adv, [[1.5, -1.5, 0.0], [1.0, -0.5, -0.5]])


def test_advantages_std_normalize_uses_population_std():
    # [1, 0, 0, 0]: mean 0.25, population var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875,
    # std = 0.4330127 -> 0.75 / std = 1.7320508 (sqrt 3), -0.25 / std = -0.5773503.
    # (A sample std, 0.5, would give 1.5 and -0.5.) Equal group: 0 / (0 + 1e-6) = 0.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, AdvantageConfig(std_normalize=True))
    close(adv, [[1.7320508, -0.5773503, -0.5773503, -0.5773503], [0.0] * 4])
    # leave-one-out then std: [1, -1/3, -1/3, -1/3] / 0.4330127
    adv = group_advantages(rewards, AdvantageConfig(baseline="leave_one_out", std_normalize=True))
    close(adv, [[2.3094011, -0.7698004, -0.7698004, -0.7698004], [0.0] * 4])


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("std_normalize", [False, True])
def test_advantages_single_attempt_is_zero(baseline, std_normalize):
    rewards = torch.tensor([[0.7], [0.2]])
    adv = group_advantages(rewards, AdvantageConfig(baseline=baseline, std_normalize=std_normalize))
    assert adv.tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize("std_normalize", [False, True])
def test_zero_signal_groups(std_normalize):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards, AdvantageConfig(std_normalize=std_normalize))
    assert zero_signal_groups(adv).tolist() == [False, True, True, False]


def test_step_baseline_gives_equal_reward_groups_the_other_groups_mean():
    # Groups: mixed [1, 0], all failed [-0.6, -0.6], all solved [1, 1].
    # Mixed keeps its own mean (0.5): [0.5, -0.5].
    # All failed: the others' 4 rewards average (1 + 0 + 1 + 1) / 4 = 0.75 -> -1.35 each.
    # All solved: the others' average (1 + 0 - 0.6 - 0.6) / 4 = -0.05 -> 1.05 each.
    rewards = torch.tensor([[1.0, 0.0], [-0.6, -0.6], [1.0, 1.0]])
    adv = group_advantages(rewards, AdvantageConfig(zero_signal_baseline="step"))
    close(adv, [[0.5, -0.5], [-1.35, -1.35], [1.05, 1.05]])
    assert zero_signal_groups(adv).tolist() == [False, False, False]
    assert equal_reward_groups(rewards).tolist() == [False, True, True]
    # "group" (the default) leaves them silent.
    assert zero_signal_groups(group_advantages(rewards, AdvantageConfig())).tolist() == [False, True, True]
    # std_normalize: the equal groups divide by the step's population std
    # over its 6 rewards (mean 0.3, var = (0.49 + 0.09 + 0.81 * 2 + 0.49 * 2) / 6 = 0.53).
    adv = group_advantages(rewards, AdvantageConfig(zero_signal_baseline="step", std_normalize=True))
    std = 0.53 ** 0.5
    close(adv, [[1.0, -1.0], [-1.35 / std] * 2, [1.05 / std] * 2], tol=1e-5)


def test_step_baseline_leaves_a_step_of_one_reward_silent():
    # Every group got the same reward (nothing to compare with), and a step
    # of one group has no other group: both stay zero-signal.
    for rewards in (torch.full((3, 4), 0.7), torch.tensor([[2.0, 2.0, 2.0]])):
        adv = group_advantages(rewards, AdvantageConfig(zero_signal_baseline="step", std_normalize=True))
        assert zero_signal_groups(adv).all()


def test_adaptive_entropy_coef_moves_towards_the_target_within_bounds():
    cfg = LossConfig(entropy_coef=0.002, entropy_target=0.3, entropy_coef_step=0.004, entropy_coef_max=0.02)
    c = 0.01  # e.g. where a checkpoint left it
    trace = []
    for h in (2.0, 2.0, 2.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.5, 0.5):
        c = next_entropy_coef(c, h, cfg, failing=True)
        trace.append(round(c, 6))
    # Above the target: down to entropy_coef and no lower; below: up to the
    # ceiling; above again: down.
    assert trace == [0.006, 0.002, 0.002, 0.006, 0.01, 0.014, 0.018, 0.02, 0.016, 0.012]
    # Off (no target), or a step without an entropy figure: unchanged.
    assert next_entropy_coef(0.01, 0.0, LossConfig(entropy_coef=0.01), failing=True) == 0.01
    assert next_entropy_coef(0.01, None, cfg, failing=True) == next_entropy_coef(0.01, float("nan"), cfg, failing=True) == 0.01


def test_adaptive_entropy_coef_raised_only_by_failing_steps_when_asked():
    cfg = LossConfig(entropy_coef=0.002, entropy_target=0.3, entropy_coef_step=0.004, entropy_coef_max=0.02,
                     entropy_raise_on_failure=True)
    c, trace = 0.01, []
    # (entropy, some group failed in every attempt)
    for h, failing in ((0.1, True), (0.1, True), (0.1, False), (0.1, False), (2.0, True), (0.1, True)):
        c = next_entropy_coef(c, h, cfg, failing=failing)
        trace.append(round(c, 6))
    # Below the target: up only with a failing group, else down (no wind-up
    # on a converged policy); above the target: down whatever failed.
    assert trace == [0.014, 0.018, 0.014, 0.01, 0.006, 0.01]
    # Without the option a step's failures do not matter.
    plain = LossConfig(entropy_coef=0.002, entropy_target=0.3, entropy_coef_step=0.004, entropy_coef_max=0.02)
    assert next_entropy_coef(0.01, 0.1, plain, failing=False) == pytest.approx(0.014)


# --------------------------------------------------------------------- loss
def example(ref_d=None) -> LossInputs:
    logpi = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, 7.0]], requires_grad=True)
    r = torch.tensor([[1.0, 4.0, 0.5], [2.0, 0.5, 1.0]])
    logmu = logpi.detach() - r.log()
    logmu[1, 2] = -5.0  # padding garbage: unmasked it would give r = e^12
    ref = None
    if ref_d is not None:  # ref = logpi + d
        ref = logpi.detach() + torch.tensor(ref_d)
        ref[1, 2] = 50.0
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return LossInputs(logpi, logmu, torch.tensor([2.0, -1.0]), mask, ref)


def run(cfg: LossConfig, normalizer: float, ref_d=None):
    inp = example(ref_d)
    out = policy_loss(inp, cfg, normalizer)
    out.loss.backward()
    return out, inp.logprobs.grad


def test_tis_reinforce_tokens():
    # l = -A logpi min(r, 2):
    #   row 0 (A=2):  -2*-1*1 = 2,  -2*-2*2 = 8,  -2*-0.5*0.5 = 0.5
    #   row 1 (A=-1):  1*-1*2 = -2,  1*-3*0.5 = -1.5
    # loss = (10.5 - 3.5) / 5 = 1.4; grad = -A min(r, 2) / 5, 0 on padding
    out, grad = run(LossConfig(kind="tis_reinforce", is_cap=2.0), normalizer=5)
    close(out.loss, 1.4)
    close(grad, [[-0.4, -0.8, -0.2], [0.4, 0.1, 0.0]])
    # ratio mean (1+4+0.5+2+0.5)/5 = 1.6, max 4 (not the padding's e^12);
    # only r=4 > 2 is truncated: 1/5; |logpi - logmu| = (0 + 2ln2 + 3 ln2)/5 = ln2
    m = out.metrics
    assert m["tokens"] == 5
    close([m["ratio_mean"], m["ratio_max"], m["clip_fraction"], m["logprob_diff_mean"]], [1.6, 4.0, 0.2, LN2])
    assert "kl" not in m


def test_tis_reinforce_sequences():
    # per-sample token mean: row 0: 10.5/3 = 3.5, row 1: -3.5/2 = -1.75
    # loss = (3.5 - 1.75) / 2 samples = 0.875
    # grad row 0: [-2, -4, -1] / 3 / 2; row 1: [2, 0.5] / 2 / 2
    out, grad = run(LossConfig(kind="tis_reinforce", normalize="sequences"), normalizer=2)
    close(out.loss, 0.875)
    close(grad, [[-1 / 3, -2 / 3, -1 / 6], [0.5, 0.125, 0.0]])


def test_ppo_clip():
    # clip range [0.8, 1.28]; l = -min(r A, clip(r) A), grad = -A r unless clipped
    #   row 0, A=2:  r=1:   min(2, 2) = 2          -> l=-2,    grad -2
    #                r=4:   min(8, 2.56) = 2.56    -> l=-2.56, clipped, grad 0
    #                r=0.5: min(1, 1.6) = 1        -> l=-1,    grad -1 (low side, A>0: not clipped)
    #   row 1, A=-1: r=2:   min(-2, -1.28) = -2    -> l=2,     grad 2 (high side, A<0: not clipped)
    #                r=0.5: min(-0.5, -0.8) = -0.8 -> l=0.8,   clipped, grad 0
    # loss = (-2 - 2.56 - 1 + 2 + 0.8) / 5 = -0.552; clip_fraction 2/5
    out, grad = run(LossConfig(kind="ppo_clip", eps_low=0.2, eps_high=0.28), normalizer=5)
    close(out.loss, -0.552)
    close(grad, [[-0.4, 0.0, -0.2], [0.4, 0.0, 0.0]])
    close(out.metrics["clip_fraction"], 0.4)
    close(out.metrics["ratio_max"], 4.0)


def test_ppo_dual_clip_bounds_only_negative_advantages_above_c():
    # test_ppo_clip's example with c = 1.5: only row 1's r=2 (A=-1, above c)
    # is bound: l = -max(min(-2, -1.28), 1.5 * -1) = 1.5, grad 0 (was 2).
    # Row 0's r=4 has A > 0: PPO's own clip, the dual clip leaves it.
    # loss = (-2 - 2.56 - 1 + 1.5 + 0.8) / 5 = -0.652; dual_clip_fraction 1/5
    out, grad = run(LossConfig(kind="ppo_clip", eps_low=0.2, eps_high=0.28, dual_clip=1.5), normalizer=5)
    close(out.loss, -0.652)
    close(grad, [[-0.4, 0.0, -0.2], [0.0, 0.0, 0.0]])
    close(out.metrics["clip_fraction"], 0.4)
    close(out.metrics["dual_clip_fraction"], 0.2)
    # The default c = 3 is above every ratio with A < 0 here: PPO's gradient.
    out, grad = run(LossConfig(kind="ppo_clip", eps_low=0.2, eps_high=0.28), normalizer=5)
    close(grad, [[-0.4, 0.0, -0.2], [0.4, 0.0, 0.0]])
    assert out.metrics["dual_clip_fraction"] == 0.0
    # Off: no bound, no metric.
    out, grad = run(LossConfig(kind="ppo_clip", eps_low=0.2, eps_high=0.28, dual_clip=0), normalizer=5)
    close(grad, [[-0.4, 0.0, -0.2], [0.4, 0.0, 0.0]])
    assert "dual_clip_fraction" not in out.metrics


def test_default_loss_bounds_stale_tokens_on_both_sides():
    # The default (pipelined runs are the default) is ppo_clip with dual_clip
    # 3: a token 4x likelier now than when it was sampled gets no gradient
    # whatever its advantage's sign (A > 0: PPO's clip at 1.28; A < 0: the
    # dual clip at 3). A fresh token (r = 1) gets -A / N. Truncated-IS
    # REINFORCE would push both stale tokens with weight min(4, is_cap).
    logpi = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    r = torch.tensor([[4.0, 1.0], [4.0, 1.0]])
    inp = LossInputs(logpi, logpi.detach() - r.log(), torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    out = policy_loss(inp, LossConfig(), normalizer=4)
    out.loss.backward()
    close(logpi.grad, [[0.0, -0.25], [0.0, 0.25]])
    close([out.metrics["clip_fraction"], out.metrics["dual_clip_fraction"]], [0.25, 0.25])


@pytest.mark.parametrize("kind", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("dual_clip", [3.0, 0.0])
def test_a_token_sampled_far_below_the_trainer_gives_no_nan(kind, dual_clip):
    # logmu = -100 against logpi = -1: r = e^99 overflows fp32 to inf. Before
    # LOG_RATIO_MAX the discarded inf branch of torch.where made the whole
    # gradient NaN (and the trainer skipped the step). Now that token gets
    # no gradient (clipped, dual-clipped, or past the bound) and the fresh
    # token beside it its usual -A / N.
    for adv in (1.0, -1.0):
        logpi = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
        logmu = torch.tensor([[-1.0], [-100.0]])
        inp = LossInputs(logpi, logmu, torch.tensor([adv, adv]), torch.ones(2, 1))
        out = policy_loss(inp, LossConfig(kind=kind, dual_clip=dual_clip), normalizer=2)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(logpi.grad).all()
        # gspo's sequence ratio is a value (no gradient through it): with the
        # dual clip off and A < 0 it pushes with the bound, e^20 (PPO's open
        # side), finite.
        stale = math.exp(20) / 2 if (kind, dual_clip, adv) == ("gspo", 0.0, -1.0) else 0.0
        close(logpi.grad, [[-adv / 2], [stale]])


@pytest.mark.parametrize("kind", ["tis_reinforce", "ppo_clip", "gspo"])
def test_ratio_stats_read_the_bounded_ratio(kind):
    # The same overflowing token (r = e^99, inf in fp32): the ratio figures
    # read exp(min(log r, LOG_RATIO_MAX)) = e^20, finite, and the loss is
    # the same as before (the figures feed nothing).
    logpi = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    inp = LossInputs(logpi, torch.tensor([[-1.0], [-100.0]]), torch.tensor([1.0, 1.0]), torch.ones(2, 1))
    m = policy_loss(inp, LossConfig(kind=kind), normalizer=2).metrics
    assert m["ratio_max"] == pytest.approx(math.exp(LOG_RATIO_MAX), rel=1e-6)
    assert m["ratio_mean"] == pytest.approx((1 + math.exp(LOG_RATIO_MAX)) / 2, rel=1e-6)
    assert m["logprob_diff_mean"] == pytest.approx(99 / 2)  # the raw size, in log space


def test_gspo_dual_clip_bounds_the_sequence_ratio():
    # Both advantages negative, A = [-2, -1]; s_0 = 2^(1/3) = 1.2599210 > c = 1.1
    # (inside the clip range [0.8, 1.3]): l = -max(-2.5198421, 1.1 * -2) = 2.2 on
    # each of row 0's tokens, grad 0. Row 1: s_1 = 1 < c: l = 1, grad -A s / 5 = 0.2.
    # loss = (3 * 2.2 + 2 * 1) / 5 = 1.72; dual_clip_fraction 3/5
    inp = example()
    inp.advantages = torch.tensor([-2.0, -1.0])
    out = policy_loss(inp, LossConfig(kind="gspo", gspo_eps_low=0.2, gspo_eps_high=0.3, dual_clip=1.1), 5)
    out.loss.backward()
    close(out.loss, 1.72)
    close(inp.logprobs.grad, [[0.0, 0.0, 0.0], [0.2, 0.2, 0.0]])
    close(out.metrics["dual_clip_fraction"], 0.6)


def test_gspo_unclipped():
    # s_0 = exp((0 + ln4 - ln2)/3) = 2^(1/3) = 1.2599210 (inside [0.8, 1.3])
    # s_1 = exp((ln2 - ln2)/2) = 1
    # tokens: l = -A s per token: row 0: 3 * -2.5198421, row 1: 2 * 1
    #   loss = (-7.5595263 + 2) / 5 = -1.1119053
    #   grad = -A s_i / 5 on every token: row 0 -0.5039684, row 1 0.2
    #   (PPO's per-token -A r_t / 5 would give row 1 [0.4, 0.1])
    cfg = LossConfig(kind="gspo", gspo_eps_low=0.2, gspo_eps_high=0.3)
    out, grad = run(cfg, normalizer=5)
    close(out.loss, -1.1119053)
    close(grad, [[-0.5039684] * 3, [0.2, 0.2, 0.0]])
    assert out.metrics["clip_fraction"] == 0.0
    # sequences (the paper's objective): (-2.5198421 + 1) / 2 = -0.7599210,
    # grad = -A s_i / |y_i| / 2: row 0 -2*1.2599210/3/2 = -0.4199737, row 1 1/2/2
    cfg = LossConfig(kind="gspo", gspo_eps_low=0.2, gspo_eps_high=0.3, normalize="sequences")
    out, grad = run(cfg, normalizer=2)
    close(out.loss, -0.7599210)
    close(grad, [[-0.4199737] * 3, [0.25, 0.25, 0.0]])


def test_gspo_clipped_sequence():
    # clip range [0.8, 1.2]: s_0 = 1.2599 > 1.2 with A > 0 -> the whole sequence is
    # clipped: l = -1.2 * 2 = -2.4 per token, grad 0. Row 1 as before.
    # loss = (3 * -2.4 + 2 * 1) / 5 = -1.04; clip_fraction = 3 tokens / 5
    out, grad = run(LossConfig(kind="gspo", gspo_eps_low=0.2, gspo_eps_high=0.2), normalizer=5)
    close(out.loss, -1.04)
    close(grad, [[0.0, 0.0, 0.0], [0.2, 0.2, 0.0]])
    close(out.metrics["clip_fraction"], 0.6)


def test_kl_k3_term():
    # d = ref - logpi = [[0, ln2, -ln2], [ln3, 0, pad]]; k3 = e^d - d - 1:
    #   0, 2 - 0.6931472 - 1 = 0.3068528, 0.5 + 0.6931472 - 1 = 0.1931472,
    #   3 - 1.0986123 - 1 = 0.9013877, 0  -> sum 1.4013877, mean 0.2802775
    # dk3/dlogpi = 1 - e^d = [[0, -1, 0.5], [-2, 0]]
    # loss = tis 1.4 + 0.5 * 1.4013877 / 5 = 1.5401388
    # grad = tis grad + 0.5 * (1 - e^d) / 5 = [[-0.4, -0.9, -0.15], [0.2, 0.1, 0]]
    d = [[0.0, LN2, -LN2], [math.log(3.0), 0.0, 0.0]]
    out, grad = run(LossConfig(kind="tis_reinforce", kl_coef=0.5), normalizer=5, ref_d=d)
    close(out.loss, 1.5401388)
    close(grad, [[-0.4, -0.9, -0.15], [0.2, 0.1, 0.0]])
    close(out.metrics["kl"], 0.2802775)


def test_entropy_term():
    # H = [[1.0, 2.0, 0.5], [1.5, 0.25, pad 99]] (a leaf: its grad is the
    # term's own); l_t -= 0.1 H_t:
    # loss = tis 1.4 - 0.1 * (3.5 + 1.75) / 5 = 1.4 - 0.105 = 1.295
    # dloss/dH = -0.1 / 5 = -0.02 on real tokens, 0 on padding; the metric is
    # the mean over real tokens, 5.25 / 5 = 1.05.
    inp = example()
    inp.entropy = torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.25, 99.0]], requires_grad=True)
    out = policy_loss(inp, LossConfig(kind="tis_reinforce", entropy_coef=0.1), 5)
    out.loss.backward()
    close(out.loss, 1.295)
    close(inp.entropy.grad, [[-0.02, -0.02, -0.02], [-0.02, -0.02, 0.0]])
    close(inp.logprobs.grad, [[-0.4, -0.8, -0.2], [0.4, 0.1, 0.0]])  # the tis part, unchanged
    close(out.metrics["entropy"], 1.05)
    # Given but not weighted: a metric only, the loss is the plain tis one.
    inp = example()
    inp.entropy = torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.25, 99.0]])
    out = policy_loss(inp, LossConfig(kind="tis_reinforce"), 5)
    close(out.loss, 1.4)
    close(out.metrics["entropy"], 1.05)
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(example(), LossConfig(entropy_coef=0.1), 5)


def test_entropy_floor_term_acts_only_below_the_floor():
    # H = [[1.0, 2.0, 0.5], [1.5, 0.25, pad 99]], floor 0.6, coef 0.5, N = 5:
    # l_t -= 0.5 * min(H_t, 0.6):
    # loss = tis 1.4 - 0.5 * (0.6 + 0.6 + 0.5 + 0.6 + 0.25) / 5 = 1.4 - 0.255 = 1.145
    # dloss/dH = -0.5 / 5 = -0.1 on the two tokens below the floor (0.5, 0.25),
    # 0 on those above it and on padding; 2 of 5 real tokens are below.
    inp = example()
    inp.entropy = torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.25, 99.0]], requires_grad=True)
    out = policy_loss(inp, LossConfig(kind="tis_reinforce", entropy_floor=0.6, entropy_floor_coef=0.5), 5)
    out.loss.backward()
    close(out.loss, 1.145)
    close(inp.entropy.grad, [[0.0, 0.0, -0.1], [0.0, -0.1, 0.0]])
    close(inp.logprobs.grad, [[-0.4, -0.8, -0.2], [0.4, 0.1, 0.0]])  # the tis part, unchanged
    close(out.metrics["entropy_below_floor"], 0.4)
    # With the mean bonus too, the two add up on the tokens below the floor.
    inp = example()
    inp.entropy = torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.25, 99.0]], requires_grad=True)
    policy_loss(inp, LossConfig(kind="tis_reinforce", entropy_coef=0.1, entropy_floor=0.6,
                                entropy_floor_coef=0.5), 5).loss.backward()
    close(inp.entropy.grad, [[-0.02, -0.02, -0.12], [-0.02, -0.12, 0.0]])
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(example(), LossConfig(entropy_floor=0.2), 5)
    # Off (the default): no floor figure, no term.
    inp = example()
    inp.entropy = torch.tensor([[1.0, 2.0, 0.5], [1.5, 0.25, 99.0]])
    out = policy_loss(inp, LossConfig(kind="tis_reinforce"), 5)
    close(out.loss, 1.4)
    assert "entropy_below_floor" not in out.metrics


def test_kl_needs_reference():
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(example(), LossConfig(kl_coef=0.1), 5)


# ------------------------------------------------ micro-batching and padding
def random_batch(B: int = 6, T: int = 5) -> LossInputs:
    g = torch.Generator().manual_seed(0)
    logmu = -torch.rand(B, T, generator=g) * 3
    logpi = (logmu + torch.randn(B, T, generator=g) * 0.5).requires_grad_()
    lengths = torch.tensor([5, 3, 0, 1, 4, 2])  # row 2 is all padding
    mask = torch.arange(T)[None, :] < lengths[:, None]
    ref = logmu + torch.randn(B, T, generator=g) * 0.3
    return LossInputs(logpi, logmu, torch.randn(B, generator=g), mask, ref)


def slice_batch(inp: LossInputs, sl: slice, logpi: torch.Tensor) -> LossInputs:
    return LossInputs(logpi[sl], inp.behaviour_logprobs[sl], inp.advantages[sl], inp.mask[sl], inp.ref_logprobs[sl])


@pytest.mark.parametrize("kind", ["tis_reinforce", "ppo_clip", "gspo"])
@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
def test_micro_batches_sum_to_the_whole_batch(kind, normalize):
    cfg = LossConfig(kind=kind, normalize=normalize, kl_coef=0.1, gspo_eps_low=0.2, gspo_eps_high=0.2)
    inp = random_batch()
    # one normalizer for the whole step: 15 trained tokens, or 6 samples
    norm = float(inp.mask.sum()) if normalize == "tokens" else 6.0

    whole = policy_loss(inp, cfg, norm)
    whole.loss.backward()
    grad_whole = inp.logprobs.grad.clone()

    logpi = inp.logprobs.detach().clone().requires_grad_()
    losses = [policy_loss(slice_batch(inp, sl, logpi), cfg, norm).loss for sl in (slice(0, 2), slice(2, 6))]
    total = losses[0] + losses[1]
    total.backward()

    close(total, whole.loss)
    close(logpi.grad, grad_whole)
    assert torch.isfinite(grad_whole).all()
    assert (grad_whole[~inp.mask] == 0).all()  # padding gets no gradient
    assert grad_whole[0].abs().sum() > 0


@pytest.mark.parametrize("kind", ["tis_reinforce", "ppo_clip", "gspo"])
def test_all_padding_batch_is_zero_not_nan(kind):
    inp = random_batch()
    inp.mask = torch.zeros_like(inp.mask)
    inp.logprobs.data[0, 0] = float("nan")  # garbage under padding
    out = policy_loss(inp, LossConfig(kind=kind, kl_coef=0.1), normalizer=1.0)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert (inp.logprobs.grad == 0).all()
    dual = {} if kind == "tis_reinforce" else {"dual_clip_fraction": 0.0}
    assert out.metrics == {"tokens": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "clip_fraction": 0.0,
                           "logprob_diff_mean": 0.0, "kl": 0.0, **dual}


# ------------------------------------------------ per-token version lag mask
def test_lag_mask_drops_only_stale_tokens_and_keeps_the_normaliser():
    # tis_reinforce on the shared example with token lags
    #   [[0, 2, 1], [1, 1, pad]], max_token_lag 1: only row 0's token 1 (l = 8,
    #   grad -0.8 unmasked) is cut; the loss keeps N = 5:
    #   loss = (10.5 - 8 - 3.5) / 5 = -0.2
    inp = example()
    inp.token_lag = torch.tensor([[0, 2, 1], [1, 1, 9]])
    out = policy_loss(inp, LossConfig(kind="tis_reinforce", is_cap=2.0, max_token_lag=1), 5)
    out.loss.backward()
    close(out.loss, -0.2)
    close(inp.logprobs.grad, [[-0.4, 0.0, -0.2], [0.4, 0.1, 0.0]])
    close(out.metrics["lag_masked_fraction"], 0.2)
    # max_token_lag 0: on-policy tokens only (row 0's first token)
    inp = example()
    inp.token_lag = torch.tensor([[0, 2, 1], [1, 1, 9]])
    out = policy_loss(inp, LossConfig(kind="ppo_clip", max_token_lag=0), 5)
    out.loss.backward()
    assert (inp.logprobs.grad.flatten()[1:] == 0).all() and inp.logprobs.grad[0, 0] != 0
    close(out.metrics["lag_masked_fraction"], 0.8)
    with pytest.raises(ValueError, match="token_lag"):
        policy_loss(example(), LossConfig(max_token_lag=1), 5)


def test_lag_mask_off_by_default_ignores_lags():
    inp = example()
    inp.token_lag = torch.full((2, 3), 7)
    out = policy_loss(inp, LossConfig(kind="tis_reinforce", is_cap=2.0), 5)
    close(out.loss, 1.4)
    assert "lag_masked_fraction" not in out.metrics


# ------------------------------------------------ train/inference mismatch
def test_mismatch_figures_by_hand():
    from rlnode.trainer.loss import mismatch_figures

    # d = logpi - logmu per token: lag 0 tokens d = [0, ln2], lag 1 token d = -ln2
    #   r = [1, 2, 0.5]; k3 = r - 1 - d = [0, 1 - ln2, ln2 - 0.5]
    #   mismatch_kl = (0 + 1 - ln2 + ln2 - 0.5) / 3 = 1/6
    #   |d| = [0, ln2, ln2]: mean 2 ln2 / 3, p99 = max = ln2
    #   tis weights min(r, 1.5) = [1, 1.5, 0.5]: ESS = 3^2 / (3 * 3.5) = 6/7
    d = torch.tensor([0.0, LN2, -LN2])
    lag = torch.tensor([0, 0, 1])
    f = mismatch_figures(d, lag, LossConfig(kind="tis_reinforce", is_cap=1.5))
    close([f["tokens"], f["mismatch_kl"], f["logprob_absdiff_mean"], f["logprob_absdiff_p99"],
           f["logprob_absdiff_max"], f["is_ess"]], [3, 1 / 6, 2 * LN2 / 3, LN2, LN2, 6 / 7])
    # lag 0: k3 [0, 1 - ln2]; weights [1, 1.5]: ESS 2.5^2 / (2 * 3.25)
    close([f["lag0/tokens"], f["lag0/mismatch_kl"], f["lag0/logprob_absdiff_max"], f["lag0/is_ess"]],
          [2, (1 - LN2) / 2, LN2, 6.25 / 6.5])
    close([f["lag1/tokens"], f["lag1/mismatch_kl"], f["lag1/is_ess"]], [1, LN2 - 0.5, 1.0])
    # ppo_clip weighs by the raw ratio r: [1, 2, 0.5]: ESS 3.5^2 / (3 * 5.25)
    close(mismatch_figures(d, lag, LossConfig(kind="ppo_clip"))["is_ess"], 3.5 ** 2 / 15.75)
    # on policy, exactly: no mismatch, full ESS
    f = mismatch_figures(torch.zeros(4), torch.zeros(4, dtype=torch.long), LossConfig())
    assert f["mismatch_kl"] == 0 and f["is_ess"] == 1 and f["logprob_absdiff_max"] == 0
    assert set(k.partition("/")[0] for k in f if "/" in k) == {"lag0"}


def test_mismatch_p99_is_a_percentile_not_the_max():
    from rlnode.trainer.loss import mismatch_figures

    d = torch.cat([torch.full((990,), 0.01), torch.full((10,), 5.0)])  # 1% outliers
    f = mismatch_figures(d, torch.zeros(1000, dtype=torch.long), LossConfig())
    close([f["logprob_absdiff_p99"], f["logprob_absdiff_max"]], [0.01, 5.0])
