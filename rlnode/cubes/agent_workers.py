"""Function agents in worker processes: never on the daemon's event loop.

An ``openai-agent`` cube with ``agent = "module:function"`` runs the function
here, in ``processes`` spawned worker processes, not in the actor daemon.
The daemon's loop carries vLLM's output handler, the gateway, the link and
(under ``--role all``) the trainer; an agent's own work (building requests in
its SDK, parsing replies, its tools) would otherwise take turns with all of
them, and a blocking one would hold the default executor the daemon's own
blocking work shares.

Each worker runs many episodes at once on its own event loop: an async
function is awaited there, a plain one runs in the worker's thread pool.
One episode that must end (its timeout, a cancelled group) is cancelled in
the worker; if it has not ended ``CANCEL_GRACE_S`` later (a blocking agent,
an agent that swallows cancellation) the worker is killed with its process
group, failing the other episodes it held (the scheduler retries them), and
a fresh worker takes its place. An exception of any kind, SystemExit
included, fails only its own episode.

Protocol (pickled tuples over a ``multiprocessing`` pipe):
    daemon -> worker: ("run", id, task, base_url, api_key) | ("cancel", id) | ("stop",)
    worker -> daemon: ("ready",) | ("load_error", message) at start;
                      ("ok", id, value) | ("error", id, message) per episode
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any, Callable

from rlnode.config import ConfigError
from rlnode.cubes.base import CubeError
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.agent_workers")

# Seconds a cancelled episode may take to unwind before its worker is killed.
CANCEL_GRACE_S = 2.0
# Seconds a worker may take to start and import the agent.
START_TIMEOUT_S = 120.0


class AgentWorkerError(CubeError):
    """The episode's agent failed in its worker (raised, or its worker died)."""


def _worker_main(conn, ref: str) -> None:  # pragma: no cover - runs in the child process
    os.setsid()  # its own process group: a kill takes what the agent started too
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers end
    import inspect
    from concurrent.futures import ThreadPoolExecutor

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
        jobs.pop(jid, None)
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - a reward of a type pickle refuses
            conn.send(("error", jid, f"the agent returned an unsendable value: {e!r}"))

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
    def __init__(self, ref: str):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, ref), daemon=True, name="rlnode-agent")
        self.proc.start()
        child.close()
        self.pending: dict[int, asyncio.Future] = {}
        self.ready: asyncio.Future | None = None

    def kill(self) -> None:
        for sig_target in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), self.proc.kill):
            try:
                sig_target()
            except (ProcessLookupError, PermissionError, OSError):
                pass


class AgentWorkers:
    """``processes`` worker processes running agent ``ref``."""

    def __init__(self, ref: str, processes: int):
        self.ref, self.processes = ref, processes
        self.workers: list[_Worker] = []
        self._ids = itertools.count()
        self._reaper: set[asyncio.Task] = set()
        self.restarts = 0  # workers killed (an episode would not end) or found dead

    async def start(self) -> None:
        """Spawn the workers; an agent that cannot be loaded fails here."""
        await asyncio.gather(*(self._spawn() for _ in range(self.processes)))

    async def _spawn(self) -> _Worker:
        loop = asyncio.get_running_loop()
        w = await loop.run_in_executor(None, _Worker, self.ref)  # spawn's fork+exec off the loop
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
        else:
            fut = w.pending.pop(msg[1], None)
            if fut is not None and not fut.done():
                if msg[0] == "ok":
                    fut.set_result(msg[2])
                else:
                    fut.set_exception(AgentWorkerError(f"agent failed: {msg[2]}"))

    def _drop(self, w: _Worker, why: str = "") -> None:
        if w in self.workers:
            self.workers.remove(w)
            _unwatch(w)
            w.kill()
            w.proc.join(timeout=0)  # reaped later by multiprocessing if still exiting
            if why:
                self.restarts += 1
                log.warning("agent.worker_lost", agent=self.ref, why=why, episodes=len(w.pending))
        for fut in w.pending.values():
            if not fut.done():
                fut.set_exception(AgentWorkerError(f"agent worker ended: {why or 'stopped'}"))
        w.pending.clear()
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(AgentWorkerError(f"agent worker ended before it was ready: {why}"))

    async def run(self, task: dict[str, Any], base_url: str, api_key: str) -> Any:
        """One episode of the agent in the least busy worker."""
        while len(self.workers) < self.processes:  # replace workers lost to kills
            await self._spawn()
        w = min(self.workers, key=lambda x: len(x.pending))
        jid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        w.pending[jid] = fut
        w.conn.send(("run", jid, task, base_url, api_key))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                try:
                    w.conn.send(("cancel", jid))
                except OSError:
                    pass
                t = asyncio.ensure_future(self._end_or_kill(w, fut))
                self._reaper.add(t)
                t.add_done_callback(self._reaper.discard)
            raise

    async def _end_or_kill(self, w: _Worker, fut: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(fut), CANCEL_GRACE_S)
        except asyncio.TimeoutError:
            self._drop(w, f"an episode did not end within {CANCEL_GRACE_S:g}s of its cancellation")
        except Exception:  # noqa: BLE001 - ended with an error: that is ending
            pass

    async def close(self) -> None:
        for t in list(self._reaper):
            t.cancel()
        await asyncio.gather(*self._reaper, return_exceptions=True)
        workers, self.workers = list(self.workers), []
        for w in workers:
            _unwatch(w)
            try:
                w.conn.send(("stop",))
            except OSError:
                pass
        loop = asyncio.get_running_loop()
        for w in workers:
            await loop.run_in_executor(None, w.proc.join, 5.0)
            w.kill()  # anything it started, and a worker that did not stop
            await loop.run_in_executor(None, w.proc.join, 5.0)
            for fut in w.pending.values():
                if not fut.done():
                    fut.set_exception(AgentWorkerError("the cube closed"))
            w.conn.close()


def _unwatch(w: _Worker) -> None:
    try:
        asyncio.get_running_loop().remove_reader(w.conn.fileno())
    except (OSError, ValueError, RuntimeError):
        pass
