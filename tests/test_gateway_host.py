"""The gateway host process (``actor.gateway_host = "process"``) beyond the
gateway tests both modes share (test_gateway.py runs those against the host
too): tool calls and the environment through the host, the daemon's own
checks of what a host asks, an agent that hangs up mid-call, a host killed
mid-episode, the channel's wire format. The engine is a NullEngine (no
model): these test the gateway's plumbing, not the policy's tokens (the
shared tests check those on the real engine)."""

import asyncio
import json
import os
import signal
import socket
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from conftest import proc_stat
from rlnode.actor.agent_episode import run_agent_episode
from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import EpisodeSettings
from rlnode.actor.gateway import GatewayHostLost, HostedGateway
from rlnode.actor.gateway.forkserver import FORK_SERVER
from rlnode.actor.gateway.protocol import (
    Abort, Channel, Generate, HostStats, SessionState, ToDaemon, ToHost, Tokens,
)
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.bench.null_engine import NullEngine, space_id
from rlnode.config import ModelConfig
from rlnode.cubes.base import AgentTask, CubeError, CubeTaskRef, Reset, StepResult, ToolSpec

SETTINGS = EpisodeSettings(SamplingSettings(max_tokens=128, temperature=1.0), max_turns=4, max_model_len=2048)
CALL = '<tool_call>{"name": "guess", "arguments": {"n": 4}}</tool_call>'
GUESS = ToolSpec("guess", "Guess a number.", {"type": "object", "properties": {"n": {"type": "integer"}}})
USER = [{"role": "user", "content": "Guess 1-8."}]


class HeldEngine(NullEngine):
    """A NullEngine that answers only while ``release`` is set; counts the
    requests it saw cancelled and keeps each request's sampling."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = asyncio.Event()
        self.release.set()
        self.waiting = self.cancelled = 0
        self.sampled: list[SamplingSettings] = []

    async def generate(self, prompt_token_ids, sampling, request_id=None, on_tokens=None):
        self.sampled.append(sampling)
        self.waiting += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.waiting -= 1
        return await super().generate(prompt_token_ids, sampling, request_id, on_tokens)


class GuessTask(AgentTask):
    """An environment with one tool whose agent posts its reward; the agent
    (``run_agent``) makes one call through the openai SDK."""

    has_evaluator = False
    reward_source = "agent"
    timeout_s = 120.0

    def __init__(self):
        self.ref = CubeTaskRef("guess", "t0")

    async def reset(self) -> Reset:
        return Reset("Guess 1-8.")

    def tools(self) -> list[ToolSpec]:
        return [GUESS]

    async def step(self, action) -> StepResult:
        n = action.tool_calls[0].arguments["n"]
        return StepResult("right" if n == 5 else "higher", reward=float(n == 5), done=n == 5,
                          error=None if n > 0 else "n must be positive")

    async def evaluate(self):
        raise NotImplementedError

    async def run_agent(self, endpoint, task) -> float | None:
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0, timeout=60)
        try:
            await client.chat.completions.create(model=endpoint.model, messages=USER)
        finally:
            await client.close()
        return 1.0


def client_for(session) -> openai.AsyncOpenAI:
    ep = session.endpoint
    return openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=60)


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def parent_of(pid: int) -> int:
    return int(proc_stat(pid)[1])


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie not reaped yet (the fork server
    reaps its hosts on SIGCHLD, a moment after they end; an orphan waits
    for an init that may never reap it)."""
    st = proc_stat(pid)
    return st is None or st[0] == "Z"


@pytest.fixture
async def hosted(tokenizer, tiny_model_dir):
    """(gateway, engine, router); afterwards: no lease, host process or
    socket directory left."""
    replies = [tokenizer.encode(CALL, add_special_tokens=False), tokenizer.encode("4 it is", add_special_tokens=False)]
    engine = HeldEngine(0, replies, space_id(tokenizer), tokenizer.eos_token_id)
    await engine.start()
    router = AdmissionRouter(1, 16)
    gw = HostedGateway(LLMClient([engine], router), ModelConfig(path=str(tiny_model_dir)), SETTINGS, model_name="tiny")
    async with gw.serve():
        yield gw, engine, router
        pid, home = gw.host_pid, os.path.dirname(gw.agent_socket)
    assert router.in_flight == [0] and engine.waiting == 0
    assert gone(pid)
    assert not os.path.exists(home)


async def test_tool_calls_streaming_and_history_through_the_host(hosted):
    gw, _, _ = hosted
    tools = [GUESS.as_chat_tool()]
    async with gw.session("ep-tools") as s:
        client = client_for(s)
        r = await client.chat.completions.create(model="tiny", messages=USER, tools=tools)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("guess", {"n": 4})]
        messages = USER + [msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "higher"}]
        stream = await client.chat.completions.create(model="tiny", messages=messages, tools=tools, stream=True)
        parts = [ch.delta.content or "" async for chunk in stream for ch in chunk.choices]
        await client.close()
    assert "".join(parts) == "4 it is"
    # The daemon's record: the second prompt extends the first + its completion.
    assert [c.step_index for c in s.calls] == [0, 1] and s.history_resets == 0
    head = s.calls[0].prompt + s.calls[0].generation.completion.token_ids
    assert s.calls[1].prompt[:len(head)] == head and len(s.calls[1].prompt) > len(head)
    assert gw.stats.calls == 2 and gw.stats.streamed == 1 and gw.stats.sessions == 1


async def test_environment_and_posted_reward_through_the_host(hosted):
    gw, _, _ = hosted
    async with gw.session("ep-env", GuessTask()) as s:
        ep = s.endpoint
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s.api_key}"}) as http:
            tools = (await http.get(ep.env_url + "/tools")).json()
            low = await http.post(ep.env_url + "/step", json={"tool": "guess", "arguments": {"n": 0}})
            hit = await http.post(ep.env_url + "/step", json={"tool": "guess", "arguments": {"n": 5}})
            again = await http.post(ep.env_url + "/step", json={"tool": "guess", "arguments": {"n": 5}})
            bad = await http.post(ep.env_url + "/step", content=b"{not json")
            with_api_key = await http.post(ep.env_url + "/reward", json={"reward": 1.0})
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s.reward_key}"}) as http:
            huge = await http.post(ep.env_url + "/reward", json={"reward": 1e9})
            ok = await http.post(ep.env_url + "/reward", json={"reward": 0.5, "success": True})
    assert tools == {"tools": [GUESS.as_chat_tool()]}
    assert low.status_code == 200 and low.json()["error"] == "n must be positive" and not low.json()["done"]
    assert hit.json() == {"observation": "right", "reward": 1.0, "done": True, "error": None, "info": {}}
    assert again.status_code == 409 and again.json()["error"]["code"] == "episode_done"
    assert bad.status_code == 400
    assert with_api_key.status_code == 401 and huge.status_code == 400 and ok.json() == {"ok": True}
    # What the host decided reached the daemon's session by its close.
    assert (s.posted_reward, s.posted_success, s.agent_errors, s.env_done) == (0.5, True, 1, True)
    assert gw.stats.rewards_refused == 2 and gw.stats.unauthorized == 1 and gw.stats.errors == 4


async def test_the_daemon_checks_what_a_host_asks(hosted, tokenizer):
    """A host chooses prompt ids, nothing else: the daemon refuses a call
    outside the episode's settings or its own count of calls, caps
    max_tokens and derives the seed itself."""
    gw, engine, _ = hosted
    seeded = msgspec.structs.replace(SETTINGS, seed=11)
    async with gw.session("ep-trust", settings=seeded) as s:
        host, prompt = s.slot.host, tokenizer.encode("hello", add_special_tokens=False)
        gw._on_messages(host, [
            Generate(1001, s.token, 0, prompt, temperature=5.0, max_tokens=8),  # above actor.sampling.temperature
            Generate(1002, s.token, 0, list(prompt) * 1000, 1.0, 8),  # no room in the context
            Generate(1003, "not-a-token", 0, prompt, 1.0, 8),
        ])
        assert not s.calls and s.terminated == "context_limit" and not engine.sampled
        gw._on_messages(host, [Generate(1004, s.token, 0, prompt, 1.0, 10**6, agent_seed=7, history_reset=True)])
        await until(lambda: s.calls)
        gw._on_messages(host, [Generate(1005, s.token, 0, prompt, 1.0, 8)])  # step 0 again
        gw._on_messages(host, [Generate(1006, s.token, 4, prompt, 1.0, 8)])  # past max_turns
        await asyncio.sleep(0.05)
    assert len(s.calls) == 1 and len(engine.sampled) == 1
    call, sampled = s.calls[0], engine.sampled[0]
    assert (call.step_index, call.prompt, call.history_reset, s.history_resets) == (0, prompt, True, 1)
    assert sampled.max_tokens == SETTINGS.sampling.max_tokens and sampled.temperature == 1.0
    assert sampled.seed not in (None, 7)  # request_seed(episode seed, step, agent seed)
    assert s.terminated == "context_limit"  # the first refusal that ended it


async def test_an_agent_that_hangs_up_mid_call_aborts_it(hosted):
    gw, engine, router = hosted
    engine.release.clear()
    async with gw.session("ep-gone") as s:
        client = client_for(s)
        call = asyncio.create_task(client.chat.completions.create(model="tiny", messages=USER))
        await until(lambda: engine.waiting)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await until(lambda: engine.cancelled == 1 and router.in_flight == [0])
        stream = await client.chat.completions.create(model="tiny", messages=USER, stream=True)
        await until(lambda: engine.waiting)
        await stream.close()
        await until(lambda: engine.cancelled == 2 and router.in_flight == [0])
        engine.release.set()  # the episode goes on
        r = await client.chat.completions.create(model="tiny", messages=USER)
        await client.close()
    assert not s._inflight and [c.step_index for c in s.calls] == [2]
    assert r.usage.completion_tokens == len(s.calls[0].generation.completion.token_ids)


async def test_a_host_killed_mid_episode_fails_that_episode_and_is_replaced(hosted):
    gw, engine, router = hosted
    engine.release.clear()
    first, url, sock = gw.host_pid, gw.url, gw.agent_socket
    episode = asyncio.create_task(run_agent_episode(gw, GuessTask(), SETTINGS, "ep-killed", "g0"))
    await until(lambda: engine.waiting)
    os.kill(first, signal.SIGKILL)
    with pytest.raises(CubeError) as e:
        await episode
    assert isinstance(e.value, GatewayHostLost)
    await until(lambda: router.in_flight == [0])
    assert engine.cancelled == 1
    engine.release.set()
    # The next episode waits for the new host, on the same URL and socket.
    result = await run_agent_episode(gw, GuessTask(), SETTINGS, "ep-next", "g1")
    assert gw.host_pid not in (0, first) and gw.host_starts == 2 and (gw.url, gw.agent_socket) == (url, sock)
    assert result.reward == 1.0 and len(result.samples) == 1 and not gw.sessions


async def test_several_hosts_share_the_episodes_and_a_lost_one_fails_only_its_own(tokenizer, tiny_model_dir):
    """actor.gateway_hosts = 2: an episode goes to the host with the fewest
    open episodes, and its URL and agent socket are that host's (the other
    host does not know it); a host killed fails its own open episodes
    alone, the other host's go on, and a new host takes its sockets."""
    from urllib.parse import urlsplit

    replies = [tokenizer.encode("4 it is", add_special_tokens=False)]
    engine = HeldEngine(0, replies, space_id(tokenizer), tokenizer.eos_token_id)
    await engine.start()
    router = AdmissionRouter(1, 16)
    gw = HostedGateway(LLMClient([engine], router), ModelConfig(path=str(tiny_model_dir)), SETTINGS,
                       model_name="tiny", hosts=2)
    async with gw.serve():
        first = gw.host_pids
        home = os.path.dirname(gw.agent_socket)
        assert len(set(first)) == 2 and 0 not in first
        async with gw.session("ep-a") as a, gw.session("ep-b") as b:
            ea, eb = a.endpoint, b.endpoint
            assert a.slot is not b.slot and ea.agent_socket != eb.agent_socket
            assert urlsplit(ea.base_url).port != urlsplit(eb.base_url).port
            assert ea.agent_sockets == eb.agent_sockets == gw.agent_sockets and len(gw.agent_sockets) == 2
            ca, cb = client_for(a), client_for(b)
            await ca.chat.completions.create(model="tiny", messages=USER)
            await cb.chat.completions.create(model="tiny", messages=USER)
            elsewhere = openai.AsyncOpenAI(
                base_url=ea.base_url.replace(f":{urlsplit(ea.base_url).port}/", f":{urlsplit(eb.base_url).port}/"),
                api_key=ea.api_key, max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await elsewhere.chat.completions.create(model="tiny", messages=USER)
            await elsewhere.close()
            os.kill(a.slot.host.pid, signal.SIGKILL)
            await until(lambda: a.lost.done())
            assert not b.lost.done()
            await cb.chat.completions.create(model="tiny", messages=USER)  # the other host serves on
            await b.settle()
            await ca.close(), await cb.close()
        assert [c.step_index for c in b.calls] == [0, 1] and len(a.calls) == 1
        await until(lambda: gw.host_starts == 3 and 0 not in gw.host_pids)
        assert gw.host_pids[1 - a.slot.index] == first[1 - a.slot.index]
        # Episodes go on, on both hosts' sockets as before.
        results = await asyncio.gather(*(run_agent_episode(gw, GuessTask(), SETTINGS, f"ep-{i}", f"g{i}")
                                         for i in range(4)))
        assert [r.reward for r in results] == [1.0] * 4 and not gw.sessions
        pids = gw.host_pids
    assert router.in_flight == [0] and engine.waiting == 0
    assert all(gone(pid) for pid in pids)
    assert not os.path.exists(home)


async def test_hosts_are_forked_from_one_server_which_comes_back_when_killed(hosted):
    """Each host is forked by the fork server (which has the imports a host
    needs done: forkserver.py), one server for every host of this process.
    A restarted host comes from the same server; a server that died is
    started again at the next host start, while running hosts serve on."""
    gw, _, _ = hosted
    server = FORK_SERVER.pid
    assert server and parent_of(gw.host_pid) == server
    first = gw.host_pid
    os.kill(first, signal.SIGKILL)
    await until(lambda: gw.host_pid not in (0, first))
    assert parent_of(gw.host_pid) == server == FORK_SERVER.pid
    os.kill(server, signal.SIGKILL)
    await until(lambda: gone(server))
    result = await run_agent_episode(gw, GuessTask(), SETTINGS, "ep-orphan", "g0")  # its host is unharmed
    assert result.reward == 1.0
    second = gw.host_pid
    os.kill(second, signal.SIGKILL)
    await until(lambda: gw.host_pid not in (0, second))
    assert FORK_SERVER.pid not in (0, server) and parent_of(gw.host_pid) == FORK_SERVER.pid
    result = await run_agent_episode(gw, GuessTask(), SETTINGS, "ep-new-server", "g1")
    assert result.reward == 1.0 and gw.host_starts == 3


SECRETS = ("HF_TOKEN", "RLNODE_HTTP_TOKEN", "AWS_SECRET_ACCESS_KEY", "VLLM_API_KEY", "WANDB_API_KEY")


@pytest.fixture
def daemon_secrets(monkeypatch):
    """Credentials in the daemon's environment, and no fork server yet: the
    next host start begins one with this environment."""
    for name in SECRETS:
        monkeypatch.setenv(name, f"s3cret-{name}")
    FORK_SERVER.close()


async def test_hosts_parse_agents_http_without_the_daemons_credentials(daemon_secrets, hosted):
    """The fork server and every host it forks get an allowlisted
    environment: none of the daemon's credentials, the basics a host needs
    (PATH, the Python path its imports use) kept; the host serves."""
    gw, _, _ = hosted
    for pid in (FORK_SERVER.pid, gw.host_pid):
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
        assert not [k for k in environ if k in SECRETS or "s3cret" in environ[k]], sorted(environ)
        assert environ["PATH"] == os.environ["PATH"] and environ.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    result = await run_agent_episode(gw, GuessTask(), SETTINGS, "ep-clean-env", "g0")
    assert result.reward == 1.0


async def test_a_host_start_cancelled_mid_fork_leaves_no_host_and_no_descriptor(tokenizer, tiny_model_dir):
    """A fork waits seconds for a fresh server's imports. A start cancelled
    then (the daemon stopping) must not hand the server descriptors that
    were closed, or reused, meanwhile: the fork finishes in its thread on
    duplicates of its own, the host it made reads EOF on its channel and
    ends, and its pidfd is closed."""
    import psutil

    old = FORK_SERVER.pid
    if old:  # the next start brings up a new server: its imports take seconds
        os.kill(old, signal.SIGKILL)
        await until(lambda: gone(old))
    engine = HeldEngine(0, [[1]], space_id(tokenizer), tokenizer.eos_token_id)
    await engine.start()
    gw = HostedGateway(LLMClient([engine], AdmissionRouter(1, 16)), ModelConfig(path=str(tiny_model_dir)), SETTINGS)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()  # the server's socket is replaced, not added

    async def serve():
        async with gw.serve():
            await asyncio.Event().wait()

    task = asyncio.create_task(serve())
    await until(lambda: FORK_SERVER.pid not in (0, old))  # the new server is importing
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(until(lambda: fds() == before), 120)  # the fork's thread is done, its pidfd closed
    server = psutil.Process(FORK_SERVER.pid)
    await asyncio.wait_for(until(lambda: not server.children()), 30)  # the host it forked has ended
    async with gw.serve():  # the server forks the next host as before
        assert parent_of(gw.host_pid) == server.pid and gw.host_starts == 1


PROBING_SERVER = """
import gc, socket, sys
from rlnode.actor.gateway import forkserver, host

def probe(argv):  # in place of the host: what its collector holds
    socket.socket(fileno=int(argv[0])).sendall(f"{gc.get_freeze_count()} {int(gc.isenabled())}".encode())
    return 0

host.main = probe
sys.exit(forkserver.serve(int(sys.argv[1])))
"""


def test_a_forked_host_leaves_the_servers_objects_to_no_collection():
    """The server's imports (torch, transformers, vLLM's parsers) are frozen
    out of the collector before it forks: a full collection in a host
    otherwise walks every one of them (375-490 ms on 2 cores, a stall of
    every call the host serves, and 159 MiB of shared pages copied into
    it); the host's own objects are collected as usual."""
    import subprocess
    import sys

    ours, theirs = socket.socketpair()
    chan, chan_host = socket.socketpair()
    tcp, unix = socket.create_server(("127.0.0.1", 0)), socket.socket(socket.AF_UNIX)
    server = subprocess.Popen([sys.executable, "-c", PROBING_SERVER, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    try:
        theirs.close()
        socket.send_fds(ours, [b"F"], [chan_host.fileno(), tcp.fileno(), unix.fileno()])
        ours.settimeout(120)
        msg, fds, _, _ = socket.recv_fds(ours, 5, 1)
        assert msg[:1] == b"P" and len(fds) == 1
        os.close(fds[0])
        chan.settimeout(60)
        frozen, enabled = map(int, chan.recv(64).split())
    finally:
        ours.close()
        server.wait(30)
        for s in (chan, chan_host, tcp, unix):
            s.close()
    assert frozen > 100_000 and enabled == 1, (frozen, enabled)


FORKING_DAEMON = """
import socket
import time
from rlnode.actor.gateway.forkserver import HostForkServer

server = HostForkServer()
chan, theirs = socket.socketpair()
tcp, unix = socket.create_server(("127.0.0.1", 0)), socket.socket(socket.AF_UNIX)
host = server.fork((theirs.fileno(), tcp.fileno(), unix.fileno()))
print(server.pid, host.pid, flush=True)
time.sleep(600)  # until killed
"""


def test_a_daemon_killed_9_leaves_neither_its_fork_server_nor_a_host():
    """Nothing of the daemon's runs at a SIGKILL: the server ends when its
    socket to the daemon closes, the host when its channel does."""
    import subprocess
    import sys
    import time

    daemon = subprocess.Popen([sys.executable, "-c", FORKING_DAEMON], stdout=subprocess.PIPE, text=True)
    try:
        server, host = map(int, daemon.stdout.readline().split())
        assert parent_of(host) == server and not gone(server) and not gone(host)
    finally:
        daemon.kill()
        daemon.wait()
        daemon.stdout.close()
    deadline = time.monotonic() + 30
    while not (gone(server) and gone(host)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server) and gone(host)


async def test_the_channel_batches_in_order_and_reports_a_broken_peer():
    a_sock, b_sock = socket.socketpair()
    got, a_lost, b_lost = [], [], []
    a = await Channel.connect(a_sock, ToDaemon, got.append, a_lost.append)
    b = await Channel.connect(b_sock, ToHost, got.append, b_lost.append)
    sent = [Generate(1, "t", 0, [1, 2, 3], 0.5, 8, agent_seed=3, stream=True), Abort(1), HostStats(errors=2),
            SessionState("t", terminated="max_turns")]
    for m in sent:
        b.send(m)
    await until(lambda: got)
    assert got == [sent] and b.frames_out == 1  # one loop iteration, one frame
    b.send(Tokens(1, [4]))  # a message the daemon's end does not take: the peer is broken
    await until(lambda: a_lost and b_lost)  # a drops the connection; b sees it closed
    assert "undecodable" in a_lost[0] and len(a_lost) == len(b_lost) == 1
    a.close(), b.close()


def test_frames_split_or_joined_across_reads_decode_whole():
    got, lost = [], []
    chan = Channel(ToDaemon, got.append, lost.append)
    frames = [msgspec.msgpack.encode([Abort(i)]) for i in range(3)]
    stream = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    for piece in (stream[:2], stream[2:7], stream[7:]):  # a header split, a body split, two frames at once
        chan.data_received(piece)
    assert got == [[Abort(0)], [Abort(1)], [Abort(2)]] and not lost and not chan._buf


def test_wire_schema_evolution():
    """Old frames decode: fields appended with defaults may be missing."""
    old = msgspec.msgpack.encode([["Generate", 1, "t", 0, [1, 2], 1.0, 8]])
    assert msgspec.msgpack.Decoder(list[ToDaemon]).decode(old) == [Generate(1, "t", 0, [1, 2], 1.0, 8)]
    new = [Generate(1, "t", 0, [1, 2], 1.0, 8, agent_seed=5, stream=True), Abort(1)]
    assert msgspec.msgpack.Decoder(list[ToDaemon]).decode(msgspec.msgpack.encode(new)) == new
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([Abort(1)])) == [["Abort", 1]]  # tag first, then fields
