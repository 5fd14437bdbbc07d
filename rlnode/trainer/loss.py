"""The RL math: group advantages and the policy-gradient loss.

Owns: the formulas below, and nothing else. No model, optimizer or I/O: the
trainer computes log pi_theta, builds one LossInputs per micro-batch, calls
policy_loss and backprops `loss`. Knobs and defaults live in
rlnode/config/trainer.py (LossConfig, AdvantageConfig); this file must not
invent its own.

Notation. One sample i = one LLM call (prompt + completion); t = a completion
token of it. Every LLM call of an episode carries the episode's advantage A.
  logpi = log pi_theta(y_t)   current policy, carries the gradient
  logmu = log mu(y_t)         behaviour policy (the engine's sampler), no grad
  r_t   = exp(logpi - logmu)  per-token importance ratio
  sg(x) = x.detach()          stop-gradient
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlnode.config import AdvantageConfig, LossConfig

STD_EPS = 1e-6  # added to the group std before dividing (all-equal groups -> 0)
# Upper bound on log r inside the PPO surrogates (r <= e^20 ~ 4.9e8). A token
# the engine sampled at a log-probability 89 below the trainer's overflows
# exp() to inf in fp32, and torch.where's discarded inf branch turns the
# token's gradient, and with it the whole step's, into NaN (the step is then
# skipped as non-finite). "ppo_clip": above the bound the clip (A > 0) or
# the dual clip (A < 0) already gives the token no gradient; with the dual
# clip off the bound stops it too (clamp passes no gradient), instead of a
# ~1e9 push. "gspo": the sequence ratio is a value without gradient, so the
# bound only caps it: with the dual clip off and A < 0 the sequence pushes
# with weight e^20 (PPO's open side), finite.
LOG_RATIO_MAX = 20.0


# ---------------------------------------------------------------------------
# Advantages, per group of A attempts of one task with rewards R_1..R_A:
#   "mean":          adv_j = R_j - (1/A) sum_k R_k
#   "leave_one_out": adv_j = R_j - 1/(A-1) sum_{k!=j} R_k = A/(A-1) (R_j - mean)
#                    (0 when A == 1: there is no other episode to compare to)
#   std_normalize:   adv_j /= std(R) + 1e-6, with the POPULATION std
#                    sqrt((1/A) sum_k (R_k - mean)^2): defined for A == 1, and
#                    0 exactly when every reward is equal, so such groups stay 0.
# zero_signal_baseline = "step", for a group g whose rewards are all equal
# (R_gj = R_g), over the step's G groups (G > 1):
#   adv_gj = R_g - mean of the rewards of the other G-1 groups
#            (/ (std over all G*A rewards of the step + 1e-6) with std_normalize)
#   The other groups' rewards do not depend on g's actions: a baseline, like
#   the group mean, that leaves the gradient unbiased.
def group_advantages(rewards: torch.Tensor, cfg: AdvantageConfig) -> torch.Tensor:
    r = rewards.float()  # [G, A]
    G, A = r.shape
    adv = r - r.mean(dim=1, keepdim=True)  # [G, A]
    if cfg.baseline == "leave_one_out":
        adv = adv * (A / max(A - 1, 1))  # A == 1: r - mean is already 0
    if cfg.std_normalize:
        adv = adv / (r.std(dim=1, correction=0, keepdim=True) + STD_EPS)
    if cfg.zero_signal_baseline == "step" and G > 1:
        others = (r.sum() - r.sum(dim=1)) / ((G - 1) * A)  # [G]
        step_adv = r - others[:, None]  # [G, A]
        # A step of one reward: rounding in the means, not signal (and it
        # would be divided by a std of ~0 below).
        step_adv = torch.where(step_adv.abs() <= STD_EPS, 0.0, step_adv)
        if cfg.std_normalize:
            step_adv = step_adv / (r.std(correction=0) + STD_EPS)
        adv = torch.where(equal_reward_groups(r)[:, None], step_adv, adv)
    return adv  # [G, A]


def equal_reward_groups(rewards: torch.Tensor, atol: float = 1e-6) -> torch.Tensor:
    """rewards [G, A] -> bool [G]: groups whose episodes all got the same
    reward (no signal against their own mean; counted as zero-signal)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) <= atol


def zero_signal_groups(adv: torch.Tensor, atol: float = 1e-6) -> torch.Tensor:
    """adv [G, A] -> bool [G]: groups with no learning signal (every
    advantage 0). The trainer skips them (their samples are not run)."""
    return (adv.abs() <= atol).all(dim=1)


# ---------------------------------------------------------------------------
@dataclass
class LossInputs:
    """One micro-batch, right-padded to T tokens."""

    logprobs: torch.Tensor  # [B, T] log pi_theta of each completion token (grad)
    behaviour_logprobs: torch.Tensor  # [B, T] log mu from the engine (no grad)
    advantages: torch.Tensor  # [B] the sample's episode advantage
    mask: torch.Tensor  # [B, T] 1/True = trained completion token, 0 = padding
    ref_logprobs: torch.Tensor | None = None  # [B, T] frozen reference (KL only)
    # [B, T] entropy of pi_theta(. | context) at each completion token, over
    # the whole vocabulary at the sampling temperature (grad; entropy term).
    entropy: torch.Tensor | None = None
    # [B, T] version lag of each token: trainer version - the version of
    # the weights that produced it (loss.max_token_lag).
    token_lag: torch.Tensor | None = None
    # [B, T] weight of each token's l_t before the normalisation (None = 1).
    # The fused head (scoring.FusedHeadLoss) scores tokens one per row and
    # expresses normalize = "sequences" as 1/|y_i| per token under "tokens".
    token_weight: torch.Tensor | None = None


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: this micro-batch's share of the step's loss
    # Over this micro-batch's masked tokens: tokens, ratio_mean, ratio_max
    # (token ratios r_t, gspo too, bounded at e^LOG_RATIO_MAX: see the stats
    # in policy_loss), clip_fraction, logprob_diff_mean (mean |logpi -
    # logmu|), kl (kl_coef > 0), entropy (when given). Micro-batches (and
    # ranks) combine each by its rule in rlnode/trainer/metrics.py (REDUCE:
    # the means weighted by metrics["tokens"], ratio_max by max).
    metrics: dict[str, float]


# Per-token loss l_t (A = the sample's advantage, c = is_cap):
#   "tis_reinforce": l_t = -A * logpi * sg(min(r_t, c))
#       truncated-IS REINFORCE: grad_logpi = -A * min(r_t, c).
#   "ppo_clip":      l_t = -min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A)
#       grad_logpi = -A r_t, or 0 where the min picks the clipped term.
#       On-policy (r_t = 1) its gradient is tis_reinforce's. On stale samples
#       it is a trust region around the data: once pi has moved a token past
#       the clip range in the direction A pushes it, that sample stops
#       pushing. tis_reinforce keeps pushing (weighted by r_t <= c), which
#       with samples 2 versions old and a fast-moving policy overshoots
#       (measured on the demo: README "The demo over seeds").
#   "gspo":          s_i = exp((1/|y_i|) sum_t (logpi - logmu))  sequence ratio,
#       l_t = -min(s_it A, clip(s_it, 1-gspo_eps_low, 1+gspo_eps_high) A),
#       s_it = sg(s_i) * exp(logpi - sg(logpi)) (value s_i; GSPO-token form),
#       so grad_logpi = -A s_i on every token of an unclipped sequence.
#   KL (kl_coef > 0): l_t += kl_coef * k3_t,
#       k3_t = exp(ref - logpi) - (ref - logpi) - 1  (>= 0; Schulman's k3 of KL(pi||ref)).
#   Entropy (entropy_coef > 0): l_t -= entropy_coef * H_t,
#       H_t = -sum_v pi(v) log pi(v) over the vocabulary at token t's context.
#       Keeps exploring where every attempt of a group agrees: those groups
#       have A = 0 and no policy gradient, so without it a policy that turned
#       deterministic too early can never leave (the trainer then keeps
#       zero-signal groups in the batch for this term).
#   Adaptive (entropy_target = H* > 0), once per optimizer step k, with the
#   step's mean entropy over its trained tokens H_k (next_entropy_coef):
#       c_{k+1} = clip(c_k + step * sign(H* - H_k), entropy_coef, entropy_coef_max)
#   With entropy_raise_on_failure, "up" also needs F_k: some group of step k
#   failed in every attempt (else the coefficient goes down):
#       c_{k+1} = clip(c_k + step * (+1 if H_k < H* and F_k else -1), ...)
#   The configured bonus while the policy is above H* (a fresh one is far
#   above it); a growing one once it has fallen below, until it is back.
#   Floor (entropy_floor = f > 0, per token, c_f = entropy_floor_coef):
#       l_t -= c_f * min(H_t, f)      (gradient c_f * dH_t only where H_t < f)
#   The mean H_k above is dominated by the open states; one state that every
#   attempt decides alike (a shared first guess, a losing line) can be
#   deterministic under it and has no policy gradient out. The floor holds
#   each token's state at >= ~f nats and leaves the others alone.
# Lag mask (max_token_lag = L >= 0): l_t *= 1[lag_t <= L], lag_t = trainer
#   version - version of the weights that produced token t. Per-token IS
#   masking by version lag: the further behind mu is, the less a (truncated)
#   importance weight corrects for it, so such tokens get no gradient; the
#   sample's newer tokens (after a push mid-generation) still train. Masked
#   tokens stay in the normaliser N: masking never enlarges the step.
#   (Chosen over AReaL's decoupled PPO: with one optimizer step per batch
#   its proximal policy is pi_theta itself, and the objective reduces to
#   "tis_reinforce".)
# Dual clip (dual_clip = c > 1, "ppo_clip" and "gspo"; Ye et al. 2020,
#   verl's clip_ratio_c): where A < 0 the min above is r_t A, unbounded as
#   r_t grows: a stale token the policy has since made far more likely than
#   mu did (r_t = 88 and 282 measured on the demo, pipelined) pushes down
#   with weight r_t, one token takes the whole clipped step, and a converged
#   policy is knocked over. Bound it:
#       l_t = -max(min(r_t A, clip(r_t) A), c A)   where A < 0
#   grad_logpi = 0 where r_t > c and A < 0 (the token keeps l_t = -c A).
#   On-policy r_t = 1 < c: no effect.
# clip_fraction = share of tokens whose ratio was cut: r_t > c (tis), the
# min picked the clipped term (ppo_clip; per sequence, counted per token, gspo).
# dual_clip_fraction = share of tokens the dual clip cut (set when it is on).
#
# Normalisation (N = `normalizer`, given by the caller for the WHOLE optimizer
# step, so summing micro-batch losses equals the loss of one big batch):
#   "tokens":    loss = sum_i sum_t l_t / N,             N = trained tokens in step
#   "sequences": loss = sum_i (1/|y_i|) sum_t l_t / N,   N = samples in step
# With "sequences", gspo is the paper's objective exactly (its gradient per
# token is -A s_i / |y_i|); with "tokens" longer samples weigh more.
def policy_loss(inp: LossInputs, cfg: LossConfig, normalizer: float) -> LossOutput:
    """The loss of one micro-batch and its figures, term by term as the
    module docstring writes them: the policy term of ``cfg.kind``, KL,
    entropy, the masks, the normalization.

    Long because it is those formulas in their order, in one place: padding
    is zeroed once before every term and the lag mask applies after all of
    them, and the figures are read in one device sync at the end."""
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if cfg.kl_coef > 0 and inp.ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_term and inp.entropy is None:
        raise ValueError("loss.entropy_coef > 0 or loss.entropy_floor > 0 needs entropy")
    if cfg.max_token_lag >= 0 and inp.token_lag is None:
        raise ValueError("loss.max_token_lag >= 0 needs token_lag")
    m = inp.mask.bool()  # [B, T]
    n_tok = m.sum(dim=1).clamp(min=1)  # [B]; all-padding rows divide by 1, not 0
    # Padding is set to 0 first, so garbage (inf, nan) there cannot leak.
    logpi = torch.where(m, inp.logprobs.float(), 0.0)  # [B, T]
    logmu = torch.where(m, inp.behaviour_logprobs.detach().float(), 0.0)
    adv = inp.advantages.detach().float()[:, None]  # [B, 1]
    log_ratio = logpi - logmu  # [B, T], 0 on padding
    ratio = log_ratio.detach().exp()  # [B, T], 1 on padding

    dual_clipped = None
    if cfg.kind == "tis_reinforce":
        per_tok = -adv * logpi * ratio.clamp(max=cfg.is_cap)
        clipped = ratio > cfg.is_cap
    elif cfg.kind == "ppo_clip":
        r = log_ratio.clamp(max=LOG_RATIO_MAX).exp()  # [B, T], with grad
        per_tok, clipped, dual_clipped = _clipped_surrogate(r, adv, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    elif cfg.kind == "gspo":
        seq = (log_ratio.sum(dim=1) / n_tok).detach().clamp(max=LOG_RATIO_MAX).exp()[:, None]  # [B, 1] s_i
        s = seq * (logpi - logpi.detach()).exp()  # [B, T], value s_i
        per_tok, clipped, dual_clipped = _clipped_surrogate(s, adv, cfg.gspo_eps_low, cfg.gspo_eps_high,
                                                            cfg.dual_clip)
    else:
        raise ValueError(f"unknown loss.kind {cfg.kind!r}")

    k3 = None
    if cfg.kl_coef > 0:
        d = torch.where(m, inp.ref_logprobs.detach().float(), 0.0) - logpi  # [B, T]
        k3 = d.exp() - d - 1  # [B, T], 0 on padding
        per_tok = per_tok + cfg.kl_coef * k3

    ent = None if inp.entropy is None else torch.where(m, inp.entropy.float(), 0.0)  # [B, T]
    if cfg.entropy_coef > 0:
        per_tok = per_tok - cfg.entropy_coef * ent
    if cfg.entropy_floor > 0:  # gradient only where H_t < floor
        per_tok = per_tok - cfg.entropy_floor_coef * ent.clamp(max=cfg.entropy_floor)

    per_tok = torch.where(m, per_tok, 0.0)  # [B, T]
    lag_masked = None
    if cfg.max_token_lag >= 0:
        lag_masked = m & (inp.token_lag > cfg.max_token_lag)  # [B, T]
        per_tok = torch.where(lag_masked, 0.0, per_tok)
    if inp.token_weight is not None:
        per_tok = per_tok * inp.token_weight
    if cfg.normalize == "tokens":
        loss = per_tok.sum() / normalizer
    else:
        loss = (per_tok.sum(dim=1) / n_tok).sum() / normalizer

    tokens = m.sum().float()
    den = tokens.clamp(min=1)
    # The ratio statistics read r_t bounded as the PPO surrogates read it,
    # exp(min(log r_t, LOG_RATIO_MAX)), not the raw exp(): a token 89 nats
    # more likely under pi than under mu overflows fp32 to inf, and one such
    # token made ratio_mean inf (and metrics.jsonl non-JSON) for the whole
    # step. No loss reads these values, so the math is unchanged; for
    # "ppo_clip" and "gspo" they are the ratios the loss used, and for
    # "tis_reinforce" (weight min(r_t, is_cap)) the bound changes nothing
    # the loss sees. ratio_max = e^20 ~ 4.9e8 reads "at or past the bound";
    # the unbounded size is in logprob_diff_mean and the mismatch figures'
    # logprob_absdiff_max (log space, finite).
    ratio_seen = log_ratio.detach().clamp(max=LOG_RATIO_MAX).exp().masked_fill(~m, 0.0)  # [B, T]
    stats = {
        "tokens": tokens,
        "ratio_mean": ratio_seen.sum() / den,
        "ratio_max": ratio_seen.max(),  # r > 0: padding never wins
        "clip_fraction": (clipped & m).sum() / den,
        "logprob_diff_mean": log_ratio.detach().abs().sum() / den,
    }
    if k3 is not None:
        stats["kl"] = k3.detach().sum() / den
    if ent is not None:
        stats["entropy"] = ent.detach().sum() / den
        if cfg.entropy_floor > 0:
            stats["entropy_below_floor"] = ((ent.detach() < cfg.entropy_floor) & m).sum() / den
    if dual_clipped is not None:
        stats["dual_clip_fraction"] = (dual_clipped & m).sum() / den
    if lag_masked is not None:
        stats["lag_masked_fraction"] = lag_masked.sum() / den
    values = torch.stack(list(stats.values())).tolist()  # one device sync
    return LossOutput(loss=loss, metrics=dict(zip(stats, values)))


def _clipped_surrogate(r: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                       dual_clip: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PPO's per-token loss -min(r A, clip(r) A), with the dual clip's bound
    -max(., c A) where A < 0 (formula above policy_loss). Returns the loss,
    the tokens the min clipped, and the tokens the dual clip cut (None when
    it is off)."""
    surr, surr_clip = r * adv, r.clamp(1 - eps_low, 1 + eps_high) * adv
    obj = torch.minimum(surr, surr_clip)
    clipped = surr_clip < surr
    if dual_clip <= 0:
        return -obj, clipped, None
    bound = dual_clip * adv  # [B, 1]; only binds where A < 0
    dual_clipped = (adv < 0) & (obj < bound)
    return -torch.where(dual_clipped, bound, obj), clipped, dual_clipped


def next_entropy_coef(coef: float, entropy: float | None, cfg: LossConfig, *, failing: bool) -> float:
    """The entropy coefficient for the next step (the adaptive control in
    the comment above policy_loss); ``coef`` unchanged when it is off or
    the step measured no entropy. ``failing``: some group of the step
    failed in every attempt (read under entropy_raise_on_failure)."""
    if cfg.entropy_target <= 0 or entropy is None or not math.isfinite(entropy):
        return coef
    up = entropy < cfg.entropy_target and (failing or not cfg.entropy_raise_on_failure)
    step = cfg.entropy_coef_step if up else -cfg.entropy_coef_step
    return min(max(cfg.entropy_coef_max, cfg.entropy_coef), max(cfg.entropy_coef, coef + step))


# ---------------------------------------------------------------------------
# Train/inference mismatch: the figures a degrading run is read by. Over the
# trained tokens of one step, before it: d_t = logpi - logmu (trainer minus
# engine, the same token under the same weights version or an older mu),
# r_t = exp(d_t).
#   mismatch_kl = mean_t (r_t - 1 - d_t)   k3 estimator of KL(mu || pi) from
#       mu's own samples: >= 0 per token, unbiased (prime-rl "mismatch_kl",
#       verl "k3_kl"; NeMo-RL reports this divergence as "gen_kl_error").
#   logprob_absdiff_{mean,p99,max} = mean / 99th percentile / max of |d_t|.
#   is_ess = (sum_t w_t)^2 / (N sum_t w_t^2), w_t = the importance weight
#       the loss applies (min(r_t, is_cap) for "tis_reinforce", else r_t):
#       the effective sample size as a fraction of the N tokens, in (0, 1];
#       1 when every weight is equal (verl "rollout_is_eff_sample_size").
# Each again per version lag of the token ("lag{k}/..." with its token
# count). Lag 0 in a call made wholly at the trainer's version is numerics
# alone (kernels, dtype), ~1e-6 in fp32 here; a lag-0 token of a call that
# began before a push attends to KV the older weights computed (in-flight
# updates keep it), so it carries some of the older policy too.
def mismatch_figures(log_ratio: torch.Tensor, token_lag: torch.Tensor, cfg: LossConfig) -> dict[str, float]:
    """log_ratio, token_lag: [N] over the step's trained tokens (no grad)."""
    out: dict[str, float] = {}
    groups = [("", torch.ones_like(token_lag, dtype=torch.bool))]
    groups += [(f"lag{int(k)}/", token_lag == k) for k in torch.unique(token_lag).tolist()]
    for prefix, sel in groups:
        d = log_ratio[sel].double()
        n = d.numel()
        if n == 0:
            continue
        r = d.exp()
        w = r.clamp(max=cfg.is_cap) if cfg.kind == "tis_reinforce" else r
        a = d.abs()
        out[prefix + "tokens"] = float(n)
        out[prefix + "mismatch_kl"] = float((r - 1 - d).mean())
        out[prefix + "logprob_absdiff_mean"] = float(a.mean())
        out[prefix + "logprob_absdiff_p99"] = float(a.kthvalue(max(1, math.ceil(0.99 * n))).values)
        out[prefix + "logprob_absdiff_max"] = float(a.max())
        out[prefix + "is_ess"] = float(w.sum() ** 2 / (n * (w * w).sum()).clamp(min=1e-300))
    return out
