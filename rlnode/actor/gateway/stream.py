"""Streaming a completion as server-sent events in OpenAI's chunk format:
content as the engine produces it where the output parsers promise that it
stays a prefix of the final content (decoded incrementally, never a partial
tool-call tag or half a character; ``CompletionParser.stream_prefix``),
the rest, the reasoning and the tool calls whole at the end, as the
non-streamed answer has them."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from rlnode.actor.episode import ChatRenderer
from rlnode.actor.gateway.api import GatewayError, openai_message, reasoning_delta, usage
from rlnode.actor.parsing import CompletionParser
from rlnode.log import get_logger

log = get_logger("rlnode.gateway")


def stream_safe(text: str, tools_on: bool, parser: CompletionParser) -> str:
    """The part of a growing completion that can be streamed as content now:
    what the parsers promise begins the final content, never half a UTF-8
    character."""
    return parser.stream_prefix(text, tools_on).rstrip("\ufffd")


async def stream_completion(gw, request, s, req, messages, tools, tools_on, prompt, sampling, step,
                            version, reset) -> web.StreamResponse:
    """Server-sent events in OpenAI's chunk format for one call of session
    ``s``, served by gateway ``gw``. Content streams as the engine produces
    it where the parsers allow; tool calls and reasoning come whole at the
    end (a partial call cannot be parsed)."""
    latest: list[Any] = [()]
    grew = asyncio.Event()
    text = _IncrementalText(gw.renderer)

    def on_tokens(ids) -> None:
        latest[0] = ids
        grew.set()

    cid, created = f"chatcmpl-{s.episode_id}-{step}", int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra) -> bytes:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": gw.model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    gen_task = asyncio.ensure_future(gw._generate(s, prompt, sampling, on_tokens, step=step, reset=reset,
                                                   agent_seed=req.seed))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    sent = ""
    try:
        # The status line goes out before the first token: from here on
        # errors travel as an error event.
        await resp.prepare(request)
        await resp.write(chunk({"role": "assistant", "content": ""}))
        while not gen_task.done():
            waiter = asyncio.ensure_future(grew.wait())
            await asyncio.wait([gen_task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            grew.clear()
            safe = stream_safe(text.update(latest[0]), tools_on, gw.renderer.parser)
            if len(safe) > len(sent) and safe.startswith(sent):
                await resp.write(chunk({"content": safe[len(sent):]}))
                sent = safe
        try:
            gen = gen_task.result()
        except GatewayError as e:
            gw.stats.errors += 1
            await resp.write(b"data: " + json.dumps({"error": {"message": e.message, "type": e.type,
                                                                 "code": e.code}}).encode() + b"\n\n")
            return resp
        delivered = False
        try:
            reply, finish, calls, reasoning = gw._reply(gen, tools if tools_on else None, prompt)
            if reasoning is not None:  # never streamed early (see stream_safe), so it precedes all content
                await resp.write(chunk(reasoning_delta(reasoning)))
            content = reply["content"]
            if not content.startswith(sent):  # cannot happen with a prefix-stable decode; keep parity honest
                log.warning("gateway.stream_diverged", episode=s.episode_id, step=step)
                reply["content"] = content = sent
            if len(content) > len(sent):
                await resp.write(chunk({"content": content[len(sent):]}))
            if calls:
                msg = openai_message(reply, calls, step)
                await resp.write(chunk({"tool_calls": [dict(tc, index=i)
                                                        for i, tc in enumerate(msg["tool_calls"])]}))
            gw._record(s, messages, tools, prompt, gen, step, version, sampling.temperature, reset, reply)
            gw.stats.streamed += 1
            await resp.write(chunk({}, finish))
            if (req.stream_options or {}).get("include_usage"):
                body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": gw.model_name,
                        "choices": [], "usage": usage(prompt, gen)}
                await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            delivered = True
        finally:
            if not delivered:  # the agent hung up before the end of the stream: not trained on
                gw._unsent(s, step)
        return resp
    finally:
        # A client that went away mid-stream: abort the engine request.
        if not gen_task.done():
            gen_task.cancel()
            await asyncio.gather(gen_task, return_exceptions=True)


class _IncrementalText:
    """The text of a growing completion, decoding only what is new (a
    whole-sequence decode per engine step would be quadratic in its length).
    A window of already-decoded tokens is decoded again with the new ones,
    so byte-level pieces that join into one character come out whole; a
    trailing partial character waits for its next token."""

    def __init__(self, renderer: ChatRenderer):
        self.renderer = renderer
        self.text = ""
        self.prefix = 0  # decoding window starts here
        self.read = 0  # tokens up to here are in self.text

    def update(self, ids) -> str:
        ids = list(ids[self.prefix:])
        if ids and ids[-1] == self.renderer.eos_id:
            ids = ids[:-1]
        done = self.read - self.prefix
        if len(ids) > done:
            head = self.renderer.decode(ids[:done])
            new = self.renderer.decode(ids)
            if len(new) > len(head) and not new.endswith("\ufffd"):
                self.text += new[len(head):]
                self.prefix, self.read = self.read, self.prefix + len(ids)
        return self.text
