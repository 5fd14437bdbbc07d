"""Scoring math and layout: token log-probs and entropy without [N, V]
tensors, and micro-batches packed to a token budget.

Owns: (1) the chunked log-softmax over the vocabulary, (2) turning forward
rows into micro-batches and one micro-batch into decoder inputs. No model
loading, optimizer or loss: the Learner calls these.

Notation. N = completion tokens scored in one forward, V = vocabulary, H =
hidden size, c = chunk (``trainer.logprob_chunk_tokens``), T_n = the
sampling temperature of token n's sample, W = lm_head weight [V, H].
  z_n    = (W h_n) / T_n                     logits at the sampling temperature [V]
  logp_n = z_n[y_n] - logsumexp(z_n)          log pi(y_n | context)
  H_n    = -sum_v pi_v log pi_v               entropy of pi at token n
The gradients of these through z (what the recompute in backward produces):
  d logp_n / d z_v = 1[v = y_n] - pi_v
  d H_n    / d z_v = -pi_v (log pi_v + H_n)
Each chunk of c tokens is computed on its own, inside torch.utils.checkpoint:
forward keeps only h (already held by the decoder's graph) and the two [c]
outputs, backward recomputes the chunk's [c, V] logits. Peak memory is a few
[c, V] fp32 tensors instead of a few [N, V]: at Qwen3's V = 151936 and N =
24k completion tokens, one [N, V] fp32 tensor is 14.6 GB; one [2048, V] is
1.2 GB.

The head is called as a module (``head(h)``), never as ``F.linear(h,
head.weight)``, so hooks a sharding installs on it (FSDP2 all-gathers its
parameters in a pre-forward hook) run on every chunk and on the recompute.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint


# ---------------------------------------------------------------------------
# Chunked log-probs and entropy


def _score_chunk(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                 fp32_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h [c, H], targets [c], temps [c] -> (logp [c], entropy [c]), fp32 (fp64 for an fp64 head)."""
    if fp32_head:
        # Outside autocast, in the head's own parameter dtype: an fp32 master
        # head gives fp32 logits (the engine's fp32_lm_head computes the same).
        with torch.autocast(h.device.type, enabled=False):
            logits = _at_least_fp32(head(h.to(_param_dtype(head))))  # [c, V]
    else:
        logits = _at_least_fp32(head(h))  # [c, V]
    logp = torch.log_softmax(logits / temps[:, None], -1)  # [c, V]
    lp = logp.gather(1, targets[:, None])[:, 0]  # [c]
    ent = -(logp.exp() * logp).sum(-1)  # [c]
    return lp, ent


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    # fp64 stays fp64 (exactness tests); bf16/fp16 logits become fp32.
    return x if x.dtype == torch.float64 else x.float()


def _param_dtype(module: torch.nn.Module) -> torch.dtype:
    p = next(module.parameters(), None)
    return torch.float32 if p is None or not p.dtype.is_floating_point else p.dtype


def chunked_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                     chunk: int, fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] (final hidden state at the positions predicting
    ``targets`` [N]), temps [N] -> (logp [N], entropy [N]) in fp32, ``chunk``
    tokens at a time. Both outputs carry gradients to ``hidden`` and the
    head's parameters; the caller detaches the entropy when it is a metric.

    fp32_head: run the head outside autocast in its parameters' dtype
    (bf16-mixed: fp32 master weights -> fp32 logits)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    # Without a graph to build (no_grad, a frozen reference model) there is
    # nothing to recompute: plain chunks bound the memory already.
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    lps, ents = [], []
    # split (not slicing in a loop): its backward concatenates the chunks'
    # gradients once instead of adding K zero-padded [N, H] tensors.
    for h, y, t in zip(hidden.split(chunk), targets.split(chunk), temps.split(chunk)):
        args = (head, h, y, t, fp32_head)
        lp, ent = checkpoint(_score_chunk, *args, use_reentrant=False) if recompute else _score_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:  # no completion token: keep the graph connected to nothing
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(ents)


# ---------------------------------------------------------------------------
# Forward rows and micro-batches


class PackedRow(NamedTuple):
    """One forward row: the token sequence and, per sample it scores,
    (sample index, completion start, completion length)."""

    tokens: np.ndarray
    spans: list[tuple[int, int, int]]


class MicroBatch(NamedTuple):
    """One forward + backward of a step: ``samples`` are indices into the
    step's samples (local sample j is ``samples[j]``), and the rows' spans
    index the local samples."""

    samples: list[int]
    rows: list[PackedRow]

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Bins of item indices, each summing to <= budget, longest items
    placed first, each into the first bin with room. An item longer than
    the budget gets a bin of its own (no bin has room for it)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = next((j for j, r in enumerate(room) if lengths[i] <= r), None)
        if b is None:
            bins.append([i])
            room.append(budget - lengths[i])
        else:
            bins[b].append(i)
            room[b] -= lengths[i]
    return bins


def budget_micro_batches(rows: list[PackedRow], budget: int) -> list[MicroBatch]:
    """Rows (spans indexing the step's samples) -> micro-batches of at most
    ``budget`` tokens (first-fit decreasing), spans re-indexed to each
    micro-batch's own samples. A sample's spans all sit in one row (one
    episode row, or its own), so every sample lands in exactly one
    micro-batch."""
    out = []
    for b in first_fit_decreasing([len(r.tokens) for r in rows], budget):
        idx = sorted(k for r in b for k, _, _ in rows[r].spans)
        local = {k: j for j, k in enumerate(idx)}
        out.append(MicroBatch(idx, [PackedRow(rows[r].tokens, [(local[k], s, n) for k, s, n in rows[r].spans])
                                    for r in b]))
    return out


class DecoderInputs(NamedTuple):
    kwargs: dict  # for model.base_model(**kwargs)
    ids: torch.Tensor  # [R * L] or [S]: the input ids, flat
    offsets: list[int]  # where row r starts in the flat hidden state


def padded_inputs(rows: list[PackedRow], device: torch.device) -> DecoderInputs:
    """Right-padded [R, L] rows with a 2D padding mask (one row per
    sequence; the padding costs compute and activations)."""
    L = max(len(r.tokens) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    attn = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.tokens)] = torch.from_numpy(r.tokens.astype("int64"))
        attn[i, : len(r.tokens)] = 1
    ids, attn = ids.to(device), attn.to(device)
    return DecoderInputs(dict(input_ids=ids, attention_mask=attn, use_cache=False), ids.reshape(-1),
                         [i * L for i in range(len(rows))])


def packed_inputs(rows: list[PackedRow], device: torch.device, attn_impl: str) -> DecoderInputs:
    """All rows concatenated into ONE sequence [1, S], S = sum of row
    lengths, no padding. ``position_ids`` restart at 0 for each row, which
    is how transformers (5.x, masking_utils.find_packed_sequence_indices)
    recognises packed sequences when attention_mask is None and there is no
    KV cache: sdpa/eager/flex then get a block-diagonal causal mask
    ([1, 1, S, S] bool for sdpa: S^2 bytes, 1 GiB at 32k), so attention never
    crosses rows. flash_attention_2/3 instead take the cumulative row
    lengths (cu_seq_lens, max_length) and run the varlen kernel: no mask at
    all; they are computed here once instead of per layer."""
    lens = [len(r.tokens) for r in rows]
    ids = torch.from_numpy(np.concatenate([r.tokens for r in rows]).astype("int64")).to(device)  # [S]
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)  # [S]
    offsets = np.concatenate([[0], np.cumsum(lens)]).tolist()
    kwargs = dict(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    if attn_impl.startswith("flash_attention"):
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    return DecoderInputs(kwargs, ids, offsets[:-1])
