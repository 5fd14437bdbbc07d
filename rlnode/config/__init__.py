"""Typed configuration: one msgspec Struct per role, loaded from TOML.

Owns: the schema of every knob, its default, its bounds, and the one place
where a config is validated (``load_config``). Must not import torch or vllm:
the CLI validates a config before anything heavy is loaded.

Errors name the dotted key path and what was expected, e.g.
``actor.router.llm_max_rollouts: expected int >= 1, got 0``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
Fraction = Annotated[float, Meta(gt=0, le=1)]


class ConfigError(ValueError):
    """A config that cannot run; the message names the key."""


class _Section(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    # Local directory of a Hugging Face model (config.json, weights, tokenizer).
    # Nothing is downloaded at run time: this must exist on every node.
    path: str = "runs/tiny-model"
    # Tokenizer directory; empty means the model directory.
    tokenizer: str = ""
    # Weights/activation dtype for engine and trainer. "float32" keeps logprob
    # parity exact on CPU ("auto" becomes bf16 on CPU in vLLM).
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    # Longest sequence (prompt + completion) in tokens an engine accepts.
    max_model_len: Annotated[int, Meta(ge=16)] = 2048
    # -- chat format: how prompts are rendered and completions read, for the
    # native agent loop and the gateway alike (as `vllm serve` takes them).
    # Chat template, a Jinja file (`vllm serve --chat-template`); empty = the
    # tokenizer's own. A relative path is taken from the working directory,
    # like model.path. It must be prefix-stable (adding a message never
    # changes the text of earlier ones). A cube that offers tools needs a
    # template that renders them: the actor refuses to start otherwise.
    # conf/templates/chatml-tools.jinja is ChatML with a Hermes tools
    # section, for ChatML models whose own template has none (SmolLM2).
    chat_template: str = ""
    # Reads tool calls out of completions: a `vllm serve --tool-call-parser`
    # name of the installed vLLM (hermes, llama3_json, mistral, pythonic,
    # qwen3_coder, ...; an unknown name is refused at start and by `rlnode
    # check`, listing the known ones). "hermes": <tool_call>{json}</tool_call>
    # (Qwen2.5, Hermes, the tiny test model, chatml-tools.jinja). "" = none:
    # completions are text only. Calls are read only on turns that offer tools.
    tool_parser: str = "hermes"
    # Splits reasoning off the answer: a `vllm serve --reasoning-parser`
    # name (deepseek_r1, qwen3, ...); "" = none. Cubes get the answer
    # without the reasoning; the gateway returns it as `reasoning` and
    # `reasoning_content`. Samples keep every token either way.
    reasoning_parser: str = ""


class EngineConfig(_Section):
    # Where the engines run: "auto" = cuda when torch sees a GPU, else cpu.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Engines on this node (one vLLM AsyncLLM each). On GPU nodes each engine
    # takes `tensor_parallel_size` consecutive GPUs.
    num_engines: PositiveInt = 1
    # GPUs per engine (tensor parallelism). CPU hosts: must be 1.
    tensor_parallel_size: PositiveInt = 1
    # GPU hosts: share of GPU memory vLLM may take, (0, 1].
    gpu_memory_utilization: Fraction = 0.85
    # CPU hosts: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE). Without it vLLM
    # reserves ~90% of RAM.
    cpu_kv_cache_gib: PositiveInt = 1
    # CPU hosts: OpenMP thread binding (VLLM_CPU_OMP_THREADS_BIND). "nobind"
    # was ~8x faster than binding on 2-core hosts.
    cpu_omp_threads_bind: str = "nobind"
    # Disable CUDA graphs / torch.compile: faster start, slower decode.
    enforce_eager: bool = False
    # Let vLLM reuse KV cache across turns of an episode (prefix caching).
    enable_prefix_caching: bool = True
    # Max sequences one engine schedules per step (vLLM max_num_seqs).
    max_num_seqs: PositiveInt = 256
    # Base seed for the engines' samplers (engine i uses seed + i).
    seed: NonNegInt = 0
    # Compute the lm_head (logits, hence sampling logprobs) in fp32 although
    # the model runs in bf16/fp16, as the trainer does: a bf16 lm_head is
    # the largest single source of engine-vs-trainer logprob mismatch in
    # low-precision runs. Costs an fp32 copy of lm_head.weight per engine.
    # "auto" = on for cuda engines whose model.dtype is not float32, off
    # otherwise. Why on by default on GPUs: vLLM 0.26 runs dense models on
    # its V2 model runner, which divides by the temperature in the logits'
    # own dtype (bf16 in, bf16 stored back; V1 upcasts to fp32 first), so
    # at temperature != 1 the behaviour logprobs would come from
    # bf16-rounded logits. An fp32 head hands the sampler fp32 logits.
    fp32_lm_head: bool | Literal["auto"] = "auto"
    # cuda engines with model.dtype = "float32": the precision of fp32 dot
    # products in vLLM's Triton kernels (attention), set as
    # TRITON_F32_DEFAULT in the engine's processes. "ieee": exact fp32, for
    # logprob parity with the trainer; "tf32": faster, ~1e-3 relative error
    # per product (3.4e-4 max |dlogprob| measured on an H100). No effect on
    # CPU or on bf16/fp16 models.
    fp32_dot_precision: Literal["ieee", "tf32"] = "ieee"
    # GPU devices this node's engines use, in order (engine i takes
    # tensor_parallel_size consecutive entries); empty = 0..N-1. With
    # `--role all` on one GPU, engine and trainer share device 0.
    gpu_ids: list[int] = []
    # When an engine takes in the bytes of a weight update (the load itself
    # always runs with generation paused):
    #   "generating": into staging buffers (kept between updates) while it
    #     keeps decoding, then pause for the load only.
    #   "paused": pause first, then receive and load: the transfer counts as
    #     stall too. For NCCL with tensor parallelism, where a second
    #     communicator running beside the model's own is not verified safe.
    # Measured on 2 CPU cores, 58M model, 8 requests decoding (rlnode bench
    # weights): "generating" updated in 0.37 s with a 0.16 s stall, "paused"
    # in 0.40 s with a 0.40 s stall.
    weight_receive: Literal["generating", "paused"] = "generating"


class RouterConfig(_Section):
    # Concurrent generations per engine. One lease = one LLM call, so an
    # episode holds a permit only while its request is in the engine.
    llm_max_rollouts: PositiveInt = 64
    # Prefer the engine an episode used last (prefix-cache reuse) while that
    # engine has a free permit; otherwise least-loaded engine first.
    affinity: bool = True


class SamplingConfig(_Section):
    # Sampling temperature. The engine reports logprobs of the distribution
    # it sampled from (logits / temperature), which the trainer must match.
    temperature: PositiveFloat = 1.0
    # The lowest temperature an agent may ask for through the gateway; a
    # lower one is raised to this (counted). The trainer scores a sample at
    # logits / T, so a tiny T scales its gradients by up to 1/T, and vLLM
    # samples greedily below 1e-5 (its logprobs are then not those of
    # logits / T). The trainer refuses samples outside
    # [min_temperature, temperature]. Must be in [1e-5, temperature].
    min_temperature: PositiveFloat = 0.25
    # Nucleus sampling: must stay 1.0 (checked at load). Anything else makes
    # the sampled distribution differ from softmax(logits / T), which the
    # trainer scores: the importance ratios would be biased.
    top_p: Fraction = 1.0
    # Max completion tokens per LLM call.
    max_tokens: PositiveInt = 64


class CubeConfig(_Section):
    # Name of this cube in the run (metrics, task refs); unique.
    id: str
    # Registry name: guessing | arithmetic | python-math | jsonl |
    # cube-protocol | openai-agent (your agent through the OpenAI gateway) |
    # verifiers (a verifiers environment) | a plug-in from the `rlnode.cubes`
    # entry-point group.
    kind: str
    # Relative share of training groups drawn from this cube; 0 = evaluation only.
    weight: Annotated[float, Meta(ge=0)] = 1.0
    # Evaluate on this cube's test split.
    eval: bool = True
    # The cube's own knobs (validated by the cube's Options schema at load).
    options: dict[str, Any] = {}


class EpisodeConfig(_Section):
    # Safety cap on LLM calls per episode (cubes usually end earlier).
    max_turns: PositiveInt = 16
    # Context reserve: an episode whose prompt leaves fewer tokens than this
    # for the completion ends with termination_reason "context_limit".
    min_completion_tokens: PositiveInt = 4
    # Rewards must be finite and within [-max_abs_reward, max_abs_reward],
    # whoever computes them (evaluator, rubric, agent): an episode outside
    # fails (retried, then counted), as one reward of 1e30 would swamp its
    # group's advantages and a NaN would waste the whole group at the trainer.
    # The trainer reads the same key: a delivered group beyond it is rejected
    # and counted ("reward_bound"), so set it alike on every node.
    max_abs_reward: Annotated[float, Meta(gt=0)] = 1000.0


class SchedulerConfig(_Section):
    # Episodes per task; they form one group (the advantage baseline).
    attempts: PositiveInt = 8
    # Groups the trainer consumes per optimizer step (one version).
    groups_per_step: PositiveInt = 8
    # Staleness budget in versions: a group started at version v is meant to
    # be trained by version v + max_lag, so at most
    # (version + max_lag + 1) * groups_per_step groups are ever started,
    # net of dropped ones, over all actors. The trainer enforces it with
    # credits (rlnode/link/credits.py); trainer.sync means max_lag = 0.
    max_lag: NonNegInt = 1
    # Episodes in flight on this node (train + eval).
    max_concurrent_episodes: PositiveInt = 256
    # Groups this node asks the trainer credits for, i.e. can run at once;
    # the trainer shares the global budget among actors by this demand.
    # 0 = ceil(max_concurrent_episodes / attempts).
    max_groups_in_flight: NonNegInt = 0
    # Retries of a failed episode (cube or engine error) before it counts as
    # failed, which drops its group.
    max_retries: NonNegInt = 2
    # Retry backoff: base * 2**attempt seconds, capped at retry_backoff_max_s.
    retry_backoff_s: Annotated[float, Meta(ge=0)] = 0.5
    retry_backoff_max_s: Annotated[float, Meta(ge=0)] = 10.0
    # Evaluate on the test cubes every N policy versions; 0 = never.
    eval_every: NonNegInt = 0
    # Test episodes per cube per evaluation.
    eval_episodes: PositiveInt = 64
    # Most of max_concurrent_episodes evaluation may hold at once, (0, 1].
    eval_share: Fraction = 0.25
    # Sampling temperature for evaluation episodes: < 0 = the training
    # temperature (actor.sampling.temperature), 0 = greedy decoding.
    eval_temperature: Annotated[float, Meta(ge=-1)] = -1.0


class ActorConfig(_Section):
    # Node identity in logs/metrics; empty = hostname.
    node_id: str = ""
    # Trainer address(es) "host:port" this actor connects to; the CLI's
    # --peers replaces this list.
    peers: list[str] = []
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # The cubes this actor trains and evaluates on ([[actor.cubes]] tables).
    cubes: list[CubeConfig] = []
    # Where the OpenAI-compatible gateway (external agents' episodes) runs.
    # "inline": on the daemon's event loop, which also carries vLLM's
    # outputs, the link and the scheduler (one core for all of it).
    # "process": its HTTP side and per-call text work (history matching,
    # chat template, tokenizing, tool/reasoning parsing) in a gateway host
    # process of its own, on its own cores, talking to the daemon over one
    # typed channel; the daemon keeps admission, the engine call and the
    # samples (rlnode/actor/gateway/hosted.py). The host then listens on a
    # port of its own (any free one, on http.host; loopback with [http]
    # off), never the ops endpoint's, and on the agents' socket; a host that
    # dies fails its open episodes (retried) and is restarted on the same
    # sockets. One host serves ~700-900 calls/s (1.1-1.5 ms of its CPU per
    # call); the daemon's loop keeps ~0.3-0.4 ms per call.
    gateway_host: Literal["inline", "process"] = "process"
    # Gateway host processes (gateway_host = "process"), each on a port and
    # an agents' socket of its own. An episode is served by the host with
    # the fewest open episodes, and its URL names that host's port, so all
    # its calls reach the host that holds its history. One host carries
    # what one core can (~700-900 calls/s); a GPU node whose agents make
    # more calls than that wants one host per such share, cores permitting.
    gateway_hosts: Annotated[int, Meta(ge=1, le=64)] = 1


class LossConfig(_Section):
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


class AdvantageConfig(_Section):
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


class OptimConfig(_Section):
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


class WeightSyncConfig(_Section):
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
    # confirm, a rank it did not bring to the rendezvous) after which an
    # actor is left out of the weight group (benched): the others go on in
    # a new epoch without it, and the trainer's wait for its engines counts
    # only the members. Only when another member of that conversation did
    # its part (else nothing shows the trainer's own side works). A benched
    # actor is probed (weights.protocol.Probe: every engine answers through
    # its engine core) with backoff, and rejoins when it answers. >= 1.
    bench_after: PositiveInt = 2


class LinkConfig(_Section):
    """The actor <-> trainer ZeroMQ link (both roles read it)."""

    # CurveZMQ: directory made by `rlnode keygen DIR --actor NAME ...` (the
    # trainer's key pair, one key pair per actor node, the actor keys the
    # trainer accepts in DIR/authorized/); empty = no encryption and no
    # authentication, which the trainer refuses on a non-loopback
    # trainer.bind_host unless `insecure` is set.
    curve_dir: str = ""
    # Actor: name of this node's key pair in curve_dir (DIR/NAME.key_secret);
    # empty = the node id (actor.node_id, default the hostname). The trainer
    # binds authorized/NAME.key to node id NAME and refuses that key from any
    # other node id, so a name other than the node id fails at start.
    key_name: str = ""
    # Trainer: accept actors on a non-loopback trainer.bind_host without
    # CurveZMQ (anyone who reaches the port can register, deliver groups and
    # join weight pushes). Logged as a warning at every start and shown in
    # /status. Only for a network you trust entirely.
    insecure: bool = False
    # Seconds between heartbeats; a peer silent for peer_timeout_s is gone.
    heartbeat_s: PositiveFloat = 1.0
    peer_timeout_s: PositiveFloat = 10.0
    # Largest message either end sends or accepts, in bytes (>= 1 MiB). One
    # group travels as one message, so a group must fit: checked at load
    # against its largest possible size (attempts x max_turns samples of
    # model.max_model_len tokens, GROUP_BYTES_PER_* below); a group over it
    # would be refused by the actor's link and its work lost.
    max_frame_bytes: Annotated[int, Meta(ge=1 << 20)] = 64 << 20
    # Seconds without a group before the alarm: an actor (with a trainer)
    # whose groups stopped reaching its link, a trainer that accepted none
    # from any actor while actors are connected. Logged as an error
    # (actor.no_group_alarm, link.trainer.no_group_alarm) and, on the actor,
    # /healthz answers 503. >= 0; 0 = off. Keep it above the slowest
    # group plus the longest pause of the trainer (a checkpoint, a push).
    no_group_alarm_s: Annotated[float, Meta(ge=0)] = 1800.0


class ParallelConfig(_Section):
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


class TrackersConfig(_Section):
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


class TrainerConfig(_Section):
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
    # sequence under flash_attention_2 (varlen kernel, no padding); rows of
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
    # Trainer attention kernel. "auto": flash_attention_2 on cuda when the
    # flash_attn package imports and compute is bf16 ("bf16", "bf16-mixed"),
    # else sdpa. "flash_attention_2" is refused with precision "fp32" (FA2
    # takes fp16/bf16 only), on cpu, or (at start) without flash_attn: it has
    # no PyPI wheels, install it on the GPU host. "eager": reference kernel.
    attention: Literal["auto", "flash_attention_2", "sdpa", "eager"] = "auto"
    # Recompute each decoder layer's activations in backward instead of
    # keeping them (less memory, ~30% more compute).
    activation_checkpointing: bool = False
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


class HttpConfig(_Section):
    """Each daemon's HTTP endpoint: /healthz, /metrics, /status, / (live page)."""

    # Serve it at all.
    enabled: bool = True
    # Interface to listen on; loopback by default (put a proxy in front to
    # expose it). Any other host needs `token` or `token_file`, else the
    # daemon refuses to start.
    host: str = "127.0.0.1"
    # Bearer token every request except /healthz must carry
    # (`Authorization: Bearer TOKEN`); empty = none (loopback only). Prefer
    # token_file to keep the secret out of the config; set at most one.
    token: str = ""
    # File holding the token (surrounding whitespace ignored), read at start.
    token_file: str = ""
    # Ports: the trainer (and `--role all`) uses trainer_port, an actor
    # actor_port; 0 = any free port (logged).
    trainer_port: Annotated[int, Meta(ge=0, le=65535)] = 8470
    actor_port: Annotated[int, Meta(ge=0, le=65535)] = 8471


class RunConfig(_Section):
    # Name of this run (logs, metrics, run directory); empty = config stem.
    name: str = ""
    # Directory for metrics, checkpoints and the final policy.
    run_dir: str = "runs/default"
    # Global seed.
    seed: NonNegInt = 0
    # Print a human-readable progress line per optimizer step and a final
    # table to stdout (the demo); logs go to stderr regardless.
    progress: bool = False
    # When the last step is an evaluation point, wait this long (s) for its
    # results before the trainer exits, so the final table has them.
    final_eval_wait_s: Annotated[float, Meta(ge=0)] = 120.0


class Config(_Section):
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    http: HttpConfig = field(default_factory=HttpConfig)


# ---------------------------------------------------------------------------
# Loading and validation


def _dotted(path: str) -> str:
    """msgspec's ``$.a.b[0]`` -> ``a.b[0]``."""
    return path.removeprefix("$").lstrip(".")


def _lookup(data: Any, dotted: str) -> Any:
    node = data
    for part in dotted.replace("[", ".").replace("]", "").split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


_MISSING = object()


def _explain(err: msgspec.ValidationError, data: Any) -> str:
    # msgspec messages look like "Expected `int`, got `str` - at `$.a.b`" or
    # "Object contains unknown field `x` - at `$.a`". Rewrite them so the
    # dotted key comes first, which is what an operator greps for.
    msg = str(err)
    what, _, where = msg.partition(" - at `")
    where = _dotted(where.rstrip("`"))
    if what.startswith("Object contains unknown field `"):
        name = what.split("`")[1]
        key = f"{where}.{name}" if where else name
        return f"{key}: unknown key (not part of the [{where or 'top-level'}] section)"
    if not where:
        return what
    what = f"{what[0].lower()}{what[1:]}"
    value = _lookup(data, where)
    if ", got" not in what and value is not _MISSING:
        what += f", got {value!r}"
    return f"{where}: {what}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` -> (["a","b","c"], value). VALUE is read as a TOML value
    (``3``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``); anything that is not valid
    TOML is taken as a bare string, so ``--set model.path=/x/y`` works."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a section")
        node = child
    node[path[-1]] = value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
) -> Config:
    """Read TOML, apply ``--set`` overrides, validate once. Raises ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for item in overrides:
        keys, value = parse_override(item)
        _apply_override(data, keys, value)
    try:
        cfg = msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(e, data)) from None
    _check_cross_field(cfg)
    if not cfg.run.name:
        cfg.run.name = Path(path).stem if path else "rlnode"
    return cfg


# vLLM samples greedily below this temperature (its _SAMPLING_EPS): the
# logprobs it reports are then not those of logits / T.
VLLM_SAMPLING_EPS = 1e-5


def _check_cross_field(cfg: Config) -> None:
    _check_cubes(cfg.actor.cubes)
    _check_attention(cfg.trainer)
    eng = cfg.actor.engine
    if eng.device == "cpu" and eng.tensor_parallel_size != 1:
        raise ConfigError("actor.engine.tensor_parallel_size: must be 1 when actor.engine.device = \"cpu\"")
    if cfg.actor.sampling.top_p < 1.0:
        # The trainer scores tokens with the full softmax at logits / T; a
        # truncated sampling distribution would make every importance ratio
        # exp(logpi - logmu) wrong (biased), silently.
        raise ConfigError(
            f"actor.sampling.top_p: must be 1.0 for training (got {cfg.actor.sampling.top_p}); "
            "the trainer scores tokens under the untruncated distribution at logits / temperature, "
            "so top-p sampling would bias the importance ratios. Lower the temperature instead"
        )
    if not VLLM_SAMPLING_EPS <= cfg.actor.sampling.min_temperature <= cfg.actor.sampling.temperature:
        raise ConfigError(
            f"actor.sampling.min_temperature: must be in [{VLLM_SAMPLING_EPS}, actor.sampling.temperature = "
            f"{cfg.actor.sampling.temperature}] (got {cfg.actor.sampling.min_temperature})")
    if 0 < cfg.trainer.loss.dual_clip <= 1:
        raise ConfigError(f"trainer.loss.dual_clip: must be 0 (off) or > 1 (got {cfg.trainer.loss.dual_clip})")
    if cfg.actor.sampling.max_tokens >= cfg.model.max_model_len:
        raise ConfigError(
            "actor.sampling.max_tokens: must be < model.max_model_len "
            f"({cfg.actor.sampling.max_tokens} >= {cfg.model.max_model_len})"
        )
    _check_group_fits_frame(cfg)


# Wire size of one sample (rlnode.wire.TrainingSample): prompt ids and
# completion ids are int32 (4 bytes a token), each completion token also
# carries a float32 logprob and a uint8 loss mask (9 bytes in all); the
# fixed part (ids, lease, strings, weight-version spans) stays below
# GROUP_BYTES_PER_SAMPLE (~390 bytes measured with 60-character group ids
# and four version spans: tests/test_ledger_bounds.py), and an episode
# summary below GROUP_BYTES_PER_EPISODE.
GROUP_BYTES_PER_PROMPT_TOKEN = 4
GROUP_BYTES_PER_COMPLETION_TOKEN = 9
GROUP_BYTES_PER_SAMPLE = 1024
GROUP_BYTES_PER_EPISODE = 512


def max_group_bytes(cfg: Config) -> int:
    """The largest a delivered group can be on the wire: every episode takes
    max_turns LLM calls, each with a context of max_model_len tokens of
    which up to max_tokens are completion."""
    s, m = cfg.actor.scheduler, cfg.model
    completion = cfg.actor.sampling.max_tokens
    sample = (GROUP_BYTES_PER_PROMPT_TOKEN * (m.max_model_len - completion)
              + GROUP_BYTES_PER_COMPLETION_TOKEN * completion + GROUP_BYTES_PER_SAMPLE)
    return s.attempts * (cfg.actor.episode.max_turns * sample + GROUP_BYTES_PER_EPISODE)


def _check_group_fits_frame(cfg: Config) -> None:
    # A group that does not fit is refused by the actor's link after all
    # its episodes ran: refuse the config instead.
    need = max_group_bytes(cfg)
    if need > cfg.link.max_frame_bytes:
        raise ConfigError(
            f"link.max_frame_bytes: a group can be up to {need} bytes (actor.scheduler.attempts = "
            f"{cfg.actor.scheduler.attempts} x actor.episode.max_turns = {cfg.actor.episode.max_turns} samples "
            f"of model.max_model_len = {cfg.model.max_model_len} tokens, actor.sampling.max_tokens = "
            f"{cfg.actor.sampling.max_tokens} of them completion), over link.max_frame_bytes = "
            f"{cfg.link.max_frame_bytes}; raise link.max_frame_bytes to at least {need} or lower one of those"
        )


def _check_attention(t: TrainerConfig) -> None:
    # flash_attn and cuda are checked at start (learner.attention_implementation).
    if t.attention != "flash_attention_2":
        return
    if t.precision == "fp32":
        # FA2 raises on fp32 inputs at the first forward; refuse at load.
        raise ConfigError(
            'trainer.attention: "flash_attention_2" takes only fp16/bf16 inputs, but trainer.precision = "fp32" '
            'computes in fp32; set trainer.precision = "bf16-mixed", or trainer.attention = "auto" or "sdpa"'
        )
    if t.device == "cpu":
        raise ConfigError('trainer.attention: "flash_attention_2" needs a cuda trainer, but trainer.device = "cpu"')


def _check_cubes(cubes: list[CubeConfig]) -> None:
    # Imported here: the registry is light, but the config module should
    # not pull the cube package in for configs without cubes.
    from rlnode.cubes.registry import UnknownCube, parse_options

    seen: set[str] = set()
    for i, c in enumerate(cubes):
        key = f"actor.cubes[{i}]"
        if c.id in seen:
            raise ConfigError(f"{key}.id: duplicate cube id {c.id!r}")
        seen.add(c.id)
        try:
            parse_options(c.kind, c.options)
        except UnknownCube as e:
            raise ConfigError(f"{key}.kind: {e.args[0]}") from None
        except msgspec.ValidationError as e:
            msg = _explain(e, c.options).replace("[top-level] section", f"options of cube kind {c.kind!r}")
            raise ConfigError(f"{key}.options.{msg}") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{key}.options: {e}") from None
    if cubes and not any(c.weight > 0 for c in cubes):
        raise ConfigError("actor.cubes: at least one cube needs weight > 0 to train on")


def groups_in_flight(cfg: Config) -> int:
    """How many groups an actor asks credits for (``max_groups_in_flight``)."""
    s = cfg.actor.scheduler
    return s.max_groups_in_flight or max(1, -(-s.max_concurrent_episodes // s.attempts))


def actor_node_id(cfg: Config) -> str:
    """This actor's node id: actor.node_id, else the hostname ("/" is the
    link identity's separator, so it never appears in one)."""
    import os

    return (cfg.actor.node_id or os.uname().nodename).replace("/", "-")


def effective_max_lag(cfg: Config) -> int:
    """The staleness budget both roles apply: ``trainer.sync`` means 0 (train
    only on the current version; generation waits for each update)."""
    return 0 if cfg.trainer.sync else cfg.actor.scheduler.max_lag


def to_toml_dict(cfg: Config) -> dict[str, Any]:
    """The effective config as plain data (for logs and the run directory)."""
    return msgspec.to_builtins(cfg)
