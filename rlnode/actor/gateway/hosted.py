"""``HostedGateway``: the gateway with its HTTP side in a host process
(``actor.gateway_host = "process"``; the host is ``host.py``, the channel
``protocol.py``). The daemon's part of each call is small: check it, take
the lease, run the engine, record it.

Owns (in the daemon): the gateway's listening sockets (per host, its TCP
port and its agents' unix socket, bound here so URLs and sandbox relays
outlive a host), the host processes (``actor.gateway_hosts`` of them,
started, watched, restarted when one dies), which host serves which
episode (the one with the fewest open episodes; the episode's URL names
that host's port, so every call of an episode reaches the host that holds
its history), the sessions' keys and settings, every call's admission (its own count of the episode's
calls, the context, the temperature range, max_tokens; the seed derived
here), the leased engine call (``LLMClient``) and the record of what the
engine was given and returned, from which ``agent_episode.py`` builds the
samples. ``env/step`` runs here, on the episode's cube task.

Must not: trust token lists from the host beyond a call's prompt, or a
host's word on an episode another host serves; serve HTTP; tokenize. A
host that dies fails the episodes it served (``GatewayHostLost``, a
CubeError: retried like any other), the other hosts' episodes go on, and a
new host takes its sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import socket
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import msgspec

from rlnode.actor.engine import EngineError
from rlnode.actor.episode import EpisodeSettings, request_seed
from rlnode.actor.gateway.api import GatewayError, check_stop
from rlnode.actor.gateway.forkserver import FORK_SERVER, ForkedHost
from rlnode.actor.gateway.protocol import (
    Abort, CallFailed, Channel, CloseSession, EnvCall, EnvReplied, Generate, Generated, HostFailed, HostReady,
    HostStart, HostStats, OpenSession, PostReward, SessionState, Settle, ToDaemon, Tokens, Unsent, WireSettings,
)
from rlnode.actor.gateway.server import Gateway, env_step, make_agents_dir
from rlnode.actor.gateway.session import GatewaySession, GatewayStats, ServedCall
from rlnode.actor.generation import LLMClient
from rlnode.config import ModelConfig
from rlnode.cubes.base import CubeError, CubeTask
from rlnode.log import get_logger
from rlnode.ops.netaddr import local_url_host

log = get_logger("rlnode.gateway")

T = TypeVar("T")
START_TIMEOUT_S = 120.0  # a host's start: tokenizer, template, vLLM's parser registry
SETTLE_TIMEOUT_S = 10.0  # a live host answers Settle / CloseSession within this
STOP_TIMEOUT_S = 5.0  # SIGTERM, then SIGKILL
RESTART_BACKOFF_S = (0.2, 30.0)  # first wait before a restart, cap (doubling while starts keep failing)
_HOST_FIELDS = ("streamed", "errors", "unauthorized", "temperature_floored", "rewards_refused")


def make_gateway(where: str, client: LLMClient, renderer, model: ModelConfig, settings: EpisodeSettings,
                 model_name: str = "rlnode", history: str = "extend") -> "Gateway | HostedGateway":
    """The gateway ``actor.gateway_host`` asks for: "inline" (on this loop,
    with ``renderer``) or "process" (a host process, which builds the same
    renderer from ``model``'s tokenizer, template and parsers).
    ``history``: actor.gateway_history."""
    if where == "process":
        return HostedGateway(client, model, settings, model_name, history=history)
    if where == "inline":
        return Gateway(client, renderer, settings, model_name, history=history)
    raise ValueError(f"actor.gateway_host must be inline or process, not {where!r}")


def _fork_host(fds: tuple[int, int, int]) -> ForkedHost:
    """FORK_SERVER.fork in a thread; closes ``fds`` (duplicates) after."""
    try:
        return FORK_SERVER.fork(fds)
    finally:
        for fd in fds:
            os.close(fd)


class GatewayHostLost(CubeError):
    """The gateway host serving an episode died (or could not start): the
    episode fails and is retried; the daemon starts a new host."""


class HostedSession(GatewaySession):
    """The daemon's side of an episode served by a host: its keys,
    settings and the calls the engine answered (``calls``: the record
    samples are made from)."""

    def __init__(self, gateway: "HostedGateway", slot: "_Slot", *args, **kwargs):
        super().__init__(gateway, *args, **kwargs)
        self.slot = self.serving = slot  # its URL and agent socket are the slot's
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()  # result: why the host was lost
        self._steps: set[int] = set()

    async def settle(self) -> None:
        """As ``GatewaySession.settle``; GatewayHostLost when the host that
        served the episode is gone (what it decided is lost with it)."""
        await self.gateway._ask_state(self)
        if self.lost.done():
            raise GatewayHostLost(f"the gateway host serving this episode was lost: {self.lost.result()}")

    async def guard(self, agent: Awaitable[T]) -> T:
        run = asyncio.ensure_future(agent)
        try:
            await asyncio.wait([run, self.lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not run.done():
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
        if run.done() and not run.cancelled() and not self.lost.done():
            return run.result()
        if self.lost.done():
            raise GatewayHostLost(f"the gateway host serving this episode was lost: {self.lost.result()}")
        return run.result()


class _Slot:
    """One host's place: the sockets it serves (bound by the daemon, kept
    across restarts), their URL and path, and the host running there."""

    def __init__(self, index: int, tcp: socket.socket, unix: socket.socket, url: str, agent_socket: str):
        self.index, self.tcp, self.unix, self.url, self.agent_socket = index, tcp, unix, url, agent_socket
        self.host: _Host | None = None
        self.up = asyncio.Event()
        self.open = 0  # episodes open here
        self.base = HostStats()  # counters of this slot's hosts that are gone

    @property
    def sync_key(self) -> str:
        return f"#{self.index}"  # a Settle that no episode's token can equal (tokens are urlsafe base64)


class _Host:
    """One host process and its channel."""

    def __init__(self, slot: _Slot, proc: ForkedHost, chan: Channel, lost: asyncio.Future):
        self.slot, self.proc, self.chan, self.lost = slot, proc, chan, lost
        self.pid = proc.pid
        self.stats = HostStats()


class HostedGateway:
    """``Gateway``'s interface (``serve``, ``session``, ``stats``, ``url``,
    ``agent_socket``) with the HTTP side in ``hosts`` host processes."""

    def __init__(self, client: LLMClient, model: ModelConfig, settings: EpisodeSettings, model_name: str = "rlnode",
                 hosts: int = 1, history: str = "extend"):
        self.client, self.model, self.settings, self.model_name = client, model, settings, model_name
        self.history = history  # actor.gateway_history, the hosts'
        self.hosts = hosts
        self.url = ""  # the first host's (each episode's endpoint names its own host's)
        self.agent_socket = ""
        self.sessions: dict[str, HostedSession] = {}
        self.stats = GatewayStats()
        self.host_starts = 0  # hosts started (a restart after a loss counts)
        self.slots: list[_Slot] = []
        self._any_up = asyncio.Event()
        self._calls: dict[tuple[int, int], asyncio.Task] = {}  # (host pid, call id) -> engine call
        self._waiting: dict[str, list[asyncio.Future]] = {}  # token -> SessionState waiters, in order

    @property
    def host_pid(self) -> int:
        """The first host's pid (0: none running)."""
        return self.host_pids[0] if self.slots else 0

    @property
    def agent_sockets(self) -> list[str]:
        """Each host's agent socket, in slot order."""
        return [slot.agent_socket for slot in self.slots]

    @property
    def host_pids(self) -> list[int]:
        """Each slot's running host (0 where none runs)."""
        return [slot.host.pid if slot.host is not None else 0 for slot in self.slots]

    def add_routes(self, app) -> None:
        """Nothing: the host serves the episode routes (on ``url``)."""

    # -- lifecycle ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator["HostedGateway"]:
        """Bind each host's sockets (the first on ``port``, the others on
        free ports), start the hosts (raising if one cannot start), keep
        them running until exit; then stop them and unbind."""
        home = await asyncio.to_thread(make_agents_dir)
        supervisors: list[asyncio.Task] = []
        try:
            for i in range(self.hosts):
                tcp = socket.create_server((host, port if i == 0 else 0), backlog=1024)
                unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                path = os.path.join(home, "agents.sock" if i == 0 else f"agents-{i}.sock")
                self.slots.append(_Slot(i, tcp, unix, f"http://{local_url_host(host)}:{tcp.getsockname()[1]}", path))
                unix.bind(path)
                os.chmod(path, 0o666)
                unix.listen(1024)
            started = await asyncio.gather(*(self._start_host(slot) for slot in self.slots), return_exceptions=True)
            for e in started:
                if isinstance(e, BaseException):
                    raise e
            self.url, self.agent_socket = self.slots[0].url, self.slots[0].agent_socket
            supervisors = [asyncio.create_task(self._supervise(slot), name=f"gateway-host-{slot.index}")
                           for slot in self.slots]
            yield self
        finally:
            self.url = self.agent_socket = ""
            try:
                for t in supervisors:
                    t.cancel()
                await asyncio.gather(*supervisors, return_exceptions=True)
                await asyncio.gather(*(self._stop_host(slot) for slot in self.slots))
            finally:
                for slot in self.slots:
                    slot.tcp.close()
                    slot.unix.close()
                self.slots = []
                # Inline, not in a thread: a few socket files (instant), and
                # they must go even when this exit is itself cancelled.
                shutil.rmtree(home, ignore_errors=True)

    async def _start_host(self, slot: _Slot) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Forked by the fork server, which has the host's imports done
        # (forkserver.py): serving in ~0.3 s instead of ~6 s. The thread
        # gets descriptors of its own: if this start is cancelled, the fork
        # under way finishes on them while ours close.
        fork = asyncio.ensure_future(asyncio.to_thread(
            _fork_host, tuple(os.dup(fd) for fd in (theirs.fileno(), slot.tcp.fileno(), slot.unix.fileno()))))
        try:
            proc = await asyncio.shield(fork)
        except BaseException:
            ours.close()  # a host forked after all reads EOF and ends
            fork.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().close())
            raise
        finally:
            theirs.close()
        loop = asyncio.get_running_loop()
        lost, ready = loop.create_future(), loop.create_future()

        def on_messages(msgs: list) -> None:
            if host is not None and slot.host is host:
                self._on_messages(host, msgs)
            elif not ready.done():
                first = msgs[0]
                if isinstance(first, HostReady):
                    ready.set_result(first.pid)
                elif isinstance(first, HostFailed):
                    ready.set_exception(GatewayHostLost(f"the gateway host could not start: {first.error}"))

        def on_lost(why: str) -> None:
            if not lost.done():
                lost.set_result(why)

        host = None
        chan = await Channel.connect(ours, ToDaemon, on_messages, on_lost)
        host = _Host(slot, proc, chan, lost)
        m = self.model
        chan.send(HostStart(m.tokenizer or m.path, m.chat_template, m.tool_parser, m.reasoning_parser,
                            self.model_name, self.history))
        try:
            await asyncio.wait([ready, lost], timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                raise GatewayHostLost(f"the gateway host did not start within {START_TIMEOUT_S:g}s"
                                      if not lost.done() else f"the gateway host exited at start: {lost.result()}")
            ready.result()
        except BaseException:
            await self._reap(host)
            raise
        slot.host = host
        self.host_starts += 1
        slot.up.set()
        self._any_up.set()
        log.info("gateway.host_started", pid=proc.pid, slot=slot.index, starts=self.host_starts)

    async def _supervise(self, slot: _Slot) -> None:
        """Restart the slot's host whenever it is lost."""
        backoff = RESTART_BACKOFF_S[0]
        while True:
            host = slot.host
            why = await host.lost
            self._lost(host, why)
            await self._reap(host)
            while True:
                await asyncio.sleep(backoff)
                try:
                    await self._start_host(slot)
                except Exception as e:  # GatewayHostLost, or the process could not be started (OSError)
                    log.error("gateway.host_start_failed", error=str(e) or repr(e), retry_in_s=backoff)
                    backoff = min(backoff * 2, RESTART_BACKOFF_S[1])
                    continue
                backoff = RESTART_BACKOFF_S[0]
                break

    def _lost(self, host: _Host, why: str) -> None:
        """A host died: its episodes fail, their engine calls are aborted;
        the other hosts' episodes go on."""
        slot = host.slot
        if slot.host is not host:
            return
        slot.host = None
        slot.up.clear()
        if not any(other.up.is_set() for other in self.slots):
            self._any_up.clear()
        open_sessions = [s for s in self.sessions.values() if s.slot is slot and not s.lost.done()]
        log.error("gateway.host_lost", pid=host.pid, slot=slot.index, why=why, episodes=len(open_sessions))
        for key, task in list(self._calls.items()):
            if key[0] == host.pid:
                task.cancel()
        for s in open_sessions:
            s.lost.set_result(why)
        for token in [slot.sync_key, *(s.token for s in open_sessions)]:
            for w in self._waiting.pop(token, []):
                if not w.done():
                    w.set_result(None)
        slot.base = HostStats(*(getattr(slot.base, f) + getattr(host.stats, f) for f in _HOST_FIELDS))
        self._sum_host_stats()

    async def _reap(self, host: _Host) -> None:
        host.chan.close()
        try:
            if host.proc.running:
                host.proc.send_signal(signal.SIGTERM)
                if not await host.proc.wait(STOP_TIMEOUT_S):
                    host.proc.send_signal(signal.SIGKILL)
                    await host.proc.wait()
        finally:
            host.proc.close()

    async def _stop_host(self, slot: _Slot) -> None:
        host, slot.host = slot.host, None
        slot.up.clear()
        if host is not None:
            await self._reap(host)

    # -- sessions ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def session(self, episode_id: str, task: CubeTask | None = None, settings: EpisodeSettings | None = None,
                      policy_version: Callable[[], int] = lambda: 0) -> AsyncIterator[HostedSession]:
        if not self.url:
            raise RuntimeError("the gateway is not served (HostedGateway.serve)")
        if not self._any_up.is_set():
            try:
                await asyncio.wait_for(self._any_up.wait(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise GatewayHostLost("no gateway host is running (restarts keep failing)") from None
        # The least busy running host; the episode's URL names it.
        slot = min((x for x in self.slots if x.up.is_set()), key=lambda x: x.open)
        s = HostedSession(self, slot, episode_id, task, settings or self.settings, policy_version)
        st, sp = s.settings, s.settings.sampling
        tools = [t.as_chat_tool() for t in task.tools()] if task is not None else []
        self.sessions[s.token] = s
        self.stats.sessions += 1
        slot.open += 1
        try:
            # Answered once the host serves the token: the agent gets its URL
            # only then (its first request must not race the open).
            await self._ask_state(s, OpenSession(
                s.token, episode_id, s.api_key,
                WireSettings(sp.max_tokens, sp.temperature, sp.top_p, st.max_turns, st.max_model_len,
                             st.min_completion_tokens, st.min_temperature, st.seed, st.max_abs_reward),
                s.reward_key, task is not None and getattr(task, "has_environment", True),
                msgspec.json.encode({"tools": tools})))
            yield s
        finally:
            try:
                await s.close()  # our engine calls first: their leases come back now
                await self._ask_state(s, CloseSession(s.token))  # the host's last word on the episode
            finally:
                self.sessions.pop(s.token, None)
                slot.open -= 1

    async def _ask_state(self, s: HostedSession, msg=None) -> None:
        """Send ``msg`` (``Settle``) and wait for the host's SessionState of
        ``s``: what the host sent before it is then applied."""
        host = s.slot.host
        if host is None or s.lost.done():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(s.token, []).append(fut)
        host.chan.send(msg or Settle(s.token))
        done, _ = await asyncio.wait([fut, s.lost], timeout=SETTLE_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            log.warning("gateway.host_slow", pid=host.pid, episode=s.episode_id, waited_s=SETTLE_TIMEOUT_S)

    async def sync(self) -> None:
        """Wait until the hosts' counters up to now are in ``stats``."""
        await asyncio.gather(*(self._sync(slot) for slot in self.slots))

    async def _sync(self, slot: _Slot) -> None:
        host = slot.host
        if host is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(slot.sync_key, []).append(fut)
        host.chan.send(Settle(slot.sync_key))
        await asyncio.wait([fut, host.lost], timeout=SETTLE_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)

    # -- the host's messages -------------------------------------------------------

    def _on_messages(self, host: _Host, msgs: list) -> None:
        for m in msgs:
            match m:
                case Generate():
                    self._generate(host, m)
                case Abort(call_id=call_id):
                    task = self._calls.get((host.pid, call_id))
                    if task is not None:
                        task.cancel()
                case Unsent(token=token, step=step):
                    s = self._session(host, token)
                    if s is not None and s.forget(step):
                        self.stats.unsent += 1
                        log.info("gateway.reply_unsent", episode=s.episode_id, step=step)
                case EnvCall():
                    self._env(host, m)
                case PostReward():
                    self._post_reward(host, m)
                case SessionState(token=token):
                    self._apply_state(host, m)
                    waiters = self._waiting.get(token)
                    if waiters:
                        w = waiters.pop(0)
                        if not waiters:
                            del self._waiting[token]
                        if not w.done():
                            w.set_result(None)
                case HostStats():
                    host.stats = m
                    self._sum_host_stats()
                case HostReady() | HostFailed():
                    pass

    def _session(self, host: _Host, token: str) -> HostedSession | None:
        """The open episode ``token`` if ``host`` serves it (a host has no
        say over another host's episodes)."""
        s = self.sessions.get(token)
        return s if s is not None and s.slot is host.slot else None

    def _agent_session(self, host: _Host, token: str) -> HostedSession | None:
        """``_session`` for a request the agent made (a model, env or
        reward call): its agent is up."""
        s = self._session(host, token)
        if s is not None:
            s.agent_up.set()
        return s

    def _sum_host_stats(self) -> None:
        for f in _HOST_FIELDS:
            setattr(self.stats, f, sum(getattr(slot.base, f) + (getattr(slot.host.stats, f) if slot.host else 0)
                                       for slot in self.slots))

    def _apply_state(self, host: _Host, m: SessionState) -> None:
        s = self._session(host, m.token)
        if s is None:
            return
        s.terminated = s.terminated or m.terminated
        if m.posted_reward is not None:
            s.posted_reward, s.posted_success = m.posted_reward, m.posted_success

    def _generate(self, host: _Host, m: Generate) -> None:
        s = self._agent_session(host, m.token)
        try:
            if s is None or s.closed or s.lost.done():
                raise GatewayError(404, "unknown or finished episode", code="episode_not_found")
            sampling = self._admit(s, m)
        except GatewayError as e:
            host.chan.send(CallFailed(m.call_id, e.status, e.message, e.code, e.param, e.type))
            return
        key = (host.pid, m.call_id)
        task = asyncio.get_running_loop().create_task(self._call(host, s, m, sampling, s.policy_version()))
        s._inflight.add(task)
        self._calls[key] = task
        task.add_done_callback(lambda t: (s._inflight.discard(t), self._calls.pop(key, None)))

    def _admit(self, s: HostedSession, m: Generate):
        """The call as the daemon runs it, checked against its own record of
        the episode (the host checked the same before: a refusal here means
        a host that does not follow the protocol)."""
        settings = s.settings
        base = settings.sampling
        if m.step in s._steps or m.step < 0:
            raise GatewayError(500, f"gateway host protocol: step {m.step} again", code="gateway_error",
                               type="server_error")
        if len(s._steps) >= settings.max_turns or m.step >= settings.max_turns:
            s.terminated = s.terminated or "max_turns"
            raise GatewayError(400, f"the episode used its {settings.max_turns} LLM calls (actor.episode.max_turns)",
                               code="max_turns_exceeded")
        if not m.prompt:
            raise GatewayError(500, "gateway host protocol: an empty prompt", code="gateway_error",
                               type="server_error")
        room = settings.max_model_len - len(m.prompt)
        if room < settings.min_completion_tokens:
            s.terminated = s.terminated or "context_limit"
            raise GatewayError(400, f"prompt of {len(m.prompt)} tokens leaves no room in the "
                                    f"{settings.max_model_len}-token context", code="context_length_exceeded",
                               param="messages")
        temperature = 0.0 if base.temperature == 0 else m.temperature
        floor = min(settings.min_temperature, base.temperature)
        if base.temperature and not floor - 1e-9 <= temperature <= base.temperature + 1e-9:
            raise GatewayError(400, f"temperature must be in [{floor}, {base.temperature}]", param="temperature")
        s._steps.add(m.step)
        s.next_step = max(s.next_step, m.step + 1)
        seed = m.agent_seed if settings.seed is None else request_seed(settings.seed, m.step, m.agent_seed)
        stop = check_stop(m.stop)
        return msgspec.structs.replace(base, temperature=temperature, seed=seed, stop=stop,
                                       max_tokens=max(1, min(m.max_tokens, base.max_tokens, room)))

    async def _call(self, host: _Host, s: HostedSession, m: Generate, sampling, version: int) -> None:
        """One leased engine call; on cancellation (the agent went away, the
        episode or the host ended) the engine request is aborted and the
        lease returned by LLMClient, and nobody is answered."""
        send = host.chan.send
        on_tokens = None
        if m.stream:
            sent = 0

            def on_tokens(ids) -> None:
                nonlocal sent
                if len(ids) > sent:
                    send(Tokens(m.call_id, list(ids[sent:])))
                    sent = len(ids)
        try:
            gen = await s.generate(self.client, m.prompt, sampling, on_tokens)
        except EngineError as e:
            send(CallFailed(m.call_id, 503, f"engine failed: {e}", "engine_error", error_type="server_error"))
            return
        except Exception as e:  # a prompt the engine refuses (ids outside the vocabulary): this call fails
            log.warning("gateway.call_failed", episode=s.episode_id, step=m.step, error=repr(e)[:300])
            send(CallFailed(m.call_id, 500, f"the call failed: {e!r}"[:1000], "gateway_error",
                            error_type="server_error"))
            return
        comp = gen.completion
        if s.closed:
            send(CallFailed(m.call_id, 404, "the episode ended during the call", "episode_not_found"))
            return
        if comp.finish_reason == "abort":
            send(CallFailed(m.call_id, 503, "the engine aborted the request", "engine_error",
                            error_type="server_error"))
            return
        s._engine = gen.lease.engine_id
        s.calls.append(ServedCall(m.step, m.prompt, gen, version, sampling.temperature, m.history_reset))
        s.history_resets += m.history_reset
        self.stats.calls += 1
        self.stats.history_resets += m.history_reset
        send(Generated(m.call_id, comp.token_ids, comp.finish_reason))

    def _post_reward(self, host: _Host, m: PostReward) -> None:
        s = self._agent_session(host, m.token)
        if s is None or s.closed:
            host.chan.send(CallFailed(m.call_id, 404, "unknown or finished episode", "episode_not_found"))
        elif not s.reward_key or not (math.isfinite(m.reward) and abs(m.reward) <= s.settings.max_abs_reward):
            # The host checks both before; agent_episode bounds it again.
            host.chan.send(CallFailed(m.call_id, 400, "reward refused", param="reward"))
        else:
            s.posted_reward, s.posted_success = m.reward, m.success
            host.chan.send(EnvReplied(m.call_id, b'{"ok":true}'))

    def _env(self, host: _Host, m: EnvCall) -> None:
        s = self._agent_session(host, m.token)

        async def step() -> None:
            try:
                if s is None or s.closed:
                    raise GatewayError(404, "unknown or finished episode", code="episode_not_found")
                body = await env_step(s, m.body)
            except GatewayError as e:
                host.chan.send(CallFailed(m.call_id, e.status, e.message, e.code, e.param, e.type))
                return
            host.chan.send(EnvReplied(m.call_id, body))

        task = asyncio.get_running_loop().create_task(step())
        if s is not None:
            s._inflight.add(task)
            task.add_done_callback(s._inflight.discard)
