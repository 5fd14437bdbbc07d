"""Messages that cross the actor -> trainer boundary (msgspec Structs).

Owns: the wire contract. ``TrainingSample`` is born in an episode coroutine
(one per LLM call), travels to the trainer, and dies in a batch there.
Change it only by appending fields with defaults (old readers keep working).

Token ids and logprobs travel as compact little-endian arrays (int32 /
float32 bytes), not lists of Python numbers: a 1k-token sample is ~8 KB
instead of ~20 KB of MessagePack ints and floats, and decodes without
creating thousands of Python objects.
"""

from __future__ import annotations

import numpy as np
import msgspec

# The sample's span labels are weights labels: their helpers are re-exported.
from rlnode.weights.plan import INITIAL_WEIGHTS, parse_weights_label, weights_label  # noqa: F401
from rlnode.weights.protocol import WeightCommand, WeightResult


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


def span_version(label: str) -> int | None:
    """The policy version a ``weight_versions`` span label names (the engine
    labels spans with ``weights_label``), or None for a label that names
    none (vLLM's "default")."""
    parsed = parse_weights_label(label)
    return None if parsed is None else parsed[0]


def unpack_f32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f4")


class LeaseMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """Travels with every training sample (router -> episode -> trainer)."""

    route_id: int
    engine_id: int
    lease_wait_s: float  # time from asking for a permit to getting one
    llm_latency_s: float  # time the generation held the permit
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started_at: float = 0.0  # wall clock (time.time()) when the permit was granted
    finished_at: float = 0.0  # wall clock when the permit was released


class TrainingSample(msgspec.Struct, array_like=True, omit_defaults=True, tag="sample"):
    """One LLM call of one episode: actor (episode coroutine) -> trainer."""

    sample_id: str  # f"{episode_id}/{step_index}", unique in the run
    group_id: str  # the `attempts` episodes of one task share it
    episode_id: str
    cube_id: str
    task_id: str
    step_index: int  # 0-based LLM call index within the episode
    prompt_ids: bytes  # int32 LE: exactly the tokens the engine saw
    completion_ids: bytes  # int32 LE: exactly the tokens the engine produced
    logprobs: bytes  # float32 LE, one per completion token, under the sampling distribution
    loss_mask: bytes  # uint8, one per completion token: 1 = train on it
    reward: float  # the episode's reward (set when the episode ends)
    finish_reason: str  # engine: "stop" | "length" | "abort"
    termination_reason: str  # episode: "done" | "max_turns" | "context_limit"
    policy_version: int  # actor's policy version when the generation started
    temperature: float  # the trainer scores tokens at logits / temperature
    lease: LeaseMetadata
    # (weights label, start, end) spans over completion tokens, from vLLM:
    # the label names the weights that produced them (``weights_label``:
    # version and trainer incarnation), which the trainer checks against
    # its own lineage (trainer/buffer.py).
    weight_versions: list[tuple[str, int, int]] = []
    num_turns: int = 0  # LLM calls in the episode

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return unpack_i32(self.prompt_ids)

    @property
    def completion_token_ids(self) -> np.ndarray:
        return unpack_i32(self.completion_ids)

    @property
    def completion_logprobs(self) -> np.ndarray:
        return unpack_f32(self.logprobs)

    @property
    def completion_mask(self) -> np.ndarray:
        return np.frombuffer(self.loss_mask, dtype=np.uint8)


# ---------------------------------------------------------------------------
# Actor <-> trainer link messages (rlnode.link). One ROUTER on the trainer,
# one DEALER per actor; every frame is one msgpack-encoded message of the
# union named after its receiver (``ToTrainer`` / ``ToActor``). All are
# array_like (field order is the schema: append defaulted fields only) and
# tagged (the tag is the array's first element).
# ---------------------------------------------------------------------------

# Bumped only for changes an older peer cannot survive; appended defaulted
# fields do not need a bump.
# 2: ControlRequest/ControlReply carry typed weight messages (weights.protocol)
# instead of a kind string and a dict payload.
PROTOCOL_VERSION = 2

# Reject reasons (trainer -> actor). The actor acts on these strings.
REJECT_REGISTER_FIRST = "register first"  # actor: re-register, then resend
REJECT_PROTOCOL = "protocol version"  # actor: fatal, surfaces as LinkFatalError
REJECT_IDENTITY = "identity mismatch"  # actor: fatal (socket identity != node/incarnation)
REJECT_MALFORMED = "malformed"  # undecodable frame; actor logs it
REJECT_INVALID_GROUP = "invalid group"  # actor: drop group_ids, count them (resending cannot help)
REJECT_BUSY = "busy"  # trainer buffer full; actor: resend group_ids after the ack timeout
REJECT_UNKNOWN_GROUP = "unknown group"  # CommitQuery for ids the trainer never saw; actor: resend


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


class EngineInfo(_Msg):
    """One engine of an actor node (inside ``Register``); encodes as
    ``[engine_id, num_workers, host, gpus]`` (shorter from actors that
    predate ``gpus`` or ``host``; defaults omitted)."""

    engine_id: int
    num_workers: int  # tensor-parallel worker processes: ranks in the weight broadcast
    # The machine it runs on (rlnode.weights.ipc.host_identity); "" = not said.
    # The trainer lends weights by CUDA IPC to engines on its own machine.
    host: str = ""
    # UUIDs ("GPU-...") of the GPUs its processes see, which every one of its
    # worker ranks sees (they share the engine's CUDA_VISIBLE_DEVICES); [] =
    # not said (an older actor, a CPU engine, no NVML). The trainer lends by
    # CUDA IPC only to engines that see its own GPU.
    gpus: list[str] = []


class Register(_Msg, tag="register"):
    """actor -> trainer: first message on every (re)connection. Answered by
    ``Welcome`` or ``Reject``."""

    node_id: str
    incarnation: str  # random per actor link start: a new one = a new outbox
    engines: list[EngineInfo]
    protocol_version: int = PROTOCOL_VERSION


class Heartbeat(_Msg, tag="hb"):
    """actor -> trainer and trainer -> actor, every ``heartbeat_s``; any frame
    counts as a sign of life, heartbeats cover quiet periods."""

    node_id: str  # the trainer sends "trainer"
    version: int  # actor: policy version its engines hold; trainer: current version
    stats: dict[str, float] = {}


class EpisodeSummary(_Msg):
    """One episode of a delivered group (inside ``GroupDelivery``)."""

    episode_id: str
    reward: float
    success: bool
    num_turns: int
    termination_reason: str  # "done" | "max_turns" | "context_limit"


class GroupDelivery(_Msg, tag="group"):
    """actor -> trainer: one complete group (all attempts of one task).
    ``group_id`` must be unique in the run (across actors and actor restarts):
    the trainer drops any second delivery of an id as a duplicate."""

    group_id: str
    node_id: str
    cube_id: str
    task_id: str
    start_version: int  # policy version when the group was admitted
    episodes: list[EpisodeSummary]
    samples: list[TrainingSample]
    # The trainer incarnation whose credit started this group ("" = none:
    # an actor without flow control). The trainer counts the group against
    # that actor's credits only when it names the trainer's own incarnation.
    credit_session: str = ""


class CommitQuery(_Msg, tag="cq"):
    """actor -> trainer: "these groups were acked long ago and are still not
    committed". Repairs a lost ``Commit``; answered by ``Commit`` for the
    consumed ones and ``Reject(unknown group)`` for ids the trainer lacks."""

    group_ids: list[str]


class EvalReport(_Msg, tag="eval"):
    """actor -> trainer: evaluation results at a policy version (from the
    scheduler's eval loop). Best effort: not acknowledged."""

    node_id: str
    version: int
    cubes: dict[str, dict[str, float | int]]  # cube id -> CubeStats.summary()


class ControlReply(_Msg, tag="creply"):
    """actor -> trainer: the answer to one ``ControlRequest``: its result
    when ``ok``, else why not (``error``)."""

    request_id: int
    ok: bool
    error: str = ""
    result: WeightResult | None = None


class CreditReport(_Msg, tag="credrep"):
    """actor -> trainer: this actor's side of the credit ledger for one
    trainer incarnation (``session``). Cumulative counts, so a lost report is
    healed by the next one; sent when a count changes and with every
    heartbeat. See ``rlnode.link.credits`` for the protocol."""

    session: str  # the trainer incarnation that granted the credits counted here
    want: int  # groups this actor can run at once: the trainer tops its credits up to this
    started: int  # credits spent on starting a group (cumulative)
    returned: int  # credits given back: groups dropped on the actor after retries (cumulative)
    # Group ids of this actor incarnation are f"{id_prefix}g{index:07d}";
    # it holds no group with an index below settled_below any more (each was
    # committed or dropped), so none can be resent: the trainer compacts its
    # memory of consumed ids up to there (rlnode.link.consumed).
    id_prefix: str = ""
    settled_below: int = 0


class Welcome(_Msg, tag="welcome"):
    """trainer -> actor: registration accepted."""

    trainer_incarnation: str  # random per trainer link start: a new one = an empty buffer
    version: int  # current policy version


class Ack(_Msg, tag="ack"):
    """trainer -> actor: these groups are in this trainer incarnation's buffer
    (``group_ids``: accepted now; ``duplicate``: it had them already, buffered
    or consumed). The actor stops resending them to this incarnation."""

    group_ids: list[str]
    duplicate: list[str] = []


class Commit(_Msg, tag="commit"):
    """trainer -> actor: these groups are durably consumed (trained and
    checkpointed, or dropped and counted); the actor forgets them."""

    group_ids: list[str]


class Reject(_Msg, tag="reject"):
    """trainer -> actor: a valid message the trainer will not act on, or an
    undecodable frame. ``reason`` is one of the ``REJECT_*`` strings."""

    reason: str
    detail: str = ""
    group_ids: list[str] = []  # the groups concerned, where known


class CreditGrant(_Msg, tag="credit"):
    """trainer -> actor: the number of credits (the right to start one group)
    this trainer incarnation has granted this actor incarnation so far.
    Cumulative: a lost grant is healed by the next one (also re-sent with
    every heartbeat)."""

    session: str  # trainer incarnation
    granted: int


class VersionUpdate(_Msg, tag="version"):
    """trainer -> actor: the trainer's policy version moved (also carried by
    every trainer ``Heartbeat``, so a lost update heals within heartbeat_s)."""

    version: int


class ControlRequest(_Msg, tag="creq"):
    """trainer -> actor: a request the actor daemon must answer with a
    ``ControlReply`` of the same ``request_id``: one step of the weight
    conversation (``rlnode.weights.protocol``)."""

    request_id: int
    command: WeightCommand


ToTrainer = Register | Heartbeat | GroupDelivery | CommitQuery | ControlReply | EvalReport | CreditReport
ToActor = Welcome | Ack | Commit | Reject | Heartbeat | VersionUpdate | ControlRequest | CreditGrant
