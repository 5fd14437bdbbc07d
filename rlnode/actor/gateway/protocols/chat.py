"""OpenAI Chat Completions: ``POST /v1/chat/completions``, as ``vllm serve``
answers it (``reasoning`` and ``reasoning_content`` beside the content,
``tool_calls`` when tools were offered; with ``return_token_ids``, vLLM's
``prompt_token_ids`` and per-choice ``token_ids``)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from rlnode.actor.gateway.api import GatewayError, check_stop, decode_body, template_message
from rlnode.actor.gateway.protocols.base import Answer, Call, Protocol, StreamWriter, sse


class ChatRequest(msgspec.Struct):
    """The fields of ``POST /chat/completions`` the gateway honours; unknown
    fields (``store``, ``metadata``, ``user``, ...) are ignored."""

    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    return_token_ids: bool | None = None


def check_n(n: int | None) -> None:
    if n not in (None, 1):
        raise GatewayError(400, "n must be 1 (one sample per call)", param="n")


def tool_choice_of(choice: Any) -> str:
    choice = choice if choice is not None else "auto"
    if choice not in ("auto", "none"):
        raise GatewayError(400, "tool_choice must be 'auto' or 'none' (forcing a call needs guided decoding)",
                           param="tool_choice")
    return choice


def openai_tool_calls(answer: Answer) -> list[dict[str, Any]]:
    return [{"id": f"call_{answer.step}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in enumerate(answer.calls)]


def reasoning_delta(reasoning: str) -> dict[str, str]:
    """The reasoning fields of a message or chunk: ``reasoning`` is what
    ``vllm serve`` 0.26-0.32 returns, ``reasoning_content`` the older name
    that DeepSeek's API and many clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def openai_usage(answer: Answer) -> dict[str, int]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}


class Chat(Protocol):
    name = "chat"
    route = "/v1/chat/completions"
    id_prefix = "chatcmpl-"

    def parse(self, raw: bytes, session) -> Call:
        req = decode_body(raw, ChatRequest)
        check_n(req.n)
        if not req.messages:
            raise GatewayError(400, "messages must not be empty", param="messages")
        return Call(messages=[template_message(m, i) for i, m in enumerate(req.messages)],
                    tools=req.tools or None, tool_choice=tool_choice_of(req.tool_choice),
                    temperature=req.temperature, top_p=req.top_p,
                    max_tokens=req.max_completion_tokens or req.max_tokens, seed=req.seed, stop=check_stop(req.stop),
                    stream=bool(req.stream), include_usage=bool((req.stream_options or {}).get("include_usage")),
                    return_token_ids=bool(req.return_token_ids))

    def message(self, answer: Answer, with_reasoning: bool = True) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant",
                               "content": answer.content if answer.content or not answer.calls else None}
        if with_reasoning and answer.reasoning is not None:
            msg.update(reasoning_delta(answer.reasoning))
        if answer.calls:
            msg["tool_calls"] = openai_tool_calls(answer)
        return msg

    def body(self, answer: Answer) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": self.message(answer), "finish_reason": answer.finish,
                                  "logprobs": None}
        out: dict[str, Any] = {"id": answer.id, "object": "chat.completion", "created": answer.created,
                               "model": answer.model, "choices": [choice], "usage": openai_usage(answer)}
        if answer.call.return_token_ids:
            out["prompt_token_ids"] = answer.prompt
            choice["token_ids"] = answer.completion
        return out

    def stream(self, answer_id: str, model: str, created: int, call: Call, prompt: list[int]) -> StreamWriter:
        return _ChatStream(answer_id, model, created, call, prompt)


class _ChatStream(StreamWriter):
    def __init__(self, answer_id: str, model: str, created: int, call: Call, prompt: list[int]):
        self.id, self.model, self.created, self.call, self.prompt = answer_id, model, created, call, prompt

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, token_ids: list[int] | None = None,
               **extra) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [choice], **extra})

    def open(self) -> bytes:
        extra = {"prompt_token_ids": self.prompt} if self.call.return_token_ids else {}
        return self._chunk({"role": "assistant", "content": ""}, **extra)

    def text(self, delta: str) -> bytes:
        return self._chunk({"content": delta})

    def close(self, answer: Answer, sent: str) -> bytes:
        out = []
        if answer.reasoning is not None:  # never streamed early, so it precedes all content
            out.append(self._chunk(reasoning_delta(answer.reasoning)))
        if len(answer.content) > len(sent):
            out.append(self._chunk({"content": answer.content[len(sent):]}))
        if answer.calls:
            out.append(self._chunk({"tool_calls": [dict(tc, index=i)
                                                   for i, tc in enumerate(openai_tool_calls(answer))]}))
        # vLLM sends each chunk's new ids; here all of them, once, with the
        # finish (early content is text decoded ahead of the ids' record).
        out.append(self._chunk({}, answer.finish, answer.completion if self.call.return_token_ids else None))
        if self.call.include_usage:
            out.append(sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model, "choices": [], "usage": openai_usage(answer)}))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def error(self, e: GatewayError) -> bytes:
        return sse({"error": {"message": e.message, "type": e.type, "code": e.code}})
