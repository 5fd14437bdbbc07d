"""The ``[actor]`` table: one actor node's engines, admission router,
sampling, episodes, scheduler, cubes and gateway hosts.

Owns these knobs' types, defaults and bounds; each comment above a field is
its documentation (scripts/gen_config_docs.py renders it into
docs/configuration.md). Rules that involve keys of other tables live in
checks.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, field

from rlnode.config.base import Fraction, NonNegInt, PositiveFloat, PositiveInt, Section


class EngineConfig(Section):
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
    # was ~8x faster than binding on 2-core hosts. Where external agents run
    # on this host too (agent and verifiers cubes), bind the engine to part
    # of the cores ("0") and the agents start on the rest
    # (scheduler.max_starting_agents): a program starting on a core the
    # engine's threads use stalls every call in the engine.
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
    # When an engine takes in the bytes of a full-weight update (the load
    # itself always runs with generation paused; a LoRA run's adapter never
    # pauses: it is served beside the old one, docs/training.md):
    #   "generating": into staging buffers (kept between updates) while it
    #     keeps decoding, then pause for the load only.
    #   "paused": pause first, then receive and load: the transfer counts as
    #     stall too. For NCCL with tensor parallelism, where a second
    #     communicator running beside the model's own is not verified safe.
    # Measured on 2 CPU cores, 58M model, 8 requests decoding (rlnode bench
    # weights): "generating" updated in 0.37 s with a 0.16 s stall, "paused"
    # in 0.40 s with a 0.40 s stall.
    weight_receive: Literal["generating", "paused"] = "generating"
    # LoRA runs (trainer.lora.rank > 0): adapters one engine batch may mix
    # (vLLM max_loras). Each version is an adapter of its own and requests
    # in flight finish on theirs, so this bounds the versions running at
    # once; a request of a newer version waits for a slot, never an old one.
    max_loras: Annotated[int, Meta(ge=2, le=64)] = 4
    # LoRA runs: the largest adapter rank the engine serves (vLLM
    # max_lora_rank, one of 1, 8, 16, 32, 64, 128, 256, 320, 512); 0 = the
    # smallest of those >= trainer.lora.rank.
    max_lora_rank: NonNegInt = 0


class RouterConfig(Section):
    # Concurrent generations per engine. One lease = one LLM call, so an
    # episode holds a permit only while its request is in the engine. An
    # external agent's deadline (its cube's timeout_s) does not count the
    # time its calls wait for a permit, so a node with more episodes than
    # its engine serves in time lowers this instead of failing them: each
    # call then finishes sooner, the others wait their turn.
    llm_max_rollouts: PositiveInt = 64
    # Prefer the engine an episode used last (prefix-cache reuse) while that
    # engine has a free permit; otherwise least-loaded engine first.
    affinity: bool = True


class SamplingConfig(Section):
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


class CubeConfig(Section):
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


class EpisodeConfig(Section):
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


class SchedulerConfig(Section):
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
    # External agents starting at once on this node (rlnode/actor/agent_starts.py):
    # an agent holds a start slot until its first request reaches the gateway,
    # and its timeout_s counts from then on. 0 = one per CPU this daemon may use,
    # less the CPUs a CPU engine's threads are bound to (engine.cpu_omp_threads_bind).
    max_starting_agents: NonNegInt = 0
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


class ActorConfig(Section):
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
    # samples (rlnode/actor/gateway/hosted.py). Either way the gateway runs
    # only when a cube hands episodes to agents (Cube.runs_agents; the
    # native cubes do not). The host then listens on a
    # port of its own (any free one, on gateway_bind), never the ops
    # endpoint's, and on the agents' socket; a host that
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
    # Address the gateway hosts' TCP ports listen on (gateway_host =
    # "process"). Agents on this node need no more than loopback: sandboxed
    # ones reach the gateway through their box's socket, unsandboxed ones
    # (isolation = "none") on 127.0.0.1. Set another address only for
    # agents that run on other machines; each episode's routes still need
    # its own key, and the start logs the exposure (gateway.exposed).
    gateway_bind: str = "127.0.0.1"
    # How the gateway builds the prompt of an agent's next call from the
    # conversation it re-sends (docs/cubes.md, "Histories the template
    # rewrites"). "extend": the last prompt + the tokens the engine sampled
    # + the template tokens of the new messages only, so each prompt extends
    # the last one token for token and the model sees its own earlier turns
    # as it wrote them (reasoning included). "render": the chat template's
    # rendering of the whole conversation, as vllm serve builds it: where
    # the template rewrites earlier turns (Qwen3 and DeepSeek-R1 drop their
    # reasoning) the model trains on the context it will see when deployed,
    # and such a turn does not extend the last one. Either way each call is
    # one sample of exactly the tokens the engine saw and sampled;
    # metrics.jsonl counts the turns that extend (turns_extending_fraction).
    gateway_history: Literal["extend", "render"] = "extend"

