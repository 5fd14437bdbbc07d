"""The Python sandbox with real child processes and hostile snippets: each
must be contained (killed, denied or truncated) without harming this process,
and no child, process group member or working directory may outlive a call.
Limits are kept small so the file runs in a few seconds on 2 cores."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from rlnode.cubes.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(wall_timeout_s=3.0, cpu_seconds=1)


def live_in_group(pgid: int) -> list[str]:
    """Processes (not zombies) whose process group is ``pgid``, per ``ps``."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat=,comm="], capture_output=True, text=True, check=True)
    rows = [line.split() for line in out.stdout.splitlines()]
    return [" ".join(r) for r in rows if r[1] == str(pgid) and not r[2].startswith("Z")]


def my_sandbox_children() -> list[int]:
    """Pids of this process's children that run the sandbox bootstrap."""
    me, found = str(os.getpid()), []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = stat.rsplit(")", 1)[1].split()[1]
        if ppid == me and b"rlnode-sandbox bootstrap" in cmdline:
            found.append(int(proc.name))
    return found


async def test_normal_snippet_prints_result():
    r = await run_python("print(sum(i*i for i in range(10)))")
    assert r.stdout == "285\n"
    assert (r.exit_code, r.killed_reason, r.timed_out) == (0, None, False)
    assert not r.stdout_truncated and not r.stderr_truncated
    assert live_in_group(r.pid) == []


async def test_stdlib_works_and_errors_show_the_snippet_only():
    code = ("import math, fractions, decimal, itertools, collections, statistics, random, json, re\n"
            "from dataclasses import dataclass\n"
            "print(math.comb(10, 3), fractions.Fraction(1, 3) * 3)\n"
            "1/0\n")
    r = await run_python(code)
    assert r.stdout == "120 1\n"
    assert r.exit_code == 1
    assert 'File "main.py", line 4' in r.stderr and "ZeroDivisionError" in r.stderr
    assert "<string>" not in r.stderr  # bootstrap frames are trimmed


async def test_infinite_loop_is_killed_by_cpu_limit():
    t0 = time.monotonic()
    r = await run_python("while True: pass", SandboxLimits(cpu_seconds=1, wall_timeout_s=10))
    assert r.timed_out and r.killed_reason == "cpu_limit"
    assert r.exit_code in (-24, -9)  # SIGXCPU, or SIGKILL at the hard limit
    assert time.monotonic() - t0 < 5
    assert live_in_group(r.pid) == []


async def test_ignoring_sigxcpu_still_hits_the_hard_limit():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    r = await run_python(code, SandboxLimits(cpu_seconds=1, wall_timeout_s=10))
    assert (r.killed_reason, r.exit_code) == ("cpu_limit", -9)
    assert r.duration_s < 5


async def test_sleeping_snippet_is_killed_by_wall_timeout_and_keeps_partial_output():
    code = "import time\nprint('started')\ntime.sleep(60)"
    r = await run_python(code, SandboxLimits(wall_timeout_s=1.0))
    assert r.timed_out and r.killed_reason == "wall_timeout"
    assert r.stdout == "started\n"
    assert 1.0 <= r.duration_s < 3.5
    assert live_in_group(r.pid) == []


async def test_fork_bomb_is_blocked_and_leaves_no_processes():
    r = await run_python("import os\nwhile True: os.fork()", FAST)
    assert r.exit_code == 1 and r.killed_reason is None
    assert "PermissionError: sandbox: os.fork is not allowed" in r.stderr
    assert live_in_group(r.pid) == []
    assert my_sandbox_children() == []


@pytest.mark.parametrize("code, denied", [
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
    ("import _posixsubprocess as p\np.fork_exec()", "process creation"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
    ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
    ("import os\nos.kill(1, 9)", "os.kill"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "resource.setrlimit"),
    ("import ctypes", "module _ctypes"),
    ("import gc\ngc.get_objects()", "gc.get_objects"),
    ("import os\nos.symlink('/etc/passwd', 'p')", "os.symlink"),
])
async def test_process_creation_and_escape_hatches_are_denied(code, denied):
    r = await run_python(code, FAST)
    assert r.exit_code == 1
    assert f"Error: sandbox: {denied}" in r.stderr
    assert live_in_group(r.pid) == []


async def test_huge_allocation_fails_in_the_child_only():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    r = await run_python("x = bytearray(10**10)\nprint('allocated')", FAST)
    assert r.killed_reason == "memory" and r.exit_code == 117
    assert "MemoryError" in r.stderr and r.stdout == ""
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 50 * 1024


@pytest.mark.parametrize("code", [
    "print(open('/etc/passwd').read())",
    "print(open('../../x').read())",
    "print(open('/proc/self/environ').read())",
    "import os\nprint(os.listdir('/'))",
    "import os\nos.chdir('/')\nprint(open('etc/passwd').read())",
])
async def test_reading_outside_the_working_dir_is_denied(code):
    r = await run_python(code, FAST)
    assert r.exit_code == 1 and r.stdout == ""
    assert "PermissionError: sandbox:" in r.stderr
    assert "root:" not in r.stderr


async def test_writing_outside_is_denied_inside_is_allowed_and_dir_is_removed(tmp_path):
    target = tmp_path / "evil.txt"
    r = await run_python(f"open({str(target)!r}, 'w').write('x')", FAST)
    assert "PermissionError: sandbox: writing outside the working directory" in r.stderr
    assert not target.exists()

    code = "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read())\nprint(os.getcwd())"
    r = await run_python(code, FAST)
    assert r.exit_code == 0
    text, workdir = r.stdout.splitlines()
    assert text == "hi"
    assert Path(workdir).name.startswith("rlnode-sandbox-")
    assert not Path(workdir).exists()


async def test_policy_survives_rebinding_builtins_and_modules():
    code = ("import builtins, posix, os\n"
            "posix.getcwd = os.getcwd = lambda: '/etc'\n"
            "builtins.str, builtins.type, builtins.PermissionError = bytes, id, None\n"
            "print(open('/etc/passwd').read())")
    r = await run_python(code, FAST)
    assert r.exit_code == 1 and r.stdout == ""
    assert "sandbox: reading outside the working directory" in r.stderr


async def test_concurrent_runs_have_separate_working_dirs():
    code = "import os\nopen('mine', 'w').write('{n}')\nprint(sorted(os.listdir('.')), open('mine').read())"
    results = await asyncio.gather(*(run_python(code.format(n=n), FAST) for n in range(3)))
    assert [r.stdout for r in results] == [f"['main.py', 'mine'] {n}\n" for n in range(3)]
    assert len({r.pid for r in results}) == 3


async def test_file_limits_bound_disk_use():
    limits = SandboxLimits(max_file_bytes=1024, max_files_created=5, wall_timeout_s=3)
    r = await run_python("with open('big', 'w') as f:\n    f.write('x' * 4096)", limits)
    assert "File too large" in r.stderr
    r = await run_python("for i in range(10): open(f'f{i}', 'w').close()", limits)
    assert "sandbox: too many files created" in r.stderr


async def test_network_is_denied_and_listener_sees_no_connection():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        r = await run_python(code, FAST)
        assert r.exit_code == 1 and "connected" not in r.stdout
        assert "PermissionError: sandbox: socket." in r.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


async def test_output_flood_is_truncated_and_killed():
    t0 = time.monotonic()
    r = await run_python("print('x' * 10**8)", FAST)
    assert len(r.stdout) == 8192 and set(r.stdout) == {"x"}
    assert r.stdout_truncated and r.killed_reason == "output_limit"
    assert time.monotonic() - t0 < 3
    # A finite overflow below the drain budget runs to completion.
    r = await run_python("print('y' * 20000)\nimport sys\nprint('e' * 100, file=sys.stderr)", FAST)
    assert (r.exit_code, r.killed_reason) == (0, None)
    assert r.stdout == "y" * 8192 and r.stdout_truncated
    assert r.stderr == "e" * 100 + "\n" and not r.stderr_truncated


async def test_cancellation_kills_the_child_and_removes_its_dir():
    code = "import time\nprint('ready', flush=True)\ntime.sleep(60)"
    task = asyncio.create_task(run_python(code, SandboxLimits(wall_timeout_s=30)))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if kids := my_sandbox_children():
            break
    assert len(kids) == 1
    pid = kids[0]
    workdir = os.readlink(f"/proc/{pid}/cwd")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert live_in_group(pid) == []
    assert not Path(workdir).exists()


async def test_event_loop_keeps_running_during_a_run():
    gaps, stop = [], asyncio.Event()

    async def ticker():
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await run_python("x = 0\nfor i in range(3 * 10**6): x += i\nprint(x)", FAST)
    stop.set()
    await tick
    assert len(gaps) > 5 and max(gaps) < 0.5


def test_runs_under_uvloop():
    uvloop = pytest.importorskip("uvloop")

    async def main():
        return await run_python("print(6 * 7)", FAST), await run_python("while True: pass", FAST)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        ok, looped = runner.run(main())
    assert ok.stdout == "42\n"
    assert looped.killed_reason == "cpu_limit"


def test_limits_are_validated():
    assert msgspec.convert({"wall_timeout_s": 2, "memory_mib": 256}, SandboxLimits).memory_mib == 256
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"walltime": 2}, SandboxLimits)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"cpu_seconds": 0}, SandboxLimits)
    with pytest.raises(msgspec.ValidationError, match="max_drain_bytes"):
        msgspec.convert({"max_output_bytes": 4096, "max_drain_bytes": 1024}, SandboxLimits)
