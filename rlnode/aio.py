"""Task helpers every daemon part uses: a base module (it imports nothing
of rlnode's but the logger), so roles and subsystems share them without
importing the daemon that runs them."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from rlnode.log import get_logger

log = get_logger("rlnode.aio")
T = TypeVar("T")


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run`` on the loop the daemons use (uvloop): what a
    benchmark of a daemon's path measures must be that loop's cost."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(main)
    return uvloop.run(main)


async def run_until_stopped(jobs: list[asyncio.Task], stop: asyncio.Event) -> None:
    """A role's run(): serve until ``stop`` is set or one job ends (a job that
    ends on its own with an error raises it here); then cancel the rest."""
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopping, *jobs], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stopping:
                t.result()
    finally:
        stopping.cancel()
        for t in jobs:
            t.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)


async def wait_for_charged(aw: Awaitable[T], timeout_s: float, uncharged: Callable[[], float]) -> T:
    """``asyncio.wait_for(aw, timeout_s)`` on a clock that stops while
    ``uncharged()`` grows: the deadline is ``timeout_s`` seconds of wall
    time less ``uncharged()`` (a monotonic count of seconds not to charge).
    On the deadline ``aw`` is cancelled and awaited and TimeoutError
    raised; cancelling the caller cancels ``aw`` and waits for it, as
    ``wait_for`` does."""
    task = asyncio.ensure_future(aw)
    t0 = time.monotonic()
    try:
        while not task.done():
            left = timeout_s - (time.monotonic() - t0 - uncharged())
            if left <= 0:
                task.cancel()
                await asyncio.wait({task})
                if task.cancelled():
                    raise TimeoutError
                break
            await asyncio.wait({task}, timeout=left)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})
        raise
    return task.result()


def spawn(tasks: set[asyncio.Task], coro) -> asyncio.Task:
    """Start a background task and keep a reference to it until it ends (the
    event loop holds only weak references: an unreferenced task can be
    garbage-collected mid-flight). A task that ends with an exception is
    logged (``task.failed``): nobody awaits these tasks, so otherwise the
    error would surface only as asyncio's "never retrieved" at exit."""
    t = asyncio.create_task(coro)
    tasks.add(t)
    t.add_done_callback(tasks.discard)
    t.add_done_callback(_log_failure)
    return t


def _log_failure(t: asyncio.Task) -> None:
    if not t.cancelled() and (e := t.exception()) is not None:
        log.error("task.failed", task=t.get_name(), error=repr(e)[:500], exc_info=e)


# Loops whose tasks ``kill -USR1 <pid>`` logs, beside the main thread's
# (a thread's own loop, e.g. the verifiers cubes' ForeignLoop).
_dumped_loops: list[asyncio.AbstractEventLoop] = []


def dump_tasks_on_signal(signum: int) -> None:
    """On ``signum``, log every pending asyncio task of the main loop and of
    the registered ones, each with the chain of awaits it is suspended in
    (``debug.task``): what an episode that neither ends nor fails waits
    for. Call from the main thread; read-only (tasks are only listed)."""
    import signal

    signal.signal(signum, lambda *_: dump_tasks())


def register_loop(loop: asyncio.AbstractEventLoop) -> None:
    _dumped_loops.append(loop)


def dump_tasks() -> int:
    """Log the pending tasks (see ``dump_tasks_on_signal``); how many."""
    loops = list(_dumped_loops)
    try:
        loops.insert(0, asyncio.get_running_loop())
    except RuntimeError:
        pass
    n = 0
    for loop in loops:
        for _ in range(3):  # another thread may add a task while we list them
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                tasks = []
        for t in tasks:
            n += 1
            log.warning("debug.task", loop=id(loop), task=t.get_name(), awaiting=_await_chain(t.get_coro()))
    return n


def _await_chain(coro) -> list[str]:
    out = []
    while coro is not None and len(out) < 40:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_filename.rsplit('/site-packages/', 1)[-1]}:{frame.f_lineno} "
                       f"{frame.f_code.co_qualname}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out
