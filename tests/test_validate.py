"""rlnode.link.validate: each content rule of a delivered group, at unit
level, with its boundary values (no sockets, no model)."""

import asyncio
import math
import time

import msgspec
import pytest

from rlnode.bench.fuzz import FrameMaker, FuzzPeer
from rlnode.config import ConfigError, LinkConfig, load_config
from rlnode.link import TrainerLink
from rlnode.link import validate as V
from rlnode.link.validate import GroupLimits, check_sample, validate_group
from rlnode.wire import REJECT_INVALID_GROUP, GroupDelivery, pack_f32, pack_i32

LIMITS = GroupLimits(attempts=3, vocab_size=100, max_model_len=32, max_samples=6, max_version_ahead=5)


def group(version: int = 2, seed: int = 0) -> GroupDelivery:
    return FrameMaker(LIMITS, "n1", seed).valid_group(version)


def test_valid_group_passes_with_and_without_limits():
    g = group()
    assert [len(g.episodes), len(g.samples)] == [3, 3]
    assert validate_group(g, LIMITS, version=2) is None
    assert validate_group(g, None) is None


@pytest.mark.parametrize("reason", V.REASONS)
def test_each_rule_names_its_reason(reason):
    # FrameMaker breaks exactly one rule per group (tests/test_fuzz.py sends these).
    for seed in range(8):  # the generators draw among several ways to break a rule
        maker = FrameMaker(LIMITS, "n1", seed)
        g = msgspec.msgpack.decode(maker.inconsistent(2, reason)[0], type=GroupDelivery)
        assert validate_group(g, LIMITS, version=2)[0] == reason


def test_episode_rules_details():
    g = group()
    g.episodes = g.episodes[:2]
    assert validate_group(g, LIMITS) == (V.R_EPISODE_COUNT, "2 episodes, expected attempts=3")
    g = group()
    g.samples[1].episode_id = "x"
    assert validate_group(g, LIMITS, 2) == (V.R_UNKNOWN_EPISODE,
                                             f"sample {g.samples[1].sample_id!r}: episode 'x' is not in the group")
    g = group()
    g.samples = g.samples[:2]
    assert validate_group(g, LIMITS, 2) == (V.R_EPISODE_WITHOUT_SAMPLES,
                                             f"1 episodes without samples, e.g. {g.episodes[2].episode_id!r}")
    # Limits off (bare links): episode bookkeeping is not checked, samples still are.
    g.episodes = []
    assert validate_group(g, None) is None
    g.samples[0].temperature = 0.0
    assert validate_group(g, None)[0] == V.R_TEMPERATURE


def test_rewards_must_be_finite_and_agree():
    g = group()
    g.episodes[1].reward = math.nan
    assert validate_group(g, LIMITS, 2) == (V.R_REWARD, f"episode {g.episodes[1].episode_id!r} reward nan")
    g = group()
    g.samples[0].reward = math.nan  # NaN != anything: caught as a mismatch with limits, as non-finite without
    assert validate_group(g, LIMITS, 2)[0] == V.R_REWARD
    assert validate_group(g, None) == (V.R_REWARD, f"sample {g.samples[0].sample_id!r} reward nan")
    g = group()
    g.samples[2].reward = g.episodes[2].reward + 1
    assert validate_group(g, LIMITS, 2)[0] == V.R_REWARD



def set_reward(g: GroupDelivery, i: int, reward: float) -> None:
    """Episode ``i`` and its sample (one per episode in these groups) get ``reward``."""
    g.episodes[i].reward = g.samples[i].reward = reward


def test_rewards_are_bounded_by_the_actors_max_abs_reward():
    """actor.episode.max_abs_reward (default 1000): the bound the actors
    fail an episode at is the one the trainer rejects a group at, so a
    forged reward of 1e30 never becomes the step."""
    bound = LIMITS.max_abs_reward
    assert bound == 1000.0
    g = group()
    set_reward(g, 0, bound)
    set_reward(g, 1, -bound)  # exactly at the bound, both signs: fine
    assert validate_group(g, LIMITS, 2) is None
    for r in (1e30, -1e30, -(bound + 1), math.nextafter(bound, math.inf)):
        g = group()
        g.episodes[1].reward = r
        assert validate_group(g, LIMITS, 2) == (
            V.R_REWARD_BOUND, f"episode {g.episodes[1].episode_id!r} reward {r!r} outside [-1000, 1000] "
                              "(actor.episode.max_abs_reward)")
        set_reward(g, 1, r)  # the sample agrees with its episode: still the episode's bound
        assert validate_group(g, LIMITS, 2)[0] == V.R_REWARD_BOUND
        assert validate_group(g, None) is None  # a bare link has no config: finiteness only
    # A sample's reward beyond the bound is named as such (not as a mismatch with its episode).
    g = group()
    g.samples[2].reward = 1e30
    assert validate_group(g, LIMITS, 2) == (
        V.R_REWARD_BOUND, f"sample {g.samples[2].sample_id!r} reward 1e+30 outside [-1000, 1000] "
                          "(actor.episode.max_abs_reward)")
    assert check_sample(g.samples[2], LIMITS)[0] == V.R_REWARD_BOUND
    assert check_sample(g.samples[2], None) is None
    # Not finite stays R_REWARD.
    for r in (math.inf, -math.inf, math.nan):
        g = group()
        set_reward(g, 0, r)
        assert validate_group(g, LIMITS, 2)[0] == V.R_REWARD
        assert check_sample(g.samples[0], LIMITS)[0] == V.R_REWARD


def test_the_reward_bound_is_the_actors_config_key():
    cfg = load_config(None, ["actor.episode.max_abs_reward=5"])
    limits = GroupLimits.from_config(cfg, vocab_size=100)
    assert limits.max_abs_reward == 5.0
    assert GroupLimits.from_config(load_config(None, []), 100).max_abs_reward == 1000.0
    g = FrameMaker(limits, "n1").valid_group(2)
    set_reward(g, 0, -5.0)
    assert validate_group(g, limits, 2) is None
    set_reward(g, 0, 5.5)
    assert validate_group(g, limits, 2) == (
        V.R_REWARD_BOUND, f"episode {g.episodes[0].episode_id!r} reward 5.5 outside [-5, 5] "
                          "(actor.episode.max_abs_reward)")


async def test_a_trainer_link_rejects_a_reward_beyond_the_bound_and_counts_it_by_reason():
    """Over real sockets: the trainer link rejects the hostile group for
    good (Reject, counted under its reason), accepts the honest one."""
    link = TrainerLink("tcp://127.0.0.1:*", LinkConfig(heartbeat_s=0.1, peer_timeout_s=5.0), limits=LIMITS)
    await link.start()
    peer = FuzzPeer(link.endpoint)
    try:
        await peer.start()
        maker = FrameMaker(LIMITS, peer.node_id)
        hostile, honest = maker.valid_group(0), maker.valid_group(0)
        set_reward(hostile, 0, 1e30)
        for g in (hostile, honest):
            await peer.send([msgspec.msgpack.encode(g)])
        deadline = time.monotonic() + 10
        while hostile.group_id not in peer.rejected or link.counters.groups_accepted < 1:
            assert time.monotonic() < deadline, "no reject / accept"
            await asyncio.sleep(0.05)
        assert peer.rejected[hostile.group_id] == REJECT_INVALID_GROUP
        assert link.counters.invalid_by_reason == {V.R_REWARD_BOUND: 1}
        assert link.counters.invalid_groups == 1 and link.counters.groups_accepted == 1
        assert (await link.next_delivery())[1].group_id == honest.group_id
    finally:
        await peer.close()
        await link.close()


def test_sizes():
    g = group()
    s = g.samples[0]
    extra = [msgspec.structs.replace(s, sample_id=f"{s.sample_id}+{k}", step_index=k + 1) for k in range(3)]
    g.samples += extra  # 6 samples = max_samples: fine
    assert validate_group(g, LIMITS, 2) is None
    g.samples.append(msgspec.structs.replace(s, sample_id="one-more", step_index=9))
    assert validate_group(g, LIMITS, 2) == (V.R_TOO_MANY_SAMPLES, "7 samples > 6")
    # prompt + completion == max_model_len is the longest allowed.
    n = len(s.completion_token_ids)
    s.prompt_ids = pack_i32([1] * (32 - n))
    assert check_sample(s, LIMITS) is None
    s.prompt_ids = pack_i32([1] * (33 - n))
    assert check_sample(s, LIMITS)[0] == V.R_TOO_LONG
    assert check_sample(s, None) is None  # no length bound without limits


def test_token_ids_and_arrays():
    s = group().samples[0]
    s.completion_ids = pack_i32([0, 99])
    s.logprobs, s.loss_mask = pack_f32([-1.0, -2.0]), b"\x01\x00"
    assert check_sample(s, LIMITS) is None
    s.completion_ids = pack_i32([0, 100])
    assert check_sample(s, LIMITS) == (V.R_TOKEN_ID,
                                       f"sample {s.sample_id!r}: token ids in [0, 100], vocabulary [0, 100)")
    assert check_sample(s, None) is None
    s.completion_ids = pack_i32([-1, 5])
    assert check_sample(s, None)[0] == V.R_TOKEN_ID
    s.completion_ids = pack_i32([1, 5])
    s.loss_mask = b"\x01"
    assert check_sample(s, LIMITS) == (V.R_ARRAY_LENGTH,
                                       f"sample {s.sample_id!r}: logprobs/mask length != 2 completion tokens")
    s.loss_mask = b"\x01\x02"
    assert check_sample(s, LIMITS)[0] == V.R_MASK
    s.loss_mask, s.prompt_ids = b"\x01\x01", b"\x00\x00\x00"
    assert check_sample(s, LIMITS) == (V.R_ARRAY_LENGTH, f"sample {s.sample_id!r}: token arrays are not int32")
    s.prompt_ids = b""
    assert check_sample(s, LIMITS) == (V.R_EMPTY_SEQUENCE, f"sample {s.sample_id!r}: 0 prompt, 2 completion tokens")


@pytest.mark.parametrize("lp,ok", [(-30.0, True), (0.0, True), (V.MAX_LOGPROB, True), (0.5, False),
                                   (math.nan, False), (math.inf, False), (-math.inf, False)])
def test_logprobs(lp, ok):
    s = group().samples[0]
    n = len(s.completion_token_ids)
    s.logprobs = pack_f32([-1.0] * (n - 1) + [lp])
    got = check_sample(s, LIMITS)
    assert got is None if ok else got[0] == V.R_LOGPROB


@pytest.mark.parametrize("t,ok", [(1.0, True), (V.MIN_TEMPERATURE, True), (100.0, True), (0.0, False),
                                  (-0.7, False), (1e-9, False), (math.nan, False), (math.inf, False)])
def test_temperature(t, ok):
    s = group().samples[0]
    s.temperature = t
    got = check_sample(s, LIMITS)
    assert got is None if ok else got == (V.R_TEMPERATURE, f"sample {s.sample_id!r} temperature {t!r} outside "
                                                           f"[{V.MIN_TEMPERATURE:g}, inf]")


@pytest.mark.parametrize("t,ok", [(1.0, True), (0.25, True), (0.6, True), (0.2, False), (1.5, False),
                                  (V.MIN_TEMPERATURE, False)])
def test_temperature_within_the_runs_sampling_bounds(t, ok):
    """From the config: actor.sampling.min_temperature (what the gateway
    lets an agent ask for) to actor.sampling.temperature (the run's)."""
    cfg = load_config(None, ["actor.sampling.min_temperature=0.25", "actor.sampling.temperature=1.0"])
    limits = GroupLimits.from_config(cfg, vocab_size=100)
    assert (limits.min_temperature, limits.max_temperature) == (0.25, 1.0)
    s = group().samples[0]
    s.temperature = t
    got = check_sample(s, limits)
    assert got is None if ok else got == (V.R_TEMPERATURE, f"sample {s.sample_id!r} temperature {t!r} outside "
                                                           "[0.25, 1]")


@pytest.mark.parametrize("lo,t", [(0.5, 0.4), (1e-6, 1.0)])
def test_a_min_temperature_outside_its_range_is_a_config_error(lo, t):
    with pytest.raises(ConfigError, match="actor.sampling.min_temperature: must be in"):
        load_config(None, [f"actor.sampling.min_temperature={lo}", f"actor.sampling.temperature={t}"])


def test_versions_may_run_ahead_by_max_version_ahead_only():
    # A trainer resumed at version 10 sees groups made at up to 10 + 5.
    g = group(version=15)
    assert validate_group(g, LIMITS, version=10) is None
    assert validate_group(g, LIMITS, version=9) == (V.R_VERSION, "start_version 15 outside [0, 14] (trainer at 9)")
    g = group(version=3)
    g.samples[1].policy_version = -1
    assert validate_group(g, LIMITS, version=3) == (
        V.R_VERSION, f"sample {g.samples[1].sample_id!r} policy_version -1 outside [0, 8] (trainer at 3)")


def test_token_version_spans_must_cover_the_samples_tokens_with_versions_the_trainer_made():
    g = group(version=3)
    s = g.samples[0]
    n = len(s.completion_ids) // 4
    s.weight_versions = [("3", 0, 1), ("4", 1, n)]
    assert validate_group(g, LIMITS, version=3) is None
    for spans, detail in (([("3", 0, n + 1)], f"version span [0, {n + 1}) outside [0, {n}]"),
                          ([("3", 2, 1)], f"version span [2, 1) outside [0, {n}]"),
                          ([("9", 0, n)], "tokens of version 9 outside [0, 8] (trainer at 3)"),
                          ([("-1", 0, n)], "tokens of version -1 outside [0, 8] (trainer at 3)")):
        s.weight_versions = spans
        assert validate_group(g, LIMITS, version=3) == (V.R_VERSION, f"sample {s.sample_id!r}: {detail}")
    # A label that is no version (vLLM's "default") or too long to be one is
    # not checked (the batch falls back to the call's version), never parsed.
    for label in ("default", "9" * 5000):
        s.weight_versions = [(label, 0, n)]
        assert validate_group(g, LIMITS, version=3) is None


def test_duplicates_and_foreign_samples():
    g = group()
    g.samples[2].sample_id = g.samples[0].sample_id
    assert validate_group(g, LIMITS, 2)[0] == V.R_DUPLICATE_SAMPLE
    g = group()
    g.episodes[2].episode_id = g.episodes[0].episode_id
    assert validate_group(g, LIMITS, 2) == (V.R_DUPLICATE_EPISODE, f"episode {g.episodes[0].episode_id!r} listed twice")
    g = group()
    g.samples[1].group_id = "other"
    assert validate_group(g, None) == (V.R_FOREIGN_SAMPLE, f"sample {g.samples[1].sample_id!r} belongs to group 'other'")
    g.samples, g.group_id = [], "x"
    assert validate_group(g, None) == (V.R_EMPTY, "empty group id or no samples")


def test_limits_from_config():
    cfg = load_config(None, ["actor.scheduler.attempts=4", "actor.episode.max_turns=3", "model.max_model_len=256",
                             "trainer.checkpoint_every=20"])
    assert GroupLimits.from_config(cfg, 263) == GroupLimits(attempts=4, vocab_size=263, max_model_len=256,
                                                            max_samples=12, max_version_ahead=20,
                                                            min_temperature=0.25, max_temperature=1.0)
    cfg = load_config(None, ["trainer.checkpoint_every=0"])
    assert GroupLimits.from_config(cfg, 10).max_version_ahead == 1_000_000
