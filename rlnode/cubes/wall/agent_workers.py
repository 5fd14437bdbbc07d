"""Function agents in worker processes: never on the daemon's event loop,
always behind the agents' wall.

An ``openai-agent`` cube with ``agent = "module:function"`` runs the function
here, in ``processes`` worker processes, not in the actor daemon. The
daemon's loop carries vLLM's output handler, the gateway, the link and
(under ``--role all``) the trainer; an agent's own work (building requests in
its SDK, parsing replies, its tools) would otherwise take turns with all of
them, and a blocking one would hold the default executor the daemon's own
blocking work shares.

A worker is not a child of the daemon's memory (no fork, no spawn
preparation data): it is a fresh interpreter started as a command, under
the same sandbox as command agents (``agent_sandbox.sandboxed_argv``: own
pid and net namespaces, an unprivileged uid, rlimits, no run dir, no link
keys; its environment is the cube's allowlist, bwrap is started with it).
It talks to the daemon over one socket pair handed to it as a descriptor,
and reaches the gateway's episode routes through its relays, one per
gateway host (``inside_url``: an episode's URL names its host's relay port). With ``isolation = "none"`` the same command runs bare.

Each worker runs many episodes at once on its own event loop: an async
function is awaited there, a plain one runs in the worker's thread pool.
One episode that must end (its timeout, a cancelled group) is cancelled in
the worker; if it has not ended ``CANCEL_GRACE_S`` later (a blocking agent,
an agent that swallows cancellation) the worker is killed with its process
group, failing the other episodes it held (the scheduler retries them), and
a fresh worker takes its place. An exception of any kind, SystemExit
included, fails only its own episode. A worker whose CPU time nears its
rlimit (``limits.cpu_s``) retires: it takes no new episode, ends when its
last one has, and a fresh one takes its place.

Protocol: msgspec Structs in length-prefixed msgpack frames over the
socket pair (``_Frames``, ``rlnode/frames.py``). Never pickle: what a
worker sends is the agent's (the policy's) doing, and unpickling it would
run its code in the daemon. The daemon reads without blocking (a worker
that sends half a frame holds nothing), refuses a frame over
``MAX_FRAME_BYTES`` or one that does not decode, and then drops the worker.
    daemon -> worker: Run(id, task, base_url, api_key) | Cancel(id) | Stop()
    worker -> daemon: Ready() | LoadError(message) at start;
                      Done(id, value) | Failed(id, message) per episode (value:
                      what msgpack carries: numbers, strings, lists, maps, None);
                      Retire() once its CPU time passes RETIRE_FRACTION of its limit
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Union

import msgspec

import rlnode
from rlnode.config import ConfigError
from rlnode.cubes.wall import agent_sandbox, isolation
from rlnode.cubes.wall.agent_sandbox import AgentLimits, GatewayRelay
from rlnode.cubes.base import AgentEndpoint, AgentError, CubeError
from rlnode.cubes.wall.box_cgroup import BoxCgroup
from rlnode.frames import FrameProtocol
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.wall.agent_workers")

# Seconds a cancelled episode may take to unwind before its worker is killed.
CANCEL_GRACE_S = 2.0
# Seconds a worker may take to start and import the agent.
START_TIMEOUT_S = 120.0
# Share of limits.cpu_s after which a worker retires (its own CPU time).
RETIRE_FRACTION = 0.8
# The worker's command: python -c WORKER_MAIN FD REF RETIRE_CPU_S
WORKER_MAIN = ("import sys; from rlnode.cubes.wall.agent_workers import worker_main; "
               "worker_main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))")
# rlnode's own package, shown read-only in a worker's sandbox (its code, no data).
RLNODE_DIR = os.path.dirname(os.path.abspath(rlnode.__file__))
# A frame (one message: a task's data, an episode's result) above this is a
# broken or hostile worker.
MAX_FRAME_BYTES = 16 * 2**20


class _Msg(msgspec.Struct, array_like=True, tag=True):
    pass


class Run(_Msg):
    id: int
    task: Any
    base_url: str
    api_key: str


class Cancel(_Msg):
    id: int


class Stop(_Msg):
    pass


class Ready(_Msg):
    pass


class LoadError(_Msg):
    message: str


class Done(_Msg):
    id: int
    value: Any = None


class Failed(_Msg):
    id: int
    message: str


class Retire(_Msg):
    pass


ToWorker = Union[Run, Cancel, Stop]
FromWorker = Union[Ready, LoadError, Done, Failed, Retire]


class _Frames(FrameProtocol):
    """One end of the socket pair: ``send`` writes a message as one frame
    (never blocks); ``on_message`` gets each one that arrives, ``on_lost``
    the reason once (``rlnode/frames.py``: a frame too large or one that
    does not decode aborts the transport)."""

    def __init__(self, incoming: Any, on_message: Callable[[Any], None], on_lost: Callable[[str], None]):
        super().__init__(incoming, on_message, on_lost, MAX_FRAME_BYTES, "the agent worker's channel")
        self._encode = msgspec.msgpack.Encoder().encode

    def send(self, msg: Any) -> None:
        """Raises TypeError/msgspec.EncodeError for what msgpack cannot carry."""
        self.write_frame(self._encode(msg))


class AgentWorkerError(AgentError):
    """The episode's agent failed in its worker (raised, or its worker died)."""


def worker_main(fd: int, ref: str, retire_cpu_s: float) -> None:  # pragma: no cover - runs in the worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers end
    import inspect
    import resource
    from concurrent.futures import ThreadPoolExecutor

    retired = False

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    try:
        fn, load_error = load_agent(ref), ""
    except BaseException as e:  # noqa: BLE001 - reported, then the worker ends
        fn, load_error = None, str(e) or repr(e)
    is_async = inspect.iscoroutinefunction(fn)
    threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="agent")
    loop = asyncio.new_event_loop()
    jobs: dict[int, asyncio.Task] = {}
    stopped = loop.create_future()

    def on_message(msg) -> None:
        match msg:
            case Run():
                jobs[msg.id] = loop.create_task(job(msg.id, msg.task, msg.base_url, msg.api_key))
            case Cancel(id=jid) if jid in jobs:
                jobs[jid].cancel()
            case Stop() if not stopped.done():
                stopped.set_result(None)

    def on_lost(_why: str) -> None:  # the daemon is gone
        if not stopped.done():
            stopped.set_result(None)

    async def job(jid: int, task, base_url: str, api_key: str) -> None:
        running = None
        try:
            if is_async:
                value = await fn(task, base_url, api_key)
            else:
                running = threads.submit(fn, task, base_url, api_key)
                value = await asyncio.wrap_future(running)
            reply = Done(jid, value)
        except asyncio.CancelledError:
            if running is not None and not running.cancel():
                # A thread cannot be stopped: no reply, so the daemon kills
                # this worker when its grace runs out.
                return
            reply = Failed(jid, "cancelled")
        except BaseException as e:  # noqa: BLE001 - SystemExit too: this episode only
            reply = Failed(jid, f"{type(e).__name__}({e})")
        nonlocal retired
        jobs.pop(jid, None)
        try:
            conn.send(reply)
        except (TypeError, ValueError, msgspec.EncodeError) as e:  # a value msgpack cannot carry
            conn.send(Failed(jid, f"the agent returned an unsendable value: {e!r}"))
        if not retired and cpu_s() > retire_cpu_s:
            retired = True
            conn.send(Retire())

    _, conn = loop.run_until_complete(loop.create_unix_connection(
        lambda: _Frames(ToWorker, on_message, on_lost), sock=socket.socket(fileno=fd)))
    if load_error:
        conn.send(LoadError(load_error))
        loop.run_until_complete(asyncio.sleep(0))  # the transport writes it
        conn.close()
        return
    conn.send(Ready())
    loop.run_until_complete(stopped)
    os._exit(0)  # threads of blocking agents may still run: the process ends regardless


def load_agent(ref: str) -> Callable:
    """``module:function`` (importable) or ``path/to/file.py:function``."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"agent {ref!r}: expected 'module:function' or 'path/to/file.py:function'")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            spec = importlib.util.spec_from_file_location(f"rlnode_agent_{path.stem}", path)
            if spec is None or not path.is_file():
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, OSError) as e:
        raise ValueError(f"agent {ref!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"agent {ref!r} is not callable")
    return fn


class _Worker:
    """One worker process: its command under the sandbox, the daemon's end
    of its socket pair, its relays to the gateway's hosts, its episodes."""

    def __init__(self, proc: asyncio.subprocess.Process, relays: list[GatewayRelay], group: BoxCgroup | None):
        self.proc, self.relays, self.group = proc, relays, group
        # Its stdout and stderr, one pipe: the last OUTPUT_TAIL bytes, for
        # the log line when it is lost (never the daemon's own stdout, which
        # is the journal: a worker could flood it or forge its lines).
        self.output = isolation.OutputTail()
        self.draining = asyncio.ensure_future(self.output.drain(proc.stdout)) if proc.stdout else None
        self.conn: _Frames | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.ready: asyncio.Future | None = None
        self.retiring = False

    def alive(self) -> bool:
        return self.proc.returncode is None

    def kill(self) -> None:
        try:  # its process group: bwrap, and with it the sandbox's pid namespace
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class AgentWorkers:
    """``processes`` worker processes running agent ``ref``, each under the
    agents' sandbox (``isolation = "bwrap"``) with environment ``env``."""

    def __init__(self, ref: str, processes: int, isolation: str = "bwrap", env: dict[str, str] | None = None,
                 ro_paths: list[str] | None = None, limits: AgentLimits | None = None, cwd: str = ""):
        self.ref, self.processes = absolute_ref(ref), processes
        self.isolation, self.env, self.cwd = isolation, dict(env or {}), cwd
        self.ro_paths = [*(ro_paths or []), RLNODE_DIR, *ref_files(self.ref)]
        self.limits = limits or AgentLimits()
        # The gateway's agent sockets (one per gateway host), known at the
        # first episode (workers start with their cube, before the gateway
        # serves): each worker has a relay to each.
        self.upstreams: list[str] = []
        self.workers: list[_Worker] = []
        self._ids = itertools.count()
        self._spawning = asyncio.Lock()
        self._reaper: set[asyncio.Task] = set()  # workers being reaped: awaited by close()
        self._watchers: set[asyncio.Task] = set()  # cancelled episodes' grace timers: cancelled by close()
        self.restarts = 0  # workers killed (an episode would not end) or found dead
        self.retired = 0  # workers that neared their CPU limit and were replaced

    async def start(self) -> None:
        """Spawn the workers; an agent that cannot be loaded fails here. Every
        spawn ends (started or failed) before the first failure is raised, so
        the caller's ``close`` finds every worker that did start."""
        spawned = await asyncio.gather(*(self._spawn() for _ in range(self.processes)), return_exceptions=True)
        for outcome in spawned:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _spawn(self) -> _Worker:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        relays: list[GatewayRelay] = []
        group: BoxCgroup | None = None
        try:
            cmd = [sys.executable, "-c", WORKER_MAIN, str(theirs.fileno()), self.ref,
                   str(RETIRE_FRACTION * self.limits.cpu_s)]
            if self.isolation == "none":
                argv, env = cmd, self.env
            else:
                for upstream in self.upstreams or [""]:
                    relays.append(await GatewayRelay(upstream, self.limits.connections).open())
                argv = agent_sandbox.sandboxed_argv(cmd, self.env, relays, self.cwd, self.ro_paths, self.limits,
                                                    pass_fds=(theirs.fileno(),))
                if group := await agent_sandbox.box_cgroup(self.limits):
                    argv = group.enter(argv)
                env = agent_sandbox.inside_env(self.env)
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd="/" if relays else (self.cwd or None), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                pass_fds=(theirs.fileno(),), start_new_session=True)  # its group: a kill takes what it started
        except BaseException:
            ours.close()
            for relay in relays:
                await relay.__aexit__(None, None, None)
            if group is not None:
                await group.close()
            raise
        finally:
            theirs.close()
        w = _Worker(proc, relays, group)
        w.ready = loop.create_future()
        self.workers.append(w)
        try:
            _, w.conn = await loop.create_unix_connection(
                lambda: _Frames(FromWorker, lambda m: self._on_message(w, m), lambda why: self._drop(w, why)),
                sock=ours)
        except BaseException:
            ours.close()
            self._drop(w)
            raise
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await w.ready
        except BaseException:
            self._drop(w)
            raise
        return w

    def _on_message(self, w: _Worker, msg: Any) -> None:
        match msg:
            case Ready():
                if not w.ready.done():
                    w.ready.set_result(None)
            case LoadError(message=message):
                if not w.ready.done():
                    w.ready.set_exception(ConfigError(f"agent {self.ref!r}: {message}"))
            case Retire():
                if not w.retiring:
                    w.retiring = True
                    self.retired += 1
                    log.info("agent.worker_retiring", agent=self.ref, cpu_limit_s=self.limits.cpu_s,
                             episodes=len(w.pending))
                self._stop_if_drained(w)
            case Done() | Failed():
                fut = w.pending.pop(msg.id, None)
                if fut is not None and not fut.done():
                    if isinstance(msg, Done):
                        fut.set_result(msg.value)
                    else:
                        fut.set_exception(AgentWorkerError(agent_sandbox.with_verdict(f"agent failed: {msg.message}",
                                                                                      w.group)))
                self._stop_if_drained(w)

    def _stop_if_drained(self, w: _Worker) -> None:
        if w.retiring and not w.pending:
            w.conn.send(Stop())
            self._drop(w)

    def _drop(self, w: _Worker, why: str = "") -> None:
        if w in self.workers:
            self.workers.remove(w)
            if why:
                why = agent_sandbox.with_verdict(why, w.group)
                self.restarts += 1
                log.warning("agent.worker_lost", agent=self.ref, why=why, episodes=len(w.pending),
                            output_bytes=w.output.total, output_tail=w.output.text()[-2000:])
            self._track(self._end(w, kill=bool(why) or not w.retiring))
        for fut in w.pending.values():
            if not fut.done():
                fut.set_exception(AgentWorkerError(f"agent worker ended: {why or 'stopped'}"))
        w.pending.clear()
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(AgentWorkerError(f"agent worker ended before it was ready: {why}"))

    async def _end(self, w: _Worker, kill: bool) -> None:
        """Reap a dropped worker (killed, or a retired one given time to
        stop), then close its relay and its socket."""
        try:
            if not kill:
                try:
                    await asyncio.wait_for(w.proc.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
            w.kill()  # anything it started, and a worker that did not stop
            await w.proc.wait()
        finally:
            if w.draining is not None:
                w.draining.cancel()
                await asyncio.gather(w.draining, return_exceptions=True)
            if w.conn is not None:
                w.conn.close()
            for relay in w.relays:
                await relay.__aexit__(None, None, None)
            if w.group is not None:
                await w.group.close()

    def _track(self, coro, tasks: set[asyncio.Task] | None = None) -> None:
        tasks = self._reaper if tasks is None else tasks
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def run(self, task: dict[str, Any], endpoint: AgentEndpoint) -> Any:
        """One episode of the agent in the least busy worker."""
        base_url = endpoint.base_url
        if self.isolation != "none":
            base_url = agent_sandbox.inside_url(base_url, self._relay_to(endpoint))
        async with self._spawning:  # episodes arriving together start the missing workers once
            while len(active := [w for w in self.workers if not w.retiring]) < self.processes:
                await self._spawn()  # replace workers lost to kills or retired
        w = min(active, key=lambda x: len(x.pending))
        if not w.ready.done():  # another episode's run() is starting it
            await asyncio.shield(w.ready)
        jid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        w.pending[jid] = fut
        try:
            w.conn.send(Run(jid, task, base_url, endpoint.api_key))
        except (TypeError, ValueError, msgspec.EncodeError) as e:
            w.pending.pop(jid, None)
            raise CubeError(f"the task's data cannot be sent to the agent: {e}") from e
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                w.conn.send(Cancel(jid))
                self._track(self._end_or_kill(w, fut), self._watchers)
            raise

    def _relay_to(self, endpoint: AgentEndpoint) -> int:
        """Which of a worker's relays reaches the host serving ``endpoint``.
        Workers whose relays lead elsewhere (started before the gateway
        served, or for a different number of hosts) retire: they finish
        what they hold and fresh ones take their place."""
        sockets = endpoint.agent_sockets or [endpoint.agent_socket]
        if sockets != self.upstreams:
            self.upstreams = list(sockets)
            for w in self.workers:
                if len(w.relays) == len(sockets):  # same shape: point them at the gateway's sockets
                    for relay, upstream in zip(w.relays, sockets):
                        relay.upstream = upstream
                elif not w.retiring:
                    w.retiring = True
                    self._stop_if_drained(w)
        return sockets.index(endpoint.agent_socket)

    async def _end_or_kill(self, w: _Worker, fut: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(fut), CANCEL_GRACE_S)
        except asyncio.TimeoutError:
            self._drop(w, f"an episode did not end within {CANCEL_GRACE_S:g}s of its cancellation")
        except Exception:  # noqa: BLE001 - ended with an error: that is ending
            pass

    async def close(self) -> None:
        for t in list(self._watchers):
            t.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        workers, self.workers = list(self.workers), []
        for w in workers:
            if w.conn is not None:
                w.conn.send(Stop())
        for w in workers:
            for fut in w.pending.values():
                if not fut.done():
                    fut.set_exception(AgentWorkerError("the cube closed"))
            self._track(self._end(w, kill=False))
        await asyncio.gather(*self._reaper, return_exceptions=True)


def absolute_ref(ref: str) -> str:
    """A ``path/file.py:function`` ref made absolute (the worker's working
    directory is its sandbox's, not the daemon's)."""
    target, sep, attr = ref.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{os.path.abspath(target)}:{attr}"
    return ref


def ref_files(ref: str) -> list[str]:
    target = ref.rpartition(":")[0]
    return [target] if target.endswith(".py") and os.path.isfile(target) else []

