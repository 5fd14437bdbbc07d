"""The ``[sft]`` table: ``rlnode sft``, the supervised warm start on the
trainer (rlnode/trainer/sft.py; docs/training.md, "Supervised warm start").

Owns these knobs' types, defaults and bounds; each comment above a field is
its documentation (scripts/gen_config_docs.py renders it into
docs/configuration.md). The job also reads [model] (the model and its chat
template), [run] (run_dir, seed, progress) and [trainer] (device,
precision, attention, optim, lora, micro-batches, keep_checkpoints): SFT
trains with the RL trainer's own pieces. ``check_sft_table`` holds the rule
between this table's keys (checked at load); ``check_sft_job`` the rules
that only a job that runs ``rlnode sft`` must meet (checked at its start).
Must not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from msgspec import Meta

from rlnode.config.base import ConfigError, NonNegInt, PositiveInt, Section
from rlnode.config.trainer import TrainerConfig


class SftConfig(Section):
    """``rlnode sft``: fine-tune model.path on chat conversations, the loss
    on the assistant's tokens only. Each conversation is rendered by the
    model's chat template (model.chat_template, else the tokenizer's own).
    Unused by the RL daemons."""

    # JSONL of training conversations, one JSON object a line:
    # {"messages": [{"role": "user", "content": "..."}, {"role":
    # "assistant", "content": "..."}, ...], "tools": [...]} ("tools"
    # optional, passed to the chat template as OpenAI-style tool specs).
    # Required by `rlnode sft`; a relative path is taken from the working
    # directory. A line that is no such object stops the job naming the
    # file and line; a conversation without an assistant turn is skipped and
    # counted.
    data: str = ""
    # JSONL of held-out conversations (same format), scored every
    # eval_every steps and after the last; empty = hold out eval_fraction of
    # `data` instead (or nothing).
    eval_data: str = ""
    # Share of `data`'s usable conversations held out from training and
    # scored instead, in [0, 0.5]; 0 = none. The split is drawn from
    # run.seed (the same split on --resume); at least one conversation is
    # held out when > 0. Not with eval_data.
    eval_fraction: Annotated[float, Meta(ge=0, le=0.5)] = 0.0
    # Score the held-out set (eval_loss in metrics.jsonl) every N optimizer
    # steps and after the last one; 0 = only after the last.
    eval_every: NonNegInt = 0
    # Passes over the training conversations, >= 1; used when max_steps = 0.
    epochs: PositiveInt = 1
    # Optimizer steps to run; 0 = `epochs` passes. More steps than a pass
    # has go on into further passes, each in an order of its own. The lr
    # schedule (trainer.optim) decays over these steps.
    max_steps: NonNegInt = 0
    # Conversations per optimizer step, >= 1 (the last step of a pass may
    # have fewer). Used when batch_tokens = 0.
    batch_size: PositiveInt = 8
    # Tokens per optimizer step instead of batch_size: a step takes
    # conversations in the pass's order while their rendered tokens (all of
    # them, not only the assistant's) add up to at most this; a longer
    # conversation makes a step of its own. 0 = off (batch_size).
    batch_tokens: NonNegInt = 0
    # Longest rendered conversation, in tokens (>= 16); it must be within
    # the model's positions (max_position_embeddings, checked at start).
    max_length: Annotated[int, Meta(ge=16)] = 2048
    # What happens to a conversation longer than max_length: "truncate"
    # keeps its first max_length tokens (a conversation left with no
    # assistant token is dropped), "drop" skips it. Both are counted
    # (sft_data.json in the run directory, and the log).
    overlong: Literal["truncate", "drop"] = "truncate"
    # Shuffle the training conversations at every pass, in an order drawn
    # from run.seed and the pass's number (a resumed run continues in the
    # same order); false = file order at every pass.
    shuffle: bool = True
    # Write a checkpoint every N optimizer steps; 0 = only when the job
    # stops (SIGINT/SIGTERM, or the last step). trainer.keep_checkpoints of
    # them are kept; `rlnode sft --resume` continues from the latest.
    save_every: NonNegInt = 0
    # With trainer.lora (rank > 0): besides final/ (the adapter, in peft's
    # format), write final-merged/, the base with the adapter merged in,
    # full weights that model.path loads (an RL run's starting point).
    # Ignored without trainer.lora, whose final/ is full weights already.
    merge_lora: bool = False


def check_sft_table(s: SftConfig) -> None:
    """The rule among [sft]'s own keys (every config, at load)."""
    if s.eval_data and s.eval_fraction > 0:
        raise ConfigError(f"sft.eval_fraction: set either sft.eval_data ({s.eval_data!r}) or sft.eval_fraction "
                          f"({s.eval_fraction}), not both")


def check_sft_job(s: SftConfig, trainer: TrainerConfig) -> None:
    """What a config must have for `rlnode sft` to run it (at its start):
    the data files exist, one trainer rank. The model's positions against
    sft.max_length are checked once its config is read (trainer/sft.py)."""
    if not s.data:
        raise ConfigError("sft.data: required by `rlnode sft` (a JSONL file of conversations)")
    for key, path in (("sft.data", s.data), ("sft.eval_data", s.eval_data)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{key}: {path} is not a file (a relative path is taken from the working directory)")
    if trainer.parallel.ranks > 1:
        raise ConfigError(f"trainer.parallel.ranks: `rlnode sft` trains on one device (got "
                          f"{trainer.parallel.ranks}); set it to 1")
