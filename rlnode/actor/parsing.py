"""Completion text -> (content, reasoning, tool calls), through vLLM's own
output parsers: the ones ``vllm serve --tool-call-parser T
--reasoning-parser R`` uses (``model.tool_parser``,
``model.reasoning_parser``), composed as it composes them: reasoning is
split off first, tool calls are read from the rest (vLLM's
``DelegatingParser.parse``).

Owns: checking the parser names against the installed vLLM, one cached
tokenizer and parser class per tokenizer, and rlnode's rules on top of
vLLM's result:

* Tool calls are read only on a turn that offers tools (as ``vllm serve``
  does); a turn without tools is content (and reasoning) only.
* Arguments must be a JSON object (a cube takes a dict); a JSON string that
  holds an object counts (some models serialise twice).
* A call the parser could not read is an error the agent is shown
  (``Parsed.error``, the native loop's ``Action.parse_error``), never an
  exception: vLLM's parsers log such a call and return the text as content,
  so a call marker of the parser still in the content is that error, and a
  parser that raises is one too.

A vLLM parser object is made per completion (``vllm serve`` makes one per
response: they keep state, and some read the offered tools on
construction); with the tokenizer cached that costs 2-170 us.

Token-in/token-out: only decoded text is read here; nothing is tokenized,
and nothing here goes back into a prompt. Must not decide what an agent
sees (``episode.py``, the gateway) or import vLLM other than through
``vllm_compat``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

import msgspec

from rlnode.actor import vllm_compat
from rlnode.config import ConfigError
from rlnode.cubes.base import ToolCall

# Registered by vLLM but unusable here: gpt-oss (Harmony) output is parsed
# from token ids through openai_harmony, not from text.
UNSUPPORTED = {
    "openai": "gpt-oss's Harmony format is parsed from token ids (vLLM's HarmonyParser), which rlnode does not wire",
    "openai_gptoss": "gpt-oss's Harmony format is parsed from token ids (vLLM's HarmonyParser), which rlnode does "
                     "not wire",
}
# Where vLLM's tool parsers keep the text that opens a call (Hermes and
# Qwen "<tool_call>", Mistral "[TOOL_CALLS]", Llama "<|python_tag|>", ...).
REQUEST_CACHE = 64  # distinct tool lists whose request objects are kept (CompletionParser._request)
_MARKER_ATTRS = ("tool_call_start_token", "bot_token", "tool_calls_start_token", "bot_string", "tc_start")


class Parsed(NamedTuple):
    """One completion, read."""

    content: str  # what the model said, reasoning and call markup removed ("" for none)
    reasoning: str | None  # None without a reasoning parser or when the model wrote none
    tool_calls: list[ToolCall]
    error: str | None  # a call was tried but could not be read (shown to the agent)


def check_parser_names(tool_parser: str, reasoning_parser: str) -> None:
    """ConfigError naming the key and the known names when the installed
    vLLM has no such parser ("" is none)."""
    tools, reasoning = vllm_compat.parser_names()
    for key, name, known in (("model.tool_parser", tool_parser, tools),
                             ("model.reasoning_parser", reasoning_parser, reasoning)):
        if name in UNSUPPORTED:
            raise ConfigError(f"{key} = {name!r} is not supported: {UNSUPPORTED[name]}")
        if name and name not in known:
            names = ", ".join(n for n in known if n not in UNSUPPORTED)
            raise ConfigError(f"{key} = {name!r} is not a parser of the installed vLLM "
                              f"({vllm_compat.installed_version()}); known: {names} (or \"\" for none)")


def _quiet_vllm_parsers() -> None:
    """vLLM's parsers log every call they cannot read with a traceback (once
    per completion: thousands a minute in an RL run); rlnode reports those as
    the agent's parse errors instead (``Parsed.error``, counted per cube).
    These loggers serve output parsing only, which runs in this process
    for rlnode alone."""
    for name in ("vllm.tool_parsers", "vllm.reasoning", "vllm.parser"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


class CompletionParser:
    """Reads completions of one tokenizer's model. Built once per tokenizer
    (``ChatRenderer.parser``); ``parse`` is cheap and stateless between
    calls."""

    def __init__(self, tokenizer, tool_parser: str = "hermes", reasoning_parser: str = ""):
        check_parser_names(tool_parser, reasoning_parser)
        _quiet_vllm_parsers()
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self._tokenizer = vllm_compat.cached_tokenizer(tokenizer)
        # Turns that offer tools / turns that do not (reasoning only, if any).
        self._with_tools = vllm_compat.output_parser_class(tool_parser, reasoning_parser)
        self._without_tools = vllm_compat.output_parser_class("", reasoning_parser)
        self._requests: dict[bytes, Any] = {}  # tool list (JSON) -> vLLM request object (_request)
        self._markers: tuple[str, ...] = ()
        self._stream_marker: str | None = None
        if self._with_tools is not None:
            try:  # a tokenizer that lacks a parser's marker tokens fails here, at start, not per turn
                sample = self._with_tools(self._tokenizer, None)
            except Exception as e:
                keys = " and ".join(f"{k} = {v!r}" for k, v in (("model.tool_parser", tool_parser),
                                                                ("model.reasoning_parser", reasoning_parser)) if v)
                raise ConfigError(f"{keys}: the parser does not fit this model's tokenizer: {e}") from e
            tool = getattr(sample, "tool_parser", None)
            self._markers = tuple(dict.fromkeys(m for a in _MARKER_ATTRS
                                                if isinstance(m := getattr(tool, a, None), str) and m))
            # Hermes' content is exactly the text before its first marker
            # (or all of it), so that text can stream before the call ends.
            if tool_parser and vllm_compat.tool_parser_class(tool_parser) is vllm_compat.tool_parser_class("hermes"):
                self._stream_marker = vllm_compat.tool_parser_class("hermes").tool_call_start_token

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None, *, output_ids: list[int] = (),
              prompt_ids: list[int] | None = None) -> Parsed:
        """``tools``: the OpenAI tool list this turn offers (none: no call is
        read); ``output_ids``/``prompt_ids``: the completion's and prompt's
        token ids, for parsers that look at them."""
        cls = self._with_tools if tools and self.tool_parser else self._without_tools
        if cls is None:
            return Parsed(text, None, [], None)
        request = self._request(tools if cls is self._with_tools else None)
        try:
            parser = cls(self._tokenizer, request.tools)
            reasoning, content, calls = vllm_compat.parse_output(parser, text, request, list(output_ids), prompt_ids)
        except Exception as e:  # a parser bug or a refusal (Mistral < v11: two [TOOL_CALLS])
            return Parsed(text, None, [], f"vLLM's {self._names()} parser failed on this output: {e}"[:500])
        content = content or ""
        out, errors = _tool_calls(calls or [])
        # vLLM leaves an unreadable call in the content (Hermes) or drops its
        # marker (Mistral): a marker with no call read, or one still in the
        # content, is a call the model tried.
        if request.tools and (tried := [m for m in self._markers if m in content or (not calls and m in text)]):
            errors.append(f"invalid tool call: {tried[0]} markup that the {self.tool_parser} parser could not read")
        return Parsed(content, reasoning, out, "; ".join(errors) or None)

    def _request(self, tools: list[dict[str, Any]] | None):
        """vLLM's request object for ``tools`` (what parsers read), built once
        per tool list: an agent offers the same tools on every call, and a
        pydantic request per call was a tenth of a gateway call's CPU."""
        try:
            key = msgspec.json.encode(tools)
        except (TypeError, msgspec.EncodeError):  # not JSON: not cached
            key = None
        request = self._requests.get(key) if key is not None else None
        if request is None:
            try:
                request = vllm_compat.chat_request(tools)
            except Exception:  # not OpenAI function tools: offer the names alone, so calls are still read
                request = vllm_compat.chat_request(_names_only(tools))
            if key is not None:
                if len(self._requests) >= REQUEST_CACHE:
                    self._requests.clear()
                self._requests[key] = request
        return request

    def _names(self) -> str:
        return " + ".join(n for n in (self.tool_parser, self.reasoning_parser) if n)

    def stream_prefix(self, text: str, tools_on: bool) -> str:
        """The part of a growing completion that is sure to begin its final
        content, so it can be streamed now: all of it when nothing is
        parsed, the text before a (possibly partial) Hermes ``<tool_call>``;
        "" where the content is known only at the end (a reasoning parser,
        other tool parsers)."""
        if self.reasoning_parser:
            return ""
        if not tools_on or not self.tool_parser:
            return text
        marker = self._stream_marker
        if marker is None:
            return ""
        at = text.find(marker)
        if at < 0:
            at = next((len(text) - k for k in range(min(len(marker) - 1, len(text)), 0, -1)
                       if marker.startswith(text[-k:])), len(text))
        # Whitespace alone before a call is no content to vLLM (None): wait.
        return text[:at] if text[:at].strip() else ""


def _names_only(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    names = [f.get("name") for t in tools or [] if isinstance(t, dict) and isinstance(f := t.get("function"), dict)]
    return [{"type": "function", "function": {"name": n}} for n in names if isinstance(n, str)] or None


def _tool_calls(calls) -> tuple[list[ToolCall], list[str]]:
    """vLLM's calls (arguments as JSON text) as ToolCalls, and why any was
    dropped."""
    out: list[ToolCall] = []
    errors: list[str] = []
    for c in calls:
        raw = c.arguments or ""
        try:
            args = json.loads(raw) if raw.strip() else {}
            if isinstance(args, str):  # serialised twice: a JSON string holding the object
                args = json.loads(args)
        except ValueError as e:
            errors.append(f"invalid arguments for {c.name!r} ({raw[:80]!r}): {e}")
            continue
        if not isinstance(args, dict) or not c.name:
            errors.append(f"invalid tool call {c.name!r}: expected a name and an object of arguments, "
                          f"got {raw[:80]!r}")
            continue
        out.append(ToolCall(c.name, args))
    return out, errors
