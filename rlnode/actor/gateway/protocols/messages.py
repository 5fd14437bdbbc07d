"""Anthropic Messages: ``POST /v1/messages``, what agents on the
``anthropic`` SDK (and Claude-Code-style harnesses) speak. The SDK's key
arrives in ``x-api-key`` (or ``Authorization: Bearer`` with an auth token);
``anthropic-version`` and ``anthropic-beta`` are accepted whatever they say.

The conversation the chat template renders: ``system`` (a string or text
blocks, joined as ``vllm serve`` joins them) first; a user turn's
``tool_result`` blocks become tool messages, in order, and its text one
user message after them; an assistant turn's text blocks its content and
its ``tool_use`` blocks its tool calls (``input`` as the arguments).
``thinking`` and ``redacted_thinking`` blocks are left out: the gateway
remembers a reply without its reasoning, and the prompt keeps the
reasoning's tokens by extending the previous prompt + completion.

The reply's content: a ``thinking`` block (empty ``signature``: nothing
signs it here) when the reasoning parser found reasoning, a ``text`` block,
a ``tool_use`` block per call; ``stop_reason`` ``end_turn``, ``max_tokens``
or ``tool_use``. Errors are Anthropic's: ``{"type": "error", "error":
{"type", "message"}}`` with the same status codes, so the SDK raises its own
exception types. ``thinking`` (the budget) and ``metadata`` are accepted
and have no effect: reasoning is the model's and its template's.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from rlnode.actor.gateway.api import GatewayError, check_stop, decode_body, template_message
from rlnode.actor.gateway.protocols.base import Answer, Call, Protocol, StreamWriter, sse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

# Anthropic's error types by status (its SDK picks the exception by status).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}


class MessagesRequest(msgspec.Struct):
    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # rlnode's extensions (vLLM's names): a sampling seed (mixed with the
    # episode's, as every API's is), the token ids in the reply.
    seed: int | None = None
    return_token_ids: bool | None = None


def _blocks_text(content: Any, where: str, allowed: tuple[str, ...] = ("text",), sep: str = "") -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: content must be a string or a list of blocks", param=where)
    out = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in allowed:
            raise GatewayError(400, f"{where}.content[{j}]: block type {kind!r} is not supported here (text only: "
                                    "no images or documents)", param=where)
        out.append(str(b.get("text", "")))
    return sep.join(out)


def conversation(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request as template messages (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    system = _blocks_text(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise GatewayError(400, f"{where}.role must be user or assistant", param="messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise GatewayError(400, f"{where}: content must be a string or a list of blocks", param="messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_result" and m["role"] == "user":
                text = _blocks_text(b.get("content"), f"{where}.content[{j}]", sep="\n")
                out.append({"role": "tool", "content": text, "tool_call_id": str(b.get("tool_use_id", ""))})
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str):
                    raise GatewayError(400, f"{where}.content[{j}]: a tool_use needs a name", param="messages")
                calls.append({"function": {"name": b["name"], "arguments": b.get("input") or {}}})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue
            else:
                raise GatewayError(400, f"{where}.content[{j}]: block type {kind!r} is not supported in a "
                                        f"{m['role']} turn", param="messages")
        if m["role"] == "assistant":
            out.append(template_message({"role": "assistant", "content": "".join(texts), "tool_calls": calls}, i))
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"),
                                                                                            dict):
            kind = t.get("type") if isinstance(t, dict) else None
            raise GatewayError(400, f"tools.{i}: only client tools with a name and an input_schema are supported"
                                    + (f" (got type {kind!r}: server tools do not run here)" if kind else ""),
                               param="tools")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def tool_choice_of(choice: dict[str, Any] | None) -> str:
    kind = (choice or {}).get("type", "auto")
    if kind not in ("auto", "none"):
        raise GatewayError(400, f"tool_choice.type {kind!r} is not supported: 'auto' or 'none' (forcing a call "
                                "needs guided decoding)", param="tool_choice")
    return kind


class Messages(Protocol):
    name = "messages"
    route = "/v1/messages"
    id_prefix = "msg_"

    def parse(self, raw: bytes, session) -> Call:
        req = decode_body(raw, MessagesRequest)
        if req.top_k not in (None, 0, -1):
            raise GatewayError(400, "top_k is not supported: the run fixes its sampling (actor.sampling)",
                               param="top_k")
        if req.max_tokens < 1:
            raise GatewayError(400, "max_tokens: must be at least 1", param="max_tokens")
        if not req.messages:
            raise GatewayError(400, "messages: at least one message is required", param="messages")
        return Call(messages=conversation(req), tools=chat_tools(req.tools), tool_choice=tool_choice_of(req.tool_choice),
                    temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens,
                    seed=req.seed, stop=check_stop(req.stop_sequences or None, "stop_sequences"),
                    stream=bool(req.stream),
                    return_token_ids=bool(req.return_token_ids))

    def blocks(self, answer: Answer) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if answer.reasoning is not None:
            out.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.content or not answer.calls:
            out.append({"type": "text", "text": answer.content})
        out += [{"type": "tool_use", "id": _tool_use_id(answer, i), "name": c.name, "input": c.arguments}
                for i, c in enumerate(answer.calls)]
        return out

    def body(self, answer: Answer) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": answer.id, "type": "message", "role": "assistant", "model": answer.model,
            "content": self.blocks(answer), "stop_reason": _stop_reason(answer),
            "stop_sequence": answer.stop_sequence,
            "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
        }
        if answer.call.return_token_ids:
            out["prompt_token_ids"], out["token_ids"] = answer.prompt, answer.completion
        return out

    def stream(self, answer_id: str, model: str, created: int, call: Call, prompt: list[int]) -> StreamWriter:
        return _MessagesStream(self, answer_id, model, len(prompt))

    def error_body(self, e: GatewayError) -> dict[str, Any]:
        kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": e.message}}

    def error_response(self, e: GatewayError) -> web.Response:
        return web.json_response(self.error_body(e), status=e.status)

    def model_card(self, name: str) -> dict[str, Any]:
        return {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}

    def model_list(self, name: str) -> dict[str, Any]:
        return {"data": [self.model_card(name)], "has_more": False, "first_id": name, "last_id": name}


def _stop_reason(answer: Answer) -> str:
    return "stop_sequence" if answer.stop_sequence is not None and not answer.calls else STOP_REASONS[answer.finish]


def _tool_use_id(answer: Answer, i: int) -> str:
    return f"toolu_{answer.step}_{i}"


class _MessagesStream(StreamWriter):
    def __init__(self, proto: Messages, answer_id: str, model: str, prompt_tokens: int):
        self.proto, self.id, self.model, self.prompt_tokens = proto, answer_id, model, prompt_tokens
        self.block = -1  # index of the last block started
        self.text_open = False

    def open(self) -> bytes:
        return sse({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}}, "message_start")

    def _start(self, block: dict[str, Any]) -> bytes:
        self.block += 1
        return sse({"type": "content_block_start", "index": self.block, "content_block": block},
                   "content_block_start")

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self.block, "delta": delta}, "content_block_delta")

    def _stop(self) -> bytes:
        return sse({"type": "content_block_stop", "index": self.block}, "content_block_stop")

    def text(self, delta: str) -> bytes:
        head = b""
        if not self.text_open:
            self.text_open = True
            head = self._start({"type": "text", "text": ""})
        return head + self._delta({"type": "text_delta", "text": delta})

    def close(self, answer: Answer, sent: str) -> bytes:
        out: list[bytes] = []
        if answer.reasoning is not None:  # never streamed early, so it is the first block
            out += [self._start({"type": "thinking", "thinking": "", "signature": ""}),
                    self._delta({"type": "thinking_delta", "thinking": answer.reasoning}), self._stop()]
        if answer.content or not answer.calls or self.text_open:
            rest = answer.content[len(sent):]
            if rest or not self.text_open:
                out.append(self.text(rest))
            out.append(self._stop())
        for i, c in enumerate(answer.calls):
            out += [self._start({"type": "tool_use", "id": _tool_use_id(answer, i), "name": c.name, "input": {}}),
                    self._delta({"type": "input_json_delta", "partial_json": msgspec.json.encode(c.arguments).decode()}),
                    self._stop()]
        out += [sse({"type": "message_delta", "delta": {"stop_reason": _stop_reason(answer),
                                                         "stop_sequence": answer.stop_sequence},
                     "usage": {"output_tokens": answer.completion_tokens}}, "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]
        return b"".join(out)

    def error(self, e: GatewayError) -> bytes:
        return sse(self.proto.error_body(e), "error")
