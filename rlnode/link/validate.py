"""Content rules for a ``GroupDelivery`` the trainer is about to accept.

Owns: what a well-formed group *means* beyond what msgspec's typed decoding
already guarantees (field types, the tag): every sample belongs to a listed
episode and every episode has samples, the group is exactly ``attempts``
episodes, rewards and logprobs are finite, rewards are within the actors'
bound (``actor.episode.max_abs_reward``), token ids index the model's
vocabulary, arrays have the lengths they claim, temperatures are ones the
engine can sample at, sizes and versions are bounded. A group that fails
can never become valid, so the trainer rejects it once and marks it
consumed (a resend is committed, never retried).

Each rule has a short stable reason name (``R_*``): the trainer counts
rejections by it and the actor logs it. Must not touch sockets, the buffer
or torch: pure functions over one message, cheap enough to run on the
event loop for every delivery (numpy over the packed arrays, no Python
loops over tokens).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from rlnode.config import VLLM_SAMPLING_EPS, EpisodeConfig
from rlnode.wire import GroupDelivery, TrainingSample, span_version

# Below this vLLM samples greedily: no sample can carry it (a configured
# actor.sampling.min_temperature raises the floor).
MIN_TEMPERATURE = VLLM_SAMPLING_EPS
# Float slack on the configured temperature bounds (msgpack carries float64,
# configs are parsed: equal values compare equal, but stay safe).
TEMPERATURE_SLACK = 1e-6
# A log-probability is <= 0; float32 rounding of a near-certain token may
# land a hair above it.
MAX_LOGPROB = 1e-3

# Reason names (stable: counters and dashboards key on them).
R_EMPTY = "empty"  # no group id, no samples or no episodes
R_EPISODE_COUNT = "episode_count"  # episodes != attempts
R_DUPLICATE_EPISODE = "duplicate_episode"  # an episode id listed twice
R_EPISODE_WITHOUT_SAMPLES = "episode_without_samples"
R_FOREIGN_SAMPLE = "foreign_sample"  # sample.group_id != group_id
R_UNKNOWN_EPISODE = "unknown_episode"  # sample.episode_id not among the episodes
R_DUPLICATE_SAMPLE = "duplicate_sample"  # sample id, or (episode, step_index), twice
R_TOO_MANY_SAMPLES = "too_many_samples"
R_REWARD = "reward"  # non-finite episode or sample reward, or a sample's != its episode's
R_REWARD_BOUND = "reward_bound"  # a finite reward beyond +-actor.episode.max_abs_reward
R_ARRAY_LENGTH = "array_length"  # token arrays not int32; logprob / mask lengths
R_EMPTY_SEQUENCE = "empty_sequence"  # no prompt or no completion token
R_TOO_LONG = "too_long"  # prompt + completion > max_model_len
R_TOKEN_ID = "token_id"  # outside [0, vocab_size)
R_LOGPROB = "logprob"  # non-finite or > MAX_LOGPROB
R_MASK = "mask"  # loss-mask byte other than 0 / 1
R_TEMPERATURE = "temperature"  # non-finite, or outside [min_temperature, temperature] of actor.sampling
R_VERSION = "version"  # negative, or ahead of the trainer by more than max_version_ahead

REASONS = (R_EMPTY, R_EPISODE_COUNT, R_DUPLICATE_EPISODE, R_EPISODE_WITHOUT_SAMPLES, R_FOREIGN_SAMPLE,
           R_UNKNOWN_EPISODE, R_DUPLICATE_SAMPLE, R_TOO_MANY_SAMPLES, R_REWARD, R_REWARD_BOUND, R_ARRAY_LENGTH,
           R_EMPTY_SEQUENCE, R_TOO_LONG, R_TOKEN_ID, R_LOGPROB, R_MASK, R_TEMPERATURE, R_VERSION)

Invalid = tuple[str, str]  # (reason name, human detail)


class GroupLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What the trainer can accept; built once by the trainer daemon from
    its config and the learner's model (``from_config``)."""

    attempts: int  # episodes per group (the advantage baseline needs all of them)
    vocab_size: int  # token ids must be < this (the model's embedding rows)
    max_model_len: int  # prompt + completion tokens of one sample
    # Samples per group (attempts * max_turns for the actor's episodes);
    # with max_model_len it bounds the tokens of a group.
    max_samples: int
    # Samples may claim a policy version up to this far ahead of the
    # trainer's: a trainer that resumes from a checkpoint is behind the
    # versions it had already pushed by up to checkpoint_every steps, and
    # the actors' unacknowledged groups carry those versions.
    max_version_ahead: int
    # Temperatures a sample may carry: the actor's actor.sampling
    # min_temperature (what the gateway lets agents ask for) to temperature
    # (the run's). Scoring at logits / T scales gradients by up to 1/T.
    min_temperature: float = MIN_TEMPERATURE
    max_temperature: float = math.inf
    # |reward| an episode or sample may carry: the actors' own bound,
    # actor.episode.max_abs_reward, one key for both sides (an honest actor
    # fails an episode outside it, so only a forged or broken one delivers
    # such a group; a trainer configured lower than its actors rejects
    # their groups as reward_bound, counted). Finiteness alone would let a
    # reward of 1e30 become the step: it swamps its group's advantages and
    # the loss. Defaults to the config's default.
    max_abs_reward: float = EpisodeConfig().max_abs_reward

    @classmethod
    def from_config(cls, cfg, vocab_size: int) -> GroupLimits:
        s, t = cfg.actor.scheduler, cfg.trainer
        max_samples = s.attempts * cfg.actor.episode.max_turns
        # Without periodic checkpoints a crash rolls back to the last
        # shutdown checkpoint (or version 0): allow the whole run.
        ahead = t.checkpoint_every if t.checkpoint_every else max(t.max_steps, 1_000_000)
        return cls(attempts=s.attempts, vocab_size=vocab_size, max_model_len=cfg.model.max_model_len,
                   max_samples=max_samples, max_version_ahead=ahead,
                   min_temperature=cfg.actor.sampling.min_temperature,
                   max_temperature=cfg.actor.sampling.temperature,
                   max_abs_reward=cfg.actor.episode.max_abs_reward)


def validate_group(g: GroupDelivery, limits: GroupLimits | None, version: int = 0) -> Invalid | None:
    """None when ``g`` may be accepted at trainer ``version``, else
    ``(reason, detail)``. ``limits=None`` (a bare link, as in link tests)
    checks only what needs no model or config: ids, array shapes, finite
    values (no reward bound), temperatures."""
    if not g.group_id or not g.samples:
        return R_EMPTY, "empty group id or no samples"
    if limits is not None:
        bad = _check_episodes(g, limits) or _check_versions(g, limits, version)
        if bad:
            return bad
    seen: set[str] = set()
    steps: set[tuple[str, int]] = set()
    for s in g.samples:
        if s.group_id != g.group_id:
            return R_FOREIGN_SAMPLE, f"sample {s.sample_id!r} belongs to group {s.group_id!r}"
        if s.sample_id in seen or (s.episode_id, s.step_index) in steps:
            return R_DUPLICATE_SAMPLE, f"sample {s.sample_id!r} (step {s.step_index}) twice"
        seen.add(s.sample_id)
        steps.add((s.episode_id, s.step_index))
        bad = check_sample(s, limits)
        if bad:
            return bad
    return None


def _check_episodes(g: GroupDelivery, limits: GroupLimits) -> Invalid | None:
    if len(g.episodes) != limits.attempts:
        return R_EPISODE_COUNT, f"{len(g.episodes)} episodes, expected attempts={limits.attempts}"
    if len(g.samples) > limits.max_samples:
        return R_TOO_MANY_SAMPLES, f"{len(g.samples)} samples > {limits.max_samples}"
    rewards: dict[str, float] = {}
    for e in g.episodes:
        if e.episode_id in rewards:
            return R_DUPLICATE_EPISODE, f"episode {e.episode_id!r} listed twice"
        bad = check_reward(f"episode {e.episode_id!r}", e.reward, limits)
        if bad:
            return bad
        rewards[e.episode_id] = e.reward
    with_samples: set[str] = set()
    for s in g.samples:
        r = rewards.get(s.episode_id)
        if r is None:
            return R_UNKNOWN_EPISODE, f"sample {s.sample_id!r}: episode {s.episode_id!r} is not in the group"
        if math.isfinite(s.reward) and (bad := check_reward(f"sample {s.sample_id!r}", s.reward, limits)):
            return bad  # beyond the bound: named so, not as a mismatch
        if s.reward != r:  # also catches a NaN sample reward
            return R_REWARD, f"sample {s.sample_id!r} reward {s.reward!r} != its episode's {r!r}"
        with_samples.add(s.episode_id)
    missing = [e for e in rewards if e not in with_samples]
    if missing:
        return R_EPISODE_WITHOUT_SAMPLES, f"{len(missing)} episodes without samples, e.g. {missing[0]!r}"
    return None


def _check_versions(g: GroupDelivery, limits: GroupLimits, version: int) -> Invalid | None:
    newest = version + limits.max_version_ahead
    for what, v in [("start_version", g.start_version)] + [
            (f"sample {s.sample_id!r} policy_version", s.policy_version) for s in g.samples]:
        if v < 0 or v > newest:
            return R_VERSION, f"{what} {v} outside [0, {newest}] (trainer at {version})"
    # Per-token versions (the loss's token lags, trainer/buffer.py): spans
    # over tokens the sample has, naming versions the trainer can have made
    # (not necessarily >= policy_version: a restarted trainer pushes its
    # checkpoint's older version into a running request).
    for s in g.samples:
        n = len(s.completion_ids) // 4
        for label, start, end in s.weight_versions:
            if not 0 <= start <= end <= n:
                return R_VERSION, f"sample {s.sample_id!r}: version span [{start}, {end}) outside [0, {n}]"
            if (v := span_version(label)) is not None and not 0 <= v <= newest:
                return R_VERSION, (f"sample {s.sample_id!r}: tokens of version {label} outside "
                                   f"[0, {newest}] (trainer at {version})")
    return None


def check_reward(what: str, reward: float, limits: GroupLimits | None) -> Invalid | None:
    """One episode's or sample's reward: finite (R_REWARD), and within
    ``limits.max_abs_reward`` (R_REWARD_BOUND; not checked without limits)."""
    if not math.isfinite(reward):
        return R_REWARD, f"{what} reward {reward!r}"
    if limits is not None and abs(reward) > limits.max_abs_reward:
        bound = limits.max_abs_reward
        return R_REWARD_BOUND, (f"{what} reward {reward!r} outside [-{bound:g}, {bound:g}] "
                                "(actor.episode.max_abs_reward)")
    return None


def check_sample(s: TrainingSample, limits: GroupLimits | None) -> Invalid | None:
    """One sample's arrays and scalars (``limits=None``: no vocabulary,
    length or reward bounds)."""
    sid = s.sample_id
    n, rem = divmod(len(s.completion_ids), 4)
    if rem or len(s.prompt_ids) % 4:
        return R_ARRAY_LENGTH, f"sample {sid!r}: token arrays are not int32"
    if len(s.logprobs) != 4 * n or len(s.loss_mask) != n:
        return R_ARRAY_LENGTH, f"sample {sid!r}: logprobs/mask length != {n} completion tokens"
    bad = check_reward(f"sample {sid!r}", s.reward, limits)
    if bad:
        return bad
    lo, hi = (limits.min_temperature, limits.max_temperature) if limits is not None else (MIN_TEMPERATURE, math.inf)
    if not (math.isfinite(s.temperature) and lo - TEMPERATURE_SLACK <= s.temperature <= hi + TEMPERATURE_SLACK
            and s.temperature >= MIN_TEMPERATURE):
        return R_TEMPERATURE, f"sample {sid!r} temperature {s.temperature!r} outside [{lo:g}, {hi:g}]"
    prompt, completion = s.prompt_token_ids, s.completion_token_ids
    # The learner predicts the first completion token from the last prompt
    # position, and a sample without completion tokens has nothing to train.
    if not len(prompt) or not n:
        return R_EMPTY_SEQUENCE, f"sample {sid!r}: {len(prompt)} prompt, {n} completion tokens"
    if limits is not None and len(prompt) + n > limits.max_model_len:
        return R_TOO_LONG, f"sample {sid!r}: {len(prompt)} + {n} tokens > max_model_len {limits.max_model_len}"
    lo = min(int(prompt.min()), int(completion.min()))
    hi = max(int(prompt.max()), int(completion.max()))
    if lo < 0 or (limits is not None and hi >= limits.vocab_size):
        vocab = limits.vocab_size if limits is not None else "inf"
        return R_TOKEN_ID, f"sample {sid!r}: token ids in [{lo}, {hi}], vocabulary [0, {vocab})"
    lp = s.completion_logprobs
    bad = ~np.isfinite(lp) | (lp > MAX_LOGPROB)  # one comparison (float32 vs the bound) for test and report
    if bad.any():
        return R_LOGPROB, f"sample {sid!r}: logprob {float(lp[bad][0])!r}"
    if int(s.completion_mask.max()) > 1:
        return R_MASK, f"sample {sid!r}: loss-mask byte {int(s.completion_mask.max())} (0 or 1)"
    return None
