"""The scoring math and layout (rlnode/trainer/scoring.py) on their own:
chunked log-probs/entropy against the one-shot [N, V] formulas, the memory
they hold, and the token-budget bin packing."""

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlnode.trainer.scoring import PackedRow, budget_micro_batches, chunked_logprobs, first_fit_decreasing


def full_logprobs(head, hidden, targets, temps):
    """The unchunked reference: one [N, V] log-softmax."""
    logits = head(hidden)  # [N, V]
    logits = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(logits / temps[:, None], -1)  # [N, V]
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def problem(N=23, H=16, V=997, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.5)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    temps = torch.tensor([1.0, 0.6, 1.3], dtype=dtype)[torch.arange(N) % 3]
    # Weights of a loss on both outputs.
    a, b = torch.randn(N, generator=g, dtype=dtype), torch.randn(N, generator=g, dtype=dtype)
    return head, hidden, targets, temps, a, b


def grads(fn, head, hidden, targets, temps, a, b, entropy_coef):
    h = hidden.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    lp, ent = fn(head, h, targets, temps)
    ((a * lp).sum() - entropy_coef * (b * ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, head.weight.grad.clone()


def test_chunked_equals_unchunked_values_and_gradients():
    # fp64: the same math, so 1e-6 is far above rounding and any real
    # difference (a missing term, a wrong chunk boundary) shows. fp32: the
    # chunks' GEMMs round differently from one GEMM, by a few ulps.
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 2e-5)):
        head, hidden, targets, temps, a, b = problem(dtype=dtype)
        for coef in (0.0, 0.3):
            ref = grads(full_logprobs, head, hidden, targets, temps, a, b, coef)
            for chunk in (1, 5, 7, 23, 4096):  # 5 and 7 do not divide N = 23
                got = grads(lambda *x: chunked_logprobs(*x, chunk=chunk), head, hidden, targets, temps, a, b, coef)
                for name, r, g in zip(("logp", "entropy", "d hidden", "d W"), ref, got):
                    assert (r - g).abs().max() < tol, (dtype, coef, chunk, name, (r - g).abs().max())
    # The entropy gradient is real (not silently detached): it changes d hidden.
    assert (grads(full_logprobs, head, hidden, targets, temps, a, b, 0.3)[2]
            - grads(full_logprobs, head, hidden, targets, temps, a, b, 0.0)[2]).abs().max() > 1e-3


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op outputs (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_memory_is_bounded_by_the_chunk_not_the_tokens():
    # A large fake vocabulary: one [N, V] fp32 tensor is 64 * 50000 * 4 =
    # 12.8 MB, one [8, V] chunk 1.6 MB.
    N, V, chunk = 64, 50_000, 8
    head, hidden, targets, temps, a, b = problem(N=N, H=8, V=V)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    def run(fn):
        saved.clear()
        h = hidden.clone().requires_grad_(True)
        with LargestTensor() as mode:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                lp, ent = fn(head, h, targets, temps)
            (lp.sum() + ent.sum()).backward()
        return mode.numel, max(saved)

    largest, kept = run(lambda *x: chunked_logprobs(*x, chunk=chunk))
    # Nothing of size N * V ever exists, in forward, backward or the graph;
    # autograd keeps only [chunk, H]-sized inputs between forward and backward.
    assert largest <= chunk * V < N * V
    assert kept <= max(N * 8, V * 8)  # hidden [N, H] or the head weight [V, H]
    full_largest, full_kept = run(full_logprobs)
    assert full_largest >= N * V and full_kept >= N * V  # the test can see [N, V]


def test_first_fit_decreasing_respects_the_budget():
    lengths = [5, 9, 3, 30, 7, 7, 2, 10]
    bins = first_fit_decreasing(lengths, 12)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [3] in bins  # longer than the budget: alone
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins if b != [3])
    assert len(bins) == 1 + 4  # 43 tokens in bins of 12 need 4, FFD finds it: 10+2, 9+3, 7+5, 7


def test_budget_micro_batches_reindex_spans_to_local_samples():
    rows = [PackedRow(np.arange(8), [(0, 3, 2), (2, 6, 2)]),  # a 2-call episode: samples 0 and 2
            PackedRow(np.arange(4), [(1, 2, 2)]),
            PackedRow(np.arange(20), [(3, 10, 10)])]  # over budget
    mbs = budget_micro_batches(rows, 12)
    assert [mb.samples for mb in mbs] == [[3], [0, 1, 2]]
    assert mbs[1].tokens == 12
    assert sorted(s for r in mbs[1].rows for s in r.spans) == [(0, 3, 2), (1, 2, 2), (2, 6, 2)]
    assert mbs[0].rows[0].spans == [(0, 10, 10)]


_RSS_SCRIPT = """
import resource, sys, torch
from rlnode.trainer.scoring import chunked_logprobs
torch.set_num_threads(1)
N, c, V, H = 1024, 128, 32768, 16
head = torch.nn.Linear(H, V, bias=False)
hidden = torch.randn(N, H, requires_grad=True)
y, temps = torch.randint(0, V, (N,)), torch.ones(N)
# Warm-up (the buffers a first GEMM allocates stay in the baseline), then
# reset the process's peak RSS (VmHWM) to its current RSS.
w = chunked_logprobs(head, hidden[:c], y[:c], temps[:c], c)
(w[0].sum() + w[1].sum()).backward()
del w
hidden.grad = head.weight.grad = None
open("/proc/self/clear_refs", "w").write("5")
base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
lp, ent = chunked_logprobs(head, hidden, y, temps, c, entropy_grad=sys.argv[1] == "1")
lp.sum().backward()  # the entropy is a metric: not in the loss
hwm = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM"))
print((hwm - base) / (c * V * 4))
"""


def test_a_metric_entropy_keeps_memory_bounded_by_the_chunk():
    # Peak RSS of a fresh process in [chunk, V] fp32 units; a fixed mmap
    # threshold makes glibc map (and unmap on free) every tensor, so RSS
    # follows what is alive (its default threshold rises to 32 MB after the
    # first free and keeps freed blocks in the heap). With a graph, the
    # entropy's saved tensors are never unpacked in backward and the
    # recompute keeps them to its end: ~2 per chunk, 8 chunks here.
    import os
    import subprocess
    import sys

    def units(entropy_grad: bool) -> float:
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, "1" if entropy_grad else "0"], check=True,
                             capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        return float(out.stdout.split()[-1])

    assert units(False) < 6  # ~4: a chunk's logits, log-softmax, exp and a gradient
    assert units(True) > 12  # ~18: what the Learner paid before entropy_grad reached the chunks
