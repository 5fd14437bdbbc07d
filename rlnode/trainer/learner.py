"""Learner: the trainer's model, optimizer and one optimizer step.

Owns: the policy (transformers, loaded from a local path), an optional frozen
reference copy (KL), AdamW with warm-up and decay, gradient clipping, and
turning a ``Batch`` into micro-batches whose token log-probabilities are
scored at each sample's sampling temperature (``log_softmax(logits / T)``:
the distribution the engine sampled from). Blocking: call ``train_step``
from a worker thread, never on the event loop.

Must not know about sockets, engines or the run directory.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from rlnode.config import Config
from rlnode.trainer.buffer import Batch
from rlnode.trainer.loss import LossInputs, policy_loss


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


class Scored(NamedTuple):
    logprobs: torch.Tensor  # [B, T] log pi of each completion token
    mask: torch.Tensor  # [B, T] 1 = trained token
    entropy: torch.Tensor  # [B, T] entropy of pi over the vocabulary there


class PackedRow(NamedTuple):
    """One forward row: the token sequence and, per sample it scores,
    (sample index, completion start, completion length)."""

    tokens: np.ndarray
    spans: list[tuple[int, int, int]]


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


class Learner:
    """shard: called once on the loaded policy, after activation
    checkpointing is set up and before the optimizer is built, to shard it in
    place (FSDP2, ``rlnode/trainer/parallel.py``). Scoring calls the
    decoder (``model.base_model``) and the head (``model.get_output_embeddings()``)
    separately, so a sharding must make both callable on their own."""

    def __init__(self, cfg: Config, shard=None):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        t = cfg.trainer
        self.device = resolve_trainer_device(t.device)
        if self.device.type == "cpu" and t.cpu_threads:
            torch.set_num_threads(t.cpu_threads)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            cfg.model.dtype, torch.float32)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).to(self.device)
        self.model.train()
        if shard is not None:
            shard(self.model)
        self.ref_model = None
        if t.loss.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        o = t.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas),
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, o.warmup_steps, t.max_steps, o.schedule, o.min_lr_ratio),
        )
        self.skipped_steps = 0  # train_step calls that took no step (non-finite loss or gradient)

    @property
    def vocab_size(self) -> int:
        """Token ids the model can both embed and score."""
        return min(self.model.get_input_embeddings().num_embeddings,
                   self.model.get_output_embeddings().out_features)

    # -- scoring -----------------------------------------------------------------

    def _micro_batch(self, samples):
        """Right-padded [R, L] inputs for the rows that ``pack_episodes``
        builds; returns (input_ids, attention_mask, rows)."""
        rows = pack_episodes(samples) if self.cfg.trainer.pack_episodes else [
            PackedRow(np.concatenate([s.prompt_token_ids, s.completion_token_ids]),
                      [(i, len(s.prompt_token_ids), len(s.completion_token_ids))])
            for i, s in enumerate(samples)]
        L = max(len(r.tokens) for r in rows)
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        attn = torch.zeros(len(rows), L, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.tokens)] = torch.from_numpy(r.tokens.astype("int64"))
            attn[i, : len(r.tokens)] = 1
        return ids.to(self.device), attn.to(self.device), rows

    def token_logprobs(self, model, samples, entropy_grad: bool = False) -> Scored:
        """log pi(completion token) for every sample, padded to [B, T], with
        the mask and the entropy of pi at each of those tokens (carrying the
        gradient only when ``entropy_grad``: it is a metric otherwise)."""
        ids, attn, rows = self._micro_batch(samples)
        # Index every completion token once: (row, position predicting it)
        # and where it goes in the [B, T] output (sample k, column t).
        r_idx, p_idx, k_idx, t_idx, temps = [], [], [], [], []
        for r, row in enumerate(rows):
            for k, start, n in row.spans:
                r_idx += [r] * n
                p_idx += range(start - 1, start - 1 + n)  # logits at j predict token j + 1
                k_idx += [k] * n
                t_idx += range(n)
                temps += [samples[k].temperature] * n
        r_i, p_i = torch.tensor(r_idx, device=self.device), torch.tensor(p_idx, device=self.device)
        # The lm_head only where a completion token is predicted, not at every
        # position: [N, V] instead of [R, L, V] (a 150k vocabulary makes the
        # full tensor the largest of the step). logits = lm_head(final hidden
        # state) is how the causal LMs we load compute them.
        hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state  # [R, L, H]
        logits = model.get_output_embeddings()(hidden[r_i, p_i]).float()  # [N, V]
        logp_all = torch.log_softmax(logits / torch.tensor(temps, device=self.device)[:, None], -1)  # [N, V]
        lp = logp_all.gather(1, ids[r_i, p_i + 1][:, None])[:, 0]  # [N]
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            h = -(logp_all.exp() * logp_all).sum(-1)  # [N]
        T = max(len(s.completion_token_ids) for s in samples)
        where = (torch.tensor(k_idx, device=self.device), torch.tensor(t_idx, device=self.device))
        out = torch.zeros(len(samples), T, device=self.device).index_put(where, lp)
        ent = torch.zeros(len(samples), T, device=self.device).index_put(where, h)
        mask = torch.zeros(len(samples), T)
        for k, s in enumerate(samples):
            mask[k, : len(s.completion_token_ids)] = torch.from_numpy(s.completion_mask.astype("float32"))
        return Scored(out, mask.to(self.device), ent if entropy_grad else ent.detach())

    # -- one optimizer step ---------------------------------------------------------

    def train_step(self, batch: Batch) -> StepMetrics:
        t0 = time.perf_counter()
        cfg = self.cfg.trainer
        samples = batch.samples
        tokens = int(sum(int(s.completion_mask.sum()) for s in samples))
        normalizer = float(batch.norm_tokens if cfg.loss.normalize == "tokens" else batch.norm_samples) or 1.0
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, diff_sum, agg = 0.0, 0.0, {}
        on_policy_max: float | None = None
        mb = cfg.micro_batch_size
        for i in range(0, len(samples), mb):
            part = samples[i : i + mb]
            logp, mask, entropy = self.token_logprobs(self.model, part, entropy_grad=cfg.loss.entropy_coef > 0)
            mu = torch.zeros_like(logp)
            for j, s in enumerate(part):
                lp = torch.from_numpy(s.completion_logprobs.astype("float32"))
                mu[j, : len(lp)] = lp.to(self.device)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = self.token_logprobs(self.ref_model, part).logprobs
            adv = torch.tensor(batch.advantages[i : i + mb], dtype=torch.float32, device=self.device)
            out = policy_loss(LossInputs(logp, mu, adv, mask, ref, entropy), cfg.loss, normalizer)
            out.loss.backward()
            total_loss += float(out.loss.detach())
            diff_sum += out.metrics["logprob_diff_mean"] * out.metrics["tokens"]
            lag0 = [j for j in range(len(part)) if batch.lags[i + j] == 0]
            if lag0:
                d = ((logp.detach() - mu).abs() * mask)[lag0].max().item()
                on_policy_max = d if on_policy_max is None else max(on_policy_max, d)
            # Micro-batch metrics are means over its tokens: weight by them.
            for k, v in out.metrics.items():
                agg.setdefault(k, []).append((float(v), out.metrics.get("tokens", 1.0)))
        grad_norm, stepped = self._clip_and_step(math.isfinite(total_loss))
        extra = {k: sum(v * n for v, n in vals) / max(1, sum(n for _, n in vals)) for k, vals in agg.items()}
        # In every step's metrics, so a skip shows as a 1 next to its loss.
        extra["nonfinite_skip"] = float(not stepped)
        extra["nonfinite_skips_total"] = float(self.skipped_steps)
        return StepMetrics(
            loss=total_loss, grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0], samples=len(samples),
            tokens=tokens, logprob_diff_mean=diff_sum / max(1, tokens), on_policy_diff_max=on_policy_max, extra=extra,
            step_s=time.perf_counter() - t0, skipped=not stepped,
        )

    def _clip_and_step(self, loss_finite: bool) -> tuple[float, bool]:
        """Clip and step; returns (gradient norm, stepped). A non-finite
        loss or gradient norm takes no step: AdamW would carry a NaN in its
        moments into every later update. The gradients are dropped, and the
        lr schedule does not advance (no step happened)."""
        max_norm = self.cfg.trainer.optim.max_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
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
