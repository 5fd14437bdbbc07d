"""GroupBuffer: complete groups waiting to be trained, and the batch a step
trains on.

Owns: which groups the next optimizer step uses (oldest first), dropping
samples that are too stale (policy version older than ``max_lag``, or
weights this trainer does not descend from), skipping groups without signal
(every episode got the same reward), and the counters for each of those
drops. Holds no model and no sockets.

A sample's *lag* is ``trainer version - sample.policy_version``: how many
updates happened between the policy that generated it and the one it is
trained into. A version number names weights only within one trainer
incarnation's ``Lineage``: a trainer killed at v103 and resumed from its
v100 checkpoint makes a v101 unlike the lost one, and a sample of the lost
v101..v103 would look fresh by number (lag <= 0). Its tokens' labels
(``wire.weights_label``: version @ incarnation) say whose weights made
them; a sample with any token from weights off this trainer's lineage is
*foreign*, dropped like a too-old one and counted apart.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import numpy as np
import torch

from rlnode.config import AdvantageConfig
from rlnode.trainer.loss import equal_reward_groups, group_advantages, zero_signal_groups
from rlnode.wire import GroupDelivery, TrainingSample, parse_weights_label, span_version


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
    dropped_stale: int = 0  # samples older than max_lag
    dropped_foreign: int = 0  # samples with tokens from weights off the trainer's lineage
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
    # Consecutive LLM calls of one episode (call k, k+1) in the consumed
    # groups, and those whose prompt k+1 begins with prompt k + completion
    # k token for token: a chat template that rewrites earlier turns (drops
    # their reasoning) or an agent that edits its history makes the rest.
    turn_pairs: int = 0
    turns_extending: int = 0

    def turn_figures(self) -> dict[str, float]:
        """metrics.jsonl's figures of multi-turn episodes (the fraction only
        where there is a pair to take it over)."""
        out: dict[str, float] = {"turn_pairs": self.turn_pairs}
        if self.turn_pairs:
            out["turns_extending_fraction"] = self.turns_extending / self.turn_pairs
        return out


def count_extending_turns(samples: list[TrainingSample]) -> tuple[int, int]:
    """(pairs of consecutive calls of one episode, of which extending): see
    ``Batch.turn_pairs``. Compared as the raw int32 bytes."""
    by_episode: dict[str, list[TrainingSample]] = {}
    for s in samples:
        by_episode.setdefault(s.episode_id, []).append(s)
    pairs = extending = 0
    for calls in by_episode.values():
        calls.sort(key=lambda s: s.step_index)
        for prev, nxt in zip(calls, calls[1:]):
            if nxt.step_index != prev.step_index + 1:
                continue  # a call between them was not trained (its reply never reached the agent)
            pairs += 1
            extending += nxt.prompt_ids.startswith(prev.prompt_ids + prev.completion_ids)
    return pairs, extending


@dataclass
class BufferCounters:
    groups_in: int = 0
    groups_trained: int = 0
    groups_zero_signal: int = 0
    samples_dropped_stale: int = 0
    groups_dropped_stale: int = 0  # groups with no sample left (too old or foreign)
    # Samples made (in part) by weights of another trainer incarnation that
    # this trainer does not descend from: a lost branch after a resume.
    samples_dropped_foreign: int = 0


class Lineage:
    """The weights a trainer's versions descend from, by name
    (``wire.weights_label``): every version of its own incarnation, and of
    each earlier incarnation the versions up to the one its checkpoint
    inherited. The initial weights (no source: the model on disk, every
    trainer's v0) and labels of actors that predate sources are judged by
    their version alone. Without an own incarnation (a buffer outside a
    trainer daemon) nothing is foreign."""

    def __init__(self, own: str = "", inherited: dict[str, int] | None = None) -> None:
        self.own = own  # this trainer's incarnation (TrainerLink.incarnation)
        # Earlier incarnations -> the newest of their versions in this
        # trainer's history: what its checkpoint recorded ({} when fresh).
        self.inherited: dict[str, int] = dict(inherited or {})

    def at(self, version: int) -> dict[str, int]:
        """What a checkpoint at ``version`` records: the ``inherited`` of
        the trainer that resumes from it."""
        return {**self.inherited, **({self.own: version} if self.own else {})}

    def on_lineage(self, version: int, source: str) -> bool:
        """Whether the weights ``weights_label(version, source)`` names are
        ones this trainer had (or, for no source, judged by version alone)."""
        if not self.own or not source or source == self.own:
            return True
        return version <= self.inherited.get(source, -1)

    def foreign(self, s: TrainingSample) -> bool:
        """Whether any of ``s``'s tokens came from weights off the lineage."""
        for label, _start, _end in s.weight_versions:
            parsed = parse_weights_label(label)
            if parsed is not None and not self.on_lineage(*parsed):
                return True
        return False


class GroupBuffer:
    def __init__(self, groups_per_step: int, max_lag: int, adv_cfg: AdvantageConfig,
                 keep_zero_signal: bool = False):
        self.groups_per_step = groups_per_step
        self.max_lag = max_lag
        self.adv_cfg = adv_cfg
        self.keep_zero_signal = keep_zero_signal
        # Set by the trainer daemon at start (its incarnation, and what its
        # checkpoint inherited); saved with every checkpoint (``at``).
        self.lineage = Lineage()
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
        return build_batch(groups, version, self.max_lag, self.adv_cfg, self.counters, self.keep_zero_signal,
                           self.lineage)


def token_versions(s: TrainingSample) -> np.ndarray:
    """The policy version of the weights that produced each completion
    token (int64 [n]). The engine labels its spans with ``weights_label``
    (vLLM's CompletionOutput.weight_versions, or the engine wrapper's own
    tracking; whose weights they were is ``Lineage.foreign``'s business);
    a token outside every span, or under a label that is no version, takes
    the version its call started at, the oldest it can be."""
    n = len(s.completion_ids) // 4
    out = np.full(n, s.policy_version, dtype=np.int64)
    for label, start, end in s.weight_versions:
        if (v := span_version(label)) is not None:
            out[max(0, start):max(0, min(end, n))] = v
    return out


def build_batch(groups: list[GroupDelivery], version: int, max_lag: int, adv_cfg: AdvantageConfig,
                counters: BufferCounters, keep_zero_signal: bool = False, lineage: Lineage | None = None) -> Batch:
    """``keep_zero_signal``: train on the samples of groups whose advantages
    are all 0 too (only an entropy or KL term acts on them). A group whose
    rewards are all equal is counted as zero-signal whatever its advantage
    (advantage.zero_signal_baseline = "step" gives it one). ``lineage``:
    samples with tokens of weights off it are dropped as foreign (none
    given: nothing is foreign)."""
    lineage = lineage or Lineage()
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
        pairs, extending = count_extending_turns(list(g.samples))
        batch.turn_pairs += pairs
        batch.turns_extending += extending
        if equal[gi]:
            batch.zero_signal_groups += 1
            counters.groups_zero_signal += 1
        if silent[gi] and not keep_zero_signal:
            fresh = [s for s in g.samples if version - s.policy_version <= max_lag and not lineage.foreign(s)]
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
            if lineage.foreign(s):  # a lag <= 0 proves nothing: its version names other weights
                batch.dropped_foreign += 1
                counters.samples_dropped_foreign += 1
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
