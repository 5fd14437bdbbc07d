"""Packed variable-length attention from PyTorch itself (``trainer.attention
= "varlen"``): one concatenated sequence per micro-batch, attention kept
inside each row, no padding, no mask, and no ``flash_attn`` wheel.

A micro-batch of R rows of lengths n_1..n_R runs as ONE sequence of S =
sum n_r tokens with cu = [0, n_1, n_1 + n_2, ..., S] (scoring.packed_inputs
builds it, with position ids restarting at 0 per row). For a query at flat
position i in row r (cu_r <= i < cu_{r+1}):

    out_i = sum_{j = cu_r}^{i} softmax_j(q_i . k_j * scale) v_j

i.e. causal attention within the row and nothing across rows: exactly what
the row alone, right-padded or unpadded, computes for its real tokens.

  cuda: ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's FlashAttention
        varlen kernel, torch >= 2.9), causal through ``window_size = (-1, 0)``
        (torch 2.11+) or ``is_causal`` (2.9/2.10, by signature). It takes
        fp16/bf16 only: q/k are cast to v's dtype, the autocast dtype
        (Qwen3's q/k norms hand fp32 to the kernel under bf16 autocast).
        Key/value heads are repeated to the query heads where the signature
        has no ``enable_gqa``.
  cpu:  one ``scaled_dot_product_attention(is_causal=True)`` per row slice:
        the same arithmetic as the padded layout's kernel on the real
        tokens, so the layouts agree exactly in fp32 (tests/test_trainer_kernels.py).

Registered with transformers' AttentionInterface under ``VARLEN`` (and
flash attention's mask function, which builds no [S, S] mask), so
``from_pretrained(attn_implementation=VARLEN)`` routes every decoder
layer's attention here; the cumulative lengths arrive as the
``cu_seq_lens_q`` / ``max_length_q`` keyword arguments of the model call.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

VARLEN = "rlnode_varlen"
# varlen_attn's causal keyword arguments for the installed torch (register()).
_CUDA_KWARGS: dict | None = None


def _cuda_varlen_kwargs(fn) -> dict:
    """The keyword arguments that make ``varlen_attn`` causal (and GQA-aware)
    in the installed torch."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        raise RuntimeError('trainer.attention = "varlen": this torch\'s varlen_attn takes neither window_size '
                           'nor is_causal; use trainer.attention = "sdpa"')
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, Hq, S, D],
    key/value [1, Hk, S, D] -> ([1, S, Hq, D], None)."""
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN} needs cu_seq_lens_q / max_length_q in the model call (scoring.packed_inputs)")
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN} takes one packed sequence [1, S], got a batch of {query.shape[0]}")
    if sliding_window is not None:
        raise ValueError(f"{VARLEN} has no sliding-window attention (the model sets sliding_window={sliding_window}): "
                         'set trainer.attention = "sdpa"')
    if dropout:
        raise ValueError(f"{VARLEN} runs without attention dropout; the model's is {dropout}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [S, H, D]
    if q.device.type == "cuda":
        return _cuda(q, k, v, cu_seq_lens_q, int(max_length_q), scaling)[None], None
    return _per_row(q, k, v, cu_seq_lens_q, scaling)[None], None


def _cuda(q, k, v, cu, max_len: int, scale: float | None) -> torch.Tensor:
    # Compile-friendly (trainer.compile traces this): the signature was read
    # at register(), and the compute dtype is v's (v_proj's output: the
    # autocast dtype; q and k leave Qwen3's norms in fp32).
    from torch.nn.attention.varlen import varlen_attn

    kwargs = _CUDA_KWARGS if _CUDA_KWARGS is not None else _cuda_varlen_kwargs(varlen_attn)
    dtype = v.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f'trainer.attention = "varlen" on cuda takes fp16/bf16 inputs, got {dtype}: '
                         'set trainer.precision = "bf16-mixed" or "bf16", or trainer.attention = "sdpa"')
    q, k = q.to(dtype), k.to(dtype)
    if "enable_gqa" not in kwargs and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu = cu.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **kwargs)


def _per_row(q, k, v, cu, scale: float | None) -> torch.Tensor:
    """cpu: causal SDPA on each row's slice, concatenated back."""
    out = []
    gqa = k.shape[1] != q.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        out.append(o[0].transpose(0, 1))  # [n, Hq, D]
    return torch.cat(out)


def is_varlen(attn_impl: str) -> bool:
    """transformers attn_implementations that take one packed sequence with
    cumulative row lengths (scoring.packed_inputs)."""
    return attn_impl.startswith("flash_attention") or attn_impl == VARLEN


def register() -> str:
    """Make ``VARLEN`` an attn_implementation transformers accepts (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    global _CUDA_KWARGS
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9: the cpu path still runs; cuda fails at the first call
        pass
    else:
        _CUDA_KWARGS = _cuda_varlen_kwargs(varlen_attn)

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
    return VARLEN
