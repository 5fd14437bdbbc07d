"""The rules that involve several keys, checked once, at load
(``check_cross_field``, called by ``load_config``), and the bound on a
group's size on the wire that one of them enforces.

Owns: which combinations of valid values cannot run, and the message that
names the key to change. Must not import torch or vllm. The one import
against the layers: each cube's options are validated against its class, so
``_check_cubes`` imports ``rlnode.cubes.registry`` lazily (.importlinter
names this exception).
"""

from __future__ import annotations

import msgspec

from rlnode.config.actor import CubeConfig
from rlnode.config.base import ConfigError, explain
from rlnode.config.derived import VLLM_LORA_RANKS
from rlnode.config.sections import Config
from rlnode.config.sft import check_sft_table
from rlnode.config.trainer import TrainerConfig

# vLLM samples greedily below this temperature (its _SAMPLING_EPS): the
# logprobs it reports are then not those of logits / T.
VLLM_SAMPLING_EPS = 1e-5


def check_cross_field(cfg: Config) -> None:
    """Raise ConfigError, naming the key, for the first rule ``cfg`` breaks."""
    _check_cubes(cfg.actor.cubes)
    _check_attention(cfg.trainer)
    eng = cfg.actor.engine
    if eng.device == "cpu" and eng.tensor_parallel_size != 1:
        raise ConfigError("actor.engine.tensor_parallel_size: must be 1 when actor.engine.device = \"cpu\"")
    if cfg.actor.sampling.top_p < 1.0:
        # The trainer scores tokens with the full softmax at logits / T; a
        # truncated sampling distribution would make every importance ratio
        # exp(logpi - logmu) wrong (biased), silently.
        raise ConfigError(
            f"actor.sampling.top_p: must be 1.0 for training (got {cfg.actor.sampling.top_p}); "
            "the trainer scores tokens under the untruncated distribution at logits / temperature, "
            "so top-p sampling would bias the importance ratios. Lower the temperature instead"
        )
    if not VLLM_SAMPLING_EPS <= cfg.actor.sampling.min_temperature <= cfg.actor.sampling.temperature:
        raise ConfigError(
            f"actor.sampling.min_temperature: must be in [{VLLM_SAMPLING_EPS}, actor.sampling.temperature = "
            f"{cfg.actor.sampling.temperature}] (got {cfg.actor.sampling.min_temperature})")
    if 0 < cfg.trainer.loss.dual_clip <= 1:
        raise ConfigError(f"trainer.loss.dual_clip: must be 0 (off) or > 1 (got {cfg.trainer.loss.dual_clip})")
    if cfg.actor.sampling.max_tokens >= cfg.model.max_model_len:
        raise ConfigError(
            "actor.sampling.max_tokens: must be < model.max_model_len "
            f"({cfg.actor.sampling.max_tokens} >= {cfg.model.max_model_len})"
        )
    _check_lora(cfg)
    _check_group_fits_frame(cfg)
    check_sft_table(cfg.sft)


# Wire size of one sample (rlnode.wire.TrainingSample): prompt ids and
# completion ids are int32 (4 bytes a token), each completion token also
# carries a float32 logprob and a uint8 loss mask (9 bytes in all); the
# fixed part (ids, lease, strings, weight-version spans) stays below
# GROUP_BYTES_PER_SAMPLE (~390 bytes measured with 60-character group ids
# and four version spans: tests/test_ledger_bounds.py), and an episode
# summary below GROUP_BYTES_PER_EPISODE.
GROUP_BYTES_PER_PROMPT_TOKEN = 4
GROUP_BYTES_PER_COMPLETION_TOKEN = 9
GROUP_BYTES_PER_SAMPLE = 1024
GROUP_BYTES_PER_EPISODE = 512


def max_group_bytes(cfg: Config) -> int:
    """The largest a delivered group can be on the wire: every episode takes
    max_turns LLM calls, each with a context of max_model_len tokens of
    which up to max_tokens are completion."""
    s, m = cfg.actor.scheduler, cfg.model
    completion = cfg.actor.sampling.max_tokens
    sample = (GROUP_BYTES_PER_PROMPT_TOKEN * (m.max_model_len - completion)
              + GROUP_BYTES_PER_COMPLETION_TOKEN * completion + GROUP_BYTES_PER_SAMPLE)
    return s.attempts * (cfg.actor.episode.max_turns * sample + GROUP_BYTES_PER_EPISODE)


def _check_group_fits_frame(cfg: Config) -> None:
    # A group that does not fit is refused by the actor's link after all
    # its episodes ran: refuse the config instead.
    need = max_group_bytes(cfg)
    if need > cfg.link.max_frame_bytes:
        raise ConfigError(
            f"link.max_frame_bytes: a group can be up to {need} bytes (actor.scheduler.attempts = "
            f"{cfg.actor.scheduler.attempts} x actor.episode.max_turns = {cfg.actor.episode.max_turns} samples "
            f"of model.max_model_len = {cfg.model.max_model_len} tokens, actor.sampling.max_tokens = "
            f"{cfg.actor.sampling.max_tokens} of them completion), over link.max_frame_bytes = "
            f"{cfg.link.max_frame_bytes}; raise link.max_frame_bytes to at least {need} or lower one of those"
        )


def _check_lora(cfg: Config) -> None:
    """LoRA keys the engines and the trainer must agree on (the model's
    module names are checked when the trainer loads it)."""
    lora, eng = cfg.trainer.lora, cfg.actor.engine
    if eng.max_lora_rank and eng.max_lora_rank not in VLLM_LORA_RANKS:
        raise ConfigError(f"actor.engine.max_lora_rank: expected 0 or one of {list(VLLM_LORA_RANKS)} "
                          f"(vLLM's ranks), got {eng.max_lora_rank}")
    if lora.rank == 0:
        return
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"trainer.lora.rank: at most {VLLM_LORA_RANKS[-1]} (vLLM's largest), got {lora.rank}")
    if eng.max_lora_rank and lora.rank > eng.max_lora_rank:
        raise ConfigError(f"trainer.lora.rank: {lora.rank} is above actor.engine.max_lora_rank = "
                          f"{eng.max_lora_rank}, the largest adapter the engines serve; raise that "
                          "(or set it to 0 to fit) or lower the rank")
    if not lora.target_modules:
        raise ConfigError("trainer.lora.target_modules: expected at least one module name")
    if cfg.trainer.parallel.ranks != 1:
        raise ConfigError("trainer.parallel.ranks: must be 1 with trainer.lora.rank > 0 (an adapter run "
                          f"trains on one rank; got {cfg.trainer.parallel.ranks})")


def _check_attention(t: TrainerConfig) -> None:
    if t.head_precision == "bf16" and t.precision == "fp32":
        raise ConfigError('trainer.head_precision: "bf16" needs bf16 compute, but trainer.precision = "fp32" '
                          'computes everything in fp32; set trainer.precision = "bf16-mixed", or '
                          'trainer.head_precision = "fp32"')
    # flash_attn and cuda are checked at start (learner.attention_implementation).
    if t.attention == "varlen" and t.precision == "fp32" and t.device == "cuda":
        raise ConfigError(
            'trainer.attention: "varlen" on cuda runs PyTorch\'s FlashAttention kernel, which takes fp16/bf16 '
            'only, but trainer.precision = "fp32" computes in fp32; set trainer.precision = "bf16-mixed", or '
            'trainer.attention = "sdpa"'
        )
    if t.attention != "flash_attention_2":
        return
    if t.precision == "fp32":
        # FA2 raises on fp32 inputs at the first forward; refuse at load.
        raise ConfigError(
            'trainer.attention: "flash_attention_2" takes only fp16/bf16 inputs, but trainer.precision = "fp32" '
            'computes in fp32; set trainer.precision = "bf16-mixed", or trainer.attention = "auto" or "sdpa"'
        )
    if t.device == "cpu":
        raise ConfigError('trainer.attention: "flash_attention_2" needs a cuda trainer, but trainer.device = "cpu"')


def _check_cubes(cubes: list[CubeConfig]) -> None:
    # Imported here: the registry is light, but the config module should
    # not pull the cube package in for configs without cubes.
    from rlnode.cubes.registry import UnknownCube, parse_options

    seen: set[str] = set()
    for i, c in enumerate(cubes):
        key = f"actor.cubes[{i}]"
        if c.id in seen:
            raise ConfigError(f"{key}.id: duplicate cube id {c.id!r}")
        seen.add(c.id)
        try:
            parse_options(c.kind, c.options)
        except UnknownCube as e:
            raise ConfigError(f"{key}.kind: {e.args[0]}") from None
        except msgspec.ValidationError as e:
            msg = explain(e, c.options).replace("[top-level] section", f"options of cube kind {c.kind!r}")
            raise ConfigError(f"{key}.options.{msg}") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{key}.options: {e}") from None
    if cubes and not any(c.weight > 0 for c in cubes):
        raise ConfigError("actor.cubes: at least one cube needs weight > 0 to train on")
