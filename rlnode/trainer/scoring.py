"""Scoring math and layout: token log-probs and entropy without [N, V]
tensors, and micro-batches packed to a token budget.

Owns: (1) the chunked log-softmax over the vocabulary, (2) turning forward
rows into micro-batches and one micro-batch into decoder inputs. No model
loading, optimizer or loss: the Learner calls these.

Two layouts of a token-budget micro-batch, by attention kernel:
  varlen (flash_attention_2, PyTorch's varlen: attention.py): rows
    bin-packed and concatenated into ONE sequence [1, S] with cumulative
    row lengths; no padding, no mask.
  padded (sdpa, eager): rows of similar length right-padded to [R, L],
    R * L <= budget, and NO attention mask. Causal attention alone is exact
    for the real tokens: a real token at j attends to positions <= j, all
    real (the padding sits after the row's last token); padded positions
    are never scored. A packed [1, S] sequence would instead need a
    block-diagonal [S, S] mask there (transformers builds one from
    restarting position ids: 1 GiB at S = 32k) and full S x S attention.

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
                 fp32_head: bool, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
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
    # A metric-only entropy builds no graph: its saved [c, V] tensors would
    # outlive the chunk's backward (never unpacked, the recompute keeps them
    # to the end of backward): 2 [c, V] fp32 per chunk, i.e. [N, V] again.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(logp.exp() * logp).sum(-1)  # [c]
    return lp, ent


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    # fp64 stays fp64 (exactness tests); bf16/fp16 logits become fp32.
    return x if x.dtype == torch.float64 else x.float()


def _param_dtype(module: torch.nn.Module) -> torch.dtype:
    p = next(module.parameters(), None)
    return torch.float32 if p is None or not p.dtype.is_floating_point else p.dtype


def chunked_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                     chunk: int, fp32_head: bool = False,
                     entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] (final hidden state at the positions predicting
    ``targets`` [N]), temps [N] -> (logp [N], entropy [N]) in fp32, ``chunk``
    tokens at a time. Both outputs carry gradients to ``hidden`` and the
    head's parameters, the entropy only with ``entropy_grad`` (False: a
    metric, computed without a graph).

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
        args = (head, h, y, t, fp32_head, entropy_grad)
        lp, ent = checkpoint(_score_chunk, *args, use_reentrant=False) if recompute else _score_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:  # no completion token: keep the graph connected to nothing
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(lps), torch.cat(ents)


# ---------------------------------------------------------------------------
# The fused head (trainer.logprob_head = "fused")
#
# Every term of policy_loss but gspo's sequence ratio reads only its own
# token, so the loss's per-token gradients
#   g_n = dL/dlogp_n,  e_n = dL/dH_n
# are known as soon as chunk c's logp and H are. Each chunk's backward then
# runs right after its forward, with its logits still in hand:
#   dL/dz_n = (g_n (onehot(y_n) - pi_n) - e_n pi_n (log pi_n + H_n)) / T_n     [V]
#   dL/dh_n = W^T dL/dz_n                                                      [H]
#   dL/dW  += sum_n dL/dz_n h_n^T                                              [V, H]
# (z_n = W h_n, the raw logits; pi_n = softmax(z_n / T_n)). The head costs
# 6 N H V FLOPs instead of the checkpointed chunks' 8 (forward, recompute,
# two backward products), no [c, V] tensor outlives its chunk, and the
# autograd backward only scales the stored dL/dh and dL/dW by the incoming
# gradient (1 for the loss).


class TokenLoss(NamedTuple):
    """What the fused head needs from the loss for tokens [a, b) of the flat
    order: ``fn(lp, ent, a, b) -> (loss, metrics)``, lp/ent [b - a] leaves
    to differentiate, loss a scalar (this chunk's share of the step's),
    metrics a policy_loss figures dict; ``entropy_grad``: the loss reads H."""

    fn: object
    entropy_grad: bool


class FusedHeadLoss(torch.autograd.Function):
    """(hidden [N, H], weight = head.weight) -> (loss, logp [N], entropy [N]),
    logp/entropy without gradient (figures). The chunks' metrics land in
    ``metrics`` (a list the caller passes)."""

    @staticmethod
    def forward(ctx, hidden, weight, head, targets, temps, chunk, fp32_head, token_loss, metrics):
        grad_h = torch.empty_like(hidden, dtype=torch.float32)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        total = hidden.new_zeros((), dtype=torch.float32)
        lps, ents = [], []
        # The backward products in the forward's precision: fp32, or the
        # autocast dtype as autocast's own backward would run them.
        mixed = not fp32_head and torch.is_autocast_enabled(hidden.device.type)
        w = weight.to(torch.get_autocast_dtype(hidden.device.type)) if mixed else weight
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            h, y, t = hidden[a:b], targets[a:b], temps[a:b, None]
            if fp32_head:
                with torch.autocast(h.device.type, enabled=False):
                    z = _at_least_fp32(head(h.to(weight.dtype)))  # [c, V]
            else:
                z = _at_least_fp32(head(h))  # [c, V]: under autocast, bf16 products
            logp = torch.log_softmax(z / t, -1)  # [c, V]
            del z
            p = logp.exp()
            lp = logp.gather(1, y[:, None])[:, 0]  # [c]
            ent = -(p * logp).sum(-1)  # [c]
            with torch.enable_grad():
                lp_leaf, ent_leaf = lp.detach().requires_grad_(), ent.detach().requires_grad_()
                loss, figures = token_loss.fn(lp_leaf, ent_leaf, a, b)
                g, e = torch.autograd.grad(loss, (lp_leaf, ent_leaf), allow_unused=True)
            g = torch.zeros_like(lp) if g is None else g
            total += loss.detach()
            metrics.append(figures)
            # dL/dz (formula above) = -pi (g + e (log pi + H)) + g onehot(y),
            # built in place of logp and p: [c, V]
            if e is not None and token_loss.entropy_grad:
                coef = logp.add_(ent[:, None]).mul_(e[:, None]).add_(g[:, None])
            else:
                coef = g[:, None]
            dz = p.mul_(coef).neg_()
            dz[torch.arange(b - a, device=dz.device), y] += g  # + g onehot(y)
            dz.div_(t)
            dzc = dz.to(w.dtype)
            grad_h[a:b] = dzc @ w
            if grad_w is not None:
                grad_w.addmm_(dzc.t(), h.to(w.dtype)) if w.dtype == torch.float32 else \
                    grad_w.add_((dzc.t() @ h.to(w.dtype)).float())
            del dz, dzc, logp, p
            lps.append(lp)
            ents.append(ent)
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.has_w, ctx.h_dtype, ctx.w_dtype = grad_w is not None, hidden.dtype, weight.dtype
        out_lp = torch.cat(lps) if lps else hidden.new_zeros(0, dtype=torch.float32)
        out_ent = torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32)
        ctx.mark_non_differentiable(out_lp, out_ent)
        return total, out_lp, out_ent

    @staticmethod
    def backward(ctx, g_loss, _g_lp, _g_ent):
        # In place: the saved gradients are used once (no double backward),
        # and a second [V, H] fp32 tensor would add to backward's peak.
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h.mul_(g_loss).to(ctx.h_dtype)
        gw = grad_w.mul_(g_loss).to(ctx.w_dtype) if ctx.has_w else None
        return gh, gw, None, None, None, None, None, None, None


def fused_head_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                    chunk: int, token_loss: TokenLoss,
                    fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[dict]]:
    """hidden [N, H] (final hidden state at the positions predicting
    ``targets`` [N]) -> (loss carrying the gradient to hidden and the head
    weight, logp [N], entropy [N], the chunks' loss figures). The head must
    be one weight matrix without bias (an lm head)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if getattr(head, "bias", None) is not None:
        raise ValueError("the fused head takes an lm head without bias")
    metrics: list[dict] = []
    loss, lp, ent = FusedHeadLoss.apply(hidden, head.weight, head, targets, temps, chunk, fp32_head, token_loss,
                                        metrics)
    return loss, lp, ent, metrics


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
        """Real tokens: what the varlen layout runs."""
        return sum(len(r.tokens) for r in self.rows)

    @property
    def padded_tokens(self) -> int:
        """Token slots of the padded layout: R rows x the longest row."""
        return len(self.rows) * max((len(r.tokens) for r in self.rows), default=0)


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


# Padded layout: a row shorter than this fraction of its micro-batch's
# longest row starts a new micro-batch instead, so padding is under half of
# every micro-batch's token slots. The price is at most log2(longest /
# shortest) extra, smaller micro-batches a step; it binds only where the
# lengths are sparse (with many rows, neighbours in length order are close).
MIN_ROW_FILL = 0.5


def length_buckets(lengths: list[int], budget: int, min_fill: float = MIN_ROW_FILL) -> list[list[int]]:
    """Bins of item indices for right-padded rows: items in decreasing
    length order, each joining the current bin while (its items + 1) x the
    bin's longest <= budget and it is at least ``min_fill`` x that longest,
    else opening a new bin. An item longer than the budget is alone."""
    bins: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if bins and (len(bins[-1]) + 1) * longest <= budget and lengths[i] >= min_fill * longest:
            bins[-1].append(i)
        else:
            bins.append([i])
            longest = lengths[i]
    return bins


def _micro_batch(rows: list[PackedRow], members: list[int]) -> MicroBatch:
    """Rows ``members`` as one micro-batch, spans re-indexed to its own
    samples. A sample's spans all sit in one row (one episode row, or its
    own), so every sample lands in exactly one micro-batch."""
    idx = sorted(k for r in members for k, _, _ in rows[r].spans)
    local = {k: j for j, k in enumerate(idx)}
    return MicroBatch(idx, [PackedRow(rows[r].tokens, [(local[k], s, n) for k, s, n in rows[r].spans])
                            for r in members])


def budget_micro_batches(rows: list[PackedRow], budget: int) -> list[MicroBatch]:
    """Varlen layout: rows (spans indexing the step's samples) ->
    micro-batches of at most ``budget`` real tokens (first-fit decreasing),
    each run as one concatenated sequence (``packed_inputs``)."""
    return [_micro_batch(rows, b) for b in first_fit_decreasing([len(r.tokens) for r in rows], budget)]


def bucket_micro_batches(rows: list[PackedRow], budget: int) -> list[MicroBatch]:
    """Padded layout: rows -> micro-batches of rows of similar length
    (``length_buckets``), each at most ``budget`` token slots once
    right-padded (``padded_inputs``)."""
    return [_micro_batch(rows, b) for b in length_buckets([len(r.tokens) for r in rows], budget)]


class DecoderInputs(NamedTuple):
    kwargs: dict  # for model.base_model(**kwargs)
    ids: torch.Tensor  # [R * L] or [S]: the input ids, flat
    offsets: list[int]  # where row r starts in the flat hidden state


def padded_inputs(rows: list[PackedRow], device: torch.device) -> DecoderInputs:
    """Right-padded [R, L] rows, L = the longest, with NO attention mask.
    Causal attention alone is exact for the real tokens (module
    docstring), and without a mask transformers' sdpa path builds none and
    calls the kernel with is_causal=True (masking_utils._ignore_causal_mask_sdpa,
    integrations/sdpa_attention.py; eager still builds its causal
    [R, 1, L, L] from the shape). The padding costs compute and
    activations; its positions are never scored."""
    L = max(len(r.tokens) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)  # [R, L]; the pad id 0 is never scored
    for i, r in enumerate(rows):
        ids[i, : len(r.tokens)] = torch.from_numpy(r.tokens.astype("int64"))
    ids = ids.to(device)
    return DecoderInputs(dict(input_ids=ids, use_cache=False), ids.reshape(-1), [i * L for i in range(len(rows))])


def packed_inputs(rows: list[PackedRow], device: torch.device, attn_impl: str) -> DecoderInputs:
    """All rows concatenated into ONE sequence [1, S], S = sum of row
    lengths, no padding, for a varlen kernel (flash_attention_*, or
    PyTorch's own: attention.py): it takes the cumulative row lengths
    (cu_seq_lens, max_length), computed here once instead of per layer, and
    keeps attention inside each row with no mask. ``position_ids`` restart
    at 0 for each row. Any other kernel
    would get a block-diagonal [1, 1, S, S] mask from transformers
    (masking_utils.find_packed_sequence_indices) and full S x S attention:
    refused (use ``padded_inputs``)."""
    from rlnode.trainer.attention import is_varlen

    if not is_varlen(attn_impl):
        raise ValueError(f"packed_inputs needs a varlen attention kernel, got {attn_impl!r}: use padded_inputs")
    lens = [len(r.tokens) for r in rows]
    ids = torch.from_numpy(np.concatenate([r.tokens for r in rows]).astype("int64")).to(device)  # [S]
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)  # [S]
    offsets = np.concatenate([[0], np.cumsum(lens)]).tolist()
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)  # [R + 1]
    kwargs = dict(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    return DecoderInputs(kwargs, ids, offsets[:-1])
