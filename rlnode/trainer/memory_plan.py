"""Trainer memory plan: will this config fit on this device, computed from
the model's config.json and the trainer config before any weight is loaded.

Owns: the arithmetic of the trainer's device memory per rank, the verdict
against a device's free bytes, and the message that says what to change.
Must not import torch at module import (``rlnode check`` and config-time
callers run it without one) and must not load weights: ``check_learner_memory``
imports torch only to ask the device how much is free.

What rlnode keeps per parameter (learner.py, parallel.py), in bytes:

  precision    weights the     fp32 master   grads   AdamW exp_avg   foreach AdamW
               forward reads                          + exp_avg_sq    temporaries
  fp32         4               -             4       4 + 4           4
  bf16-mixed   2 (autocast     4             4       4 + 4           4
               copies)
  bf16         2               -             2       2 + 2           2

With ``trainer.lora.rank`` > 0 the base is frozen in the same dtype (no
gradients, no AdamW state, no fp32 copy beyond what the precision keeps)
and the KL reference is the base with the adapter off (no second model).
Only the adapter trains: r * (in + out) parameters per target projection
per layer (``ModelShape.adapter_params``), fp32 whatever the precision
(peft upcasts a bf16 base's adapter), each with its fp32 gradient and two
fp32 AdamW moments: 16 B per adapter parameter. Its activations are the
full run's (gradients flow through every layer to reach the adapters),
plus each target's dropped-out input when ``trainer.lora.dropout`` > 0.

torch's AdamW allocates its state ``zeros_like(param)``, so the state dtype
is the parameters' (trainer.precision). "bf16-mixed" keeps no bf16 copy of
its own: autocast casts each decoder linear weight once per forward and
keeps the copy (its cache, and autograd saves it) until backward. foreach
AdamW (``_multi_tensor_adam``) materialises ``sqrt(exp_avg_sq)`` for every
parameter at once: one more state-sized tensor per parameter at each step;
fused AdamW (``_fused_adamw_``) updates in place; the per-tensor loop (torch's
CPU default) holds two temporaries of the largest parameter.

Per token of one micro-batch, per decoder layer, autograd keeps (H hidden,
I intermediate, q = heads * head_dim, k = kv_heads * head_dim; b = parameter
bytes, c = compute bytes; counted from what each op saves, and checked
against autograd's saved tensors in tests/test_memory_plan.py):

  bf16-mixed:  26 H + 6 (q + k) [qk-norm] + 6 q + 4 k + 8 I   (fp32 residual
               stream; autocast casts the fp32 norm output once per consumer:
               q, k, v, gate, up)
  fp32, bf16:  2 (4 + 2b) H + (4 + b)(q + k) [qk-norm] + b (3q + 2k) + 4 b I

Activation checkpointing keeps only each checkpointed layer's input (b H per
token; 4 H under bf16-mixed) and recomputes one layer at a time in backward;
with c of the L layers checkpointed (``trainer.activation_checkpointing =
"auto"``: the fewest that fit, ``checkpoint_layers``) the others keep their
activations, and under bf16-mixed their autocast copies, into backward.

The head (scoring.py) runs ``logprob_chunk_tokens`` tokens at a time: a chunk's
forward holds 3 fp32 [chunk, vocab] tensors, its recompute + backward 5
(measured on CPU with the real chunked_logprobs: 4.0 with the entropy as a
metric, 5.0 with it in the loss).

Phases (the peak is the largest; steady state: a second micro-batch or a
later step, so gradients and AdamW state exist throughout):
  load       the policy in its parameter dtype, whole on every rank (FSDP
             shards it after loading), and the reference model;
  forward    weights + grads + state + compute copies + saved activations +
             a chunk's forward (with checkpointing: the autocast copies are
             freed when the forward's autocast region ends);
  backward   the same + a chunk's backward (no checkpointing), or the layer
             inputs + max(a chunk's backward, one layer recomputed);
  optimizer  weights + grads + state + AdamW temporaries.
The reserve (RESERVE_FIXED + RESERVE_FRACTION of the peak) covers the
caching allocator's fragmentation and cuBLAS/NCCL workspaces; the device's
free bytes (``torch.cuda.mem_get_info``) already exclude the CUDA context
and anything another process (a vLLM engine on the same GPU) holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from rlnode.config import Config, ConfigError, fused_head_blocker

GiB = 1 << 30
# Allocator fragmentation and library workspaces on top of the predicted
# peak of allocated bytes: reserved - allocated is typically a few percent
# of the peak in a training loop whose tensor sizes repeat.
RESERVE_FIXED = 1 * GiB
RESERVE_FRACTION = 0.05
# fp32 [chunk, vocab] tensors alive in a scoring chunk's forward and in its
# recompute + backward (module docstring).
HEAD_FORWARD_TENSORS = 3
HEAD_BACKWARD_TENSORS = 5
# FSDP2 (parallel.py): decoder layers gathered at once (the current one and
# the prefetched next) while the rest stay sharded.
FSDP_GATHERED_LAYERS = 2
# Model types whose layers this module counts exactly; others are counted
# as a llama-style dense decoder from the same config.json keys.
KNOWN_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PRECISION_BYTES = {"fp32": 4, "bf16-mixed": 4, "bf16": 2}  # parameters, grads, AdamW state
COMPUTE_BYTES = {"fp32": 4, "bf16-mixed": 2, "bf16": 2}  # what the matmuls read and write

AdamWImpl = Literal["fused", "foreach", "for_loop"]


class UnsupportedModel(ValueError):
    """config.json describes a model this plan cannot count (MoE, missing keys)."""


class DoesNotFit(ConfigError):
    """The plan's peak exceeds the device: the message is ``MemoryPlan.describe()``."""


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """The numbers of a dense decoder-only config.json that set its memory."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # q/k/v projections carry a bias (qwen2; attention_bias elsewhere)
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # an RMSNorm over head_dim on q and k (qwen3)

    @classmethod
    def from_config(cls, d: dict) -> ModelShape:
        d = d.get("text_config", d)  # multimodal wrappers keep the decoder's keys there
        if any(d.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise UnsupportedModel(f"model_type {d.get('model_type')!r} is a mixture of experts: not modelled")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            kind = str(d.get("model_type", ""))
            attn_bias = bool(d.get("attention_bias", False))
            return cls(model_type=kind, vocab=int(d["vocab_size"]), hidden=hidden,
                       layers=int(d["num_hidden_layers"]), intermediate=int(d["intermediate_size"]), heads=heads,
                       kv_heads=int(d.get("num_key_value_heads") or heads),
                       head_dim=int(d.get("head_dim") or hidden // heads),
                       tied=bool(d.get("tie_word_embeddings", False)),
                       qkv_bias=kind == "qwen2" or attn_bias, o_bias=kind != "qwen2" and attn_bias,
                       mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=kind == "qwen3")
        except KeyError as e:
            raise UnsupportedModel(f"config.json lacks {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        f = Path(path) / "config.json"
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise UnsupportedModel(f"{f}: {e}") from None
        return cls.from_config(d)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def k(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_params(self) -> int:
        """One decoder layer's projection weights and biases (what autocast casts)."""
        H, q, k, I = self.hidden, self.q, self.k, self.intermediate
        attn = H * (q + 2 * k) + q * H + self.qkv_bias * (q + 2 * k) + self.o_bias * H
        return attn + 3 * H * I + self.mlp_bias * (2 * I + H)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each decoder-layer projection, by the module
        name peft matches (``trainer.lora.target_modules``)."""
        H, q, k, I = self.hidden, self.q, self.k, self.intermediate
        return {"q_proj": (H, q), "k_proj": (H, k), "v_proj": (H, k), "o_proj": (q, H),
                "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def adapter_params(self, rank: int, targets: tuple[str, ...] | list[str]) -> int:
        """A LoRA adapter's parameters: r * (in + out) for each target
        projection of each layer (A is r x in, B is out x r)."""
        dims = self.projections()
        if unknown := [t for t in targets if t not in dims]:
            raise UnsupportedModel(f"trainer.lora.target_modules {unknown}: the plan counts adapters on "
                                   f"{', '.join(dims)} only")
        return self.layers * sum(rank * sum(dims[t]) for t in targets)

    def layer_params(self) -> int:
        return self.linear_params() + 2 * self.hidden + self.qk_norm * 2 * self.head_dim

    def params(self) -> int:
        """Parameters as ``sum(p.numel() for p in model.parameters())`` counts them."""
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def layer_activation_bytes(self, precision: str) -> int:
        """Bytes autograd keeps per token for one decoder layer (module docstring)."""
        H, q, k, I = self.hidden, self.q, self.k, self.intermediate
        c = COMPUTE_BYTES[precision]
        if precision == "bf16-mixed":
            # Each RMSNorm keeps its fp32 input and fp32 output; the output
            # is cast to bf16 separately for each of q, k, v (gate, up).
            norms = 2 * 8 * H + 5 * 2 * H
        else:
            b = PRECISION_BYTES[precision]
            # fp32 copy of the input + normalized in the input dtype + the
            # weighted output, which q/k/v (gate/up) share.
            norms = 2 * (4 + 2 * b) * H
        qk = (4 + c) * (q + k) if self.qk_norm else 0
        attn = c * (2 * q + 2 * k) + c * q  # the kernel keeps q, k, v, out; o_proj its contiguous input
        return norms + qk + attn + 4 * c * I  # gate, silu(gate), up, their product


class MemoryPlan(msgspec.Struct, kw_only=True):
    """Per-rank device memory of a trainer config. Each byte field is one
    term's size per GPU; ``phases`` sums the terms that coexist in each
    phase, ``peak_terms`` lists those of the largest."""

    model: str  # model_type and parameter count, for messages
    params: int
    lora_rank: int = 0  # trainer.lora.rank; 0 = every parameter trains
    adapter_params: int = 0  # what trains with LoRA (fp32)
    ranks: int  # FSDP2 shard factor
    precision: str
    adamw_impl: AdamWImpl
    tokens: int  # tokens of the largest micro-batch planned for
    tokens_exact: bool  # False: micro_batch_size x max_model_len, a worst case
    chunk_tokens: int  # scoring chunk (logprob_chunk_tokens, at most tokens)
    activation_checkpointing: bool  # any layer checkpointed
    checkpoint_layers: int = 0  # decoder layers recomputed in backward, of layers
    layers: int = 0
    weights: int  # what the forward reads (bf16-mixed: the autocast bf16 copies)
    adapter_weights: int = 0  # LoRA: the adapter's fp32 parameters
    master_weights: int  # fp32 master weights (bf16-mixed), sharded
    gradients: int
    optimizer_states: int  # AdamW exp_avg + exp_avg_sq, in the parameters' dtype
    optimizer_temporaries: int  # only in the optimizer phase
    activations: int  # decoder activations kept for backward (+ recompute), one micro-batch
    logits: int  # fp32 [chunk, vocab] tensors of the scoring head in backward (3/5 of it in forward)
    fsdp_unsharded: int  # FSDP2 (ranks > 1): the gathered root/head group, a layer's unsharded gradient
    reference_model: int  # frozen KL reference, whole on every rank
    phases: dict[str, int]  # peak bytes allocated per phase
    peak_phase: str
    peak_terms: dict[str, int]  # the terms that coexist at the peak, largest first
    peak: int  # predicted torch.cuda.max_memory_allocated
    reserve: int
    total: int  # peak + reserve
    device_bytes: int  # free bytes on the device the plan is checked against
    verdict: Literal["fits", "may_not_fit", "does_not_fit"]
    advice: list[str] = []  # config changes that make it fit, each alone unless said

    @property
    def fits(self) -> bool:
        return self.total <= self.device_bytes

    def describe(self) -> str:
        """One paragraph: the verdict, the biggest terms in GiB, what to change."""
        bound = f"micro-batches of {self.tokens} tokens" + ("" if self.tokens_exact else
                                                            " (micro_batch_size x max_model_len, a worst case)")
        lora = (f", LoRA rank {self.lora_rank} ({self.adapter_params / 1e6:.1f}M trained, base frozen)"
                if self.lora_rank else "")
        ckpt = (f"{self.checkpoint_layers} of {self.layers} layers checkpointed, " if self.layers else "")
        head = (f"trainer memory plan: {self.model}{lora}, {self.ranks} rank(s), {self.precision}, "
                f"{self.adamw_impl} AdamW, {ckpt}"
                f"{bound}: peak {_g(self.peak)} GiB in the {self.peak_phase} phase + {_g(self.reserve)} GiB reserve "
                f"= {_g(self.total)} GiB per GPU, ")
        room = f"{_g(self.device_bytes)} GiB free"
        verdict = {"fits": f"fits in {room}.", "does_not_fit": f"does NOT fit in {room}.",
                   "may_not_fit": f"may not fit in {room} if micro-batches reach that size."}[self.verdict]
        # bf16-mixed's "weights" are the bf16 copies the forward computes with.
        label = {"weights": "bf16 weight copies"} if self.precision == "bf16-mixed" else {}
        if self.lora_rank:  # the base does not train: no master copy, just the frozen weights
            label = {**label, "master_weights": "frozen fp32 base"} if label else {"weights": "frozen base"}
        terms = ", ".join(f"{label.get(k, k.replace('_', ' '))} {_g(v)}"
                          for k, v in list(self.peak_terms.items())[:5])
        text = f"{head}{verdict} Biggest terms (GiB): {terms}."
        if self.verdict != "fits" and self.advice:
            text += " To fit: " + "; ".join(self.advice) + "."
        elif self.verdict != "fits":
            text += (" Nothing the plan tries fits (up to trainer.parallel.ranks = 8, precision bf16): a smaller "
                     "model or a larger GPU.")
        return text


def _g(n: int) -> str:
    return f"{n / GiB:.1f}"


# ---------------------------------------------------------------------------
# The arithmetic


class _Knobs(msgspec.Struct, kw_only=True):
    """What the plan depends on, resolved (no "auto")."""

    precision: str
    adamw_impl: AdamWImpl
    ranks: int
    tokens: int  # the largest micro-batch
    tokens_exact: bool
    max_len: int  # model.max_model_len: the longest row, alone in a micro-batch if need be
    chunk: int  # logprob_chunk_tokens
    ckpt_layers: int  # decoder layers checkpointed (0 .. the model's layers)
    eager: bool  # eager attention keeps [heads, L, L] scores per row
    kl: bool
    lora_rank: int = 0  # trainer.lora.rank; 0 = full fine-tuning
    lora_targets: tuple[str, ...] = ()
    lora_dropout: bool = False
    fused_head: bool = False  # scoring.FusedHeadLoss: no recompute; fp32 dL/dW, dL/dh held until backward


def _state_terms(m: ModelShape, k: _Knobs) -> dict[str, int]:
    """Weights, gradients, AdamW state and temporaries, per rank. "weights"
    is what persists; "copies" what exists only around forward/backward
    (bf16-mixed's autocast copies; FSDP2's gathered layers)."""
    if k.lora_rank:
        return _lora_state_terms(m, k)
    P, N, b = m.params(), k.ranks, PRECISION_BYTES[k.precision]
    mixed = k.precision == "bf16-mixed"
    shard = -(-P // N)
    if N == 1:
        copies, fsdp = (2 * m.layers * m.linear_params() if mixed else 0), 0
    else:
        copies = FSDP_GATHERED_LAYERS * m.layer_params() * COMPUTE_BYTES[k.precision]
        # The root (embedding, final norm) and an untied head stay gathered
        # for the whole step, with unsharded gradients; one layer's
        # unsharded gradient waits for its reduce-scatter.
        head_group = m.vocab * m.hidden * (1 if m.tied else 2) + m.hidden
        fsdp = int(head_group * 2 * b * (1 - 1 / N)) + m.layer_params() * b
    temps = {"fused": 0, "foreach": shard * b, "for_loop": 2 * m.vocab * m.hidden * b}[k.adamw_impl]
    return dict(weights=0 if mixed else shard * b, copies=copies, master_weights=shard * b if mixed else 0,
                adapter_weights=0, gradients=shard * b, optimizer_states=2 * shard * b, optimizer_temporaries=temps,
                fsdp_unsharded=fsdp, reference_model=P * (4 if k.precision == "fp32" else 2) if k.kl else 0)


def _lora_state_terms(m: ModelShape, k: _Knobs) -> dict[str, int]:
    """trainer.lora (one rank): the base frozen in the precision's dtype, the
    adapter fp32 with fp32 gradients and AdamW moments; the KL reference is
    the base with the adapter off (module docstring)."""
    P, A, b = m.params(), m.adapter_params(k.lora_rank, k.lora_targets), PRECISION_BYTES[k.precision]
    mixed = k.precision == "bf16-mixed"
    # autocast's bf16 copies of the frozen linears: not cached (no grad), but
    # each is saved for the backward that reaches the adapters below it.
    copies = 2 * m.layers * m.linear_params() if mixed else 0
    biggest = k.lora_rank * max(sum(d) for d in m.projections().values())  # the largest A + B pair
    temps = {"fused": 0, "foreach": A * 4, "for_loop": 2 * biggest * 4}[k.adamw_impl]
    return dict(weights=0 if mixed else P * b, copies=copies, master_weights=P * b if mixed else 0,
                adapter_weights=A * 4, gradients=A * 4, optimizer_states=2 * A * 4, optimizer_temporaries=temps,
                fsdp_unsharded=0, reference_model=0)


def _activation_terms(m: ModelShape, k: _Knobs) -> dict[str, int]:
    """Decoder activations kept from forward to backward ("kept"), one
    layer's worth ("layer": its backward's gradients, or its recompute under
    checkpointing), and the scoring head's chunk in forward and backward."""
    T, r = k.tokens, 4 if k.precision in ("fp32", "bf16-mixed") else 2
    layer = m.layer_activation_bytes(k.precision) * T
    if k.eager:
        layer += m.heads * min(k.max_len, T) * (4 + COMPUTE_BYTES[k.precision]) * T  # fp32 softmax + its cast
    outside = (4 + 2 * r) * m.hidden * T  # embedding output, final norm, the head's input rows
    if k.lora_rank and k.lora_dropout:  # each target's dropped-out input and its mask
        dims = m.projections()
        layer += sum(dims[t][0] for t in k.lora_targets) * (COMPUTE_BYTES[k.precision] + 1) * T
    c = min(k.ckpt_layers, m.layers)
    kept = outside + c * r * m.hidden * T + (m.layers - c) * layer
    unit = min(k.chunk, T) * m.vocab * 4
    if k.fused_head:
        grads = (m.vocab * m.hidden * 4 if not k.lora_rank else 0) + T * m.hidden * 4
        return dict(kept=kept, layer=(2 if c else 1) * layer, head_fwd=HEAD_FORWARD_TENSORS * unit + grads,
                    head_bwd=grads)
    return dict(kept=kept, layer=(2 if c else 1) * layer, head_fwd=HEAD_FORWARD_TENSORS * unit,
                head_bwd=HEAD_BACKWARD_TENSORS * unit)


def _phase_terms(m: ModelShape, k: _Knobs) -> dict[str, dict[str, int]]:
    """Which terms coexist in each phase (module docstring)."""
    s, a = _state_terms(m, k), _activation_terms(m, k)
    state = {n: s[n] for n in ("weights", "master_weights", "adapter_weights", "gradients", "optimizer_states",
                               "fsdp_unsharded", "reference_model")}
    # Checkpointing: the autocast copies die with the forward's autocast
    # region; FSDP2 regathers its layers in backward either way.
    copies_bwd = s["copies"] if k.ranks > 1 else s["copies"] * (m.layers - min(k.ckpt_layers, m.layers)) // m.layers
    head_wins = a["head_bwd"] >= a["layer"]
    full = "master_weights" if k.precision == "bf16-mixed" else "weights"
    return {
        "load": {full: m.params() * PRECISION_BYTES[k.precision], "adapter_weights": s["adapter_weights"],
                 "reference_model": s["reference_model"]},
        "forward": state | {"weights": s["weights"] + s["copies"], "activations": a["kept"],
                            "logits": a["head_fwd"]},
        "backward": state | {"weights": s["weights"] + copies_bwd,
                             "activations": a["kept"] + (0 if head_wins else a["layer"]),
                             "logits": a["head_bwd"] if head_wins else 0},
        "optimizer": state | {"optimizer_temporaries": s["optimizer_temporaries"]},
    }


def _plan(m: ModelShape, k: _Knobs, device_bytes: int) -> MemoryPlan:
    phase_terms = _phase_terms(m, k)
    phases = {name: sum(t.values()) for name, t in phase_terms.items()}
    peak_phase = max(phases, key=phases.__getitem__)
    peak = phases[peak_phase]
    reserve = RESERVE_FIXED + int(RESERVE_FRACTION * peak)
    s, a = _state_terms(m, k), _activation_terms(m, k)
    known = "" if m.model_type in KNOWN_TYPES else " (counted as a llama-style decoder)"
    return MemoryPlan(
        model=f"{m.model_type or 'model'} {m.params() / 1e9:.2f}B params{known}", params=m.params(),
        lora_rank=k.lora_rank, adapter_params=m.adapter_params(k.lora_rank, k.lora_targets) if k.lora_rank else 0,
        ranks=k.ranks, adapter_weights=s["adapter_weights"],
        precision=k.precision, adamw_impl=k.adamw_impl, tokens=k.tokens, tokens_exact=k.tokens_exact,
        chunk_tokens=min(k.chunk, k.tokens), activation_checkpointing=k.ckpt_layers > 0,
        checkpoint_layers=min(k.ckpt_layers, m.layers), layers=m.layers, weights=s["weights"] + s["copies"],
        master_weights=s["master_weights"], gradients=s["gradients"], optimizer_states=s["optimizer_states"],
        optimizer_temporaries=s["optimizer_temporaries"], activations=a["kept"] + a["layer"],
        logits=a["head_bwd"], fsdp_unsharded=s["fsdp_unsharded"], reference_model=s["reference_model"],
        phases=phases, peak_phase=peak_phase, peak_terms=_largest_first(phase_terms[peak_phase]), peak=peak,
        reserve=reserve, total=peak + reserve, device_bytes=device_bytes,
        verdict="fits" if peak + reserve <= device_bytes else "does_not_fit")


def _largest_first(terms: dict[str, int]) -> dict[str, int]:
    return {n: v for n, v in sorted(terms.items(), key=lambda kv: -kv[1]) if v}


# ---------------------------------------------------------------------------
# From a Config, with advice


def resolve_adamw_impl(choice: str, device_type: str) -> AdamWImpl:
    """trainer.optim.adamw_impl -> the implementation torch will run:
    "auto" is fused on cuda, torch's own default elsewhere (the per-tensor
    loop on cpu: foreach kernels are cuda-only there)."""
    if choice == "auto":
        return "fused" if device_type == "cuda" else "for_loop"
    return choice  # type: ignore[return-value]


def knobs_for_config(cfg: Config, *, ranks: int | None = None, tokens: int | None = None,
                     device_type: str = "cuda") -> _Knobs:
    t = cfg.trainer
    max_len = cfg.model.max_model_len
    if tokens is not None:
        bound, exact = tokens, True
    elif t.micro_batch_tokens > 0:
        # A row longer than the budget gets a micro-batch of its own.
        bound, exact = max(t.micro_batch_tokens, max_len), True
    else:
        bound, exact = t.micro_batch_size * max_len, False
    return _Knobs(precision=t.precision, adamw_impl=resolve_adamw_impl(t.optim.adamw_impl, device_type),
                  ranks=1 if t.lora.rank else max(1, ranks if ranks is not None else t.parallel.ranks),
                  tokens=bound, tokens_exact=exact,
                  max_len=max_len, chunk=t.logprob_chunk_tokens,
                  ckpt_layers=ALL_LAYERS if t.activation_checkpointing in (True, "auto") else 0,
                  eager=t.attention == "eager", kl=t.loss.kl_coef > 0, lora_rank=t.lora.rank,
                  lora_targets=tuple(t.lora.target_modules), lora_dropout=t.lora.dropout > 0,
                  fused_head=t.logprob_head != "chunked"
                  and not fused_head_blocker(t, sharded=(ranks if ranks is not None else t.parallel.ranks) > 1))


def plan_for_config(cfg: Config, device_bytes: int, *, ranks: int | None = None, tokens: int | None = None,
                    device_type: str = "cuda", shape: ModelShape | None = None,
                    checkpoint_layers: int | None = None) -> MemoryPlan:
    """The trainer's per-GPU plan for ``cfg`` on a device with ``device_bytes``
    free. ranks: the FSDP2 degree (default trainer.parallel.ranks, where 0
    = one per GPU reads as 1: pass the GPU count). tokens: the largest
    micro-batch (default max(micro_batch_tokens, max_model_len), or, with
    micro_batch_tokens = 0, micro_batch_size x max_model_len: a worst case,
    verdict "may_not_fit" where only it does not fit). shape: default read
    from model.path/config.json. checkpoint_layers: what a learner chose
    (else the config's). Raises UnsupportedModel."""
    m = shape if shape is not None else ModelShape.from_dir(cfg.model.path)
    k = knobs_for_config(cfg, ranks=ranks, tokens=tokens, device_type=device_type)
    k = msgspec.structs.replace(k, ckpt_layers=min(k.ckpt_layers, m.layers))
    if checkpoint_layers is not None:
        k = msgspec.structs.replace(k, ckpt_layers=min(checkpoint_layers, m.layers))
    elif cfg.trainer.activation_checkpointing == "auto":
        k = msgspec.structs.replace(k, ckpt_layers=fewest_checkpointed_layers(m, k, device_bytes))
    plan = _plan(m, k, device_bytes)
    if plan.verdict == "fits":
        return plan
    if not k.tokens_exact and _fits(m, k, device_bytes, tokens=k.max_len, tokens_exact=True):
        plan.verdict = "may_not_fit"
    plan.advice = advice(m, k, device_bytes)
    return plan


# knobs_for_config's stand-in for "every decoder layer" (capped at the model's).
ALL_LAYERS = 1 << 30


def fewest_checkpointed_layers(m: ModelShape, k: _Knobs, device_bytes: int) -> int:
    """activation_checkpointing = "auto": the fewest layers to recompute for
    the plan (reserve included) to fit; every layer when even that does not
    (the plan's advice then says what else). Each costs ~1/3 of its compute."""
    lo, hi = 0, m.layers
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(m, k, device_bytes, ckpt_layers=mid) else (mid + 1, hi)
    return lo


def _fits(m: ModelShape, k: _Knobs, device_bytes: int, **change) -> bool:
    return _plan(m, msgspec.structs.replace(k, **change), device_bytes).verdict == "fits"


def largest_micro_batch(m: ModelShape, k: _Knobs, device_bytes: int) -> int:
    """The most tokens per micro-batch that fit, everything else equal; 0 = none."""
    lo, hi = 0, max(k.tokens, k.max_len)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(m, k, device_bytes, tokens=mid, tokens_exact=True) else (lo, mid - 1)
    return lo


def advice(m: ModelShape, k: _Knobs, device_bytes: int) -> list[str]:
    """Config changes that each make the plan fit on their own, cheapest in
    compute first; if none does alone, the cumulative set that does."""
    out = []
    if k.adamw_impl != "fused" and _fits(m, k, device_bytes, adamw_impl="fused"):
        out.append('trainer.optim.adamw_impl = "fused" (no per-step optimizer temporaries)')
    n = largest_micro_batch(m, k, device_bytes)
    if n >= k.max_len:
        out.append(f"trainer.micro_batch_tokens = {n // 256 * 256 or n} or less")
    elif n:
        out.append(f"trainer.micro_batch_tokens = {n} with model.max_model_len <= {n} (a longer row gets a "
                   "micro-batch of its own)")
    if k.chunk > 512 and _fits(m, k, device_bytes, chunk=512):
        out.append("trainer.logprob_chunk_tokens = 512")
    every = dict(ckpt_layers=m.layers)
    if k.ckpt_layers < m.layers and _fits(m, k, device_bytes, **every):
        out.append("trainer.activation_checkpointing = true (~30% more compute)")
    elif k.ckpt_layers < m.layers and (n_ck := largest_micro_batch(m, msgspec.structs.replace(k, **every),
                                                                    device_bytes)) > n \
            and n_ck >= k.max_len:
        out.append(f"trainer.activation_checkpointing = true with trainer.micro_batch_tokens = {n_ck // 256 * 256} "
                   "or less")
    if k.lora_rank:
        pass  # an adapter run trains on one rank
    elif ranks := next((r for r in (2, 4, 8) if r > k.ranks and _fits(m, k, device_bytes, ranks=r)), 0):
        out.append(f"trainer.parallel.ranks = {ranks} (FSDP2 over {ranks} GPUs)")
    if k.precision != "bf16" and _fits(m, k, device_bytes, precision="bf16"):
        out.append('trainer.precision = "bf16" (8 B/param instead of 16; an update below bf16 resolution, '
                   "e.g. at lr 1e-6, is lost)")
    lora = dict(lora_rank=16, lora_targets=tuple(m.projections()), lora_dropout=False, ranks=1)
    if not k.lora_rank and _fits(m, k, device_bytes, **lora):
        out.append(f"trainer.lora.rank = 16 (a LoRA adapter on every projection, "
                   f"{m.adapter_params(16, lora['lora_targets']) / 1e6:.0f}M parameters, trains; the base is frozen)")
    if not any(a.startswith(("trainer.optim", "trainer.micro", "trainer.logprob", "trainer.activation"))
               for a in out):
        # Only more GPUs, a lower precision or LoRA alone: say what fits on these.
        out += _together(m, k, device_bytes, ranks=False)
    return out or _together(m, k, device_bytes, ranks=not k.lora_rank)


def _together(m: ModelShape, k: _Knobs, device_bytes: int, ranks: bool) -> list[str]:
    """The cumulative changes, cheapest first, that fit together; [] if none."""
    steps = [('trainer.optim.adamw_impl = "fused"', dict(adamw_impl="fused")),
             ("trainer.activation_checkpointing = true", dict(ckpt_layers=m.layers)),
             ("trainer.logprob_chunk_tokens = 512", dict(chunk=min(k.chunk, 512)))]
    steps += [(f"trainer.parallel.ranks = {r}", dict(ranks=r)) for r in (2, 4, 8) if ranks and r > k.ranks]
    steps = [(text, change) for text, change in steps
             if any(getattr(k, key) != value for key, value in change.items())]  # not what it is already
    said, cur = [], k
    for text, change in steps:
        cur = msgspec.structs.replace(cur, **change)
        if "ranks" in change and said and said[-1].startswith("trainer.parallel.ranks"):
            said.pop()
        said.append(text)
        if _plan(m, cur, device_bytes).verdict == "fits":
            return ["all of " + ", ".join(said)]
    return []


def check_learner_memory(cfg: Config, device, ranks: int = 1) -> MemoryPlan | None:
    """At learner start, before the model is loaded: the plan against this
    GPU's free memory (torch.cuda.mem_get_info). trainer.memory_check
    "enforce" raises DoesNotFit (the plan's message) when it cannot fit,
    "warn" logs it, "off" skips. A cpu trainer is not planned (None)."""
    from rlnode.log import get_logger

    log = get_logger("rlnode.trainer.memory_plan")
    mode = cfg.trainer.memory_check
    if mode == "off" or device.type != "cuda":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    try:
        plan = plan_for_config(cfg, free, ranks=ranks, device_type="cuda")
    except UnsupportedModel as e:
        log.warning("trainer.memory_plan_skipped", reason=str(e))
        return None
    log.info("trainer.memory_plan", verdict=plan.verdict, peak_phase=plan.peak_phase, peak_gib=_g(plan.peak),
             total_gib=_g(plan.total), free_gib=_g(free), ranks=plan.ranks, adamw_impl=plan.adamw_impl)
    if plan.verdict == "does_not_fit" and mode == "enforce":
        raise DoesNotFit(plan.describe() + ' (trainer.memory_check = "warn" starts anyway)')
    if plan.verdict != "fits":
        log.warning("trainer.memory_plan_warning", message=plan.describe())
    return plan
