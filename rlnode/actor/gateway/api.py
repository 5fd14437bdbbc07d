"""What every API the gateway speaks shares (``protocols/`` has each API's
own): its error, messages as the chat template renders them (the form
re-sent histories are compared in), the environment routes' bodies. No
state and no engine here."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from aiohttp import web


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


# Stop sequences a call may give (OpenAI allows 4, Anthropic more; vLLM
# checks each against the text of every step).
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256


def check_stop(stop: Any, param: str = "stop") -> tuple[str, ...]:
    """An agent's stop sequences (a string or a list of them) as the engine
    takes them, or GatewayError naming what is wrong."""
    if stop is None:
        return ()
    seqs = [stop] if isinstance(stop, str) else stop
    if not isinstance(seqs, (list, tuple)) or not all(isinstance(x, str) and x for x in seqs):
        raise GatewayError(400, f"{param} must be a non-empty string or a list of them", param=param)
    if len(seqs) > MAX_STOP_SEQUENCES or any(len(x) > MAX_STOP_CHARS for x in seqs):
        raise GatewayError(400, f"{param}: at most {MAX_STOP_SEQUENCES} sequences of at most {MAX_STOP_CHARS} "
                                "characters", param=param)
    return tuple(seqs)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """``text`` up to the first stop sequence in it, and that sequence
    (None: no stop sequence in it)."""
    hits = [(i, s) for s in stop if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    i, s = min(hits)
    return text[:i], s


def hold_back_stop(text: str, stop: tuple[str, ...]) -> str:
    """What of a growing completion can be streamed now: cut at a stop
    sequence in it, and short of a tail that may be the start of one."""
    text, hit = cut_at_stop(text, stop)
    if hit is not None or not stop:
        return text
    keep = len(text)
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if s.startswith(text[-k:]):
                keep = min(keep, len(text) - k)
                break
    return text[:keep]


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
    return decode_body(await request.read(), cls)


def decode_body(raw: bytes, cls: type):
    """A JSON body as ``cls`` (GatewayError 400 naming what is wrong)."""
    try:
        return msgspec.json.decode(raw, type=cls)
    except msgspec.ValidationError as e:
        raise GatewayError(400, f"invalid request: {e}") from e
    except msgspec.DecodeError as e:
        raise GatewayError(400, f"request body is not JSON: {e}") from e
