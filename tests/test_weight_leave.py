"""Join and leave never hold the engine core for a stuck transfer.

A receive whose trainer went silent (a frozen host: its sockets stay open,
nothing moves) waits in its collective until the group's timeout. Leaving
that group runs inside a collective RPC, on the engine core; closing a gloo
group waits for its collective in flight, so a leave or a join that closed
the old group there stopped every request of the engine for the rest of the
group's timeout. The worker hands such a group to a thread of its own: the
join and the leave return at once, generation goes on, the new group
carries the next update. The real engine on the tiny model; the trainer is
this process (rank 0)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from conftest import reference_logprobs
from test_weights import _engine_rig, _sync_cfg, _train_a_little, leave_group
from rlnode.weights.broadcast import WeightBroadcaster, update_tensors
from rlnode.weights.plan import TransferError

pytestmark = pytest.mark.engine

# The groups' per-collective timeout (_engine_rig's broadcaster, and the new
# one here): how long the stuck receive waits in its collective.
GROUP_TIMEOUT_S = 60.0
# Far inside it: a join, a leave or a few tokens that took this long waited
# for the stuck receive.
BOUND_S = GROUP_TIMEOUT_S / 3


async def _stuck_receive(engine, bc: WeightBroadcaster, model, version: int) -> None:
    """The engine starts receiving ``version`` from ``bc``, which never sends:
    the driver gives up after 2 s (TransferError); the worker's job stays in
    its collective, waiting for rank 0, until the group's timeout."""
    from rlnode.actor.weight_receiver import apply_weight_update

    with pytest.raises(TransferError, match="still running"):
        await apply_weight_update(engine, bc.plan(update_tensors(model), version), timeout_s=2)


async def _serves(engine, model, prompts, bound_s: float | None = BOUND_S) -> float:
    """Max |engine - model| logprob over a few sampled tokens per prompt,
    each call within ``bound_s`` (the engine core is not held)."""
    from rlnode.actor.engine import SamplingSettings

    async with asyncio.timeout(bound_s):
        outs = await asyncio.gather(*(engine.generate(p, SamplingSettings(max_tokens=8, seed=i, ignore_eos=True))
                                      for i, p in enumerate(prompts)))
    return max((reference_logprobs(model, p, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
               for p, c in zip(prompts, outs))


async def test_join_and_leave_with_a_receive_stuck_return_at_once_and_generation_goes_on(tmp_path, engine_config):
    from rlnode.actor.weight_receiver import apply_weight_update, engine_num_ranks, join_group
    from rlnode.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "model", tie_embeddings=False, seed=5)
    async with _engine_rig(path, False, engine_config, prompt_seed=3, prompt_len=(20, 40)) as rig:
        engine, old = rig.engine, rig.bc
        assert old.timeout_s == GROUP_TIMEOUT_S
        new = WeightBroadcaster(_sync_cfg(), master_host="127.0.0.1", timeout_s=GROUP_TIMEOUT_S)
        new.epoch = old.epoch  # the trainer's next epoch
        try:
            # The first tokens also compile kernels (on the engine core: up to
            # a minute on a loaded 2-core machine): not what is bounded here.
            assert await _serves(engine, rig.hf, rig.prompts, bound_s=None) < 1e-4
            # 1. Stuck on the old epoch, the engine joins the next one: the
            # join and the tokens asked for meanwhile do not wait for it.
            await _stuck_receive(engine, old, rig.hf, 1)
            spec = new.new_epoch([("node/0", engine_num_ranks(engine))])
            async with asyncio.timeout(BOUND_S):
                _, _, diff = await asyncio.gather(new.open_group_async(spec), join_group(engine, spec, first_rank=1),
                                                  _serves(engine, rig.hf, rig.prompts))
            assert diff < 1e-4  # still the weights it loaded at start

            # 2. The new group carries the next update.
            _train_a_little(rig.hf, seed=1)
            tensors = update_tensors(rig.hf)
            plan = new.plan(tensors, 1)
            await asyncio.gather(new.broadcast_async(plan, tensors),
                                 apply_weight_update(engine, plan, timeout_s=GROUP_TIMEOUT_S))
            assert await _serves(engine, rig.hf, rig.prompts) < 1e-4

            # 3. Stuck on the new epoch, the engine leaves it: at once, and
            # it serves on; the group it left carries nothing more.
            await _stuck_receive(engine, new, rig.hf, 2)
            async with asyncio.timeout(BOUND_S):
                await asyncio.gather(leave_group(engine), _serves(engine, rig.hf, rig.prompts))
            with pytest.raises(TransferError, match="no usable group"):
                await apply_weight_update(engine, new.plan(tensors, 3), timeout_s=10)
            assert await _serves(engine, rig.hf, rig.prompts) < 1e-4
        finally:
            # The silent trainer closes its ends: the stuck collectives fail
            # and the worker's threads close the groups they were handed.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(new.close_group)
