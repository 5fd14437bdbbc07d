"""The OpenAI API shapes the gateway speaks: the request it honours, its
errors, messages as the chat template renders them, and the response bodies
(tool calls and reasoning as vLLM's parsers read them, ``parsing.py``). No
state and no engine here."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from aiohttp import web

from rlnode.actor.generation import Generation
from rlnode.cubes.base import ToolCall

# Long agent histories (tool outputs, documents) outgrow aiohttp's 1 MiB default.
MAX_REQUEST_BYTES = 64 * 2**20
# New message text above this many characters is tokenized in a thread.
TOKENIZE_INLINE_CHARS = 32_768


class GatewayError(Exception):
    """Answered in OpenAI's error shape: ``{"error": {"message", "type",
    "param", "code"}}``."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


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


# -- messages ------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise GatewayError(400, f"{where}: only text content parts are supported", param="messages")
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise GatewayError(400, f"{where}: content must be a string or a list of text parts", param="messages")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object when they are JSON (the SDKs send a
    JSON string, templates want an object)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw if raw is not None else {}


def template_message(m: Any, i: int) -> dict[str, Any]:
    """An OpenAI message as the chat template renders it (also the form the
    gateway compares histories in)."""
    if not isinstance(m, dict):
        raise GatewayError(400, f"messages[{i}] must be an object", param="messages")
    role = m.get("role")
    if role == "developer":  # the newer name of the system role
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise GatewayError(400, f"messages[{i}].role {role!r} is not one of system, developer, user, "
                                "assistant, tool", param="messages")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"messages[{i}]")}
    if role == "assistant" and m.get("tool_calls"):
        calls = []
        for tc in m["tool_calls"]:
            f = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise GatewayError(400, f"messages[{i}].tool_calls: each needs function.name", param="messages")
            calls.append({"type": "function", "function": {"name": f["name"], "arguments": _arguments(f.get("arguments"))}})
        out["tool_calls"] = calls
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


class EnvStep(msgspec.Struct):
    tool: str = ""
    arguments: dict[str, Any] = {}
    text: str = ""


class EnvReward(msgspec.Struct):
    reward: float
    success: bool | None = None


async def read_body(request: web.Request, cls: type):
    raw = await request.read()
    try:
        return msgspec.json.decode(raw, type=cls)
    except msgspec.ValidationError as e:
        raise GatewayError(400, f"invalid request: {e}") from e
    except msgspec.DecodeError as e:
        raise GatewayError(400, f"request body is not JSON: {e}") from e


def openai_message(reply: dict[str, Any], calls: list[ToolCall], step: int,
                   reasoning: str | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply["content"] if reply["content"] or not calls else None}
    if reasoning is not None:
        msg.update(reasoning_delta(reasoning))
    if calls:
        msg["tool_calls"] = [{"id": f"call_{step}_{i}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                             for i, c in enumerate(calls)]
    return msg


def reasoning_delta(reasoning: str) -> dict[str, str]:
    """The reasoning fields of a message or chunk: ``reasoning`` is what
    ``vllm serve`` 0.26-0.32 returns, ``reasoning_content`` the older name
    that DeepSeek's API and many clients read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def usage(prompt: list[int], gen: Generation) -> dict[str, int]:
    n = len(gen.completion.token_ids)
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}

