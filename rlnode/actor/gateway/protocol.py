"""The one channel between the actor daemon and its gateway host process
(``actor.gateway_host = "process"``, ``host.py``): msgspec Structs in
length-prefixed msgpack frames over a unix socket pair.

Daemon -> host: ``HostStart`` (once, first), ``OpenSession``,
``CloseSession``, ``Settle``, and the answers to the host's calls:
``Tokens`` (a streamed call's new token ids), ``Generated``,
``CallFailed``, ``EnvReplied``.
Host -> daemon: ``HostReady`` (once, or ``HostFailed``), ``Generate``,
``Abort``, ``Unsent``, ``EnvCall``, ``PostReward``, ``SessionState``
(answering ``OpenSession``, ``Settle`` and ``CloseSession``),
``HostStats``.

Token-in / token-out. The host chooses a call's prompt ids (the chat
template, the re-sent history matched and tokenized there); the daemon
checks the call against its own count of the episode's calls and settings
(turns, context, temperature, max_tokens; the seed it derives itself), takes
the lease, runs the engine and records what the engine was given and
returned. Samples are built from that record alone: the host never sends
completion ids, logprobs or versions, it only receives them.

Frames (``rlnode/frames.py``): ``u32 big-endian length | msgpack list of
messages``. Whatever is ready when the loop comes round goes out as one
frame (``Channel.send`` queues; one flush per loop iteration).
"""

from __future__ import annotations

import asyncio
from typing import Callable, Union

import msgspec

from rlnode.frames import FrameProtocol

MAX_FRAME_BYTES = 1 << 30  # a frame carries whole prompts (up to max_model_len ids per call)


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


# -- daemon -> host ---------------------------------------------------------------


class HostStart(_Msg):
    """The host's renderer (``model.*`` chat format) and model name."""

    tokenizer: str  # model.tokenizer or model.path
    chat_template: str = ""  # model.chat_template (a path)
    tool_parser: str = "hermes"
    reasoning_parser: str = ""
    model_name: str = "rlnode"
    history: str = "extend"  # actor.gateway_history


class WireSettings(msgspec.Struct, array_like=True, omit_defaults=True):
    """An episode's EpisodeSettings as the host needs them to refuse calls
    early (the daemon checks every call again against its own copy)."""

    max_tokens: int
    temperature: float
    top_p: float
    max_turns: int
    max_model_len: int
    min_completion_tokens: int = 4
    min_temperature: float = 1e-5
    seed: int | None = None
    max_abs_reward: float = 1000.0


class OpenSession(_Msg):
    """Answered by ``SessionState`` once the host serves the token."""

    token: str
    episode_id: str
    api_key: str
    settings: WireSettings
    reward_key: str = ""  # empty: the episode refuses posted rewards
    has_environment: bool = False
    tools_json: bytes = b'{"tools":[]}'  # GET env/tools, answered by the host


class CloseSession(_Msg):
    """The token stops working; answered by ``SessionState(closed=True)``."""

    token: str


class Settle(_Msg):
    """Answered by ``SessionState``: every frame the host sent before it has
    then been applied by the daemon."""

    token: str


class Tokens(_Msg):
    """A streamed call's token ids produced since the last ``Tokens``."""

    call_id: int
    ids: list[int]


class Generated(_Msg):
    call_id: int
    completion_ids: list[int]
    finish_reason: str


class CallFailed(_Msg):
    """A call (``Generate`` or ``EnvCall``) refused or failed: answered in
    OpenAI's error shape with these fields."""

    call_id: int
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    error_type: str = "invalid_request_error"


class EnvReplied(_Msg):
    """POST env/step answered (200; a refusal is ``CallFailed``)."""

    call_id: int
    body: bytes  # the JSON body of the answer


# -- host -> daemon ---------------------------------------------------------------


class HostReady(_Msg):
    pid: int


class HostFailed(_Msg):
    error: str


class Generate(_Msg):
    """One chat completion's engine call: the prompt the host built; the
    sampling the agent asked for, as the host validated it."""

    call_id: int
    token: str
    step: int  # the host's count of this episode's calls (must match the daemon's)
    prompt: list[int]
    temperature: float
    max_tokens: int
    agent_seed: int | None = None
    stream: bool = False
    history_reset: bool = False
    stop: list[str] = []  # the agent's stop sequences


class Abort(_Msg):
    """The agent went away: abort the call's engine request."""

    call_id: int


class Unsent(_Msg):
    """A call the daemon answered whose reply never reached the agent (it
    hung up, or the write failed): its sample is dropped. An agent that
    gave up and retried would otherwise be trained on both tries, one of
    which it never saw."""

    token: str
    step: int


class EnvCall(_Msg):
    call_id: int
    token: str
    body: bytes  # POST env/step's JSON body


class PostReward(_Msg):
    """A reward the agent posted (key-checked and bounded by the host),
    answered by ``EnvReplied`` once the daemon holds it, before the agent
    hears "ok"."""

    call_id: int
    token: str
    reward: float
    success: bool | None = None


class SessionState(_Msg):
    """What the host decided for an episode: the gateway's refusal that
    ended it, a posted reward (already key-checked and bounded)."""

    token: str
    closed: bool = False
    terminated: str | None = None
    posted_reward: float | None = None
    posted_success: bool | None = None


class HostStats(_Msg):
    """The host's counters (GatewayStats fields it owns), whole."""

    streamed: int = 0
    errors: int = 0
    unauthorized: int = 0
    temperature_floored: int = 0
    rewards_refused: int = 0


ToHost = Union[HostStart, OpenSession, CloseSession, Settle, Tokens, Generated, CallFailed, EnvReplied]
ToDaemon = Union[HostReady, HostFailed, Generate, Abort, Unsent, EnvCall, SessionState, HostStats, PostReward]


class Channel(FrameProtocol):
    """One end of the channel. Delivery: in order, each message once, while
    the connection lives; no acknowledgement (the protocol's answers are
    its acknowledgements) and no high-water mark (what is queued is bounded
    by the episodes' calls in flight). ``on_messages`` gets each frame's
    messages, in order, on the loop; ``on_lost`` once, when the peer is
    gone (EOF, error, or a frame that does not decode: the peer is broken).
    """

    def __init__(self, incoming: type, on_messages: Callable[[list], None], on_lost: Callable[[str], None]):
        super().__init__(list[incoming], on_messages, on_lost, MAX_FRAME_BYTES)
        self._encoder = msgspec.msgpack.Encoder()
        self._out: list = []

    @property
    def on_messages(self) -> Callable[[list], None]:
        return self.on_decoded

    @classmethod
    async def connect(cls, sock, incoming: type, on_messages, on_lost) -> "Channel":
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_unix_connection(lambda: cls(incoming, on_messages, on_lost), sock=sock)
        return proto

    def send(self, msg) -> None:
        """Queue ``msg``; everything queued in this loop iteration leaves as
        one frame. Dropped once the channel is lost."""
        if self._lost:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(msg)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out:
            self.write_frame(self._encoder.encode(out))

    def close(self) -> None:
        self._flush()
        super().close()
