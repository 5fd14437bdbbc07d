"""LoRA matrix products for vLLM's CPU engines, grouped by adapter.

vLLM's CPU LoRA path (``PunicaWrapperCPU``) runs its pure-torch reference
ops (``vllm.lora.ops.torch_ops``), whose ``bgmv_*`` gather a copy of the
adapter's matrix for every token, ``weights[indices]`` (tokens x out x
rank), then contract it with an einsum. In a prefill of thousands of tokens
that copy is gigabytes per layer: a LoRA run of SmolLM2-135M on 2 cores
spent its engine steps there (py-spy: ``bgmv_expand_slice``), its weight
pushes waited 10-17 s for a step to end, and a 20-step recipe would have
taken an hour. The same products grouped by adapter (one matmul per adapter
present in the batch, usually one or two) compute the same sums without the
copies.

``install`` puts the grouped ops where ``PunicaWrapperCPU`` and the
``sgmv_*`` wrappers look them up; it is called in the engine's worker
process (rlnode.weights.worker) and changes nothing on GPUs, whose punica
wrapper runs Triton kernels. Same signatures and the same results, up to the
summation order of float products (tests/test_lora_updates.py compares them
with vLLM's own on mixed batches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_ORIGINAL: dict[str, object] = {}


def _products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor | None:
    """rows t: ``weights[indices[t]] @ inputs[t]`` (weights: adapters x
    [1 x] out x in), one matmul per adapter in ``indices``; None when the
    shapes are not the per-token case (the reference op handles those)."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    if w.dim() != 3 or inputs.dim() != 2 or indices.dim() != 1 or indices.shape[0] != inputs.shape[0]:
        return None
    x = inputs.to(dtype)
    adapters = indices.unique()
    if adapters.numel() == 1:  # the usual batch: one adapter (or none, index -1) for every token
        return x @ w[int(adapters[0])].to(dtype).T
    out = x.new_empty(x.shape[0], w.shape[1])
    for a in adapters.tolist():  # Python's indexing, as the reference's: -1 is the last slot
        rows = indices == a
        out[rows] = x[rows] @ w[a].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _ORIGINAL["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None or (outputs.shape[0] == 1 and output_tensor.shape[0] != 1):
        return _ORIGINAL["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:, :common]
    else:
        output_tensor[:, :common] = outputs[:, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if outputs is None:
        return _ORIGINAL["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                              slice_offset, slice_size, add_inputs)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


def install() -> bool:
    """The grouped ops in place of vLLM's reference ``bgmv_*``, where its
    CPU punica wrapper and ``sgmv_*`` find them; False when this vLLM has
    no such ops (nothing changed)."""
    try:
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    names = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    if not all(hasattr(lora_ops, n) and hasattr(punica_cpu, n) for n in names):
        return False
    for name in names:
        _ORIGINAL.setdefault(name, getattr(lora_ops, name))
        for module in (lora_ops, punica_cpu):
            setattr(module, name, globals()[name])
    return True
