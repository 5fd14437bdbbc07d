"""One event loop, in one thread, for all the foreign environment code of a
process: every episode of every verifiers cube runs on it.

Why one loop, not one per episode. Environment libraries build their
asyncio objects once and share them between episodes: verifiers 0.4 keeps
its script locks on a class (``SubprocessRuntime._locks``), its harnesses
share semaphores. An ``asyncio.Lock`` binds to the loop of the first
episode that waits on it; an episode on any other loop then fails with
"... is bound to a different event loop". With a loop per episode, 62 of 64
concurrent first tries failed that way (issue 34). One loop for the whole
process, for the process's lifetime, is the only shape in which every such
object is used where it was bound: a loop per cube would still break two
cubes that share a class-level lock, and a loop that stopped and restarted
with its cubes would strand the locks bound to the old one.

Why not the daemon's own loop. asyncio re-raises ``SystemExit`` and
``KeyboardInterrupt`` from *any* task out of ``run_forever`` (``Task.__step``,
``Handle._run``), so a ``sys.exit`` in a task a foreign library spawned
(verifiers scores rubrics under ``gather``) would stop the actor. Here it
stops only this loop's ``run_forever``: the thread's supervisor records it
and runs the loop on. The task that raised it is finished with that
exception (``Task.__step`` sets it before re-raising), so whoever awaited it
-- the episode -- sees it, and ``run`` turns it into a ``CubeError`` for
that episode alone. The ready callbacks left behind in that iteration run on
the next turn of the loop: nothing else is lost.

Deadlines. ``run`` is cancelled by its caller's deadline (the cube's
``timeout_s``, the episode's ``wait_for``): it cancels the episode's task on
the foreign loop and waits up to ``cancel_grace_s`` for it to unwind. An
episode that ignores cancellation is left behind (counted in ``abandoned``,
logged) and the loop serves every other episode. Code that blocks the thread
itself (``time.sleep``) stalls every foreign episode until it returns.

The loop is a plain ``asyncio.SelectorEventLoop`` whatever policy the daemon
installed (uvloop's handles re-raise these exceptions differently).

Owns: the thread, the loop, the outcome of each foreign coroutine. Must not
know what an environment is (the verifiers cube does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import Any, Awaitable, Callable, TypeVar

from rlnode.aio import register_loop
from rlnode.cubes.base import CubeError
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.foreign_loop")
T = TypeVar("T")


class ForeignLoop:
    """A daemon thread that runs one asyncio loop forever (see the module
    docstring). ``shared()`` is the process's one instance."""

    _shared: ForeignLoop | None = None
    _shared_lock = threading.Lock()

    def __init__(self, name: str = "rlnode-foreign-loop"):
        self.name = name
        self.loop = asyncio.SelectorEventLoop()
        self.running = 0  # coroutines started and not yet finished
        self.completed = 0  # coroutines finished, whatever their outcome
        self.escapes = 0  # SystemExit / KeyboardInterrupt that stopped run_forever and were contained
        self.abandoned = 0  # cancelled coroutines still running after their grace
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> ForeignLoop:
        with cls._shared_lock:
            if cls._shared is None or not cls._shared._thread.is_alive():
                cls._shared = cls()
            return cls._shared

    # -- the thread --------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        register_loop(self.loop)
        while True:  # the process's lifetime: nothing stops this loop
            try:
                self.loop.run_forever()
            except (SystemExit, KeyboardInterrupt) as e:
                # Raised by a task on this loop; that task holds it as its
                # exception. Keep serving every other task.
                self.escapes += 1
                log.warning("foreign_loop.contained", error=type(e).__name__, message=str(e)[:200])
            except BaseException:  # noqa: BLE001 - a bug in the loop itself: logged, the loop runs on
                log.exception("foreign_loop.error")

    # -- the caller's side ---------------------------------------------------

    async def run(self, what: str, fn: Callable[[], Awaitable[T]], cancel_grace_s: float = 10.0) -> T:
        """``await fn()`` on the foreign loop, from the caller's loop.

        Exceptions come back as raised; any BaseException that is not an
        Exception (SystemExit, KeyboardInterrupt, a CancelledError the code
        raised on its own) comes back as a CubeError naming ``what``.
        Cancelling the caller cancels ``fn`` there (see the module docstring)."""
        outer = asyncio.get_running_loop()
        done: asyncio.Future = outer.create_future()
        handle: concurrent.futures.Future = concurrent.futures.Future()  # fn's task on the foreign loop

        def settle(outcome: tuple[bool, Any]) -> None:
            if not done.done():
                done.set_result(outcome)

        async def main() -> None:
            self.running += 1
            try:
                outcome = (True, await fn())
            except BaseException as e:  # noqa: BLE001 - every outcome crosses back to the caller's loop
                outcome = (False, e)
            finally:
                self.running -= 1
                self.completed += 1
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody waits
                outer.call_soon_threadsafe(settle, outcome)

        def start() -> None:
            if not handle.set_running_or_notify_cancel():  # the caller gave up before it started
                return
            handle.set_result(self.loop.create_task(main(), name=f"rlnode-{what}"))

        self.loop.call_soon_threadsafe(start)
        try:
            ok, value = await asyncio.shield(done)
        except asyncio.CancelledError:
            if not handle.cancel():  # already started: cancel it there
                task = handle.result()
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(task.cancel)
                try:
                    await asyncio.wait_for(asyncio.shield(done), cancel_grace_s)
                except TimeoutError:
                    self.abandoned += 1
                    log.warning("foreign_loop.cancel_unfinished", what=what, grace_s=cancel_grace_s)
            raise
        if ok:
            return value
        if isinstance(value, Exception):
            raise value
        raise CubeError(f"{what}: the environment raised {type(value).__name__}: {value}") from value

    def stats(self) -> dict[str, int]:
        return {"running": self.running, "completed": self.completed, "escapes": self.escapes,
                "abandoned": self.abandoned}
