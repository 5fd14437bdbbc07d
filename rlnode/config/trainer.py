"""The ``[trainer]`` table: the trainer's device and batching, its FSDP2
ranks, the loss, advantages, optimizer, weight sync to the engines,
checkpoints and experiment trackers.

Owns these knobs' types, defaults and bounds; each comment above a field is
its documentation (scripts/gen_config_docs.py renders it into
docs/configuration.md). Rules that involve keys of other tables live in
checks.py.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field

from rlnode.config.base import NonNegInt, PositiveFloat, PositiveInt, Section


class LossConfig(Section):
    # Policy loss (formulas in rlnode/trainer/loss.py):
    #   "tis_reinforce": -A * logpi * sg(min(r, is_cap)), r = exp(logpi - logmu)
    #   "ppo_clip":      -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)
    #   "gspo":          PPO-clip on the sequence-level ratio (geometric mean over tokens)
    # On-policy (trainer.sync = true) "tis_reinforce" and "ppo_clip" give the
    # same gradient. Pipelined (the default, trainer.sync = false), where the
    # policy moves between sampling and training, "ppo_clip" with its dual
    # clip is the default: truncated IS let samples 2 versions old overshoot
    # the demo's policy (entropy 0.7 -> 5.0, success 0.64 -> 0.05 in 50 steps;
    # README "The demo over seeds"); the clip stops a stale sample from
    # pushing a token the trainer already moved past 1 +- eps, and the dual
    # clip bounds the other side.
    kind: Literal["tis_reinforce", "ppo_clip", "gspo"] = "ppo_clip"
    # Truncation c of the importance weight for "tis_reinforce", > 0.
    is_cap: PositiveFloat = 2.0
    # PPO clip range [1 - eps_low, 1 + eps_high] ("ppo_clip"), each in (0, 1).
    eps_low: Annotated[float, Meta(gt=0, lt=1)] = 0.2
    eps_high: Annotated[float, Meta(gt=0, lt=1)] = 0.28
    # GSPO clip range on the sequence ratio ("gspo"), each in (0, 1).
    gspo_eps_low: Annotated[float, Meta(gt=0, lt=1)] = 3e-4
    gspo_eps_high: Annotated[float, Meta(gt=0, lt=1)] = 4e-4
    # Dual clip c ("ppo_clip", "gspo"): where the advantage is negative, a
    # token's ratio above c gets no gradient (loss.py); 0 = off, else > 1.
    # Why: PPO's clip bounds the ratio only on the side the advantage pushes
    # towards; a negative advantage on a token the policy has since made
    # far likelier (ratio 88 and 282 in pipelined demo runs) pushes with
    # weight r, takes the step's whole gradient (norm 52 before clipping)
    # and knocked runs' held-out success from 1.00 to 0.84 and 0.69 to 0.56. 3 is
    # verl's clip_ratio_c. On-policy (trainer.sync = true) the ratio is 1.
    dual_clip: Annotated[float, Meta(ge=0)] = 3.0
    # Weight of KL(pi || reference) (k3 estimator) to the frozen initial
    # policy; 0 = no reference model is kept.
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0
    # Weight of the entropy bonus (minus coef * entropy of pi over the
    # vocabulary at each trained token). > 0 also trains on zero-signal
    # groups (advantage 0: only this term and KL act there), so a policy
    # that turned deterministic everywhere keeps exploring; 0 = off.
    entropy_coef: Annotated[float, Meta(ge=0)] = 0.0
    # Adaptive entropy control (Skywork-OR1's): the mean entropy (nats) of
    # the trained tokens to hold the policy at or above; 0 = off (entropy_coef
    # is constant). > 0: entropy_coef is where the coefficient starts and its
    # floor, and after every step it moves by entropy_coef_step, up when the
    # step's entropy was below the target and down when above, within
    # [entropy_coef, entropy_coef_max] (loss.next_entropy_coef; 0 as the
    # floor is Skywork-OR1's form: on the demo's seed 1 that took away the
    # early 0.01 and the run never reached 0.8). Why: a constant bonus
    # that is large enough to re-open a choice the policy made for good
    # (0.05 on the demo) keeps a fresh policy near-uniform (held-out success
    # 0.58-0.62 at v200-v400 against 0.78-1.00 with 0.01), and one small
    # enough for a fresh policy (0.01, 0.02) leaves that choice shut. The
    # coefficient is in every step's metrics (loss/entropy_coef) and in the
    # checkpoint.
    entropy_target: Annotated[float, Meta(ge=0)] = 0.0
    # How far the adaptive coefficient moves per step, > 0.
    entropy_coef_step: PositiveFloat = 0.001
    # The adaptive coefficient's ceiling, >= 0.
    entropy_coef_max: Annotated[float, Meta(ge=0)] = 0.1
    # Adaptive control raises the coefficient only at a step where some
    # group failed in every attempt (and entropy is below the target); at
    # any other step it moves down. That is the trap the bonus is for: a
    # policy deterministic where it loses has no gradient out. A policy
    # that wins or splits its groups is converging, and is below the target
    # too: there the coefficient would wind up until the bonus tipped the
    # policy over (on the demo: 0.05-0.07 after 100 steps at 1.00, then
    # entropy 0.1 -> 0.7-1.3 nats in 10-20 steps and held-out success 0.55
    # and 0.78; README "The demo over seeds").
    entropy_raise_on_failure: bool = False
    # Per-token entropy floor (nats), 0 = off. Every trained token whose
    # entropy is below it gets a bonus of entropy_floor_coef * H_t, tokens at
    # or above it none (loss.policy_loss: - coef * min(H_t, floor)). Why: a
    # choice that every attempt of a group makes alike carries no policy
    # gradient (the group's advantages sum to 0 over a token they all
    # share), and once deterministic no later reward can re-open it. The
    # mean-entropy bonus above cannot see one collapsed state among many
    # open ones: on the demo a run stalled at 0.55-0.66 for 500 steps with
    # its FIRST guess deterministic ("5" in 32 of 32 attempts, capping
    # success at 0.8) while the step's mean entropy stayed above 0.2, and
    # runs that had reached 1.0 fell when one later state went
    # deterministic on a losing guess. The floor holds each state open
    # without pushing the states above it towards uniform, which is what a
    # large constant bonus does to a fresh policy.
    entropy_floor: Annotated[float, Meta(ge=0)] = 0.0
    # Weight of the floor's bonus, >= 0 (used when entropy_floor > 0).
    entropy_floor_coef: Annotated[float, Meta(ge=0)] = 0.1
    # "tokens": sum over every trained token / tokens in the step;
    # "sequences": per-sample token mean, then mean over samples.
    normalize: Literal["tokens", "sequences"] = "tokens"
    # Per-token masking by version lag: a token produced by weights more
    # than this many versions behind the trainer's gets no gradient (its
    # importance weight is the least reliable), while the newer tokens of
    # the same sample still train. Tokens carry their own version (a push
    # mid-generation starts a new one), so this can be tighter than
    # actor.scheduler.max_lag, which drops whole samples by the version
    # they started at. -1 = off; 0 = train only on-policy tokens.
    max_token_lag: Annotated[int, Meta(ge=-1)] = -1

    @property
    def entropy_term(self) -> bool:
        """The loss has an entropy term (bonus or floor): entropy must be
        computed with its gradient, and the term acts on zero-signal groups."""
        return self.entropy_coef > 0 or self.entropy_floor > 0


class AdvantageConfig(Section):
    # Baseline subtracted from each episode's reward within its group:
    # "mean" (group mean) or "leave_one_out" (mean of the other episodes).
    baseline: Literal["mean", "leave_one_out"] = "mean"
    # Divide by the group's reward std (+ 1e-6) (GRPO-style).
    std_normalize: bool = False
    # What a group whose episodes all got the same reward is compared to.
    # "group": its own mean, so advantage 0 and no policy gradient (GRPO).
    # "step": the mean reward of the step's OTHER groups (divided by the
    # std of the step's rewards under std_normalize). A policy that turned
    # deterministic on a task it now always fails gets a negative advantage
    # there and is pushed off it; a task it always solves is held (positive
    # advantage) against interference from the tasks still being learnt.
    # A step whose groups all got one reward stays silent. Measured on the
    # demo, against its late fall, and not kept there: 3 of 6 runs fell
    # (the solved groups sharpen a converged policy, and an adaptive
    # entropy bonus then winds up; README "The demo over seeds").
    zero_signal_baseline: Literal["group", "step"] = "group"


class OptimConfig(Section):
    # AdamW learning rate (peak, after warm-up), > 0.
    lr: PositiveFloat = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    # Linear warm-up from 0 over this many optimizer steps.
    warmup_steps: NonNegInt = 0
    # After warm-up: "constant", or "cosine"/"linear" decay to min_lr_ratio *
    # lr at max_steps.
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.1
    # Clip the global gradient norm; 0 = no clipping.
    max_grad_norm: Annotated[float, Meta(ge=0)] = 1.0
    # AdamW kernel. "foreach" materialises sqrt(exp_avg_sq) for every
    # parameter at each step (one more copy of the optimizer state: 15 GiB
    # for a 4B model under "bf16-mixed"); "fused" updates in place. "auto":
    # fused on cuda, torch's default elsewhere (a per-tensor loop on cpu).
    adamw_impl: Literal["auto", "fused", "foreach"] = "auto"


class WeightSyncConfig(Section):
    # torch.distributed backend for the weight broadcast: "auto" = nccl when
    # the trainer is on cuda, else gloo.
    #   "cuda_ipc": engine and trainer on one node: the engine's workers open
    #   CUDA IPC handles of the trainer's (bucketed) tensors; no NCCL group,
    #   so trainer and engine may share one GPU. "auto" picks it when the
    #   trainer is on cuda and every engine in the group is on the trainer's
    #   host and sees the trainer's GPU (matched by UUID: engines run under
    #   their own CUDA_VISIBLE_DEVICES), else nccl; the trainer logs why
    #   (weights.backend) and /status shows it. gloo with a cuda trainer
    #   stages each bucket through CPU memory.
    backend: Literal["auto", "gloo", "nccl", "cuda_ipc"] = "auto"
    # Tensors are packed into flat buffers of about this size (MiB), one
    # collective each.
    bucket_mb: PositiveInt = 64
    # Host the engines' workers reach the trainer's rendezvous on; empty =
    # trainer.advertise_host.
    master_host: str = ""
    # First TCP port tried for a new group epoch (each epoch takes a fresh
    # free port from here).
    base_port: Annotated[int, Meta(ge=1024, le=65000)] = 29500
    # Rendezvous and per-collective timeout (s): how long a dead actor can
    # stall a weight push before the epoch is abandoned and re-formed.
    timeout_s: PositiveFloat = 120.0
    # Failed pushes in a row (each retried after a backoff of 1 s, doubling
    # up to 60 s) after which the trainer's /healthz answers 503 and systemd's
    # watchdog restarts it; a successful push resets the count. >= 1. Only
    # the trainer's own failures count: failures that named actors while
    # another member of the same conversation did its part bench those
    # actors (bench_after) instead.
    max_failures: PositiveInt = 5
    # Failed weight conversations in a row (a join or an update it did not
    # confirm, a rank it did not bring to the rendezvous, silence after a
    # plan vote or broadcast timed out while the other members reported it)
    # after which an actor is left out of the weight group (benched): the
    # others go on in a new epoch without it, and the trainer's wait for its
    # engines counts only the members. Only when another member of that
    # conversation did its part (else nothing shows the trainer's own side
    # works). A benched actor is probed (weights.protocol.Probe: every
    # engine answers through its engine core) with backoff, and rejoins when
    # it answers; one benched again before a push with it lands waits twice
    # as long each time (up to 30 s) before its next readmission. >= 1.
    bench_after: PositiveInt = 2


class ParallelConfig(Section):
    """FSDP2 data parallelism across the trainer node's devices, all under
    the one trainer daemon: rank 0 owns the link and the weight push, every
    rank holds a shard of the weights, gradients and optimizer state."""

    # Trainer ranks (processes) on this node: 1 = no sharding; 0 = one per
    # visible GPU (1 on CPU). Ranks > 0 are child processes of the daemon.
    ranks: NonNegInt = 1
    # torch.distributed backend among the ranks: "auto" = nccl on cuda,
    # gloo on cpu.
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Loopback TCP port of the ranks' rendezvous; 0 = a free port.
    port: Annotated[int, Meta(ge=0, le=65535)] = 0


class TrackersConfig(Section):
    """Experiment trackers that mirror the trainer's metrics (every step's
    record and every evaluation, rlnode/trainer/trackers.py), off by
    default; metrics.jsonl stays the record. They need the ``trackers``
    extra (pip install 'rlnode[trackers]'); a tracker that fails mid-run is
    logged and dropped, never stops the trainer."""

    # TensorBoard event files in <run_dir>/tensorboard (x axis: version).
    tensorboard: bool = False
    # Weights & Biases run under <run_dir>/wandb.
    wandb: bool = False
    # "offline": written locally, uploaded later with `wandb sync`
    # (no network needed); "online": streamed (WANDB_API_KEY, network).
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_project: str = "rlnode"
    # W&B entity (team or user); empty = the API key's default.
    wandb_entity: str = ""


class LoraConfig(Section):
    """Train a LoRA adapter (peft) on a frozen base instead of full weights.
    Each version's adapter (a few MB) goes to the engines, which serve it
    as a new vLLM adapter beside the old one: no pause, no drain, and a
    sample's version is its adapter's (docs/training.md, "LoRA")."""

    # Adapter rank r; 0 = train full weights (the default). The engines
    # serve up to actor.engine.max_lora_rank (0 there = fit this).
    rank: NonNegInt = 0
    # Scaling alpha: the adapter adds (alpha / r) * B @ A to each target.
    alpha: PositiveFloat = 32.0
    # Dropout on the adapter's input while training, in [0, 1).
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    # Module names (the last part of the name, peft's matching) that get an
    # adapter. Each must name linear layers of the model (refused at start
    # otherwise); vLLM serves adapters on attention and MLP projections.
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class TrainerConfig(Section):
    # Address the trainer binds its ZeroMQ socket on. Loopback by default;
    # any other address (0.0.0.0 for every interface) needs link.curve_dir
    # (or link.insecure = true), else the trainer refuses to start.
    bind_host: str = "127.0.0.1"
    # TCP port of the trainer's ZeroMQ socket (actors' --peers).
    port: Annotated[int, Meta(ge=1, le=65535)] = 5555
    # Address actors' engines use to reach this trainer's weight broadcast
    # rendezvous. "auto": 127.0.0.1 when bind_host is loopback, bind_host
    # when it is one specific address, else this node's address on its
    # default route (rlnode/ops/netaddr.py). `rlnode check` flags a loopback
    # rendezvous behind a non-loopback bind (remote engines cannot join).
    advertise_host: str = "auto"
    # Device for the trainer model: "auto" = cuda if available, else cpu.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CPU trainer: torch intra-op threads; 0 = torch's default (all cores).
    # With an engine on the same CPU (`--role all`), fewer threads avoid
    # oversubscribing the cores the engine's OpenMP threads use.
    cpu_threads: NonNegInt = 0
    # Optimizer steps to run; 0 = until stopped.
    max_steps: NonNegInt = 0
    # Samples per micro-batch (gradient accumulation splits a step); used
    # when micro_batch_tokens = 0.
    micro_batch_size: PositiveInt = 64
    # Token budget of one micro-batch: forward rows (packed episodes) are
    # split into micro-batches of at most this many tokens: one concatenated
    # sequence under a varlen kernel (varlen, flash_attention_2: no padding); rows of
    # similar length right-padded, rows x longest <= this, padding < half,
    # no mask, under sdpa/eager. 0 = split by micro_batch_size samples
    # instead. A row longer than the budget gets a micro-batch of its own.
    micro_batch_tokens: NonNegInt = 0
    # Completion tokens whose lm_head logits, log-softmax and entropy are
    # computed at once: peak memory holds [chunk, vocab] fp32 (and the
    # chunk is recomputed in backward), never [tokens, vocab]. >= 1.
    logprob_chunk_tokens: PositiveInt = 2048
    # "fp32": weights, optimizer state and compute in fp32 (CPU default;
    # exact parity with an fp32 engine). "bf16-mixed": fp32 master weights
    # and AdamW state, bf16 compute (autocast / FSDP2 param_dtype); the
    # weights pushed to engines are cast to model.dtype. "bf16": weights and
    # optimizer state in bf16 (half the memory; an update below bf16
    # resolution, e.g. lr 1e-6, is lost: the weights do not move).
    precision: Literal["fp32", "bf16-mixed", "bf16"] = "fp32"
    # Trainer attention kernel. "auto": on cuda with bf16 compute ("bf16",
    # "bf16-mixed") flash_attention_2 when the flash_attn package imports,
    # else "varlen"; elsewhere sdpa. "varlen": PyTorch's own variable-length
    # kernel (torch.nn.attention.varlen, no extra wheel; on cpu causal SDPA
    # per row), micro-batches packed like flash_attention_2's; on cuda it
    # takes bf16 compute. "flash_attention_2" is refused with precision
    # "fp32" (FA2 takes fp16/bf16 only), on cpu, or (at start) without
    # flash_attn: it has no PyPI wheels. "eager": reference kernel.
    attention: Literal["auto", "varlen", "flash_attention_2", "sdpa", "eager"] = "auto"
    # The lm head under precision "bf16-mixed": "fp32" computes the logits
    # from the fp32 master head (the engines' actor.engine.fp32_lm_head
    # computes the same: the logprob parity of a bf16 run); "bf16" under
    # autocast like the decoder: 14x the fp32 head's matmul rate on an H200
    # (bf16 tensor cores vs fp32 CUDA cores), a 16k-token Qwen3-1.7B step
    # 0.70 -> 0.44 s, and up to ~0.02 nats from the fp32 head's log-probs at
    # Qwen3's vocabulary: pair it with actor.engine.fp32_lm_head = false. Precision "bf16"
    # always computes a bf16 head, "fp32" an fp32 one.
    head_precision: Literal["fp32", "bf16"] = "fp32"
    # How token log-probs and entropy meet the loss: "chunked" computes them
    # logprob_chunk_tokens at a time and recomputes each chunk's head in
    # backward; "fused" runs each chunk's backward in its forward with the
    # loss's per-token gradients (rlnode/trainer/scoring.py: 6 instead of 8
    # N H V head FLOPs, no recompute, no [tokens, vocab] tensor either way).
    # "fused" cannot run with loss.kind = "gspo", trainer.lora.rank > 0 or
    # trainer.parallel.ranks > 1; "auto" = fused wherever it can.
    logprob_head: Literal["auto", "chunked", "fused"] = "auto"
    # Recompute decoder layers' activations in backward instead of keeping
    # them (less memory, ~1/3 more compute per layer recomputed). true:
    # every layer; false: none; "auto": on cuda the fewest layers for the
    # memory plan (rlnode/trainer/memory_plan.py, its reserve included) to
    # fit the GPU's free memory, none when everything fits (cpu, or
    # memory_check = "off": none).
    activation_checkpointing: bool | Literal["auto"] = "auto"
    # Each decoder layer under torch.compile (Inductor fuses the norms,
    # rotary, SwiGLU and autocast casts): "auto" = on cuda only, where
    # `rlnode bench trainer --switches` measured the gain (Qwen3-1.7B on an
    # H200: 0.67 -> 0.44 s per 16k-token step, 88 -> 64 GiB); the first
    # steps of each new shape pay the compile. true/false force it on/off.
    compile: bool | Literal["auto"] = "auto"
    # Trainer memory plan (rlnode/trainer/memory_plan.py), checked on cuda
    # against the GPU's free memory before the model loads: "enforce"
    # refuses to start when it cannot fit (the message lists the biggest
    # terms and what to change), "warn" logs that and starts, "off" skips.
    memory_check: Literal["enforce", "warn", "off"] = "enforce"
    # Score each episode's LLM calls in one forward row (call k+1's prompt
    # extends call k's prompt + completion, so the last call's sequence holds
    # them all): the same logprobs, a multi-turn episode's shared prefix
    # computed once. Samples that do not extend their episode get own rows.
    pack_episodes: bool = True
    # Train only on samples of the current version and make generation wait
    # for each update (synchronous RL, for comparison).
    sync: bool = False
    # Save a checkpoint every N optimizer steps (and at shutdown); 0 = only
    # at shutdown.
    checkpoint_every: NonNegInt = 50
    # Checkpoints kept in run_dir/checkpoints (oldest removed first).
    keep_checkpoints: PositiveInt = 2
    # Seconds a batch's worth of groups may wait with no optimizer step
    # starting or ending before the trainer's /healthz answers 503 (the loop
    # is stuck: a push, a checkpoint, a hung device). >= 0; 0 = off. Keep it
    # above the slowest step plus push (weights.timeout_s bounds a push).
    stall_timeout_s: Annotated[float, Meta(ge=0)] = 600.0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


