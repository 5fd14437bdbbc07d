"""The gateway host: a process of its own per actor node
(``actor.gateway_host = "process"``) serving the gateway's HTTP side, so
that the daemon's event loop (vLLM's output handler, the link, the
scheduler) does not carry it.

Owns, on its own event loop and cores: the episode routes on the gateway's
TCP port and agent socket (both bound by the daemon, which keeps them open
across host restarts), the episode keys' checks, request validation, the
per-session text work (history matching, the chat template, tokenizing,
tool-call and reasoning parsing, ``server.py``'s ``Gateway`` as is), the
replies and streaming, a posted reward (key-checked, bounded).

Must not touch: engines, leases, samples, rewards' use, the cube task. An
LLM call leaves as ``Generate`` with the prompt ids this process built; the
daemon (``hosted.py``) checks it, runs it and keeps the record samples are
made from; the answer's ids come back to build the reply and the history.
``env/step`` is answered by the daemon, which owns the task.

Forked for the daemon by its fork server (``forkserver.py``, which has
imported transformers and vLLM's parsers already), with three descriptors:
the channel's socket and the two listening sockets (``main``); exits when
the channel closes (the daemon is gone) or on SIGTERM.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import sys
from typing import Any, Callable

import msgspec
from aiohttp import web

from rlnode.actor.engine import Completion, SamplingSettings
from rlnode.actor.episode import EpisodeSettings, make_renderer
from rlnode.actor.gateway.api import MAX_REQUEST_BYTES, GatewayError
from rlnode.actor.gateway.protocol import (
    Abort, CallFailed, Channel, CloseSession, EnvCall, EnvReplied, Generate, Generated, HostFailed, HostReady,
    HostStart, HostStats, OpenSession, PostReward, SessionState, Settle, ToHost, Tokens, Unsent,
)
from rlnode.actor.gateway.server import Gateway
from rlnode.actor.gateway.session import GatewaySession
from rlnode.config import ModelConfig

STATS_EVERY_S = 0.5  # the host's counters reach the daemon's /metrics this often (and with every SessionState)


class _Generation(msgspec.Struct):
    """What the host learns of a call: the completion's ids and finish
    reason (``Gateway._reply`` and ``usage`` read no more)."""

    completion: Completion


class _Pending:
    __slots__ = ("fut", "on_tokens", "ids", "token")

    def __init__(self, fut: asyncio.Future, token: str, on_tokens: Callable | None = None):
        self.fut, self.token, self.on_tokens, self.ids = fut, token, on_tokens, []


class HostGateway(Gateway):
    """``Gateway`` whose engine is the daemon, across the channel."""

    def __init__(self, renderer, model_name: str, chan: Channel, history: str = "extend"):
        super().__init__(None, renderer, None, model_name, history)
        self.chan = chan
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}

    # -- calls to the daemon -------------------------------------------------------

    def _ask(self, token: str, on_tokens: Callable | None = None) -> tuple[int, _Pending]:
        call_id = next(self._ids)
        p = self._pending[call_id] = _Pending(asyncio.get_running_loop().create_future(), token, on_tokens)
        return call_id, p

    async def _generate(self, s: GatewaySession, prompt: list[int], sampling: SamplingSettings,
                        on_tokens: Callable | None = None, *, step: int, reset: bool,
                        agent_seed: int | None) -> _Generation:
        call_id, p = self._ask(s.token, on_tokens)
        self.chan.send(Generate(call_id, s.token, step, prompt, sampling.temperature, sampling.max_tokens,
                                agent_seed, on_tokens is not None, reset, list(sampling.stop)))
        try:
            ids, finish = await p.fut
        except asyncio.CancelledError:  # the agent went away: the daemon aborts the engine request
            if self._pending.pop(call_id, None) is not None:
                self.chan.send(Abort(call_id))
            elif p.fut.done() and not p.fut.cancelled() and p.fut.exception() is None:
                self.chan.send(Unsent(s.token, step))  # answered, and recorded there: drop it
            raise
        finally:
            self._pending.pop(call_id, None)
        if s.closed:
            raise GatewayError(404, "the episode ended during the call", code="episode_not_found")
        return _Generation(Completion(ids, [], finish))

    def _record(self, s, call, prompt, gen, step, version, temperature, reset, answer) -> None:
        # The daemon keeps the calls (its own record); the host the history.
        s.remember(step, call, prompt, gen.completion.token_ids, answer.reply)

    def _unsent(self, s: GatewaySession, step: int) -> None:
        # The history here; the call's record (and the count) in the daemon.
        s.forget(step)
        self.chan.send(Unsent(s.token, step))

    async def _env_tools(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
        except GatewayError as e:
            return e.response()
        return web.Response(body=s.tools_json, content_type="application/json")

    async def _env_step(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
            raw = await request.read()
            call_id, p = self._ask(s.token)
            self.chan.send(EnvCall(call_id, s.token, raw))
            try:
                body = await p.fut
            finally:
                self._pending.pop(call_id, None)
        except GatewayError as e:
            self.stats.errors += 1
            return e.response()
        return web.Response(body=body, content_type="application/json")

    async def _env_reward(self, request: web.Request) -> web.Response:
        """Checked here (``Gateway._env_reward``); "ok" once the daemon holds
        the reward, so an agent that returns after posting is scored by it."""
        resp = await super()._env_reward(request)
        s = self.sessions.get(request.match_info["token"])
        if resp.status != 200 or s is None:
            return resp
        call_id, p = self._ask(s.token)
        self.chan.send(PostReward(call_id, s.token, s.posted_reward, s.posted_success))
        try:
            await p.fut
        except GatewayError as e:
            self.stats.errors += 1
            return e.response()
        finally:
            self._pending.pop(call_id, None)
        return resp

    # -- the daemon's messages ------------------------------------------------------

    def on_messages(self, msgs: list) -> None:
        for m in msgs:
            match m:
                case Tokens(call_id=call_id, ids=ids):
                    p = self._pending.get(call_id)
                    if p is not None and p.on_tokens is not None:
                        p.ids += ids
                        p.on_tokens(p.ids)
                case Generated(call_id=call_id):
                    self._answer(call_id, (m.completion_ids, m.finish_reason))
                case EnvReplied(call_id=call_id, body=body):
                    self._answer(call_id, body)
                case CallFailed(call_id=call_id):
                    self._answer(call_id, GatewayError(m.status, m.message, m.code, m.param, m.error_type))
                case OpenSession():
                    self._open(m)
                case CloseSession(token=token):
                    self._close(token)
                case Settle(token=token):
                    self.report_stats()
                    s = self.sessions.get(token)
                    self.chan.send(self._state(s) if s is not None else SessionState(token, closed=True))
                case HostStart():
                    pass  # only the first counts (``serve``)

    def _answer(self, call_id: int, result: Any) -> None:
        p = self._pending.pop(call_id, None)
        if p is None or p.fut.done():  # aborted or the episode closed: nobody waits
            return
        if isinstance(result, BaseException):
            p.fut.set_exception(result)
        else:
            p.fut.set_result(result)

    def _open(self, m: OpenSession) -> None:
        w = m.settings
        settings = EpisodeSettings(SamplingSettings(max_tokens=w.max_tokens, temperature=w.temperature, top_p=w.top_p),
                                   w.max_turns, w.max_model_len, w.min_completion_tokens, w.min_temperature, w.seed,
                                   w.max_abs_reward)
        s = GatewaySession(self, m.episode_id, None, settings, lambda: 0, keys=(m.token, m.api_key, m.reward_key))
        s.tools_json = m.tools_json
        self.sessions[m.token] = s
        self.stats.sessions += 1
        self.chan.send(self._state(s))  # the daemon hands out the URL once this arrives

    def _close(self, token: str) -> None:
        s = self.sessions.pop(token, None)
        if s is None:
            self.chan.send(SessionState(token, closed=True))
            return
        s.closed = True
        ended = GatewayError(404, "the episode ended during the call", code="episode_not_found")
        for call_id in [c for c, p in self._pending.items() if p.token == token]:
            self._answer(call_id, ended)
        self.report_stats()
        self.chan.send(self._state(s))

    @staticmethod
    def _state(s: GatewaySession) -> SessionState:
        return SessionState(s.token, s.closed, s.terminated, s.posted_reward, s.posted_success)

    def report_stats(self) -> None:
        st = self.stats
        msg = HostStats(st.streamed, st.errors, st.unauthorized, st.temperature_floored, st.rewards_refused)
        if msg != getattr(self, "_reported", None):
            self._reported = msg
            self.chan.send(msg)


async def _report_stats(gw: HostGateway) -> None:
    while True:
        await asyncio.sleep(STATS_EVERY_S)
        gw.report_stats()


async def serve(chan_fd: int, tcp_fd: int, unix_fd: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started: asyncio.Future = loop.create_future()
    gw: HostGateway | None = None

    def on_messages(msgs: list) -> None:
        if gw is not None:
            gw.on_messages(msgs)
        elif msgs and isinstance(msgs[0], HostStart) and not started.done():
            started.set_result(msgs[0])

    chan = await Channel.connect(socket.socket(fileno=chan_fd), ToHost, on_messages, lambda why: stop.set())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([started, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not started.done():
        return 0
    m: HostStart = started.result()
    try:
        renderer = await asyncio.to_thread(_renderer, m)
    except Exception as e:  # a template or parser that cannot work: the daemon says why
        chan.send(HostFailed(f"{type(e).__name__}: {e}"[:2000]))
        await asyncio.sleep(0)
        chan.close()
        return 1
    gw = HostGateway(renderer, m.model_name, chan, m.history)
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    gw.add_routes(app)
    # handler_cancellation: an agent that hangs up mid-call cancels its
    # handler, so the daemon aborts the engine request at once.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
    await runner.setup()
    try:
        for fd in (tcp_fd, unix_fd):
            await web.SockSite(runner, socket.socket(fileno=fd), backlog=1024).start()
        chan.send(HostReady(os.getpid()))
        reporter = asyncio.ensure_future(_report_stats(gw))
        await stopping
        reporter.cancel()
    finally:
        await runner.cleanup()
        chan.close()
    return 0


def _renderer(m: HostStart):
    from transformers import AutoTokenizer

    model = ModelConfig(path=m.tokenizer, chat_template=m.chat_template, tool_parser=m.tool_parser,
                        reasoning_parser=m.reasoning_parser)
    renderer = make_renderer(AutoTokenizer.from_pretrained(m.tokenizer), model)
    renderer.parser  # noqa: B018 - vLLM's parser registry loads now, not at the first call
    return renderer


def main(argv: list[str]) -> int:
    chan_fd, tcp_fd, unix_fd = (int(a) for a in argv)
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop comes with vLLM
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(chan_fd, tcp_fd, unix_fd))

