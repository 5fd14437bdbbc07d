"""A version number names weights only within one trainer incarnation.

A trainer killed at v103 and resumed from its v100 checkpoint makes a new
v101 that differs from the lost one. Weights are therefore named by
(trainer incarnation, version) — ``wire.weights_label`` — everywhere it
matters:

* the engine's prefix-cache salt: a request under the resumed trainer's
  v1 never reuses KV blocks computed under the lost trainer's v1 (the real
  engine, a real gloo push, logprobs checked against transformers);
* the trainer's buffer: a sample whose tokens came from another
  incarnation's weights, beyond what this trainer descends from, is stale
  whatever its version number says (dropped, counted as foreign);
* the weight plan carries the sender's incarnation, and old plans and
  labels still decode.
"""

from __future__ import annotations

import asyncio
import copy
import random

import msgspec
import pytest
import torch

from conftest import reference_logprobs
from rlnode.config import AdvantageConfig, WeightSyncConfig
from rlnode.weights.broadcast import WeightBroadcaster, update_tensors
from rlnode.wire import EpisodeSummary, GroupDelivery, LeaseMetadata, TrainingSample, pack_f32, pack_i32


# --------------------------------------------------------------------------
# The real engine: the prefix cache across a trainer restart


@pytest.fixture(scope="module")
async def rig(tmp_path_factory, engine_config):
    """An engine (with the weight extension) in a group with a trainer-side
    broadcaster; the trainer's model; three prompts several KV blocks long."""
    from transformers import AutoModelForCausalLM

    from rlnode.actor.engine import Engine
    from rlnode.actor.weight_receiver import EXTENSION, engine_num_ranks, join_group
    from rlnode.config import ModelConfig
    from rlnode.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("version-names"), tie_embeddings=False, seed=13)
    engine = Engine(0, ModelConfig(path=str(path), max_model_len=1024), engine_config, worker_extension_cls=EXTENSION)
    await engine.start()
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=60)
    try:
        spec = bc.new_epoch([("node/0", engine_num_ranks(engine))])
        await asyncio.gather(bc.open_group_async(spec), join_group(engine, spec, first_rank=1))
        rng = random.Random(17)
        prompts = [[rng.randrange(40, 200) for _ in range(rng.randrange(300, 360))] for _ in range(3)]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        yield engine, bc, hf, prompts
    finally:
        bc.close_group()
        await engine.shutdown()


def _moved(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with every parameter moved: what one trainer's
    steps from the same checkpoint make of it."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return out


async def _push(engine, bc, model, version: int, source: str = ""):
    """``source``: the incarnation the actor's link was welcomed by (what
    the actor falls back on for a plan that names none)."""
    from rlnode.actor.weight_receiver import apply_weight_update

    tensors = update_tensors(model)
    plan = bc.plan(tensors, version)
    await asyncio.gather(bc.broadcast_async(plan, tensors),
                         apply_weight_update(engine, plan, timeout_s=60, source=source))
    return plan


async def _generate(engine, prompts):
    from rlnode.actor.engine import SamplingSettings

    return await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=8, seed=i, ignore_eos=True))
                                  for i, p in enumerate(prompts)))


def _max_diff(model, prompts, completions) -> float:
    return max((reference_logprobs(model, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
               for p, c in zip(prompts, completions))


@pytest.mark.engine
async def test_resumed_trainers_version_never_reuses_the_lost_branchs_prefix_cache(rig):
    engine, bc, hf, prompts = rig
    lost = _moved(hf, seed=1)  # trainer "a1"'s v1: lost when it was killed
    resumed = _moved(hf, seed=2)  # trainer "b2"'s v1, made again from the same checkpoint

    # a1 predates plan sources: its actor names it by the link's Welcome.
    await _push(engine, bc, lost, 1, source="a1")
    first = await _generate(engine, prompts)  # fills the prefix cache under a1's v1
    assert _max_diff(lost, prompts, first) < 1e-4

    bc.source = "b2"  # b2's broadcaster stamps its incarnation on its plans
    plan = await _push(engine, bc, resumed, 1)
    again = await _generate(engine, prompts)  # the same prompts, under b2's v1
    # A reused block of a1's KV shows as a gap of ~0.1 nats or more here.
    assert _max_diff(resumed, prompts, again) < 1e-4, "KV of the lost weights was reused"
    assert _max_diff(lost, prompts, again) > 1e-2

    from rlnode.wire import weights_label

    # The tokens carry the name of the weights that produced them.
    assert plan.source == "b2" and plan.label == "1@b2"
    assert engine.weight_version == weights_label(1, "b2") == "1@b2"
    assert all(c.weight_versions == [("1@b2", 0, 8)] for c in again), [c.weight_versions for c in again]
    assert all(c.weight_versions == [("1@a1", 0, 8)] for c in first)


# --------------------------------------------------------------------------
# Labels and plans on the wire


def test_labels_name_version_and_source_and_old_labels_still_parse():
    from rlnode.wire import INITIAL_WEIGHTS, parse_weights_label, span_version, weights_label

    assert weights_label(101, "9f3ab2c4d5e6f708") == "101@9f3ab2c4d5e6f708"
    assert INITIAL_WEIGHTS == weights_label(0) == "0"  # loaded from disk: no trainer named them
    assert parse_weights_label("101@9f3ab2c4d5e6f708") == (101, "9f3ab2c4d5e6f708")
    assert parse_weights_label("7") == (7, "")  # an actor that predates sources
    for bad in ("default", "", "@a", "1@", "1@a-b", "1@" + "a" * 65, "9" * 19, "x@1"):
        assert parse_weights_label(bad) is None, bad
    assert span_version("101@9f3ab2c4d5e6f708") == 101 and span_version("default") is None


def test_plan_carries_its_source_and_plans_without_one_still_decode():
    from rlnode.weights.plan import WeightUpdatePlan, decode_plan, encode, plan_buckets

    buckets = plan_buckets([("w", "float32", (4,))], 1 << 20)
    plan = WeightUpdatePlan(5, 2, buckets, "gloo", source="9f3ab2c4")
    assert decode_plan(encode(plan)) == plan and plan.label == "5@9f3ab2c4"

    class OldPlan(msgspec.Struct, frozen=True):  # a trainer that predates ``source``
        version: int
        epoch: int
        buckets: tuple
        backend: str

    old = decode_plan(msgspec.msgpack.encode(OldPlan(5, 2, msgspec.to_builtins(buckets), "gloo")))
    assert old.source == "" and old.label == "5"
    # ... and an actor that predates it reads a new plan (it drops the field).
    assert msgspec.msgpack.decode(encode(plan), type=OldPlan).version == 5
    # The digest both ends compare covers the byte layout only: a peer that
    # drops the appended field still agrees.
    assert old.digest() == plan.digest()


# --------------------------------------------------------------------------
# The trainer's buffer


def _sample(episode: str, version: int, spans: list[tuple[str, int, int]], n: int = 4) -> TrainingSample:
    return TrainingSample(
        sample_id=f"{episode}/0", group_id="g", episode_id=episode, cube_id="c", task_id="t", step_index=0,
        prompt_ids=pack_i32([1, 2]), completion_ids=pack_i32(range(n)), logprobs=pack_f32([-1.0] * n),
        loss_mask=bytes([1]) * n, reward=0.0, finish_reason="stop", termination_reason="done",
        policy_version=version, temperature=1.0, lease=LeaseMetadata(0, 0, 0.0, 0.0), weight_versions=spans)


def _group(gid: str, samples: list[TrainingSample]) -> GroupDelivery:
    """One episode per sample, rewards 0, 1, ...: every group has signal."""
    samples = [msgspec.structs.replace(s, group_id=gid, reward=float(i)) for i, s in enumerate(samples)]
    episodes = [EpisodeSummary(s.episode_id, s.reward, bool(s.reward), 1, "done") for s in samples]
    return GroupDelivery(gid, "n1", "c", "t", samples[0].policy_version, episodes, samples)


def _buffer(own: str, inherited: dict[str, int] | None = None):
    from rlnode.trainer.buffer import GroupBuffer

    from rlnode.trainer.buffer import Lineage

    buf = GroupBuffer(1, max_lag=2, adv_cfg=AdvantageConfig())
    buf.lineage = Lineage(own, inherited)
    return buf


def test_right_version_number_from_a_foreign_incarnation_is_stale():
    # Trainer "b2" resumed at v100 from "a1"'s checkpoint; a1 reached v103
    # before it was killed. Samples of a1's lost v101..v103 look fresh by
    # number (lag <= 0) but were made by weights this trainer never had.
    buf = _buffer("b2", {"a1": 100})
    mine = _sample("e0", 101, [("101@b2", 0, 4)])
    lost = _sample("e1", 101, [("101@a1", 0, 4)])
    buf.put(_group("g1", [mine, lost]))
    batch = buf.take_batch(101)
    assert [s.episode_id for s in batch.samples] == ["e0"]
    assert batch.dropped_foreign == 1 and batch.dropped_stale == 0
    assert buf.counters.samples_dropped_foreign == 1 and buf.counters.samples_dropped_stale == 0
    assert batch.lags == [0]


def test_weights_this_trainer_descends_from_are_not_foreign():
    buf = _buffer("b2", {"a1": 100})
    inherited = _sample("e0", 100, [("100@a1", 0, 4)])  # a1's v100 is b2's checkpoint
    initial = _sample("e1", 0, [("0", 0, 4)])  # the weights on disk: every trainer's v0
    old_actor = _sample("e2", 101, [("101", 0, 4)])  # an actor that predates sources: lag decides
    buf.put(_group("g1", [inherited, initial, old_actor]))
    batch = buf.take_batch(101)
    assert [s.episode_id for s in batch.samples] == ["e0", "e2"]
    assert batch.dropped_stale == 1 and batch.dropped_foreign == 0  # v0 is 101 versions old
    assert batch.lags == [1, 0]


def test_a_sample_that_crossed_into_a_foreign_incarnation_is_dropped():
    # Started under the lost a1's v102, finished under b2's v101 (the
    # request was kept across the push): its start is foreign, whatever its
    # end. One that started under a1's v100, this trainer's checkpoint, is not.
    buf = _buffer("b2", {"a1": 100})
    mixed = _sample("e0", 102, [("102@a1", 0, 2), ("101@b2", 2, 4)])
    fine = _sample("e1", 100, [("100@a1", 0, 2), ("101@b2", 2, 4)])
    buf.put(_group("g1", [mixed, fine]))
    batch = buf.take_batch(101)
    assert [s.episode_id for s in batch.samples] == ["e1"] and batch.dropped_foreign == 1
    assert batch.token_lags[0].tolist() == [1, 1, 0, 0]


def test_lineage_travels_with_checkpoints():
    from rlnode.trainer.buffer import Lineage

    a = Lineage("a1", {"z9": 50})  # a1 itself resumed from z9's v50
    assert a.at(100) == {"z9": 50, "a1": 100}
    b = Lineage("b2", a.at(100))
    assert b.on_lineage(100, "a1") and not b.on_lineage(101, "a1")
    assert b.on_lineage(50, "z9") and not b.on_lineage(51, "z9")
    assert b.on_lineage(10**6, "b2") and b.on_lineage(3, "")
    assert not b.on_lineage(1, "c3")
    # No own incarnation (a buffer outside a trainer daemon): no check.
    assert Lineage().on_lineage(7, "anything")


def test_the_link_bounds_the_version_of_a_named_label_like_a_bare_one():
    from rlnode.link.validate import R_VERSION, GroupLimits, validate_group

    limits = GroupLimits(attempts=2, vocab_size=100, max_model_len=32, max_samples=4, max_version_ahead=5)
    ok = _group("g1", [_sample("e0", 3, [("3@b2", 0, 4)]), _sample("e1", 3, [("0", 0, 2), ("3@b2", 2, 4)])])
    assert validate_group(ok, limits, version=0) is None
    ahead = _group("g2", [_sample("e0", 3, [("9@b2", 0, 4)]), _sample("e1", 3, [("3@b2", 0, 4)])])
    assert validate_group(ahead, limits, version=0)[0] == R_VERSION
