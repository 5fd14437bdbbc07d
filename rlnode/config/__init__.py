"""Typed configuration: one msgspec Struct per role, loaded from TOML.

Owns: the schema of every knob, its default, its bounds, and the one place
where a config is validated (``load_config``). Must not import torch or vllm:
the CLI validates a config before anything heavy is loaded.

Errors name the dotted key path and what was expected, e.g.
``actor.router.llm_max_rollouts: expected int >= 1, got 0``.

Where each part lives (import from ``rlnode.config``, which re-exports them):

* ``base.py``: ``ConfigError``, the ``Section`` base, bounded number types,
  the key-first rewrite of msgspec's validation messages.
* ``actor.py``: the ``[actor]`` table (engines, router, sampling, episodes,
  scheduler, cubes, gateway hosts).
* ``trainer.py``: the ``[trainer]`` table (loss, advantages, optimizer,
  weight sync, ranks, trackers).
* ``sections.py``: ``[run]``, ``[model]``, ``[link]``, ``[http]`` and the
  root ``Config``.
* ``sft.py``: the ``[sft]`` table (``rlnode sft``, the supervised warm
  start) and its checks.
* ``checks.py``: the rules that involve several keys, and the bound on a
  group's wire size.
* ``load.py``: TOML, ``--set`` overrides, the one validation.
* ``derived.py``: values both roles read off a loaded config.

A knob is documented by the comment above its declaration;
docs/configuration.md is generated from those (scripts/gen_config_docs.py).
"""

from rlnode.config.actor import (
    ActorConfig,
    CubeConfig,
    EngineConfig,
    EpisodeConfig,
    RouterConfig,
    SamplingConfig,
    SchedulerConfig,
)
from rlnode.config.base import ConfigError, Fraction, NonNegInt, PositiveFloat, PositiveInt, Section
from rlnode.config.checks import (
    GROUP_BYTES_PER_COMPLETION_TOKEN,
    GROUP_BYTES_PER_EPISODE,
    GROUP_BYTES_PER_PROMPT_TOKEN,
    GROUP_BYTES_PER_SAMPLE,
    VLLM_SAMPLING_EPS,
    check_cross_field,
    max_group_bytes,
)
from rlnode.config.derived import (VLLM_LORA_RANKS, actor_node_id, effective_max_lag, engine_lora_rank,
                                   fused_head_blocker, groups_in_flight)
from rlnode.config.load import load_config, parse_override, to_toml_dict
from rlnode.config.sections import Config, HttpConfig, LinkConfig, ModelConfig, RunConfig
from rlnode.config.sft import SftConfig, check_sft_job
from rlnode.config.trainer import (
    AdvantageConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
    ParallelConfig,
    TrackersConfig,
    TrainerConfig,
    WeightSyncConfig,
)

__all__ = [
    "GROUP_BYTES_PER_COMPLETION_TOKEN",
    "GROUP_BYTES_PER_EPISODE",
    "GROUP_BYTES_PER_PROMPT_TOKEN",
    "GROUP_BYTES_PER_SAMPLE",
    "VLLM_LORA_RANKS",
    "VLLM_SAMPLING_EPS",
    "ActorConfig",
    "AdvantageConfig",
    "Config",
    "ConfigError",
    "CubeConfig",
    "EngineConfig",
    "EpisodeConfig",
    "Fraction",
    "HttpConfig",
    "LinkConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "NonNegInt",
    "OptimConfig",
    "ParallelConfig",
    "PositiveFloat",
    "PositiveInt",
    "RouterConfig",
    "RunConfig",
    "SamplingConfig",
    "SchedulerConfig",
    "Section",
    "SftConfig",
    "TrackersConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "actor_node_id",
    "check_cross_field",
    "check_sft_job",
    "effective_max_lag",
    "fused_head_blocker",
    "groups_in_flight",
    "load_config",
    "max_group_bytes",
    "parse_override",
    "to_toml_dict",
]
