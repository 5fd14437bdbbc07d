"""Inside an engine worker: what the model computes with, and an fp32 head.

Owns:
  * ``weight_digest``: per-checkpoint-tensor checksums of the weights the
    engine's kernels actually use, mapped back to checkpoint names, so a
    logprob mismatch can be split into "the engine holds other weights"
    (digests differ from ``tensor_digest`` of what the trainer sent) and
    "the kernels differ" (digests equal);
  * the fp32 lm_head (``actor.engine.fp32_lm_head``): logits from an fp32
    copy of ``lm_head.weight``, refreshed after every weight load.

Runs in the worker process (called from ``WeightReceiverExtension``). Must
not touch: groups, staging buffers, the engine loop.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Rows of the identity pushed through a linear kernel at once (weight_digest).
PROBE_ROWS = 1024


def tensor_digest(t: torch.Tensor) -> tuple[float, float, str]:
    """(float64 sum, float64 sum of squares, blake2b-64 of the bytes in
    row-major order): equal hashes = bitwise equal tensors."""
    import torch

    x = t.detach().contiguous()
    f = x.to(torch.float64)
    raw = x.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return float(f.sum()), float((f * f).sum()), hashlib.blake2b(raw, digest_size=8).hexdigest()


def _kernel_weight(module: torch.nn.Module) -> torch.Tensor:
    """The [out, in] weight a linear-like module's kernel multiplies by,
    read through the kernel itself: ``apply(I) = I @ W^T = W^T``, exact in
    any precision (each output is one product by 1 plus zeros). On CPU vLLM
    keeps linear weights only inside oneDNN / sgl-kernel packed copies
    (``layer.weight`` is emptied), and a stale packed copy is exactly what
    a digest must catch (see refresh_tied_heads)."""
    import torch

    weight = module._parameters["weight"]
    k = weight.shape[1] if weight.numel() else module.input_size_per_partition
    dtype = weight.dtype
    parts = []
    for start in range(0, k, PROBE_ROWS):
        eye = torch.zeros(min(PROBE_ROWS, k - start), k, dtype=dtype, device=weight.device)
        eye[:, start:start + eye.shape[0]].fill_diagonal_(1)
        out = module.quant_method.apply(module, eye, bias=None)
        parts.append(out.to(dtype))
    return torch.cat(parts).t().contiguous()


def _split_names(model: torch.nn.Module, module_name: str, module: torch.nn.Module, pname: str):
    """Checkpoint names and row counts of a fused parameter (qkv_proj,
    gate_up_proj), from the model's ``packed_modules_mapping``; one part
    otherwise. Single-rank engines only: a tensor-parallel shard holds a
    slice of each part."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = getattr(model, "packed_modules_mapping", {}).get(leaf)
    sizes = getattr(module, "output_sizes", None)
    if not parts or not sizes or len(parts) != len(sizes):
        return [(f"{module_name}.{pname}", None)]
    return [(f"{prefix}.{p}.{pname}" if prefix else f"{p}.{pname}", n) for p, n in zip(parts, sizes)]


def weight_digest(model: torch.nn.Module) -> dict[str, tuple[float, float, str]]:
    """checkpoint name -> ``tensor_digest`` of the engine's weight, in the
    checkpoint's layout: fused parameters split back into their parts,
    vocab padding cut off (rows past the checkpoint's vocab are never
    served), linear weights read through their kernels. A tied lm_head is
    reported as ``lm_head.weight`` too (its kernel may hold its own copy)."""
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    out: dict[str, tuple[float, float, str]] = {}
    with torch.no_grad():
        for mname, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            for pname, param in module._parameters.items():
                if param is None:
                    continue
                tensor = param
                if pname == "weight" and (isinstance(method, UnquantizedLinearMethod)
                                          or isinstance(module, ParallelLMHead)
                                          and isinstance(method, UnquantizedEmbeddingMethod)):
                    tensor = _kernel_weight(module)
                org = getattr(module, "org_vocab_size", None)
                if org is not None and pname == "weight":
                    tensor = tensor[:org]  # padded vocab rows
                names = _split_names(model, mname, module, pname)
                if len(names) == 1:
                    out[names[0][0]] = tensor_digest(tensor)
                    continue
                start = 0
                for name, rows in names:
                    out[name] = tensor_digest(tensor[start:start + rows])
                    start += rows
    return out


# --------------------------------------------------------------------------
# fp32 lm_head


@functools.cache
def _fp32_head_class():
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    class Fp32HeadMethod(UnquantizedEmbeddingMethod):
        """Wraps the lm_head's quant method: ``apply`` (the logits; vLLM's
        LogitsProcessor calls ``lm_head.quant_method.apply``) multiplies
        fp32 hidden states by an fp32 copy of the weight; everything else
        (embedding lookups of a tied head, post-processing) is the wrapped
        method's. The copy is refreshed *in place* so any graph that captured
        its storage sees new weights."""

        def __init__(self, inner):
            self.inner = inner
            self.weight32 = None

        def refresh(self, layer) -> None:
            import torch

            w = layer.weight.detach()
            if self.weight32 is None or self.weight32.shape != w.shape:
                self.weight32 = torch.empty(w.shape, dtype=torch.float32, device=w.device)
            self.weight32.copy_(w)

        def create_weights(self, *args, **kwargs):
            return self.inner.create_weights(*args, **kwargs)

        def process_weights_after_loading(self, layer) -> None:
            self.inner.process_weights_after_loading(layer)

        def embedding(self, layer, input_):
            return self.inner.embedding(layer, input_)

        def apply(self, layer, x, bias=None):
            import torch.nn.functional as F

            return F.linear(x.float(), self.weight32, None if bias is None else bias.float())

    return Fp32HeadMethod


def _lm_head(model: torch.nn.Module):
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "quant_method", None) is None:
        raise RuntimeError(f"{type(model).__name__} has no lm_head with a quant method: cannot compute it in fp32")
    return head


def set_fp32_head(model: torch.nn.Module, enable: bool) -> bool:
    """Install (or remove) the fp32 head; returns whether it is installed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    head = _lm_head(model)
    cls = _fp32_head_class()
    method = head.quant_method
    installed = isinstance(method, cls)
    if enable and not installed:
        if type(method) is not UnquantizedEmbeddingMethod:
            raise RuntimeError(f"fp32_lm_head: lm_head uses {type(method).__name__}, only an unquantized head is supported")
        head.quant_method = wrapper = cls(method)
        wrapper.refresh(head)
    elif not enable and installed:
        head.quant_method = method.inner
    return enable


def refresh_fp32_head(model: torch.nn.Module) -> bool:
    """After a weight load: copy the (possibly tied) head weight into the fp32
    copy. No-op without an fp32 head."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if not isinstance(method, _fp32_head_class()):
        return False
    method.refresh(head)
    return True
