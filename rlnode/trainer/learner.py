"""Learner: the trainer's model, optimizer and one optimizer step.

Owns: the policy (transformers, loaded from a local path; with trainer.lora
peft's wrap of it, the base frozen, and ``model`` is then the peft model),
an optional frozen reference copy (KL; with LoRA the base itself, the
adapter switched off), AdamW over the trainable parameters only (the
adapter's with LoRA) with warm-up and decay, gradient clipping, and
turning a ``Batch`` into micro-batches whose token log-probabilities are
scored at each sample's sampling temperature (``log_softmax(logits / T)``:
the distribution the engine sampled from). Blocking: call ``train_step``
from a worker thread, never on the event loop.

Scale (trainer.* knobs): the parameters are fp32 ("fp32", "bf16-mixed":
fp32 master weights and AdamW state, bf16 autocast compute, fp32 head) or
bf16 ("bf16"), whatever the engines' model.dtype (the weight push casts);
log-probs and entropy are computed ``logprob_chunk_tokens`` at a time
(scoring.py: no [tokens, vocab] tensor); with ``micro_batch_tokens`` the
forward rows split into token-budget micro-batches, laid out for the
attention kernel (``trainer.attention``, scoring.py): ONE concatenated
sequence per micro-batch for a varlen kernel (flash_attention_2, or
PyTorch's own: attention.py), else
right-padded rows of similar length with no mask (never an [S, S] one);
``activation_checkpointing`` recomputes decoder layers in backward. On
cuda the memory plan (memory_plan.py) is checked before the model loads.

Must not know about sockets, engines or the run directory.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from rlnode.config import Config, ConfigError, fused_head_blocker
from rlnode.trainer import attention as varlen_attention
from rlnode.trainer.buffer import Batch
from rlnode.trainer.loss import LossInputs, LossOutput, mismatch_figures, policy_loss
from rlnode.trainer.memory_plan import check_learner_memory, resolve_adamw_impl
from rlnode.trainer.metrics import combine
from rlnode.trainer.scoring import (MicroBatch, PackedRow, TokenLoss, bucket_micro_batches, budget_micro_batches,
                                    chunked_logprobs, fused_head_loss, packed_inputs, padded_inputs)
from rlnode.weights import lora


@dataclass
class StepMetrics:
    loss: float
    grad_norm: float
    lr: float
    samples: int
    tokens: int
    logprob_diff_mean: float
    # max |engine - trainer| logprob over the tokens of lag-0 samples (the
    # engine held exactly the trainer's weights): the parity check of the
    # live run, ~1e-6 in fp32. None when the batch had no lag-0 sample.
    on_policy_diff_max: float | None
    extra: dict[str, float]
    step_s: float
    # The loss or the gradient was not finite: no optimizer step was taken
    # (the weights, the optimizer state and the lr schedule are unchanged).
    skipped: bool = False
    # Train/inference mismatch over the trained tokens (loss.mismatch_figures,
    # with truncated_fraction and masked_fraction), and trained tokens per
    # version lag.
    mismatch: dict[str, float] = field(default_factory=dict)
    token_lag_hist: dict[int, int] = field(default_factory=dict)


def resolve_trainer_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under ``model``: peft's wrap (trainer.lora)
    holds it with the adapter layers in place, so scoring through it
    computes the adapted policy (or the base, under ``disable_adapter``)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class Scored(NamedTuple):
    logprobs: torch.Tensor  # [B, T] log pi of each completion token
    mask: torch.Tensor  # [B, T] 1 = trained token
    entropy: torch.Tensor  # [B, T] entropy of pi over the vocabulary there


def pack_episodes(samples) -> list[PackedRow]:
    """One row per episode instead of one per LLM call.

    An episode's call k+1 sees exactly call k's prompt + completion + the
    next message (token-in/token-out; the actor checks it), so its last
    sample's sequence contains every earlier completion at the same
    positions, and causal attention gives those tokens the same logits as
    their own rows would. Scoring the episode once saves the repeated
    prefixes: a 3-turn guessing episode is 187 tokens in one row instead of
    83 + 135 + 187 in three (padded to 187 each). A sample whose prompt does
    not extend its episode's row token for token (a truncated context, an
    unstable template) starts a row of its own, so packing never changes
    what is scored.
    """
    rows: list[PackedRow] = []
    open_rows: dict[str, int] = {}  # episode id -> its row, while it can grow
    order = sorted(range(len(samples)), key=lambda k: (samples[k].episode_id, samples[k].step_index))
    for k in order:
        s = samples[k]
        prompt, completion = s.prompt_token_ids, s.completion_token_ids
        r = open_rows.get(s.episode_id)
        if r is not None:
            head = rows[r].tokens
            if len(prompt) >= len(head) and np.array_equal(prompt[: len(head)], head):
                rows[r] = PackedRow(np.concatenate([prompt, completion]),
                                    rows[r].spans + [(k, len(prompt), len(completion))])
                continue
        open_rows[s.episode_id] = len(rows)
        rows.append(PackedRow(np.concatenate([prompt, completion]), [(k, len(prompt), len(completion))]))
    return rows


# Parameter dtype of the policy per trainer.precision. The engine's dtype
# (model.dtype) is separate: the weight push casts to it.
PARAM_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.float32, "bf16": torch.bfloat16}


# Dtype the attention kernel sees per trainer.precision: "bf16-mixed"
# keeps fp32 parameters but runs under bf16 autocast, which transformers'
# flash-attention integration casts q/k/v to.
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16}


def attention_implementation(choice: str, device: torch.device, precision: str) -> str:
    """The transformers attn_implementation for trainer.attention =
    ``choice``. "auto" on cuda with fp16/bf16 compute: flash_attention_2
    where the flash_attn package imports, else PyTorch's own varlen kernel
    (attention.py); elsewhere sdpa. An explicit kernel that cannot run is a
    ConfigError naming the key (load_config refused what it could see
    already; the device may be "auto")."""
    import importlib.util

    low_precision = COMPUTE_DTYPE[precision] in (torch.float16, torch.bfloat16)
    has_fa = importlib.util.find_spec("flash_attn") is not None
    if choice == "auto":
        if device.type == "cuda" and low_precision:
            return "flash_attention_2" if has_fa else varlen_attention.register()
        return "sdpa"
    if choice == "varlen":
        if device.type == "cuda" and not low_precision:
            raise ConfigError(f'trainer.attention: "varlen" on cuda runs PyTorch\'s FlashAttention kernel, which takes '
                              f'fp16/bf16 only, but trainer.precision = "{precision}" computes in fp32: set '
                              'trainer.precision = "bf16-mixed", or trainer.attention = "sdpa"')
        return varlen_attention.register()
    if choice == "flash_attention_2":
        if not low_precision:
            raise ConfigError(f'trainer.attention: "flash_attention_2" takes only fp16/bf16 inputs, but '
                              f'trainer.precision = "{precision}" computes in fp32')
        if device.type != "cuda":
            raise ConfigError(f'trainer.attention: "flash_attention_2" needs a cuda trainer, got device {device}')
        if not has_fa:
            raise ConfigError('trainer.attention: "flash_attention_2" needs the flash_attn package, which is not '
                              'installed (no PyPI wheels: build or install it on this host), or set '
                              'trainer.attention = "auto" (PyTorch\'s own varlen kernel on cuda) or "varlen"')
    return choice


def logprob_head(t, sharded: bool) -> bool:
    """Whether trainer.logprob_head runs fused (scoring.FusedHeadLoss) or
    chunked with recompute. "fused" is refused, naming the key, where the
    loss or the head cannot be split per token: loss.kind = "gspo" (a
    sequence ratio), a LoRA run (the head may be adapted), FSDP2 ranks
    (sharded head weight). "auto": fused wherever it can run."""
    why = fused_head_blocker(t, sharded)
    if t.logprob_head == "fused" and why:
        raise ConfigError(f'trainer.logprob_head: "fused" cannot run with {why}; set trainer.logprob_head = '
                          '"chunked" or "auto"')
    return t.logprob_head == "fused" or (t.logprob_head == "auto" and not why)


def compiles_layers(choice: bool | str, device_type: str) -> bool:
    """trainer.compile = ``choice``: "auto" compiles on cuda only."""
    return choice is True or (choice == "auto" and device_type == "cuda")


def checkpoint_layers(choice: bool | str, plan, layers: int) -> int:
    """Decoder layers to recompute in backward for trainer.activation_checkpointing
    = ``choice``: true all, false none, "auto" what the memory plan chose
    (none without a plan: a cpu trainer, or memory_check = "off")."""
    if choice == "auto":
        return plan.checkpoint_layers if plan is not None else 0
    return layers if choice else 0


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers, in order (transformers' GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class Learner:
    """shard: called once on the loaded policy, after activation
    checkpointing is set up and before the optimizer is built, to shard it in
    place (FSDP2, ``rlnode/trainer/parallel.py``). Scoring calls the
    decoder (``model.base_model``) and the head (``model.get_output_embeddings()``)
    separately, so a sharding must make both callable on their own; the head
    is called once per ``logprob_chunk_tokens`` chunk and again per chunk in
    backward (recompute). Under "bf16-mixed" the head runs outside autocast
    in its parameters' dtype: keep the head's parameters fp32 when sharding
    (its own MixedPrecisionPolicy) for fp32 logits."""

    def __init__(self, cfg: Config, shard=None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        t = cfg.trainer
        self.device = resolve_trainer_device(t.device)
        if self.device.type == "cpu" and t.cpu_threads:
            torch.set_num_threads(t.cpu_threads)
        self.attn_impl = attention_implementation(t.attention, self.device, t.precision)
        # One concatenated sequence per token-budget micro-batch only for a
        # varlen kernel; any other gets padded rows (scoring.py: layouts).
        self.varlen = varlen_attention.is_varlen(self.attn_impl)
        # Before any weight is on the device: a config that cannot fit is
        # refused with its numbers instead of running out of memory later.
        ranks = torch.distributed.get_world_size() if shard is not None and torch.distributed.is_initialized() else 1
        self.memory_plan = check_learner_memory(cfg, self.device, ranks)
        dtype = PARAM_DTYPE[t.precision]
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype,
                                                          attn_implementation=self.attn_impl).to(self.device)
        self.model.train()
        self.checkpoint_layers = checkpoint_layers(t.activation_checkpointing, self.memory_plan,
                                                   self.model.config.num_hidden_layers)
        if self.checkpoint_layers:
            # Non-reentrant: works with inputs that need no grad (the token
            # ids) and with FSDP2's hooks; recomputes each checkpointed
            # decoder layer (the first checkpoint_layers: which ones does
            # not change the memory, only how many).
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            for layer in decoder_layers(self.model)[self.checkpoint_layers:]:
                layer.gradient_checkpointing = False
        # bf16-mixed's head from the fp32 master weights outside autocast
        # (trainer.head_precision = "fp32"), else in the compute dtype.
        self.fp32_head = t.precision == "bf16-mixed" and t.head_precision == "fp32"
        self.fused_head = logprob_head(t, sharded=shard is not None)
        self.compiled = compiles_layers(t.compile, self.device.type)
        if self.compiled:
            # Per layer, not the whole model: one graph every layer shares
            # (same code, parameters as inputs), checkpointing and FSDP2's
            # per-layer hooks stay outside it (torchtitan's order: AC,
            # compile, shard).
            for layer in decoder_layers(self.model):
                layer.compile()
        if shard is not None:
            shard(self.model)
        # trainer.lora: the model is peft's wrap of the frozen base (a
        # ConfigError naming trainer.lora.target_modules when a target is no
        # linear layer); scoring goes through the adapter, the KL reference
        # is the base with the adapter switched off (no second copy).
        self.adapter = lora.adapter_spec(t.lora) if t.lora.rank > 0 else None
        if self.adapter is not None:
            self.model = lora.wrap(self.model, t.lora)
        self.ref_model = None
        if t.loss.kl_coef > 0 and self.adapter is None:
            # No gradient, no optimizer state: bf16 suffices unless the run is fp32.
            ref_dtype = torch.float32 if t.precision == "fp32" else torch.bfloat16
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                cfg.model.path, dtype=ref_dtype, attn_implementation=self.attn_impl).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        o = t.optim
        # "foreach" holds a state-sized temporary at each step, "fused" none;
        # the per-tensor loop (cpu's default) passes neither flag.
        impl = resolve_adamw_impl(o.adamw_impl, self.device.type)
        kernel = {"fused": dict(fused=True), "foreach": dict(foreach=True)}.get(impl, {})
        # Only what trains: every parameter, or the adapter's with LoRA.
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=o.lr, betas=tuple(o.betas),
                                           weight_decay=o.weight_decay, **kernel)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, o.warmup_steps, t.max_steps, o.schedule, o.min_lr_ratio),
        )
        self.skipped_steps = 0  # train_step calls that took no step (non-finite loss or gradient)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps and clipping measures: every parameter,
        or with trainer.lora only the adapter's (the base is frozen)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def vocab_size(self) -> int:
        """Token ids the model can both embed and score."""
        return min(self.model.get_input_embeddings().num_embeddings,
                   self.model.get_output_embeddings().out_features)

    # -- micro-batches ---------------------------------------------------------------

    def forward_rows(self, samples) -> list[PackedRow]:
        """The forward rows of ``samples`` (spans index ``samples``): one per
        episode (``pack_episodes``) or one per sample."""
        if self.cfg.trainer.pack_episodes:
            return pack_episodes(samples)
        return [PackedRow(np.concatenate([s.prompt_token_ids, s.completion_token_ids]),
                          [(i, len(s.prompt_token_ids), len(s.completion_token_ids))])
                for i, s in enumerate(samples)]

    def micro_batches(self, samples) -> list[MicroBatch]:
        """How a step's samples split into forward/backward passes:
        micro_batch_tokens > 0: rows to that token budget, bin-packed into
        one concatenated sequence each (varlen kernel) or length-bucketed
        padded rows (sdpa/eager); else micro_batch_size samples each, in
        order, one padded row per forward row."""
        t = self.cfg.trainer
        if t.micro_batch_tokens > 0:
            layout = budget_micro_batches if self.varlen else bucket_micro_batches
            return layout(self.forward_rows(samples), t.micro_batch_tokens)
        n, mb = len(samples), t.micro_batch_size
        return [MicroBatch(list(range(i, min(i + mb, n))), self.forward_rows(samples[i : i + mb]))
                for i in range(0, n, mb)]

    # -- scoring -----------------------------------------------------------------

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.trainer.precision == "bf16-mixed")

    def _scoring_inputs(self, model, samples, rows: list[PackedRow] | None):
        """The decoder's forward over the rows and, for every completion
        token in flat order: the hidden state predicting it [N, H], the
        token [N], its sample's temperature [N], and where it goes in the
        [B, T] layout (sample k, column t)."""
        rows = self.forward_rows(samples) if rows is None else rows
        inp = packed_inputs(rows, self.device, self.attn_impl) if self.varlen else padded_inputs(rows, self.device)
        # Index every completion token once: the flat position predicting it
        # (logits at j predict token j + 1) and where it goes in the [B, T]
        # output (sample k, column t).
        f_idx, k_idx, t_idx, temps = [], [], [], []
        for off, row in zip(inp.offsets, rows):
            for k, start, n in row.spans:
                f_idx += range(off + start - 1, off + start - 1 + n)
                k_idx += [k] * n
                t_idx += range(n)
                temps += [samples[k].temperature] * n
        f_i = torch.tensor(f_idx, dtype=torch.long, device=self.device)
        hidden = causal_lm(model).base_model(**inp.kwargs).last_hidden_state  # [R, L, H] or [1, S, H]
        where = (torch.tensor(k_idx, dtype=torch.long, device=self.device),
                 torch.tensor(t_idx, dtype=torch.long, device=self.device))
        return (hidden.reshape(-1, hidden.shape[-1])[f_i], inp.ids[f_i + 1],
                torch.tensor(temps, device=self.device), where)

    def _layout(self, samples, where, *flat: torch.Tensor) -> list[torch.Tensor]:
        """Flat per-token values -> [B, T] each."""
        T = max(len(s.completion_token_ids) for s in samples)
        return [torch.zeros(len(samples), T, device=self.device).index_put(where, x) for x in flat]

    def _mask(self, samples) -> torch.Tensor:
        """[B, T]: 1 = a trained completion token."""
        mask = torch.zeros(len(samples), max(len(s.completion_token_ids) for s in samples))
        for k, s in enumerate(samples):
            mask[k, : len(s.completion_token_ids)] = torch.from_numpy(s.completion_mask.astype("float32"))
        return mask.to(self.device)

    def token_logprobs(self, model, samples, entropy_grad: bool = False, rows: list[PackedRow] | None = None) -> Scored:
        """log pi(completion token) for every sample, padded to [B, T], with
        the mask and the entropy of pi at each of those tokens (carrying the
        gradient only when ``entropy_grad``: it is a metric otherwise), all
        in one forward. ``rows``: the forward rows (spans index
        ``samples``); default ``forward_rows(samples)``. With a varlen
        kernel the rows are concatenated into one sequence, else
        right-padded with no mask."""
        t = self.cfg.trainer
        model = causal_lm(model)
        with self._autocast():
            hidden, targets, temps, where = self._scoring_inputs(model, samples, rows)
            # The lm_head only where a completion token is predicted, and
            # chunkwise (scoring.py): never [N, V], let alone [R, L, V].
            lp, h = chunked_logprobs(model.get_output_embeddings(), hidden, targets, temps,
                                     t.logprob_chunk_tokens, fp32_head=self.fp32_head,
                                     entropy_grad=entropy_grad)  # [N], [N]
        if not (entropy_grad and torch.is_grad_enabled()):
            h = h.detach()
        out, ent = self._layout(samples, where, lp, h)
        return Scored(out, self._mask(samples), ent)

    def fused_loss(self, samples, rows, mu: torch.Tensor, adv: torch.Tensor, lag: torch.Tensor,
                   ref: torch.Tensor | None, loss_cfg, normalizer: float):
        """trainer.logprob_head = "fused": the micro-batch's loss with the
        head's backward done chunk by chunk in its forward (scoring.FusedHeadLoss).
        mu, lag, ref: [B, T]; adv: [B]. Returns (loss carrying the decoder's
        gradient, logp [B, T] and entropy [B, T] without gradient, mask
        [B, T], the chunks' figures)."""
        t = self.cfg.trainer
        model = causal_lm(self.model)
        with self._autocast():
            hidden, targets, temps, where = self._scoring_inputs(model, samples, rows)
            mask = self._mask(samples)
            k, col = where
            # Per token, in the flat order: one token per loss row ([N, 1]).
            tok = dict(mu=mu[k, col], mask=mask[k, col], lag=lag[k, col], adv=adv[k],
                       ref=ref[k, col] if ref is not None else None)
            weight = None
            if loss_cfg.normalize == "sequences":  # l_t / |y_i| under "tokens" (loss.LossInputs.token_weight)
                weight = 1.0 / mask.sum(dim=1).clamp(min=1)[k]
            cfg_tokens = msgspec.structs.replace(loss_cfg, normalize="tokens")

            def chunk_loss(lp, ent, a, b):
                col1 = lambda x: None if x is None else x[a:b, None]  # noqa: E731
                out = policy_loss(LossInputs(lp[:, None], col1(tok["mu"]), tok["adv"][a:b], col1(tok["mask"]),
                                             col1(tok["ref"]), ent[:, None], col1(tok["lag"]), col1(weight)),
                                  cfg_tokens, normalizer)
                return out.loss, out.metrics

            loss, lp, ent, parts = fused_head_loss(model.get_output_embeddings(), hidden, targets, temps,
                                                   t.logprob_chunk_tokens, TokenLoss(chunk_loss, loss_cfg.entropy_term),
                                                   fp32_head=self.fp32_head)
        logp, entropy = self._layout(samples, where, lp, ent)
        return loss, logp, entropy, mask, parts

    # -- one optimizer step ---------------------------------------------------------

    def train_step(self, batch: Batch) -> StepMetrics:
        t0 = time.perf_counter()
        cfg = self.cfg.trainer
        samples = batch.samples
        tokens = int(sum(int(s.completion_mask.sum()) for s in samples))
        normalizer = float(batch.norm_tokens if cfg.loss.normalize == "tokens" else batch.norm_samples) or 1.0
        loss_cfg = cfg.loss
        if batch.entropy_coef is not None and batch.entropy_coef != loss_cfg.entropy_coef:
            loss_cfg = msgspec.structs.replace(loss_cfg, entropy_coef=batch.entropy_coef)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, parts = 0.0, []
        on_policy_max: float | None = None
        # The step's trained tokens, for the train/inference mismatch figures.
        log_ratios: list[torch.Tensor] = []
        token_lags: list[torch.Tensor] = []
        completion_tokens = 0
        mbs = self.micro_batches(samples)
        for mb in mbs:
            part = [samples[i] for i in mb.samples]
            T = max(len(s.completion_token_ids) for s in part)
            mu = torch.zeros(len(part), T, device=self.device)
            lag = torch.zeros(len(part), T, dtype=torch.long)
            for j, (i, s) in enumerate(zip(mb.samples, part)):
                lp = torch.from_numpy(s.completion_logprobs.astype("float32"))
                mu[j, : len(lp)] = lp.to(self.device)
                lag[j, : len(lp)] = torch.from_numpy(batch.token_lags[i]) if batch.token_lags else batch.lags[i]
            lag = lag.to(self.device)
            ref = self.reference_logprobs(part, mb.rows) if loss_cfg.kl_coef > 0 else None
            adv = torch.tensor([batch.advantages[i] for i in mb.samples], dtype=torch.float32, device=self.device)
            # Divided by the whole step's normalizer: the micro-batch losses
            # (and their gradients) sum to the loss of the step as one batch.
            if self.fused_head:
                loss, logp, entropy, mask, figures = self.fused_loss(part, mb.rows, mu, adv, lag, ref, loss_cfg,
                                                                     normalizer)
                out = LossOutput(loss, combine(figures))
            else:
                logp, mask, entropy = self.token_logprobs(self.model, part, entropy_grad=loss_cfg.entropy_term,
                                                          rows=mb.rows)
                out = policy_loss(LossInputs(logp, mu, adv, mask, ref, entropy, lag), loss_cfg, normalizer)
            out.loss.backward()
            trained = mask.bool()
            log_ratios.append((logp.detach() - mu)[trained].cpu())
            token_lags.append(lag[trained].cpu())
            completion_tokens += sum(len(s.completion_ids) // 4 for s in part)
            total_loss += float(out.loss.detach())
            parts.append(out.metrics)
            lag0 = [j for j, i in enumerate(mb.samples) if batch.lags[i] == 0]
            if lag0:
                d = ((logp.detach() - mu).abs() * mask)[lag0].max().item()
                on_policy_max = d if on_policy_max is None else max(on_policy_max, d)
        grad_norm, stepped = self._clip_and_step(math.isfinite(total_loss))
        # Each figure by its own rule (metrics.REDUCE): sums, maxima, means
        # weighted by each micro-batch's tokens. The ranks merge with it too.
        extra = combine(parts)
        # In every step's metrics, so a skip shows as a 1 next to its loss.
        extra["nonfinite_skip"] = float(not stepped)
        extra["nonfinite_skips_total"] = float(self.skipped_steps)
        extra.update(self._layout_figures(mbs))
        mismatch, lag_hist = {}, {}
        if log_ratios:
            lags = torch.cat(token_lags)
            mismatch = mismatch_figures(torch.cat(log_ratios), lags, cfg.loss)
            # The min's clip (r < 1 - eps_low where A < 0) and the dual clip
            # (r > c > 1 where A < 0) never cut the same token: they add.
            mismatch["truncated_fraction"] = extra.get("clip_fraction", 0.0) + extra.get("dual_clip_fraction", 0.0)
            # Completion tokens the loss never saw (loss mask 0: e.g. an
            # agent's own tool-call syntax), plus those the lag mask cut.
            masked = completion_tokens - tokens + extra.get("lag_masked_fraction", 0.0) * tokens
            mismatch["masked_fraction"] = masked / max(1, completion_tokens)
            values, counts = torch.unique(lags, return_counts=True)
            lag_hist = {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist())}
        return StepMetrics(
            loss=total_loss, grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0], samples=len(samples),
            tokens=tokens, logprob_diff_mean=extra.get("logprob_diff_mean", 0.0), on_policy_diff_max=on_policy_max,
            extra=extra,
            step_s=time.perf_counter() - t0, skipped=not stepped, mismatch=mismatch, token_lag_hist=lag_hist,
        )

    @torch.no_grad()
    def reference_logprobs(self, samples, rows: list[PackedRow] | None = None) -> torch.Tensor:
        """log pi_ref of the completion tokens (the KL term): the frozen
        initial policy, or with trainer.lora the base with the adapter off."""
        if self.adapter is not None:
            with self.model.disable_adapter():
                return self.token_logprobs(self.model, samples, rows=rows).logprobs
        return self.token_logprobs(self.ref_model, samples, rows=rows).logprobs

    def _layout_figures(self, mbs) -> dict[str, float]:
        """Tokens through the decoder (padding included) and passes: what
        the micro-batch layout cost this step."""
        packed = self.varlen
        forward = sum(mb.tokens if packed else mb.padded_tokens for mb in mbs)
        pad = float(forward - sum(mb.tokens for mb in mbs))
        return {"micro_batches": float(len(mbs)), "forward_tokens": float(forward), "pad_tokens": pad,
                "pad_fraction": pad / max(1, forward)}

    def _clip_and_step(self, loss_finite: bool) -> tuple[float, bool]:
        """Clip and step; returns (gradient norm, stepped). A non-finite
        loss or gradient norm takes no step: AdamW would carry a NaN in its
        moments into every later update. The gradients are dropped, and the
        lr schedule does not advance (no step happened)."""
        max_norm = self.cfg.trainer.optim.max_grad_norm
        params = [p for p in self.trainable_parameters() if p.grad is not None]
        if not params:
            if not loss_finite:
                return self._skip(0.0)
            self.scheduler.step()
            return 0.0, True
        if max_norm > 0:
            # Clipping by a NaN norm scales the gradients to NaN: harmless,
            # they are dropped below in that case.
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        if not (loss_finite and math.isfinite(norm)):
            return self._skip(norm)
        self.optimizer.step()
        self.scheduler.step()
        return norm, True

    def _skip(self, norm: float) -> tuple[float, bool]:
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        return norm, False
