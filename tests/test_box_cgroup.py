"""A box's cgroup (rlnode/cubes/wall/box_cgroup.py): joined before the box's
first instruction, its caps hold for all its processes together, the cap
reached is named, and no folder or process outlives the box or a daemon
killed -9."""

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from rlnode.cubes.wall import box_cgroup
from rlnode.cubes.wall.box_cgroup import BoxCgroups

HERE = BoxCgroups.here()
pytestmark = pytest.mark.skipif(not HERE.parents, reason=f"no box cgroups on this node: {HERE.why_not}")

# Children that each hold 48 MiB (every page touched) for a second.
HOLD = ("import os, time\n"
        "pids = []\n"
        "for _ in range({n}):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        b = bytearray(48 << 20); b[::4096] = b'x' * len(range(0, len(b), 4096)); time.sleep(1); os._exit(0)\n"
        "    pids.append(pid)\n"
        "print(sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == -9 for p in pids))\n")


async def _run(group, code: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*group.enter([sys.executable, "-c", code]),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode, (out + err).decode()


async def test_processes_of_one_box_share_its_memory_cap():
    """Two children of 48 MiB fit in 256 MiB; six do not: the kernel kills
    inside the box, the verdict names the key, and a later verdict is empty
    (each reached cap is told once)."""
    group = HERE.new(256, 64)
    try:
        assert await _run(group, HOLD.format(n=2)) == (0, "0\n")
        assert group.verdict() == ""
        code, out = await _run(group, HOLD.format(n=6))
        assert code != 0 or out.strip() != "0", out  # someone was killed
        assert "limits.box_memory_mib = 256" in group.verdict()
        assert group.verdict() == ""
    finally:
        await group.close()
    assert not any(os.path.exists(f) for f in group.folders)


async def test_a_box_cannot_fork_past_its_process_cap():
    group = HERE.new(1024, 8)
    code = ("import os\nn = 0\ntry:\n    while n < 50:\n        if os.fork() == 0:\n            import time; "
            "time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('refused after', n)\n")
    try:
        rc, out = await _run(group, code)
        assert "refused after 7" in out, out  # the box's own process is the eighth
        assert "limits.processes = 8" in group.verdict()
    finally:
        await group.close()  # the sleeping children are killed with it
    assert not any(os.path.exists(f) for f in group.folders)


def test_a_killed_daemons_box_cgroups_are_removed_by_the_next_one():
    """What a daemon killed -9 left (its rlnode-PID folder, a box in it, a
    process in the box) is gone after the next probe's sweep."""
    # A pid above pid_max: never any process's (a pid freed just now could
    # be a new daemon's by the time the sweep looks).
    dead = int(open("/proc/sys/kernel/pid_max").read()) + 1
    bases = [os.path.dirname(p) for p in HERE.parents]
    left = [os.path.join(b, f"rlnode-{dead}", "box-0") for b in bases]
    for folder in left:
        os.makedirs(folder)
    orphan = subprocess.Popen(["sleep", "60"])
    try:
        for folder in left:
            with open(os.path.join(folder, "cgroup.procs"), "w") as f:
                f.write(str(orphan.pid))
        for base in bases:
            box_cgroup._sweep(base)
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert not any(os.path.exists(os.path.dirname(f)) for f in left)
    finally:
        orphan.kill()
        orphan.wait()
        for folder in left:
            if os.path.exists(folder):
                os.rmdir(folder)
                os.rmdir(os.path.dirname(folder))


def test_boxes_that_start_together_share_one_probe(monkeypatch):
    """Workers spawned at once ask for the node's cgroups from threads at
    once: one probe answers them all. (A second probe removes the first's
    folder and kills the boxes already in it: a cube start failed so.)"""
    import threading
    import time

    probes = []
    real = box_cgroup._probe

    def slow_probe():
        probes.append(1)
        time.sleep(0.2)  # the window the others would probe in
        return real()

    monkeypatch.setattr(BoxCgroups, "_here", None)
    monkeypatch.setattr(box_cgroup, "_probe", slow_probe)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(BoxCgroups.here())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(probes) == 1 and len({id(a) for a in answers}) == 1 and answers[0].parents
