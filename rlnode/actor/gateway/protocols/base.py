"""The one internal request and reply every API is translated to and from.

A protocol module (``chat.py``, ``completions.py``, ``responses.py``,
``messages.py``) reads its API's request body into a ``Call`` and writes an
``Answer`` back in its API's shape, whole or as server-sent events; its
errors too. Everything between (keys, turn and context limits, the prompt
in tokens, the history matching that keeps samples exact, the leased engine
call, the parsers, the record the samples are made from) is the gateway's
(``server.py``) and the same for every API. A new API is one new module
with one ``Protocol`` subclass, listed in ``protocols/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from aiohttp import web

from rlnode.actor.gateway.api import GatewayError
from rlnode.cubes.base import ToolCall


class Call(msgspec.Struct):
    """One LLM call, whichever API asked for it.

    The prompt is one of three things: ``messages`` (a conversation, in the
    form the chat template renders: ``api.template_message``), ``text`` (a
    raw prompt, no template: ``/v1/completions``), or ``prompt_ids`` (the
    agent's own token ids). ``tools`` are chat-completions tool schemas
    (``{"type": "function", "function": {...}}``), whatever form the API
    sent them in.
    """

    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    prompt_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # "auto" | "none" (forcing a call needs guided decoding)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop sequences (api.check_stop)
    stream: bool = False
    include_usage: bool = False  # chat: stream_options.include_usage
    return_token_ids: bool = False  # the reply carries prompt and completion token ids (vLLM's extension)
    # The API's own request, for what its reply echoes (Responses echoes
    # instructions, tools, previous_response_id).
    echo: dict[str, Any] = {}


@dataclass
class Answer:
    """What one engine call produced, read by the parsers: what every API's
    reply is written from."""

    id: str  # the reply's id (chatcmpl-..., resp_..., msg_...), unique per call of the run
    step: int  # the call's index in its episode
    model: str
    created: int
    content: str
    reasoning: str | None
    calls: list[ToolCall]
    # "stop" (end of turn), "length" (max_tokens or the context), "tool_calls"
    finish: str
    prompt: list[int]
    completion: list[int]
    call: Call = field(default_factory=Call)
    # The reply as the template renders it (content and calls, no
    # reasoning): what a re-sent history is matched against.
    reply: dict[str, Any] = field(default_factory=dict)
    # The stop sequence the completion ended on (its text, cut before it,
    # is what the agent gets); None: it ended otherwise.
    stop_sequence: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.completion)


class StreamWriter:
    """One streamed reply, as the API's server-sent events. ``open`` goes
    out before the first token; ``text`` with content as the engine
    produces it (only where the parsers promise it begins the final
    content); ``close`` with the rest (reasoning, content not sent yet, tool
    calls, the finish, usage); ``error`` when the call fails after the
    status line went out."""

    def open(self) -> bytes:
        raise NotImplementedError

    def text(self, delta: str) -> bytes:
        raise NotImplementedError

    def close(self, answer: Answer, sent: str) -> bytes:
        """The events after the last ``text``; ``sent`` is the content
        already streamed (a prefix of ``answer.content``)."""
        raise NotImplementedError

    def error(self, e: GatewayError) -> bytes:
        raise NotImplementedError


class Protocol:
    """One API the gateway speaks: the route it serves (below an episode's
    ``/episodes/{token}``), how its requests read and its replies and errors
    are written."""

    name: ClassVar[str]  # "chat" | "completions" | "responses" | "messages" (metrics, bench)
    route: ClassVar[str]  # e.g. "/v1/chat/completions"
    id_prefix: ClassVar[str]  # of Answer.id

    def parse(self, raw: bytes, session) -> Call:
        """The request body as a Call (GatewayError, in this API's terms,
        for one the gateway refuses). ``session``: the episode's
        ``GatewaySession`` (Responses resolves ``previous_response_id``
        against it)."""
        raise NotImplementedError

    def body(self, answer: Answer) -> dict[str, Any]:
        """The whole (not streamed) reply."""
        raise NotImplementedError

    def stream(self, answer_id: str, model: str, created: int, call: Call, prompt: list[int]) -> StreamWriter:
        raise NotImplementedError

    def error_body(self, e: GatewayError) -> dict[str, Any]:
        """The API's error object (OpenAI's shape unless it has its own)."""
        return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}

    def error_response(self, e: GatewayError) -> web.Response:
        return web.json_response(self.error_body(e), status=e.status)

    def model_card(self, name: str) -> dict[str, Any]:
        """``GET /models/{name}``'s body, and each entry of ``GET /models``."""
        return {"id": name, "object": "model", "created": 0, "owned_by": "rlnode"}

    def model_list(self, name: str) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card(name)]}

    def answered(self, answer: Answer, session) -> None:
        """The reply reached the agent (Responses keeps it for a later
        ``previous_response_id``; a reply that never reached it is never
        kept)."""


def sse(data: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event (``event:`` line where the API names its
    events, as Responses and Messages do)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + msgspec.json.encode(data) + b"\n\n"
