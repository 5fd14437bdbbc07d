"""``rlnode bench trainer``: Learner.train_step against plain transformers +
torch AdamW, on the same model and the same tokens, in the same run.

A synthetic step of ``tokens_per_step`` tokens: samples of ``prompt_tokens``
+ ``completion_tokens`` random ids, advantages +-1, behaviour log-probs 0.

  (a) rlnode: ``Learner.train_step`` with the config as given (set
      trainer.precision, micro_batch_tokens, attention, compile,
      head_precision, activation_checkpointing with --set), and with
      ``--switches`` the config with one of those switched at a time
      (``switch_variants``), each with what the learner resolved;
  (b) baseline: ``model(input_ids, attention_mask).logits`` on right-padded
      micro-batches of ``micro_batch_size`` samples, full [B, L, V] fp32
      log-softmax, a REINFORCE loss, backward, AdamW, in the Learner's
      parameter dtype (and autocast for bf16-mixed).

Reported per mode: tokens/s (prompt + completion tokens of the step per
second of optimizer step), MFU = 6 * params * tokens / step time / peak
FLOP/s (None where the device's peak is unknown: CPUs), peak GPU memory,
and on cuda the largest micro-batch (tokens) that fits, by doubling
micro_batch_tokens until a step runs out of memory. Medians over
``rounds`` steps after one warm-up step. Next to rlnode's measured peak,
the memory plan's prediction for this micro-batch (memory_plan.py), so a
GPU run checks the plan's arithmetic.
"""

from __future__ import annotations

import gc
import statistics
import time

import msgspec
import numpy as np
import torch

from rlnode.wire import LeaseMetadata
from rlnode.config import Config
from rlnode.trainer.buffer import Batch
from rlnode.wire import TrainingSample, pack_f32, pack_i32

# Dense bf16 tensor-core peak per device (FLOP/s), by a substring of
# torch.cuda.get_device_name(). Unknown devices report MFU None.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


class ModeResult(msgspec.Struct):
    step_s: float  # median seconds per optimizer step
    tokens_per_s: float
    mfu: float | None
    peak_mem_gib: float | None  # torch.cuda.max_memory_allocated; None on cpu
    error: str = ""  # e.g. "OOM": the mode could not run this step
    # What the learner resolved: attention kernel, layers checkpointed,
    # compiled or not, head precision ("" for the baseline).
    setup: str = ""


class SwitchResult(msgspec.Struct):
    name: str  # e.g. "checkpoint every layer": one switch changed from the config
    sets: dict[str, str]  # the trainer keys it changed
    result: ModeResult
    speedup_vs_config: float | None  # config step_s / this step_s


class TrainerBenchResult(msgspec.Struct):
    model: str
    device: str
    params: int
    precision: str
    tokens_per_step: int
    samples: int
    prompt_tokens: int
    completion_tokens: int
    micro_batch_tokens: int
    rounds: int
    rlnode: ModeResult
    baseline: ModeResult
    speedup: float | None  # baseline step_s / rlnode step_s
    memory_ratio: float | None  # rlnode peak / baseline peak
    max_micro_batch_tokens: int | None  # largest that fit (cuda only)
    # The memory plan's peak for this step's largest micro-batch (what
    # rlnode.peak_mem_gib measures); None where the model is not modelled.
    predicted_peak_gib: float | None = None
    predicted_peak_phase: str = ""
    # --switches: the config with one switch changed at a time.
    switches: list[SwitchResult] = []


def synthetic_batch(n: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        ids = rng.integers(0, vocab, prompt + completion)
        samples.append(TrainingSample(
            sample_id=f"b{i}/e0/0", group_id=f"b{i}", episode_id=f"b{i}/e0", cube_id="bench", task_id="t",
            step_index=0, prompt_ids=pack_i32(ids[:prompt].tolist()), completion_ids=pack_i32(ids[prompt:].tolist()),
            logprobs=pack_f32([0.0] * completion), loss_mask=bytes([1]) * completion, reward=0.0,
            finish_reason="length", termination_reason="done", policy_version=0, temperature=1.0,
            lease=LeaseMetadata(1, 0, 0.0, 0.0)))
    adv = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return Batch(samples, adv, [s.group_id for s in samples], adv, [0.0] * n, [0] * n,
                 norm_tokens=n * completion, norm_samples=n)


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def _time(step, rounds: int, device: torch.device) -> tuple[float, float | None]:
    """Median step seconds after one warm-up, and peak memory (GiB)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    step()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def baseline_step_fn(cfg: Config, device: torch.device, dtype: torch.dtype, batch: Batch):
    """Plain transformers + AdamW: padded micro-batches, full logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.optim.lr)
    mixed = cfg.trainer.precision == "bf16-mixed"
    mb = cfg.trainer.micro_batch_size
    rows = [np.concatenate([s.prompt_token_ids, s.completion_token_ids]).astype("int64") for s in batch.samples]
    starts = [len(s.prompt_token_ids) for s in batch.samples]

    def step():
        opt.zero_grad(set_to_none=True)
        for i in range(0, len(rows), mb):
            part = rows[i : i + mb]
            L = max(len(r) for r in part)
            ids = torch.zeros(len(part), L, dtype=torch.long)
            attn = torch.zeros(len(part), L, dtype=torch.long)
            comp = torch.zeros(len(part), L - 1)
            for j, r in enumerate(part):
                ids[j, : len(r)] = torch.from_numpy(r)
                attn[j, : len(r)] = 1
                comp[j, starts[i + j] - 1 : len(r) - 1] = 1
            ids, attn, comp = ids.to(device), attn.to(device), comp.to(device)
            adv = torch.tensor(batch.advantages[i : i + mb], device=device)[:, None]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()  # [B, L, V]
            logp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]  # [B, L-1]
            (-(adv * logp * comp).sum() / batch.norm_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return model, step


def _mode(step_s: float, peak: float | None, tokens: int, params: int, flops: float | None) -> ModeResult:
    return ModeResult(step_s, tokens / step_s, 6 * params * tokens / step_s / flops if flops else None, peak)


def learner_setup(learner) -> str:
    t = learner.cfg.trainer
    head = "fp32" if t.precision == "fp32" or learner.fp32_head else "bf16"
    layers = learner.model.config.num_hidden_layers
    return (f"attention {learner.attn_impl}, checkpoint {learner.checkpoint_layers}/{layers} layers, "
            f"{'compiled' if learner.compiled else 'eager'}, head {head} {'fused' if learner.fused_head else 'chunked'}")


def switch_variants(cfg: Config, device_type: str) -> list[tuple[str, dict]]:
    """The config with one trainer switch changed at a time (issue 49's
    switches): checkpointing every layer / none, compile flipped, padded
    sdpa instead of a varlen kernel, the chunked (recomputed) log-prob head
    instead of the fused one, the head's precision flipped under
    bf16-mixed. A variant that resolves to the config's setup is left out."""
    from rlnode.trainer.learner import compiles_layers

    t = cfg.trainer
    compiled = compiles_layers(t.compile, device_type)
    out = [("checkpoint every layer", dict(activation_checkpointing=True)),
           ("checkpoint none", dict(activation_checkpointing=False)),
           ("compile " + ("off" if compiled else "on"), dict(compile=not compiled)),
           ("attention sdpa (padded rows)", dict(attention="sdpa")),
           ("attention varlen (packed)", dict(attention="varlen"))]
    out.append(("logprob head chunked" if t.logprob_head != "chunked" else "logprob head fused",
                dict(logprob_head="chunked" if t.logprob_head != "chunked" else "fused")))
    if t.precision == "bf16-mixed":
        flip = "bf16" if t.head_precision == "fp32" else "fp32"
        out.append((f"head {flip}", dict(head_precision=flip)))
    if t.precision == "fp32" and device_type == "cuda":  # varlen takes bf16 compute on cuda
        out = [(name, sets) for name, sets in out if sets.get("attention") != "varlen"]
    return [(name, sets) for name, sets in out if any(getattr(t, k) != v for k, v in sets.items())]


def bench_trainer(cfg: Config, tokens_per_step: int, prompt_tokens: int, completion_tokens: int, rounds: int,
                  log, switches: bool = False, largest: bool = True) -> TrainerBenchResult:
    from rlnode.trainer.learner import PARAM_DTYPE, Learner

    if cfg.trainer.memory_check == "enforce":
        # The bench measures what the plan predicts (and probes past it for
        # the largest micro-batch): warn instead of refusing.
        cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, memory_check="warn"))
    learner = Learner(cfg)
    device, vocab = learner.device, learner.vocab_size
    params = sum(p.numel() for p in learner.model.parameters())
    n = max(1, tokens_per_step // (prompt_tokens + completion_tokens))
    batch = synthetic_batch(n, prompt_tokens, completion_tokens, vocab)
    tokens = n * (prompt_tokens + completion_tokens)
    plan = _predicted(cfg, n, prompt_tokens + completion_tokens, device.type, learner.checkpoint_layers)
    flops = _peak_flops(device)
    log(f"trainer: {params / 1e6:.1f}M params on {device}, {n} samples x {prompt_tokens}+{completion_tokens} tokens")

    def run(name, step, setup: str = "") -> ModeResult:
        try:
            step_s, peak = _time(step, rounds, device)
        except Exception as e:  # noqa: BLE001 - one mode's failure is its row's result, not the bench's end
            why = "OOM" if _is_oom(e) else f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log(f"  {name}: {why}")
            if not _is_oom(e):
                import traceback

                log(traceback.format_exc()[-3000:])
            _free(device)
            return ModeResult(float("nan"), 0.0, None, None, error=why, setup=setup)
        log(f"  {name}: {step_s:.3f} s/step ({setup})" if setup else f"  {name}: {step_s:.3f} s/step")
        return msgspec.structs.replace(_mode(step_s, peak, tokens, params, flops), setup=setup)

    ours = run("rlnode", lambda: learner.train_step(batch), learner_setup(learner))
    largest_mb = _largest_micro_batch(learner, prompt_tokens, completion_tokens, vocab, log) \
        if device.type == "cuda" and largest else None
    del learner
    _free(device)
    varied = []
    for name, sets in switch_variants(cfg, device.type) if switches else []:
        lrn = Learner(msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, **sets)))
        if learner_setup(lrn) == ours.setup:  # resolves to what the config runs already
            del lrn
            _free(device)
            continue
        res = run(name, lambda lrn=lrn: lrn.train_step(batch), learner_setup(lrn))
        varied.append(SwitchResult(name, {k: str(v) for k, v in sets.items()}, res,
                                   ours.step_s / res.step_s if not (res.error or ours.error) else None))
        del lrn
        _free(device)
    model, step = baseline_step_fn(cfg, device, PARAM_DTYPE[cfg.trainer.precision], batch)
    base = run("baseline", step)
    del model, step
    _free(device)
    ok = not ours.error and not base.error
    return TrainerBenchResult(
        model=cfg.model.path, device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        params=params, precision=cfg.trainer.precision, tokens_per_step=tokens, samples=n,
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens, rounds=rounds, rlnode=ours, baseline=base,
        speedup=base.step_s / ours.step_s if ok else None,
        memory_ratio=ours.peak_mem_gib / base.peak_mem_gib if ok and base.peak_mem_gib else None,
        max_micro_batch_tokens=largest_mb, predicted_peak_gib=plan.peak / 2**30 if plan else None,
        predicted_peak_phase=plan.peak_phase if plan else "", switches=varied)


def _predicted(cfg: Config, n: int, length: int, device_type: str, checkpoint_layers: int):
    """The memory plan for the bench's largest micro-batch: ``n`` samples of
    ``length`` tokens split by micro_batch_tokens (whole samples; a longer
    sample alone) or micro_batch_size, with the layers the learner
    checkpoints."""
    from rlnode.trainer.memory_plan import UnsupportedModel, plan_for_config

    t = cfg.trainer
    per_mb = max(1, t.micro_batch_tokens // length) if t.micro_batch_tokens > 0 else t.micro_batch_size
    try:
        return plan_for_config(cfg, 0, ranks=1, tokens=min(n, per_mb) * length,
                               device_type=device_type, checkpoint_layers=checkpoint_layers)
    except UnsupportedModel:
        return None


def _largest_micro_batch(learner, prompt: int, completion: int, vocab: int, log, cap: int = 1 << 20) -> int | None:
    """Double micro_batch_tokens (one micro-batch of that many tokens per
    step) until a train_step runs out of memory; the last that ran."""
    t = learner.cfg.trainer
    saved, best, budget = t.micro_batch_tokens, None, 4096
    try:
        while budget <= cap:
            t.micro_batch_tokens = budget
            batch = synthetic_batch(max(1, budget // (prompt + completion)), prompt, completion, vocab, seed=1)
            try:
                learner.train_step(batch)
            except RuntimeError as e:
                if not _is_oom(e):
                    raise
                break
            finally:
                learner.optimizer.zero_grad(set_to_none=True)
                _free(learner.device)
            best = budget
            log(f"  micro-batch of {budget} tokens fits")
            budget *= 2
    finally:
        t.micro_batch_tokens = saved
    return best


def print_table(res: TrainerBenchResult) -> None:
    print(f"\ntrainer benchmark: {res.model} on {res.device}")
    print(f"  {res.params / 1e6:.1f}M params, precision {res.precision}, {res.samples} samples x "
          f"{res.prompt_tokens}+{res.completion_tokens} = {res.tokens_per_step} tokens/step, "
          f"micro_batch_tokens {res.micro_batch_tokens}, median of {res.rounds}")
    print(f"  {'mode':<30}{'s/step':>10}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'vs config':>11}  setup")
    rows = [("rlnode (config)", res.rlnode, None)]
    rows += [(s.name, s.result, s.speedup_vs_config) for s in res.switches]
    rows.append(("baseline (transformers)", res.baseline, None))
    for name, m, vs in rows:
        mfu = f"{m.mfu:.3f}" if m.mfu is not None else "-"
        mem = f"{m.peak_mem_gib:.2f}" if m.peak_mem_gib is not None else "-"
        ratio = f"{vs:.2f}x" if vs is not None else "-"
        print(f"  {name:<30}{m.step_s:>10.3f}{m.tokens_per_s:>12.0f}{mfu:>8}{mem:>10}{ratio:>11}  "
              f"{m.setup}{'  ' + m.error if m.error else ''}")
    speed = f"{res.speedup:.2f}x" if res.speedup is not None else "-"
    mem = f"{res.memory_ratio:.2f}" if res.memory_ratio is not None else "-"
    print(f"  speedup (baseline / rlnode step time) = {speed}, memory ratio = {mem}, "
          f"largest micro-batch that fits = {res.max_micro_batch_tokens or '-'} tokens")
    if res.predicted_peak_gib is not None:
        got = f"{res.rlnode.peak_mem_gib:.2f}" if res.rlnode.peak_mem_gib is not None else "-"
        print(f"  memory plan: predicted rlnode peak {res.predicted_peak_gib:.2f} GiB ({res.predicted_peak_phase}), "
              f"measured {got} GiB")
