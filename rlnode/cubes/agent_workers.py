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
and reaches the gateway's episode routes through its relay
(``inside_url``). With ``isolation = "none"`` the same command runs bare.

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

Protocol (pickled tuples over a ``multiprocessing.connection`` socket):
    daemon -> worker: ("run", id, task, base_url, api_key) | ("cancel", id) | ("stop",)
    worker -> daemon: ("ready",) | ("load_error", message) at start;
                      ("ok", id, value) | ("error", id, message) per episode;
                      ("retire",) once its CPU time passes RETIRE_FRACTION of its limit
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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import rlnode
from rlnode.config import ConfigError
from rlnode.cubes import agent_sandbox
from rlnode.cubes.agent_sandbox import AgentLimits, GatewayRelay
from rlnode.cubes.base import AgentEndpoint, CubeError
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.agent_workers")

# Seconds a cancelled episode may take to unwind before its worker is killed.
CANCEL_GRACE_S = 2.0
# Seconds a worker may take to start and import the agent.
START_TIMEOUT_S = 120.0
# Share of limits.cpu_s after which a worker retires (its own CPU time).
RETIRE_FRACTION = 0.8
# The worker's command: python -c WORKER_MAIN FD REF RETIRE_CPU_S
WORKER_MAIN = ("import sys; from rlnode.cubes.agent_workers import worker_main; "
               "worker_main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))")
# rlnode's own package, shown read-only in a worker's sandbox (its code, no data).
RLNODE_DIR = os.path.dirname(os.path.abspath(rlnode.__file__))


class AgentWorkerError(CubeError):
    """The episode's agent failed in its worker (raised, or its worker died)."""


def worker_main(fd: int, ref: str, retire_cpu_s: float) -> None:  # pragma: no cover - runs in the worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers end
    import inspect
    import resource
    from concurrent.futures import ThreadPoolExecutor

    conn = Connection(fd)
    retired = False

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    try:
        fn = load_agent(ref)
    except BaseException as e:  # noqa: BLE001 - reported, then the worker ends
        conn.send(("load_error", str(e)))
        return
    is_async = inspect.iscoroutinefunction(fn)
    threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="agent")
    loop = asyncio.new_event_loop()
    jobs: dict[int, asyncio.Task] = {}
    stopped = loop.create_future()

    async def job(jid: int, task, base_url: str, api_key: str) -> None:
        running = None
        try:
            if is_async:
                value = await fn(task, base_url, api_key)
            else:
                running = threads.submit(fn, task, base_url, api_key)
                value = await asyncio.wrap_future(running)
            reply = ("ok", jid, value)
        except asyncio.CancelledError:
            if running is not None and not running.cancel():
                # A thread cannot be stopped: no reply, so the daemon kills
                # this worker when its grace runs out.
                return
            reply = ("error", jid, "cancelled")
        except BaseException as e:  # noqa: BLE001 - SystemExit too: this episode only
            reply = ("error", jid, f"{type(e).__name__}({e})")
        nonlocal retired
        jobs.pop(jid, None)
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - a reward of a type pickle refuses
            conn.send(("error", jid, f"the agent returned an unsendable value: {e!r}"))
        if not retired and cpu_s() > retire_cpu_s:
            retired = True
            conn.send(("retire",))

    def on_message() -> None:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the daemon is gone
            msg = ("stop",)
        if msg[0] == "run":
            jobs[msg[1]] = loop.create_task(job(*msg[1:]))
        elif msg[0] == "cancel" and msg[1] in jobs:
            jobs[msg[1]].cancel()
        elif msg[0] == "stop" and not stopped.done():
            stopped.set_result(None)

    loop.add_reader(conn.fileno(), on_message)
    conn.send(("ready",))
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
    of its socket pair, its relay to the gateway, its episodes."""

    def __init__(self, proc: asyncio.subprocess.Process, conn: Connection, relay: GatewayRelay | None):
        self.proc, self.conn, self.relay = proc, conn, relay
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
        self.ref, self.processes = _absolute_ref(ref), processes
        self.isolation, self.env, self.cwd = isolation, dict(env or {}), cwd
        self.ro_paths = [*(ro_paths or []), RLNODE_DIR, *_ref_files(self.ref)]
        self.limits = limits or AgentLimits()
        # The gateway's agent socket, known at the first episode (workers
        # start with their cube, before the gateway serves).
        self.upstream = ""
        self.workers: list[_Worker] = []
        self._ids = itertools.count()
        self._reaper: set[asyncio.Task] = set()  # workers being reaped: awaited by close()
        self._watchers: set[asyncio.Task] = set()  # cancelled episodes' grace timers: cancelled by close()
        self.restarts = 0  # workers killed (an episode would not end) or found dead
        self.retired = 0  # workers that neared their CPU limit and were replaced

    async def start(self) -> None:
        """Spawn the workers; an agent that cannot be loaded fails here."""
        await asyncio.gather(*(self._spawn() for _ in range(self.processes)))

    async def _spawn(self) -> _Worker:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        relay = None
        try:
            cmd = [sys.executable, "-c", WORKER_MAIN, str(theirs.fileno()), self.ref,
                   str(RETIRE_FRACTION * self.limits.cpu_s)]
            if self.isolation == "none":
                argv, env = cmd, self.env
            else:
                relay = GatewayRelay(self.upstream, self.limits.connections)
                await relay.__aenter__()
                argv = agent_sandbox.sandboxed_argv(cmd, self.env, relay, self.cwd, self.ro_paths, self.limits,
                                                    pass_fds=(theirs.fileno(),))
                env = agent_sandbox.inside_env(self.env)
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd="/" if relay else (self.cwd or None), stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True)  # its group: a kill takes what it started
        except BaseException:
            ours.close()
            if relay is not None:
                await relay.__aexit__(None, None, None)
            raise
        finally:
            theirs.close()
        w = _Worker(proc, Connection(ours.detach()), relay)
        w.ready = loop.create_future()
        loop.add_reader(w.conn.fileno(), self._on_readable, w)
        self.workers.append(w)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await w.ready
        except BaseException:
            self._drop(w)
            raise
        return w

    def _on_readable(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._drop(w, "the agent worker died")
            return
        if msg[0] == "ready":
            w.ready.set_result(None)
        elif msg[0] == "load_error":
            w.ready.set_exception(ConfigError(f"agent {self.ref!r}: {msg[1]}"))
        elif msg[0] == "retire":
            w.retiring = True
            self.retired += 1
            log.info("agent.worker_retiring", agent=self.ref, cpu_limit_s=self.limits.cpu_s, episodes=len(w.pending))
            self._stop_if_drained(w)
        else:
            fut = w.pending.pop(msg[1], None)
            if fut is not None and not fut.done():
                if msg[0] == "ok":
                    fut.set_result(msg[2])
                else:
                    fut.set_exception(AgentWorkerError(f"agent failed: {msg[2]}"))
            self._stop_if_drained(w)

    def _stop_if_drained(self, w: _Worker) -> None:
        if w.retiring and not w.pending:
            try:
                w.conn.send(("stop",))
            except OSError:
                pass
            self._drop(w)

    def _drop(self, w: _Worker, why: str = "") -> None:
        if w in self.workers:
            self.workers.remove(w)
            _unwatch(w)
            if why:
                self.restarts += 1
                log.warning("agent.worker_lost", agent=self.ref, why=why, episodes=len(w.pending))
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
            w.conn.close()
            if w.relay is not None:
                await w.relay.__aexit__(None, None, None)

    def _track(self, coro, tasks: set[asyncio.Task] | None = None) -> None:
        tasks = self._reaper if tasks is None else tasks
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def run(self, task: dict[str, Any], endpoint: AgentEndpoint) -> Any:
        """One episode of the agent in the least busy worker."""
        base_url = endpoint.base_url
        if self.isolation != "none":
            self.upstream = endpoint.agent_socket
            for w in self.workers:
                if w.relay is not None:
                    w.relay.upstream = endpoint.agent_socket
            base_url = agent_sandbox.inside_url(base_url)
        while len(active := [w for w in self.workers if not w.retiring]) < self.processes:
            await self._spawn()  # replace workers lost to kills or retired
        w = min(active, key=lambda x: len(x.pending))
        jid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        w.pending[jid] = fut
        w.conn.send(("run", jid, task, base_url, endpoint.api_key))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                try:
                    w.conn.send(("cancel", jid))
                except OSError:
                    pass
                self._track(self._end_or_kill(w, fut), self._watchers)
            raise

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
            _unwatch(w)
            try:
                w.conn.send(("stop",))
            except OSError:
                pass
        for w in workers:
            for fut in w.pending.values():
                if not fut.done():
                    fut.set_exception(AgentWorkerError("the cube closed"))
            self._track(self._end(w, kill=False))
        await asyncio.gather(*self._reaper, return_exceptions=True)


def _absolute_ref(ref: str) -> str:
    """A ``path/file.py:function`` ref made absolute (the worker's working
    directory is its sandbox's, not the daemon's)."""
    target, sep, attr = ref.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{os.path.abspath(target)}:{attr}"
    return ref


def _ref_files(ref: str) -> list[str]:
    target = ref.rpartition(":")[0]
    return [target] if target.endswith(".py") and os.path.isfile(target) else []


def _unwatch(w: _Worker) -> None:
    try:
        asyncio.get_running_loop().remove_reader(w.conn.fileno())
    except (OSError, ValueError, RuntimeError):
        pass
