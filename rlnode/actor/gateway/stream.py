"""Streaming a completion as server-sent events, in the shape of the API it
came through (``Protocol.stream``): content as the engine produces it where
the output parsers promise that it stays a prefix of the final content
(decoded incrementally, never a partial tool-call tag or half a character;
``CompletionParser.stream_prefix``), the rest, the reasoning and the tool
calls whole at the end, as the non-streamed answer has them."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from rlnode.actor.episode import ChatRenderer
from rlnode.actor.gateway.api import GatewayError, hold_back_stop
from rlnode.actor.parsing import CompletionParser
from rlnode.log import get_logger

log = get_logger("rlnode.gateway")


def stream_safe(text: str, tools_on: bool, parser: CompletionParser) -> str:
    """The part of a growing completion that can be streamed as content now:
    what the parsers promise begins the final content, never half a UTF-8
    character."""
    return parser.stream_prefix(text, tools_on).rstrip("\ufffd")


async def stream_completion(gw, request, s, call, proto, prompt, sampling, step, version, reset, answer_id,
                            created) -> web.StreamResponse:
    """One call of session ``s``, served by gateway ``gw``, streamed as
    ``proto``'s server-sent events. Content streams as the engine produces
    it where the parsers allow; tool calls and reasoning come whole at the
    end (a partial call cannot be parsed)."""
    latest: list[Any] = [()]
    grew = asyncio.Event()
    text = _IncrementalText(gw.renderer)
    tools_on = bool(call.tools) and call.tool_choice != "none"
    parsed = call.messages is not None  # a raw prompt's text is not parsed: all of it streams

    def on_tokens(ids) -> None:
        latest[0] = ids
        grew.set()

    events = proto.stream(answer_id, gw.model_name, created, call, prompt)
    gen_task = asyncio.ensure_future(gw._generate(s, prompt, sampling, on_tokens, step=step, reset=reset,
                                                   agent_seed=call.seed))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    sent = ""
    try:
        # The status line goes out before the first token: from here on
        # errors travel as an error event.
        await resp.prepare(request)
        head = events.open()
        if head:
            await resp.write(head)
        while not gen_task.done():
            waiter = asyncio.ensure_future(grew.wait())
            await asyncio.wait([gen_task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            grew.clear()
            grown = text.update(latest[0])
            safe = stream_safe(grown, tools_on, gw.renderer.parser) if parsed else grown.rstrip("\ufffd")
            safe = hold_back_stop(safe, call.stop)  # never a stop sequence, nor a start of one
            if len(safe) > len(sent) and safe.startswith(sent):
                await resp.write(events.text(safe[len(sent):]))
                sent = safe
        try:
            gen = gen_task.result()
        except GatewayError as e:
            gw.stats.errors += 1
            await resp.write(events.error(e))
            return resp
        delivered = False
        answer = None
        try:
            answer = gw._answer_of(gen, call, prompt, step, answer_id, created)
            if not answer.content.startswith(sent):  # cannot happen with a prefix-stable decode; keep parity honest
                log.warning("gateway.stream_diverged", episode=s.episode_id, step=step)
                answer.content = sent
                if "content" in answer.reply:
                    answer.reply["content"] = sent
            gw._record(s, call, prompt, gen, step, version, sampling.temperature, reset, answer)
            gw.stats.streamed += 1
            await resp.write(events.close(answer, sent))
            await resp.write_eof()
            delivered = True
            proto.answered(answer, s)
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
