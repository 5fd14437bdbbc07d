"""Values read off a loaded config that more than one component needs, in
one place so that the actor and the trainer compute them alike.

Owns no knob and no rule (checks.py). Must not import torch or vllm.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlnode.config.base import ConfigError
from rlnode.config.sections import Config, ModelConfig


def groups_in_flight(cfg: Config) -> int:
    """How many groups an actor asks credits for (``max_groups_in_flight``)."""
    s = cfg.actor.scheduler
    return s.max_groups_in_flight or max(1, -(-s.max_concurrent_episodes // s.attempts))


def actor_node_id(cfg: Config) -> str:
    """This actor's node id: actor.node_id, else the hostname ("/" is the
    link identity's separator, so it never appears in one)."""
    return (cfg.actor.node_id or os.uname().nodename).replace("/", "-")


def effective_max_lag(cfg: Config) -> int:
    """The staleness budget both roles apply: ``trainer.sync`` means 0 (train
    only on the current version; generation waits for each update)."""
    return 0 if cfg.trainer.sync else cfg.actor.scheduler.max_lag


# The adapter ranks vLLM's engines accept (vllm.config.lora.MaxLoRARanks,
# the same from 0.26 to 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(cfg: Config) -> int:
    """The ``max_lora_rank`` the actor's engines start with: 0 = no LoRA
    (``trainer.lora.rank`` = 0, full weights); else
    ``actor.engine.max_lora_rank``, or when that is 0 the smallest rank
    vLLM accepts that holds ``trainer.lora.rank``."""
    rank = cfg.trainer.lora.rank
    if rank == 0:
        return 0
    return cfg.actor.engine.max_lora_rank or next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def fused_head_blocker(t, sharded: bool) -> str:
    """Why trainer.logprob_head cannot run fused (scoring.FusedHeadLoss) for
    trainer section ``t``, or "" where it can: the loss or the head must
    split per token. ``sharded``: FSDP2 ranks hold the head's weight."""
    if t.loss.kind == "gspo":
        return 'loss.kind = "gspo" (its sequence ratio reads every token of a sample)'
    if t.lora.rank > 0:
        return "trainer.lora.rank > 0"
    return "trainer.parallel.ranks > 1 (FSDP2 shards the head)" if sharded else ""


def chat_template_text(model: ModelConfig) -> str | None:
    """``model.chat_template``'s Jinja text, or None for the tokenizer's own;
    a ConfigError naming the key when the file is missing. The actor's
    renderer and ``rlnode sft`` render with the same template."""
    if not model.chat_template:
        return None
    path = Path(model.chat_template)
    if not path.is_file():
        raise ConfigError(f"model.chat_template: {path} is not a file (a Jinja chat template; a relative path "
                          "is taken from the working directory)")
    return path.read_text()
