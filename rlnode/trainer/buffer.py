"""GroupBuffer: complete groups waiting to be trained, and the batch a step
trains on.

Owns: which groups the next optimizer step uses (oldest first), dropping
samples that are too stale (policy version older than ``max_lag``), skipping
groups without signal (every episode got the same reward), and the counters
for each of those drops. Holds no model and no sockets.

A sample's *lag* is ``trainer version - sample.policy_version``: how many
updates happened between the policy that generated it and the one it is
trained into.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import numpy as np
import torch

from rlnode.config import AdvantageConfig
from rlnode.trainer.loss import equal_reward_groups, group_advantages, zero_signal_groups
from rlnode.wire import GroupDelivery, TrainingSample, span_version


@dataclass
class Batch:
    """What one optimizer step trains on."""

    samples: list[TrainingSample]
    advantages: list[float]  # one per sample: its episode's advantage
    group_ids: list[str]  # every group consumed by this step (trained or skipped)
    rewards: list[float]  # every episode reward of the consumed groups
    successes: list[float]
    lags: list[int]  # per trained sample: trainer version - the version it started at
    # Per trained sample, one per completion token: trainer version - the
    # version of the weights that produced that token (token_versions).
    token_lags: list[np.ndarray] = field(default_factory=list)
    version: int = 0  # the trainer version the lags are counted from
    dropped_stale: int = 0
    # Groups whose episodes all got one reward (trained under
    # advantage.zero_signal_baseline = "step", else skipped or kept for
    # the entropy term), and groups in which every episode failed / every
    # one succeeded: a task the policy always fails is what a late fall
    # looks like (README "The demo over seeds").
    zero_signal_groups: int = 0
    groups_all_failed: int = 0
    groups_all_solved: int = 0
    cubes: dict[str, list[float]] = field(default_factory=dict)  # cube id -> episode rewards
    # Tokens and samples of every fresh sample of the consumed groups,
    # zero-signal ones included: the loss normaliser. Zero-signal samples
    # have advantage 0 and contribute no gradient, so they are not run; but
    # counting them keeps the step size independent of how many groups
    # happened to be silent (else an early batch with one informative group
    # would take a many-times larger step).
    norm_tokens: int = 0
    norm_samples: int = 0
    # This step's entropy coefficient (adaptive control: the daemon's);
    # None = trainer.loss.entropy_coef.
    entropy_coef: float | None = None


@dataclass
class BufferCounters:
    groups_in: int = 0
    groups_trained: int = 0
    groups_zero_signal: int = 0
    samples_dropped_stale: int = 0
    groups_dropped_stale: int = 0


class GroupBuffer:
    def __init__(self, groups_per_step: int, max_lag: int, adv_cfg: AdvantageConfig,
                 keep_zero_signal: bool = False):
        self.groups_per_step = groups_per_step
        self.max_lag = max_lag
        self.adv_cfg = adv_cfg
        self.keep_zero_signal = keep_zero_signal
        self._groups: collections.deque[GroupDelivery] = collections.deque()
        self._ids: set[str] = set()
        self._changed = asyncio.Event()
        self.counters = BufferCounters()

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._ids

    def put(self, group: GroupDelivery) -> None:
        self._groups.append(group)
        self._ids.add(group.group_id)
        self.counters.groups_in += 1
        self._changed.set()

    def snapshot(self) -> list[GroupDelivery]:
        """The groups waiting, oldest first (saved with checkpoints)."""
        return list(self._groups)

    async def wait_ready(self) -> None:
        while len(self._groups) < self.groups_per_step:
            self._changed.clear()
            await self._changed.wait()

    def take_batch(self, version: int) -> Batch:
        """Pop ``groups_per_step`` groups (oldest first) and build the batch
        for training at ``version``."""
        groups = [self._groups.popleft() for _ in range(min(self.groups_per_step, len(self._groups)))]
        for g in groups:
            self._ids.discard(g.group_id)
        return build_batch(groups, version, self.max_lag, self.adv_cfg, self.counters, self.keep_zero_signal)


def token_versions(s: TrainingSample) -> np.ndarray:
    """The policy version of the weights that produced each completion
    token (int64 [n]). The engine labels its spans with str(version) (vLLM's
    CompletionOutput.weight_versions, or the engine wrapper's own tracking);
    a token outside every span, or under a label that is no version, takes
    the version its call started at, the oldest it can be."""
    n = len(s.completion_ids) // 4
    out = np.full(n, s.policy_version, dtype=np.int64)
    for label, start, end in s.weight_versions:
        if (v := span_version(label)) is not None:
            out[max(0, start):max(0, min(end, n))] = v
    return out


def build_batch(groups: list[GroupDelivery], version: int, max_lag: int, adv_cfg: AdvantageConfig,
                counters: BufferCounters, keep_zero_signal: bool = False) -> Batch:
    """``keep_zero_signal``: train on the samples of groups whose advantages
    are all 0 too (only an entropy or KL term acts on them). A group whose
    rewards are all equal is counted as zero-signal whatever its advantage
    (advantage.zero_signal_baseline = "step" gives it one)."""
    batch = Batch([], [], [g.group_id for g in groups], [], [], [], version=version)
    if not groups:
        return batch
    # rewards [G, A]: groups are complete, so every row has `attempts` entries.
    rewards = torch.tensor([[e.reward for e in g.episodes] for g in groups], dtype=torch.float64)
    adv = group_advantages(rewards, adv_cfg)
    equal = equal_reward_groups(rewards)
    silent = zero_signal_groups(adv)
    for gi, g in enumerate(groups):
        batch.rewards += [e.reward for e in g.episodes]
        batch.successes += [float(e.success) for e in g.episodes]
        batch.cubes.setdefault(g.cube_id, []).extend(e.reward for e in g.episodes)
        solved = sum(bool(e.success) for e in g.episodes)
        batch.groups_all_failed += solved == 0
        batch.groups_all_solved += solved == len(g.episodes)
        if equal[gi]:
            batch.zero_signal_groups += 1
            counters.groups_zero_signal += 1
        if silent[gi] and not keep_zero_signal:
            fresh = [s for s in g.samples if version - s.policy_version <= max_lag]
            batch.norm_samples += len(fresh)
            batch.norm_tokens += sum(int(s.completion_mask.sum()) for s in fresh)
            continue
        by_episode = {e.episode_id: 0.0 if silent[gi] else float(adv[gi, ei]) for ei, e in enumerate(g.episodes)}
        fresh = 0
        for s in g.samples:
            lag = version - s.policy_version
            if lag > max_lag:
                batch.dropped_stale += 1
                counters.samples_dropped_stale += 1
                continue
            batch.samples.append(s)
            batch.advantages.append(by_episode[s.episode_id])
            batch.lags.append(lag)
            batch.token_lags.append(version - token_versions(s))
            batch.norm_samples += 1
            batch.norm_tokens += int(s.completion_mask.sum())
            fresh += 1
        if fresh == 0:
            counters.groups_dropped_stale += 1
        else:
            counters.groups_trained += 1
    return batch
