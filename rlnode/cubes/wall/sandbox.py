"""Sandboxed Python: run one untrusted snippet in a locked-down child process.

Owns: the child process of one ``run_python`` call from spawn to reap, its
fresh temporary working directory, the limits it runs under and the policy
its bootstrap enforces. Must not touch anything of the caller's process (no
signal handlers, no rlimits, no cwd or env changes, no ``preexec_fn``: the
daemon has threads) and never blocks the event loop: the child is started
with ``asyncio.create_subprocess_exec`` and its output is read incrementally.

Layers, outermost first:

* Process: own session/process group (``start_new_session``), SIGKILLed as a
  group at the end, always, also when the awaiting coroutine is cancelled.
  Wall-clock timeout enforced here; output kept up to ``max_output_bytes``
  per stream, and a snippet that floods more than ``max_drain_bytes`` is
  killed so a flood costs bounded memory and event-loop time.
* OS isolation (the security boundary): ``rlnode.cubes.wall.isolation`` wraps the
  interpreter in bubblewrap (namespaces, a read-only minimal filesystem view,
  a private bounded tmpfs as the only writable place, no network, an
  unprivileged kernel uid), else ``unshare`` namespaces and the drop to
  nobody, else refuses to run; ``isolation = "none"`` only when an operator
  sets it. See that module for exactly what each layer shows the snippet.
* Kernel limits, set by the bootstrap before the snippet's first
  instruction and enforced by the kernel: CPU time, address space, file
  size, open files, processes and threads (RLIMIT_NPROC: per run under bwrap,
  not enforced for a root child, i.e. under ``isolation = "none"`` as root),
  no core dumps. The snippet cannot raise them: it has no CAP_SYS_RESOURCE.
  Worst-case memory of one run is ``max_processes * memory_mib``.

Trusted: the kernel, bwrap/unshare/setpriv, this module and the bootstrap
up to the ``exec`` of the snippet. Not trusted, and not a security layer:
everything the snippet can reach in its interpreter, including the
bootstrap's ``sys.addaudithook`` policy. That hook (no process creation,
network, ctypes, rlimit changes or gc introspection; files only in the
working dir and the stdlib; a budget on files created) exists to turn
common mistakes into a clear message ("network sockets are not allowed")
fast. A snippet can defeat it from inside (it can rewrite the hook's
closure cells through a caught exception's traceback, or load a fresh copy
of a stubbed extension module); tests/test_sandbox.py does both and checks
that the OS layer still holds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rlnode.cubes.wall import isolation
from rlnode.cubes.wall.isolation import Isolation, SandboxUnavailable

MiB = 1 << 20

# Exit status the bootstrap uses for an uncaught MemoryError.
_EXIT_MEMORY = 117

KilledReason = Literal["wall_timeout", "cpu_limit", "memory", "output_limit", "signal"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (cannot spawn, no interpreter); never raised
    for anything the snippet does."""


class SandboxLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Wall-clock seconds before the whole process group is killed.
    wall_timeout_s: Annotated[float, Meta(gt=0, le=600)] = 5.0
    # CPU seconds (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL one second later.
    cpu_seconds: Annotated[int, Meta(ge=1, le=600)] = 5
    # Address space in MiB (RLIMIT_AS): larger allocations raise MemoryError.
    memory_mib: Annotated[int, Meta(ge=64, le=1 << 20)] = 512
    # Bytes of stdout and of stderr kept (each); the rest is discarded.
    max_output_bytes: Annotated[int, Meta(ge=64, le=16 * MiB)] = 8192
    # Bytes one stream may write in total before the snippet is killed
    # ("output_limit"): bounds the event-loop time a flood costs.
    max_drain_bytes: Annotated[int, Meta(ge=64, le=1 << 30)] = 1 * MiB
    # Largest file the snippet may write, in bytes (RLIMIT_FSIZE).
    max_file_bytes: Annotated[int, Meta(ge=0, le=1 << 40)] = 1 * MiB
    # Files and directories the snippet may create: with max_file_bytes this
    # bounds the disk a snippet can fill.
    max_files_created: Annotated[int, Meta(ge=0, le=1_000_000)] = 64
    # Open file descriptors (RLIMIT_NOFILE).
    max_open_files: Annotated[int, Meta(ge=16, le=65536)] = 64
    # Accepted for old configs and ignored: every isolation layer but "none"
    # isolates the network and runs the snippet unprivileged.
    isolate_network: bool = True
    drop_privileges: bool = True
    # OS isolation: "auto" = bwrap, else unshare (root only), else refuse to
    # run (SandboxError); "bwrap"/"unshare" = that layer or refuse; "none" =
    # no isolation, the snippet runs as the daemon's user behind the audit
    # hook only (which is no security boundary): an explicit operator choice.
    isolation: Isolation = "auto"
    # Processes and threads the snippet may have at once (RLIMIT_NPROC);
    # bounds a fork bomb. Memory of a run is at most this * memory_mib.
    max_processes: Annotated[int, Meta(ge=1, le=1024)] = 8
    # Size of the private tmpfs /tmp that holds the working dir (bwrap), MiB.
    tmp_mib: Annotated[int, Meta(ge=1, le=4096)] = 64

    def __post_init__(self):
        if self.max_drain_bytes < self.max_output_bytes:
            raise ValueError("max_drain_bytes must be >= max_output_bytes")


class SandboxResult(msgspec.Struct, kw_only=True):
    stdout: str
    stderr: str
    # Exit status; negative: killed by that signal; None: could not be reaped.
    exit_code: int | None
    # The snippet ran out of time (wall clock or CPU).
    timed_out: bool
    # Why it ended abnormally: "wall_timeout", "cpu_limit", "memory" (uncaught
    # MemoryError), "output_limit" (flood), "signal" (other fatal signal).
    killed_reason: KilledReason | None
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    # Process (and process group) id of the child, for diagnostics.
    pid: int
    network_isolated: bool
    privileges_dropped: bool
    # The OS layer it ran under: "bwrap", "unshare" or "none".
    isolation: str = ""


# The child's program. Runs as `python -I -S -B -c _BOOTSTRAP cpu mem fsize
# nofile max_created uid nproc` with the snippet on stdin and cwd = working
# dir. Its audit hook is a friendly error, not a security layer (see above).
# The first line marks sandbox processes in `ps`.
_BOOTSTRAP = r'''# rlnode-sandbox bootstrap (rlnode.cubes.wall.sandbox)
import posix, resource, sys

EXIT_MEMORY = %(exit_memory)d
# Unaudited primitives (no audit event in 3.11) that matter when root.
DISARM = ("mknod", "mkfifo", "chroot", "pidfd_open", "memfd_create", "nice", "setpriority",
          "sched_setscheduler", "sched_setparam", "sched_setaffinity", "setns", "unshare")
DENY = frozenset(("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
                  "os.startfile", "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill",
                  "os.link", "os.symlink", "resource.setrlimit", "resource.prlimit",
                  "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.remote_exec"))
DENY_PREFIX = ("socket.", "ctypes.", "syslog.", "sqlite3.")
# Modules whose C code forks, opens files or talks to the system outside the
# audit hooks, or would run code outside this interpreter's hooks; posix,
# _signal and _posixsubprocess because a re-import would undo drop_and_disarm.
# Denied with ModuleNotFoundError so optional imports in the stdlib degrade.
BLOCKED = frozenset(("_posixsubprocess", "_ctypes", "_sqlite3", "_dbm", "_gdbm", "readline",
                     "_curses", "_curses_panel", "_tkinter", "_ssl", "spwd", "pwd", "grp", "nis",
                     "_crypt", "ossaudiodev", "_posixshmem", "_multiprocessing", "posix", "_signal"))
BLOCKED_PREFIX = ("_test", "_xx")
READS = frozenset(("os.listdir", "os.scandir", "os.getxattr", "os.listxattr"))
WRITES = frozenset(("os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.truncate", "os.utime",
                    "os.chmod", "os.chown", "os.setxattr", "os.removexattr", "os.chflags",
                    "os.lchflags"))


def limit(cpu, mem, fsize, nofile, nproc):
    R = resource
    for res, soft, hard in ((R.RLIMIT_CPU, cpu, cpu + 1), (R.RLIMIT_AS, mem, mem),
                            (R.RLIMIT_FSIZE, fsize, fsize), (R.RLIMIT_NOFILE, nofile, nofile),
                            (R.RLIMIT_NPROC, nproc, nproc), (R.RLIMIT_CORE, 0, 0)):
        R.setrlimit(res, (soft, hard))


def no_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: process creation is not allowed")


def drop_and_disarm(uid):
    if uid >= 0 and posix.geteuid() == 0:
        posix.setgroups([])
        posix.setgid(uid)
        posix.setuid(uid)
    import _posixsubprocess, _signal
    for mod in (posix, sys.modules.get("os"), _signal, sys.modules.get("signal")):
        if mod is not None:
            for name in DISARM + ("pidfd_send_signal",):
                mod.__dict__.pop(name, None)
    # fork_exec raises no audit event; stubbed (not blocked) so that modules
    # importing subprocess, like asyncio, still load.
    _posixsubprocess.fork_exec = no_fork_exec


def read_roots():
    roots = []
    for p in sys.path:
        p = posix.fspath(p)
        if p.startswith("/"):
            roots.append(__import__("os").path.realpath(p))
    return tuple(roots)


def make_resolver():
    # Everything the hook calls is bound in closures like this one, so a
    # snippet that rebinds module attributes or builtins cannot change the
    # policy, and any error inside the hook denies the operation (fails closed).
    Deny, getcwd, fspath = PermissionError, posix.getcwd, posix.fspath
    t_str, t_bytes, t_int, t_dirent, t_type = str, bytes, int, posix.DirEntry, type

    def absolute(p):
        t = t_type(p)
        if t is t_int:
            return None  # an fd: it came from an open this hook allowed
        if t is t_dirent:
            p = fspath(p)
            t = t_type(p)
        if t is t_bytes:
            p = p.decode("utf-8", "surrogateescape")
        elif t is not t_str:
            raise Deny("sandbox: pass file paths as plain str (e.g. str(path))")
        rel = not p.startswith("/")
        parts = []
        # Lexical resolution is exact here: cwd and every directory fd are
        # inside the working dir, which has no symlinks (they are denied),
        # and '..' could escape relative to a dir_fd the event does not show.
        for part in (getcwd() + "/" + p if rel else p).split("/"):
            if part == "..":
                if rel:
                    raise Deny("sandbox: '..' is not allowed in relative paths")
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    return absolute


def make_paths(workdir, roots, max_created):
    absolute, Deny, OSErr, stat = make_resolver(), PermissionError, OSError, posix.stat
    IFMT, IFREG, IFDIR = 0o170000, 0o100000, 0o040000
    work, root_dirs, created = workdir + "/", tuple(r + "/" for r in roots), [0]

    def mode_of(path):
        try:
            return stat(path).st_mode & IFMT
        except OSErr:
            return 0

    def in_work(path):
        return path == workdir or path.startswith(work)

    def check_write(p, creating, what="writing"):
        path = absolute(p)
        if path is None:
            return
        if not in_work(path):
            raise Deny("sandbox: " + what + " outside the working directory is not allowed: " + path)
        mode = mode_of(path)
        if mode == 0 and creating:
            created[0] += 1
            if created[0] > max_created:
                raise Deny("sandbox: too many files created")
        elif mode != 0 and mode != IFREG and mode != IFDIR:
            raise Deny("sandbox: special files are not allowed: " + path)

    def check_read(p, opening):
        path = absolute(p)
        if path is None:
            return
        if in_work(path):
            mode = mode_of(path)
            if mode != 0 and mode != IFREG and mode != IFDIR:
                raise Deny("sandbox: special files are not allowed: " + path)
            return
        for r in root_dirs:
            if path.startswith(r) or path + "/" == r:
                # A directory fd outside the working dir would let dir_fd
                # paths escape the checks above.
                if opening and mode_of(path) == IFDIR:
                    raise Deny("sandbox: cannot open a directory outside the working directory")
                return
        raise Deny("sandbox: reading outside the working directory is not allowed: " + path)

    return check_read, check_write


def make_hook(workdir, roots, max_created):
    check_read, check_write = make_paths(workdir, roots, max_created)
    Deny, NoModule, t_type, t_int, t_str = PermissionError, ModuleNotFoundError, type, int, str
    WRITE_FLAGS = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    O_CREAT, deny, deny_prefix, reads, writes = posix.O_CREAT, DENY, DENY_PREFIX, READS, WRITES
    blocked, blocked_prefix = BLOCKED, BLOCKED_PREFIX
    as_int = int.__index__  # the value C code sees, whatever an int subclass overrides

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if t_type(flags) is not t_int:
                flags = WRITE_FLAGS if t_type(mode) is not t_str or mode != "r" else 0
            if flags & WRITE_FLAGS:
                check_write(path, flags & O_CREAT)
            else:
                check_read(path, True)
        elif event in reads:
            check_read("." if args[0] is None else args[0], False)
        elif event in writes:
            check_write(args[0], event == "os.mkdir")
            if event == "os.rename":
                check_write(args[1], False)
        elif event == "os.chdir":
            check_write(args[0], False, "changing directory")  # cwd stays inside
        elif event == "socket.__new__":
            # AF_UNIX only, for socketpair() (asyncio's self-pipe): every
            # connect/bind/sendto is denied below, so it reaches nothing.
            if as_int(args[1]) != 1:
                raise Deny("sandbox: network sockets are not allowed")
        elif event == "import":
            name = args[0]
            top = name.partition(".")[0]
            if top in blocked or top.startswith(blocked_prefix):
                raise NoModule("sandbox: module " + name + " is not available")
        elif event in deny or event.startswith(deny_prefix):
            raise Deny("sandbox: " + event + " is not allowed")

    return hook


def boot():
    cpu, mem, fsize, nofile, max_created, uid, nproc = (int(a) for a in sys.argv[1:8])
    workdir, roots = posix.getcwd(), read_roots()
    drop_and_disarm(uid)
    code = sys.stdin.buffer.read()  # stdin stays at EOF: input() raises EOFError
    with open("main.py", "wb") as f:  # so tracebacks show source lines
        f.write(code)
    limit(cpu, mem, fsize, nofile, nproc)  # after main.py, which may exceed max_file_bytes
    sys.stdout.reconfigure(line_buffering=True)  # partial output survives a kill
    sys.addaudithook(make_hook(workdir, roots, max_created))
    return code


def trim(e):
    # The author of the snippet sees its frames only, not the bootstrap's or
    # the audit hook's (also in chained exceptions).
    for _ in range(8):
        if e is None:
            return
        kept, tb = [], e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_globals is not BOOT:
                kept.append(tb)
            tb = tb.tb_next
        for a, b in zip(kept, kept[1:] + [None]):
            a.tb_next = b
        e.__traceback__ = kept[0] if kept else None
        e = e.__cause__ or e.__context__


def run(code):
    glb = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "main.py", "exec"), glb)
    except SystemExit:
        raise
    except BaseException as e:
        status = EXIT_MEMORY if isinstance(e, MemoryError) else 1
        if status == EXIT_MEMORY:
            glb.clear()  # free the snippet's data so the traceback can print
        try:
            trim(e)
            sys.excepthook(type(e), e, e.__traceback__)
        finally:
            sys.exit(status)


BOOT = globals()


run(boot())
''' % {"exit_memory": _EXIT_MEMORY}

# Cleanups still running after their run_python was cancelled (kept alive).
_cleanups: set[asyncio.Task] = set()


async def _command(limits: SandboxLimits, workdir: str) -> tuple[list[str], isolation.Wrap, str, dict[str, str]]:
    """argv for the child, its wrapper, and the working dir and env it sees."""
    exe = sys.executable
    if not exe:
        raise SandboxError("no Python interpreter to run snippets with (sys.executable is empty)")
    try:
        layer = await isolation.choose(limits.isolation, exe)
    except SandboxUnavailable as e:
        raise SandboxError(str(e)) from e
    inside = "/tmp/" + os.path.basename(workdir) if layer == "bwrap" else workdir
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": inside, "TMPDIR": inside}
    wrap = isolation.wrap(layer, exe, inside, limits.tmp_mib * MiB)
    if layer == "bwrap":
        exe = isolation.interpreter(exe)
    args = (limits.cpu_seconds, limits.memory_mib * MiB, limits.max_file_bytes, limits.max_open_files,
            limits.max_files_created, wrap.drop_uid, limits.max_processes)
    return [*wrap.prefix, exe, "-I", "-S", "-B", "-c", _BOOTSTRAP, *map(str, args)], wrap, inside, env


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group. The group id is the child's pid
    (start_new_session); it cannot be reused while any member lives, and pids
    are allocated sequentially, so a stale id hitting a new group is moot."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Capture:
    """One output stream: keeps the first ``keep`` bytes and drains the rest
    to EOF (a paused pipe would keep the transport, and ``wait()``, open);
    past ``drain`` bytes it kills the group once (``flooded``)."""

    def __init__(self, keep: int, drain: int, pid: int):
        self.keep, self.drain, self.pid = keep, drain, pid
        self.data = bytearray()
        self.total = 0
        self.flooded = False

    async def pump(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.keep - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            self.total += len(chunk)
            if self.total > self.drain and not self.flooded:
                self.flooded = True
                _kill_group(self.pid)

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")

    @property
    def truncated(self) -> bool:
        return self.total > self.keep


async def _feed(stdin: asyncio.StreamWriter, code: bytes) -> None:
    try:
        stdin.write(code)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the child died before reading: its exit status tells why


async def _watch(proc, tasks: list[asyncio.Task], limits: SandboxLimits, streams: tuple[_Capture, ...]) -> str | None:
    """Wait for the child and its pipes under the wall timeout; the reason we
    killed it, if we did."""
    _, pending = await asyncio.wait(tasks, timeout=limits.wall_timeout_s)
    if any(s.flooded for s in streams):
        reason = "output_limit"
    else:
        reason = "wall_timeout" if pending else None
    if pending:
        _kill_group(proc.pid)
        await asyncio.wait(tasks, timeout=2.0)  # EOF and exit follow the kill
    return reason


async def _reap_and_remove(tasks: list[asyncio.Task], root: str) -> None:
    if tasks:
        # The group is dead, so the pumps reach EOF and wait() returns; a
        # child stuck in the kernel (D state) is left to its pending SIGKILL.
        _, pending = await asyncio.wait(tasks, timeout=5.0)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(shutil.rmtree, root, True)


async def _cleanup(proc, tasks: list[asyncio.Task], root: str) -> None:
    """Kill (synchronously, so it happens even under cancellation), then reap
    and remove the working dir in a task that a second cancel cannot stop.
    Also after a clean exit: nothing of the group may outlive the call."""
    if proc is not None:
        _kill_group(proc.pid)
    task = asyncio.ensure_future(_reap_and_remove(tasks, root))
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    await asyncio.shield(task)


def _exit_status(returncode: int | None, wrapped: bool) -> int | None:
    """The snippet's exit status: bwrap and unshare report a child killed by
    signal N as 128 + N; negative (N) as for an unwrapped child."""
    if wrapped and returncode is not None and 128 < returncode < 128 + signal.NSIG:
        return 128 - returncode
    return returncode


def _classify(returncode: int | None, reason: str | None) -> str | None:
    if reason is not None:
        return reason
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        # We only SIGKILL after setting a reason; the other sender is the
        # kernel's hard RLIMIT_CPU (one second past the soft limit).
        return "cpu_limit"
    if returncode == _EXIT_MEMORY:
        return "memory"
    if returncode is not None and returncode < 0:
        return "signal"
    return None


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter; never raises for what
    the code does (SandboxError only when the sandbox cannot start)."""
    limits = limits or SandboxLimits()
    loop = asyncio.get_running_loop()
    # One mkdir: cheaper than a thread hop, and the cleanup must own the dir
    # before the first await. Under bwrap it only names the run's private dir.
    try:
        root = os.path.realpath(tempfile.mkdtemp(prefix="rlnode-sandbox-"))
    except OSError as e:
        raise SandboxError(f"cannot create the sandbox's working directory: {e}") from e
    proc, tasks = None, []
    try:
        argv, wrap, inside, env = await _command(limits, root)
        start = loop.time()
        try:
            if wrap.drop_uid >= 0:
                os.chown(root, wrap.drop_uid, wrap.drop_uid)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=root, env=env, start_new_session=True)
        except OSError as e:
            raise SandboxError(f"cannot start the sandbox: {e}") from e
        out, err = (_Capture(limits.max_output_bytes, limits.max_drain_bytes, proc.pid) for _ in "oe")
        data = code.encode("utf-8", errors="replace")
        tasks = [asyncio.ensure_future(c) for c in
                 (_feed(proc.stdin, data), out.pump(proc.stdout), err.pump(proc.stderr), proc.wait())]
        reason = await _watch(proc, tasks, limits, (out, err))
        status = _exit_status(proc.returncode, wrap.layer != "none")
        killed = _classify(status, reason)
        return SandboxResult(
            stdout=out.text(), stderr=err.text(), exit_code=status,
            timed_out=killed in ("wall_timeout", "cpu_limit"), killed_reason=killed,
            stdout_truncated=out.truncated, stderr_truncated=err.truncated,
            duration_s=round(loop.time() - start, 4), pid=proc.pid,
            network_isolated=wrap.network_isolated, privileges_dropped=wrap.privileges_dropped,
            isolation=wrap.layer)
    finally:
        await _cleanup(proc, tasks, root)
