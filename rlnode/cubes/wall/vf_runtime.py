"""Verifiers' subprocess runtime behind the agents' wall.

A verifiers environment's harness runs programs (an agent CLI, a shell tool,
a verifier script) through its *runtime*; the tool calls those programs run
are the policy's. verifiers' own ``SubprocessRuntime`` starts them as the
daemon's user, with the daemon's environment (less names containing
``API_KEY``), its files and every loopback port. ``WalledRuntime`` takes its
place (``install``): every process of one runtime runs in one *box*, a
bubblewrap sandbox made like an agent's (``agent_sandbox``: own pid and net
namespaces, an unprivileged uid, a read-only view of the system and the
Python installation, the runtime's working directory read-write, a private
/tmp, the cube's ``limits`` as rlimits, an allowlisted environment) and
started at the runtime's first process.

The box itself (its first process, ports, disk cap) is ``vf_box``.

File reads and writes of the runtime (``read``/``write``, the log of
``run_background``) are done on the working directory from the host side,
as the daemon, so they never follow a link: every path component is opened
beneath the working directory with ``O_NOFOLLOW`` (``open_beneath``), since
the box can plant ``out.txt -> <run_dir>/link-keys/...`` there. A path
outside the working directory is read inside the box (verifiers' own
fallback through ``run``) and never written. The working directory is the
box's alone: owned by its uid, mode 0700. It lives under rlnode's cache
root, and PEP 723 scripts are prepared on the host and shown read-only
(``vf_scripts``): nothing a box can write is run by another box.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import errno
import signal
import stat
from typing import Any, AsyncIterator
from urllib.parse import urlsplit, urlunsplit

from rlnode.cubes.wall.agent_sandbox import AgentLimits
from rlnode.cubes.wall.vf_box import Box, BoxError
from rlnode.cubes.vf_scripts import ScriptCache, ScriptError, cache_root
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.wall.vf_runtime")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A read of a path outside the working directory, done in the box, with no
# bound of the caller's: the most it returns.
MAX_BOX_READ = 64 << 20


def _relative_parts(workdir: str, path: str) -> list[str] | None:
    """``path``'s components under ``workdir`` (relative, or absolute inside
    it), or None for a path outside it; ``..`` counts as outside."""
    if os.path.isabs(path):
        if not path.startswith(workdir.rstrip("/") + "/"):
            return None
        path = path[len(workdir.rstrip("/")) + 1:]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return None if not parts or ".." in parts else parts


def open_beneath(workdir: str, path: str, flags: int, mode: int = 0o644, make_dirs: bool = False) -> int:
    """A descriptor of ``path`` inside ``workdir``, opened one component at a
    time with O_NOFOLLOW from the directory before it: a symlink anywhere on
    the way (ELOOP/ENOTDIR) or a path outside is PermissionError, never a
    file outside the box. ``make_dirs``: create missing folders on the way."""
    parts = _relative_parts(workdir, path)
    if parts is None:
        raise PermissionError(f"{path!r} is outside the runtime's working directory")
    dir_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            if make_dirs:
                try:
                    os.mkdir(part, 0o755, dir_fd=dir_fd)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PermissionError(f"{path!r}: {part!r} is a link or not a folder") from e
                raise
            os.close(dir_fd)
            dir_fd = nxt
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise PermissionError(f"{path!r} is a link; the runtime's files are never followed out") from e
            raise
    finally:
        os.close(dir_fd)


def _read_beneath(workdir: str, path: str, max_bytes: int | None) -> bytes | None:
    """The file's bytes (at most ``max_bytes``), or None when it is not a
    regular file (a FIFO: left to the box, as verifiers does)."""
    fd = open_beneath(workdir, path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read() if max_bytes is None else f.read(max_bytes)


def _write_beneath(workdir: str, path: str, data: bytes) -> None:
    fd = open_beneath(workdir, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_dirs=True)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(64 * 1024):
        yield chunk


def make_walled_runtime(limits: AgentLimits, env: dict[str, str], scripts: ScriptCache):
    """The ``SubprocessRuntime`` subclass whose processes run in a box, its
    PEP 723 scripts prepared by ``scripts`` (on the host) and its working
    directories under ``scripts.runtimes_dir``.

    Long because its classes are defined inside it: they subclass
    verifiers' runtime types, and verifiers (an optional dependency) is
    imported only when a walled verifiers cube starts."""
    from verifiers.v1.errors import SandboxError
    from verifiers.v1.runtimes.base import ProgramResult, RuntimeProcess
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    class BoxProcess(RuntimeProcess):
        def __init__(self, box: Box, pid: int, stdin: asyncio.StreamWriter | None,
                     stdout: asyncio.StreamReader, stderr: asyncio.StreamReader):
            self.box, self.pid, self._stdin = box, pid, stdin
            self.stdout, self.stderr = _chunks(stdout), _chunks(stderr)
            self._exit = box._future(("exit", pid))

        async def write(self, data: bytes) -> None:
            self._stdin.write(data)
            await self._stdin.drain()

        async def wait(self) -> int:
            return await asyncio.shield(self._exit)

        async def poll(self) -> int | None:
            return self._exit.result() if self._exit.done() and not self._exit.exception() else None

        async def terminate(self) -> None:
            self.box.signal(self.pid, signal.SIGTERM)

        async def kill(self) -> None:
            self.box.signal(self.pid, signal.SIGKILL)

    class WalledRuntime(SubprocessRuntime):
        """verifiers' subprocess runtime, every process in one box."""

        scripts_dir = str(scripts.scripts_dir)

        def __init__(self, config, name: str | None = None) -> None:
            super().__init__(config, name)
            self._box: Box | None = None
            self._box_lock = asyncio.Lock()
            self._ports: set[int] = set()
            self._started: list[tuple[Box, int]] = []

        def host_url(self, url: str) -> str:
            parts = urlsplit(url)
            if parts.hostname in LOOPBACK and parts.port:
                self._ports.add(parts.port)  # mirrored into the box before its next process starts
                return urlunsplit(parts._replace(netloc=f"127.0.0.1:{parts.port}"))
            return url

        async def start(self) -> None:
            # Under rlnode's cache root, not verifiers' ~/.cache: a service's
            # home may be read-only (systemd ProtectHome=read-only).
            self.workdir = scripts.runtimes_dir / self.name
            await asyncio.to_thread(self.workdir.mkdir, parents=True)
            self.info.id = str(self.workdir)

        async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *,
                                    activate: bool = True) -> list[str]:
            """verifiers' argv for a PEP 723 script, the script prepared on
            the host (``vf_scripts``) instead of inside the box."""
            data = script.encode() if isinstance(script, str) else script
            try:
                prepared = await scripts.prepare(data, env)
            except ScriptError as e:
                raise RuntimeError(str(e)) from e  # what verifiers' harnesses expect of a failed preparation
            if not activate:
                return [prepared.interpreter, prepared.path]
            venv = os.path.dirname(os.path.dirname(prepared.interpreter))
            # verifiers' own activation line (runtimes/base.py), so the script
            # and what it starts see the environment as upstream sets it.
            command = ('export VIRTUAL_ENV="$1" PATH="${1}/bin:$HOME/.local/bin:$PATH" '
                       'UV_INSTALL_DIR="$HOME/.local/bin" UV_RUN_RECURSION_DEPTH=1; shift; exec "$@"')
            return ["sh", "-c", command, "uv-script", venv, prepared.interpreter, prepared.path]

        async def _ready_box(self) -> Box:
            async with self._box_lock:
                if self._box is None:
                    box = Box(str(self.workdir), env, limits, scripts.ro_paths())
                    await box.start()
                    self._box = box
            for port in sorted(self._ports - set(self._box.relays)):
                await self._box.mirror(port)
            return self._box

        def _env(self, extra: dict[str, str]) -> dict[str, str]:
            return {"MALLOC_ARENA_MAX": "4", **env, "HOME": "/tmp/home", "TMPDIR": "/tmp",
                    **self.process_env(extra)}

        async def _start(self, argv: list[str], extra: dict[str, str], stdin: int, stdout: int,
                         stderr: int) -> tuple[Box, int]:
            box = await self._ready_box()
            try:
                pid = await box.spawn(list(argv), self._env(extra), str(self.workdir), (stdin, stdout, stderr))
            except BoxError as e:
                # What a missing program is for verifiers' own runtime.
                raise FileNotFoundError(f"{argv[0] if argv else ''}: {e}") from e
            self._started.append((box, pid))
            return box, pid

        async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            null = os.open(os.devnull, os.O_RDONLY)
            try:
                box, pid = await self._start(argv, env, null, out_w, err_w)
            except BaseException:
                for fd in (out_r, err_r):
                    os.close(fd)
                raise
            finally:
                for fd in (null, out_w, err_w):
                    os.close(fd)
            out, err = await _reader(out_r), await _reader(err_r)
            try:
                stdout, stderr, code = await asyncio.gather(out.read(), err.read(), box.wait(pid))
            finally:
                if not box._future(("exit", pid)).done():  # cancelled (a timeout): its group dies
                    box.signal(pid, signal.SIGKILL)
            if code and (verdict := box.over or (box.group.verdict() if box.group is not None else "")):
                stderr += f"\nrlnode: {verdict}\n".encode()
            return ProgramResult(exit_code=code or 0, stdout=stdout.decode(errors="replace"),
                                 stderr=stderr.decode(errors="replace"))

        async def open_process(self, argv: list[str], env: dict[str, str]):
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                box, pid = await self._start(argv, env, in_r, out_w, err_w)
            except BaseException:
                for fd in (in_w, out_r, err_r):
                    os.close(fd)
                raise
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            loop = asyncio.get_running_loop()
            transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                                os.fdopen(in_w, "wb", 0))
            writer = asyncio.StreamWriter(transport, protocol, None, loop)
            return BoxProcess(box, pid, writer, await _reader(out_r), await _reader(err_r))

        async def run_background(self, argv: list[str], env: dict[str, str], log: str) -> None:
            null = os.open(os.devnull, os.O_RDONLY)
            try:
                fd = await asyncio.to_thread(open_beneath, str(self.workdir), log,
                                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, True)
            except BaseException:
                os.close(null)
                raise
            try:
                await self._start(argv, env, null, fd, fd)
            finally:
                os.close(null)
                os.close(fd)

        async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
            # Outside the working directory (what the box sees there), or a
            # FIFO or device in it: read in the box, verifiers' bounded path.
            data = None
            if _relative_parts(str(self.workdir), path) is not None:
                try:
                    data = await asyncio.to_thread(_read_beneath, str(self.workdir), path, max_bytes)
                except OSError as e:
                    raise SandboxError(f"read {path!r}: {e}") from e
            if data is None:
                return await super(SubprocessRuntime, self)._read(path, MAX_BOX_READ if max_bytes is None
                                                                  else max_bytes)
            return data

        async def write(self, path: str, data: bytes) -> None:
            try:
                await asyncio.to_thread(_write_beneath, str(self.workdir), path, data)
            except OSError as e:
                raise SandboxError(f"write {path!r}: {e}") from e

        async def teardown(self) -> None:
            box, self._box = self._box, None
            if box is not None:
                await box.close()
            self._started = []
            if self.workdir is not None:
                await asyncio.to_thread(shutil.rmtree, self.workdir, True)

        def cleanup(self) -> None:
            if self._box is not None:
                self._box.kill_now()
                shutil.rmtree(self._box.relay_dir, ignore_errors=True)
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)

    return WalledRuntime


_installed: dict[str, Any] = {}


def install(limits: AgentLimits, env: dict[str, str], cache_dir: str = "") -> None:
    """Make verifiers build ``WalledRuntime`` wherever a config says
    ``runtime.type = "subprocess"``, for the whole process (verifiers picks
    the class by type, in ``verifiers.v1.runtimes._runtime_cls``). The first
    call's limits, environment and cache root hold: one wall for every
    verifiers cube."""
    import verifiers.v1.runtimes as runtimes

    if "cls" in _installed:
        return
    original = getattr(runtimes, "_runtime_cls", None)
    if not callable(original):
        raise RuntimeError("this verifiers release picks runtimes some other way than rlnode expects "
                           "(verifiers.v1.runtimes._runtime_cls)")
    scripts = ScriptCache(cache_root(cache_dir))
    scripts.make_dirs()
    walled = make_walled_runtime(limits, env, scripts)

    def _runtime_cls(config):
        return walled if config.type == "subprocess" else original(config)

    runtimes._runtime_cls = _runtime_cls
    _installed["cls"] = walled
    log.info("verifiers.runtime_walled", limits=limits, cache=str(scripts.root))


def installed() -> bool:
    return "cls" in _installed


__all__ = ["install", "installed", "make_walled_runtime"]
