"""The job-wide tables (``[run]``, ``[model]``, ``[link]``, ``[http]``,
which both roles read) and ``Config``, the root that holds every table
(``[sft]``, read only by ``rlnode sft``, is declared in sft.py).

Owns these knobs' types, defaults and bounds; each comment above a field is
its documentation (scripts/gen_config_docs.py renders it into
docs/configuration.md). The root's field order is the order of the
sections in that page.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, field

from rlnode.config.actor import ActorConfig
from rlnode.config.base import NonNegInt, PositiveFloat, Section
from rlnode.config.sft import SftConfig
from rlnode.config.trainer import TrainerConfig


class ModelConfig(Section):
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



class LinkConfig(Section):
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
    # model.max_model_len tokens, GROUP_BYTES_PER_* in rlnode/config/checks.py);
    # a group over it would be refused by the actor's link and its work lost.
    max_frame_bytes: Annotated[int, Meta(ge=1 << 20)] = 64 << 20
    # Seconds without a group before the alarm: an actor (with a trainer)
    # whose groups stopped reaching its link, a trainer that accepted none
    # from any actor while actors are connected. Logged as an error
    # (actor.no_group_alarm, link.trainer.no_group_alarm) and, on the actor,
    # /healthz answers 503. >= 0; 0 = off. Keep it above the slowest
    # group plus the longest pause of the trainer (a checkpoint, a push).
    no_group_alarm_s: Annotated[float, Meta(ge=0)] = 1800.0



class HttpConfig(Section):
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


class RunConfig(Section):
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


class Config(Section):
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    sft: SftConfig = field(default_factory=SftConfig)

