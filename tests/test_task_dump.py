"""`kill -USR1 <pid>`: every waiting asyncio task, with what it awaits,
logged by a running rlnode command (the main loop's and the verifiers
cubes' foreign loop's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from daemons import ROOT

PROGRAM = r"""
import asyncio, sys, threading
from rlnode.aio import dump_tasks_on_signal
from rlnode.cubes.foreign_loop import ForeignLoop
from rlnode.log import setup_logging
setup_logging("info", True)
dump_tasks_on_signal(__import__("signal").SIGUSR1)

parked = threading.Event()

async def parked_on_the_foreign_loop():
    parked.set()
    await asyncio.Event().wait()

async def held_by_the_main_loop(ev):
    await ev.wait()

async def main():
    ev = asyncio.Event()
    waiter = asyncio.create_task(held_by_the_main_loop(ev), name="main-waiter")
    foreign = asyncio.create_task(ForeignLoop.shared().run("parked", parked_on_the_foreign_loop))
    await asyncio.to_thread(parked.wait)
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the test closes stdin once it has signalled
    foreign.cancel()
    ev.set()
    await asyncio.gather(waiter, foreign, return_exceptions=True)

asyncio.run(main())
"""


def test_sigusr1_logs_each_waiting_task_with_its_await_chain():
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        os.kill(proc.pid, signal.SIGUSR1)
        # The signal is pending before stdin closes, so the main thread runs its handler
        # before any code that could follow the end of stdin.
        _, err = proc.communicate("", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    tasks = [json.loads(line) for line in err.splitlines() if '"debug.task"' in line]
    chains = {t["task"]: " <- ".join(t["awaiting"]) for t in tasks}
    assert "held_by_the_main_loop" in chains["main-waiter"] and "Event.wait" in chains["main-waiter"]
    assert "parked_on_the_foreign_loop" in chains["rlnode-parked"]
    assert len({t["loop"] for t in tasks}) == 2  # the main loop's and the foreign loop's
