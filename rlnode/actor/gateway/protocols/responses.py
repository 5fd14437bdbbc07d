"""OpenAI Responses: ``POST /v1/responses``, what the Agents SDK and
Codex-style agents speak.

Input items become the conversation the chat template renders: messages
(``input_text`` / ``output_text`` parts), ``function_call`` items (joined
to the assistant message before them, as one turn with its calls),
``function_call_output`` items (tool messages). ``reasoning`` items are
left out: the gateway remembers a reply without its reasoning, and the
prompt keeps the reasoning's tokens by extending the previous prompt +
completion (``session.py``). ``instructions`` is the system message and
does not carry over to a later response (as OpenAI's API does).

``previous_response_id`` works within the episode: the gateway keeps each
delivered response's conversation (its input and output) for the episode's
lifetime, never across episodes, and never a response whose reply did not
reach the agent. ``store`` is accepted and means that; ``item_reference``
and ``conversation`` are refused.

The reply: a ``reasoning`` item (``reasoning_text`` content) when the
reasoning parser found reasoning, a ``message`` item, and a
``function_call`` item per call. A reply cut by ``max_output_tokens`` (or
the context) is ``status = "incomplete"`` with ``incomplete_details``; when
streamed it still ends with ``response.completed``, as ``vllm serve`` does
(the Agents SDK fails a run on ``response.incomplete``; an RL turn cut short
is still a sample). ``return_token_ids`` (an rlnode extension) adds the
prompt's and completion's ids at the top level.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from rlnode.actor.gateway.api import GatewayError, decode_body, template_message
from rlnode.actor.gateway.protocols.base import Answer, Call, Protocol, StreamWriter, sse
from rlnode.actor.gateway.protocols.chat import tool_choice_of

# Agents that resend a long run by previous_response_id keep this many of an
# episode's responses (its turns are bounded by actor.episode.max_turns).
MAX_KEPT_RESPONSES = 256


class ResponsesRequest(msgspec.Struct):
    input: str | list[dict[str, Any]] = []
    model: str = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    text: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    return_token_ids: bool | None = None
    # Accepted, with no effect here: reasoning (the effort is the model's
    # and its template's), store, metadata, user, include, truncation,
    # service_tier, prompt_cache_key, background (refused below).
    background: bool | None = None


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat-completions tool schemas."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise GatewayError(400, f"tools[{i}]: only function tools are supported (got {kind!r}); hosted tools "
                                    "(web search, file search, code interpreter) do not run here", param="tools")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as template messages (see the module's docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise GatewayError(400, f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(template_message({"role": item.get("role"), "content": item.get("content")}, i))
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise GatewayError(400, f"input[{i}]: a function_call needs a name", param="input")
            call = template_message({"role": "assistant", "content": None, "tool_calls": [
                {"function": {"name": item["name"], "arguments": item.get("arguments")}}]}, i)["tool_calls"][0]
            if out and out[-1]["role"] == "assistant":  # the calls of the turn whose message came before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else template_message({"role": "tool", "content": output},
                                                                            i)["content"]
            out.append({"role": "tool", "content": text, "tool_call_id": str(item.get("call_id", ""))})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise GatewayError(400, f"input[{i}]: encrypted reasoning is not supported", param="input")
        else:
            raise GatewayError(400, f"input[{i}]: item type {kind!r} is not supported (messages, function_call, "
                                    "function_call_output and reasoning items are)", param="input")
    return out


class Responses(Protocol):
    name = "responses"
    route = "/v1/responses"
    id_prefix = "resp_"

    def parse(self, raw: bytes, session) -> Call:
        req = decode_body(raw, ResponsesRequest)
        if req.background:
            raise GatewayError(400, "background responses are not supported", param="background")
        if req.conversation is not None:
            raise GatewayError(400, "conversation objects are not supported; use previous_response_id or send "
                                    "the items", param="conversation")
        fmt = (req.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") != "text":
            raise GatewayError(400, "text.format must be text (structured output needs guided decoding)",
                               param="text.format")
        messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
        if req.previous_response_id:
            kept = responses_of(session).get(req.previous_response_id)
            if kept is None:
                raise GatewayError(400, f"Previous response with id {req.previous_response_id!r} not found (only "
                                        "this episode's delivered responses are kept).",
                                   code="previous_response_not_found", param="previous_response_id")
            messages += [m for m in kept if m["role"] != "system"]
        messages += input_messages(req.input)
        if not messages:
            raise GatewayError(400, "input must not be empty", param="input")
        tools = function_tools(req.tools)
        return Call(messages=messages, tools=tools, tool_choice=tool_choice_of(req.tool_choice),
                    temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_output_tokens,
                    stream=bool(req.stream), return_token_ids=bool(req.return_token_ids),
                    echo={"instructions": req.instructions, "previous_response_id": req.previous_response_id,
                          "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                          "parallel_tool_calls": req.parallel_tool_calls is not False,
                          "temperature": req.temperature, "top_p": req.top_p,
                          "max_output_tokens": req.max_output_tokens})

    # -- the reply --------------------------------------------------------------

    def items(self, answer: Answer, status: str = "completed") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if answer.reasoning is not None:
            out.append(_reasoning_item(answer.id, answer.reasoning))
        if answer.content or not answer.calls:
            out.append(_message_item(answer.id, answer.content, status))
        out += [_call_item(answer, i) for i in range(len(answer.calls))]
        return out

    def body(self, answer: Answer, status: str | None = None) -> dict[str, Any]:
        cut = answer.finish == "length"
        status = status or ("incomplete" if cut else "completed")
        out = envelope(answer.id, answer.created, answer.model, answer.call.echo, status)
        out.update({
            "output": self.items(answer, status),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "max_output_tokens": answer.call.echo.get("max_output_tokens"), "store": True,
            "usage": {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": answer.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": answer.prompt_tokens + answer.completion_tokens},
        })
        if answer.call.return_token_ids:
            out["prompt_token_ids"], out["token_ids"] = answer.prompt, answer.completion
        return out

    def stream(self, answer_id: str, model: str, created: int, call: Call, prompt: list[int]) -> StreamWriter:
        return _ResponsesStream(self, answer_id, model, created, call)

    def answered(self, answer: Answer, session) -> None:
        kept = responses_of(session)
        if len(kept) >= MAX_KEPT_RESPONSES:
            kept.pop(next(iter(kept)))
        kept[answer.id] = [*(answer.call.messages or []), answer.reply]


def responses_of(session) -> dict[str, list[dict[str, Any]]]:
    """The episode's delivered responses (id -> conversation), kept on its
    session so they end with it."""
    kept = getattr(session, "responses", None)
    if kept is None:
        kept = session.responses = {}
    return kept


def envelope(answer_id: str, created: int, model: str, echo: dict[str, Any], status: str) -> dict[str, Any]:
    """A response's fields before its output: what the request echoes."""
    return {"id": answer_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": [], "error": None, "incomplete_details": None,
            "instructions": echo.get("instructions"), "previous_response_id": echo.get("previous_response_id"),
            "tools": echo.get("tools", []), "tool_choice": echo.get("tool_choice", "auto"),
            "parallel_tool_calls": echo.get("parallel_tool_calls", True), "temperature": echo.get("temperature"),
            "top_p": echo.get("top_p"), "metadata": {}, "text": {"format": {"type": "text"}}}


def _reasoning_item(answer_id: str, text: str) -> dict[str, Any]:
    return {"id": f"rs_{answer_id}", "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(answer_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": f"msg_{answer_id}", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(answer: Answer, i: int) -> dict[str, Any]:
    c = answer.calls[i]
    return {"id": f"fc_{answer.id}_{i}", "type": "function_call", "call_id": f"call_{answer.step}_{i}",
            "name": c.name, "arguments": json.dumps(c.arguments), "status": "completed"}


class _ResponsesStream(StreamWriter):
    """Responses' events, numbered (``sequence_number``), each item added,
    filled and done at its ``output_index``."""

    def __init__(self, proto: Responses, answer_id: str, model: str, created: int, call: Call):
        self.proto, self.id, self.model, self.created, self.call = proto, answer_id, model, created, call
        self.seq = 0
        self.index = 0  # output_index of the next item
        self.message_at: int | None = None  # output_index of the open message item

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    def _shell(self, status: str) -> dict[str, Any]:
        """The response as it stands before its output."""
        return envelope(self.id, self.created, self.model, self.call.echo, status)

    def open(self) -> bytes:
        return (self._event("response.created", response=self._shell("in_progress"))
                + self._event("response.in_progress", response=self._shell("in_progress")))

    def _open_message(self) -> bytes:
        self.message_at = self.index
        self.index += 1
        item = {**_message_item(self.id, "", "in_progress"), "content": []}
        return (self._event("response.output_item.added", output_index=self.message_at, item=item)
                + self._event("response.content_part.added", item_id=item["id"], output_index=self.message_at,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []}))

    def text(self, delta: str) -> bytes:
        head = self._open_message() if self.message_at is None else b""
        return head + self._event("response.output_text.delta", item_id=f"msg_{self.id}",
                                  output_index=self.message_at, content_index=0, delta=delta, logprobs=[])

    def close(self, answer: Answer, sent: str) -> bytes:
        out: list[bytes] = []
        status = "incomplete" if answer.finish == "length" else "completed"
        if answer.reasoning is not None:  # never streamed early, so no message is open yet
            at, self.index = self.index, self.index + 1
            item = _reasoning_item(self.id, answer.reasoning)
            out += [self._event("response.output_item.added", output_index=at,
                                item={**item, "content": [{"type": "reasoning_text", "text": ""}]}),
                    self._event("response.reasoning_text.delta", item_id=item["id"], output_index=at,
                                content_index=0, delta=answer.reasoning),
                    self._event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                content_index=0, text=answer.reasoning),
                    self._event("response.output_item.done", output_index=at, item=item)]
        if answer.content or not answer.calls or self.message_at is not None:
            if self.message_at is None:
                out.append(self._open_message())
            if len(answer.content) > len(sent):
                out.append(self.text(answer.content[len(sent):]))
            item = _message_item(self.id, answer.content, status)
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=self.message_at,
                                content_index=0, text=answer.content, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=self.message_at,
                                content_index=0, part=item["content"][0]),
                    self._event("response.output_item.done", output_index=self.message_at, item=item)]
        for i in range(len(answer.calls)):
            at, self.index = self.index, self.index + 1
            item = _call_item(answer, i)
            out += [self._event("response.output_item.added", output_index=at,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=at, item=item)]
        out.append(self._event("response.completed", response=self.proto.body(answer, status)))
        return b"".join(out)

    def error(self, e: GatewayError) -> bytes:
        return self._event("error", code=e.code, message=e.message, param=e.param)
