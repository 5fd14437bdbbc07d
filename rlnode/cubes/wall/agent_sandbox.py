"""Agents under OS isolation: they reach the gateway and nothing else.

An agent is the user's code, but what it does is the policy's: the tool
calls it runs are model output. So by default (``openai-agent`` option
``isolation = "bwrap"``) every agent runs under bubblewrap, as the python
sandbox's snippets do (``isolation.agent_prefix``): a command agent's
process per episode, a function agent's worker processes
(``agent_workers.py``), a verifiers environment's harness programs
(``verifiers_cube.py``). Each gets its own pid namespace (no
``/proc/<daemon>/environ``), a network namespace with loopback only (no link
port, no CURVE endpoint, no internet), a fresh unprivileged uid without
capabilities, a read-only view of the system, the Python installation and
the agent's own files, a size-bounded private ``/tmp`` (also ``HOME``), an
allowlisted environment that bwrap is *started with* (never ``--setenv``:
argv is world-readable in /proc), and rlimits (``AgentLimits``: processes,
address space, open files, CPU seconds). No run dir, key file or daemon
file is visible.

The one way out is the gateway's *agent socket*: a unix socket serving the
episode routes alone (``Gateway.serve_agents``; not ``/status``,
``/metrics`` or ``/history``). The sandbox's loopback is its own, so:

    agent --TCP 127.0.0.1:INSIDE_PORT--> bootstrap (in the sandbox, this
        file's BOOTSTRAP) --unix socket--> GatewayRelay (the daemon; at most
        ``limits.connections`` at once) --unix socket--> the agent socket

The bootstrap sets the rlimits, listens on ``INSIDE_PORT`` inside the
sandbox (the episode's URLs change host and port only: ``inside_url``;
with several relays, one per gateway host, relay i on INSIDE_PORT + i),
starts the agent (stdin, stdout, stderr, the allowlisted environment and
the descriptors named pass through) and exits with its status. The relay's
socket lives in a private directory bound read-only into that one sandbox
(a socket is connectable on a read-only mount).

``isolation = "none"`` runs agents bare, as the daemon's user: an
operator's explicit choice, logged as an error at start.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

import msgspec
from msgspec import Meta

from rlnode.config import ConfigError
from rlnode.cubes.wall import isolation
from rlnode.cubes.wall.box_cgroup import BoxCgroup, BoxCgroups
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.wall.agent_sandbox")

SOCKET_NAME = "gateway.sock"
# The port the bootstrap listens on inside a sandbox (its loopback is its own).
INSIDE_PORT = 8000


class AgentLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """What one agent sandbox may take from the node (rlimits set by the
    bootstrap before the agent's first instruction; a root daemon's sandbox
    runs as a uid of its own, so the process count is the sandbox's)."""

    # Processes and threads at once (RLIMIT_NPROC): a fork bomb ends here,
    # as an error in the agent, not as a node out of pids.
    processes: Annotated[int, Meta(ge=16)] = 256
    # Address space per process, MiB (RLIMIT_AS): a memory hog gets
    # MemoryError (or ENOMEM), not the node's OOM killer. Virtual memory:
    # threads reserve stacks and malloc arenas (MALLOC_ARENA_MAX is 4 inside).
    memory_mib: Annotated[int, Meta(ge=256)] = 8192
    # Open descriptors per process (RLIMIT_NOFILE); sockets count.
    open_files: Annotated[int, Meta(ge=64)] = 1024
    # CPU seconds per process (RLIMIT_CPU; SIGXCPU, SIGKILL a second later).
    # A function agent's worker retires before it reaches it.
    cpu_s: Annotated[int, Meta(ge=10)] = 3600
    # Gateway connections one sandbox may hold open at once; more are
    # refused (closed at once) and counted.
    connections: Annotated[int, Meta(ge=1)] = 256
    # Writable /tmp (and HOME), MiB.
    tmp_mib: Annotated[int, Meta(ge=1)] = 256
    # Largest file a process may write, MiB (RLIMIT_FSIZE; EFBIG past it).
    # Bounds each file in a folder on the node's disk (a verifiers runtime's
    # working directory), not their number.
    file_mib: Annotated[int, Meta(ge=1)] = 1024
    # Memory of the whole box, MiB (all its processes, its /tmp included):
    # past it the kernel's OOM killer ends processes of that box only, and
    # the episode's error names this key. Also caps the box's processes at
    # ``processes``. Needs a cgroup the daemon may make (box_cgroup.py);
    # without one, each process keeps the rlimits above, logged at start.
    box_memory_mib: Annotated[int, Meta(ge=64)] = 8192
    # What a verifiers runtime's box may keep in its working directory on
    # the node's disk, MiB, all files together (each counted at least 4 KiB):
    # summed every second, the box is ended past it and the episode's error
    # names this key. Other boxes write only their /tmp (tmp_mib, memory).
    disk_mib: Annotated[int, Meta(ge=1)] = 4096

    def rlimits(self) -> str:
        """The bootstrap's limits argument (``set_limits``)."""
        return (f"{self.processes},{self.memory_mib * 2**20},{self.open_files},{self.cpu_s},"
                f"{self.file_mib * 2**20}")


# The loopback relay inside a sandbox, shared by its first process (BOOTSTRAP
# here, vf_box.BOX_INIT): listen(port, path) relays every connection to
# 127.0.0.1:port to the unix socket at path. One selector thread, so the
# relay's own threads never count against the sandbox's process limit.
RELAY = r"""
import selectors, socket, threading
sel = selectors.DefaultSelector()
wake_r, wake_w = socket.socketpair()
sel.register(wake_r, selectors.EVENT_READ)
pending, peer = [], {}
def listen(port, path):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(128)
    pending.append((srv, path))
    wake_w.send(b"x")
def done(s):
    other = peer[s]
    sel.unregister(s)
    try:
        other.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    if other not in sel.get_map():
        for x in (s, other):
            peer.pop(x, None)
            x.close()
def accept(srv, path):
    try:
        conn, _ = srv.accept()
    except OSError:
        return
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        conn.close()
        up.close()
        return
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer[conn], peer[up] = up, conn
    sel.register(conn, selectors.EVENT_READ)
    sel.register(up, selectors.EVENT_READ)
def relay():
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is wake_r:
                s.recv(64)
                while pending:
                    srv, path = pending.pop()
                    sel.register(srv, selectors.EVENT_READ, path)
                continue
            if key.data:
                accept(s, key.data)
                continue
            try:
                data = s.recv(65536)
                if data:
                    peer[s].sendall(data)
                    continue
            except OSError:
                pass
            done(s)
threading.Thread(target=relay, daemon=True).start()
"""

# The rlimits a sandbox's first process sets on itself (its children inherit
# them): argument LIMITS is "NPROC,AS,NOFILE,CPU".
SET_LIMITS = r"""
import resource
def set_limits(limits):
    for name, n in zip(("NPROC", "AS", "NOFILE", "CPU", "FSIZE"), map(int, limits.split(","))):
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (n, n + 1 if name == "CPU" else n))
"""

# Runs as the sandbox's first process:
#   python -I -S -c BOOTSTRAP SOCKET,... PORT NPROC,AS,NOFILE,CPU,FSIZE FD,... ARGV...
# (relay socket i is reached on PORT + i)
BOOTSTRAP = SET_LIMITS + RELAY + r"""
import subprocess, sys
sock_paths, port, limits, fds, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
for i, sock_path in enumerate(sock_paths.split(",")):
    listen(port + i, sock_path)
set_limits(limits)
try:
    child = subprocess.Popen(argv, pass_fds=[int(fd) for fd in fds.split(",") if fd])
except OSError as e:
    print(f"rlnode agent sandbox: cannot start {argv[0]!r}: {e}", file=sys.stderr)
    sys.exit(127)
code = child.wait()
sys.exit(128 - code if code < 0 else code)
"""


class GatewayRelay:
    """A unix socket whose connections are piped to the gateway's agent
    socket (or to ``tcp://HOST:PORT``), for one sandbox: ``async with
    GatewayRelay(upstream) as relay``.
    At most ``max_connections`` at once; more are closed at once and
    counted (``refused``). ``upstream`` may be set after the relay starts
    (a function agent's workers start before the gateway serves); until
    then every connection is refused."""

    def __init__(self, upstream: str = "", max_connections: int = 256):
        self.upstream, self.max_connections = upstream, max_connections
        self.dir = ""
        self.socket = ""
        self.refused = 0
        self.relayed = 0  # connections piped upstream
        self._server: asyncio.AbstractServer | None = None
        self._pipes: set[asyncio.Task] = set()

    async def __aenter__(self) -> "GatewayRelay":
        return await self.open()

    async def open(self, path: str = "") -> "GatewayRelay":
        """Listen at ``path`` (in a directory the caller owns), else in a
        private directory of its own."""
        if path:
            self.socket = path
        else:
            self.dir = tempfile.mkdtemp(prefix="rlnode-agent-")
            os.chmod(self.dir, 0o711)  # the sandbox's uid passes through to the socket, lists nothing
            self.socket = os.path.join(self.dir, SOCKET_NAME)
        self._server = await asyncio.start_unix_server(self._accept, path=self.socket)
        os.chmod(self.socket, 0o666)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._pipes):
            t.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.upstream or len(self._pipes) >= self.max_connections:
            if self.refused == 0:
                log.warning("agent.relay_refused", connections=len(self._pipes), limit=self.max_connections,
                            key="limits.connections")
            self.refused += 1
            writer.close()
            return
        task = asyncio.current_task()
        self._pipes.add(task)
        try:
            if self.upstream.startswith("tcp://"):  # a host loopback port (a verifiers box's mirror)
                host, _, port = self.upstream[len("tcp://"):].rpartition(":")
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
            else:
                up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
        except OSError:
            writer.close()
            self._pipes.discard(task)
            return
        self.relayed += 1
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
            self._pipes.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


def inside_url(url: str, relay_index: int = 0) -> str:
    """``url`` as a sandboxed agent reaches it through its relay number
    ``relay_index``: its own loopback, INSIDE_PORT + relay_index."""
    return urlunsplit(urlsplit(url)._replace(netloc=f"127.0.0.1:{INSIDE_PORT + relay_index}"))


def inside_env(env: dict[str, str]) -> dict[str, str]:
    """The whole environment a sandbox is started with (bwrap passes it on)."""
    return {"MALLOC_ARENA_MAX": "4", **env, "HOME": "/tmp/home", "TMPDIR": "/tmp"}


def _command_file(arg: str, i: int, cwd: str) -> str | None:
    """The absolute path of a file ``command[i]`` names (its program, a
    script, a config), or None. Absolute, not resolved: a venv's python is
    found by the path it is started as (pyvenv.cfg next to its bin/)."""
    path = arg if os.path.isabs(arg) else os.path.join(cwd or os.getcwd(), arg)
    return os.path.abspath(path) if (i == 0 or not arg.startswith("-")) and os.path.isfile(path) else None


def _command_argv(command: list[str], env: dict[str, str], cwd: str) -> list[str]:
    argv = []
    for i, arg in enumerate(command):
        if path := _command_file(arg, i, cwd):
            argv.append(path)
        elif i == 0 and (found := shutil.which(arg, path=env.get("PATH"))):
            argv.append(found)
        else:
            argv.append(arg)
    return argv


def shown_paths(command: list[str], env: dict[str, str], cwd: str, ro_paths: list[str]) -> list[tuple[str, str]]:
    """(option, path) of everything an agent's box shows of the host beyond
    the system and the Python installation: ``ro_paths``, ``cwd``, every
    PYTHONPATH folder and the files the command names."""
    shown = [(f"options.ro_paths[{i}]", p) for i, p in enumerate(ro_paths) if p]
    shown += [("options.cwd", cwd)] if cwd else []
    shown += [(f"PYTHONPATH entry {p!r}", p) for p in env.get("PYTHONPATH", "").split(":") if p and os.path.isdir(p)]
    shown += [(f"options.command[{i}]", path) for i, arg in enumerate(command) if (path := _command_file(arg, i, cwd))]
    return shown


def check_shown(cube_id: str, shown: list[tuple[str, str]]) -> None:
    """At cube start: ConfigError naming the option and the guarded key when
    a path the cube's boxes would show is, holds or lies inside a path no
    box may see (``isolation.guard_paths``)."""
    for option, path in shown:
        if conflict := isolation.shown_conflict(path):
            raise ConfigError(f"cube {cube_id!r}: {option} ({os.path.abspath(path)}) would show {conflict} to "
                              "its agents: show a folder that holds neither, or move that path out of it")


def sandboxed_argv(command: list[str], env: dict[str, str], relay: GatewayRelay | list[GatewayRelay], cwd: str,
                   ro_paths: list[str], limits: AgentLimits, pass_fds: tuple[int, ...] = ()) -> list[str]:
    """The whole argv that runs ``command`` in its sandbox; start it with
    ``env=inside_env(env)`` and ``pass_fds``. ``relay``: one, or one per
    gateway host (relay i on INSIDE_PORT + i inside). Files the command
    names (its script, a config) are made absolute and shown read-only;
    ``cwd`` (the option, if set) and ``ro_paths`` too; the working
    directory is ``cwd`` or the private /tmp/home."""
    relays = relay if isinstance(relay, list) else [relay]
    argv, shown = _command_argv(command, env, cwd), [r.dir for r in relays]
    shown += [path for _, path in shown_paths(command, env, cwd, ro_paths)]
    prefix = isolation.agent_prefix(env, [os.path.abspath(p) for p in shown if p],
                                    os.path.abspath(cwd) if cwd else "/tmp/home", limits.tmp_mib * 2**20)
    exe = isolation.interpreter(sys.executable)
    rlimits = limits.rlimits()
    return [*prefix, exe, "-I", "-S", "-c", BOOTSTRAP, ",".join(r.socket for r in relays), str(INSIDE_PORT), rlimits,
            ",".join(map(str, pass_fds)), *argv]


async def box_cgroup(limits: AgentLimits) -> BoxCgroup | None:
    """A cgroup of its own for one box, capped by ``limits``; None where the
    node gives the daemon none (``box_cgroup.py``: then rlimits only)."""
    cgroups = BoxCgroups._here or await asyncio.to_thread(BoxCgroups.here)
    return cgroups.new(limits.box_memory_mib, limits.processes)


def with_verdict(message: str, group: BoxCgroup | None) -> str:
    """An episode's error, and the box's cap it reached if it did."""
    verdict = group.verdict() if group is not None else ""
    return f"{message} ({verdict})" if verdict else message


async def check(requested: str, cube_id: str) -> None:
    """At cube start: the isolation this cube's agents will run under works
    here, or a config error naming the option. ``none`` is logged as an error."""
    if requested == "none":
        log.error("agent.unisolated", cube=cube_id, key="options.isolation",
                  warning="agent commands and the tools they run have the daemon's user, files and network")
        return
    if not await isolation.works("bwrap", sys.executable):
        why = isolation.why_not("bwrap", sys.executable)
        raise ConfigError(f"cube {cube_id!r}: options.isolation = \"bwrap\" cannot run agents here: {why}. "
                          "Fix that (`rlnode check` probes it, --as-unit as the systemd unit runs it), or set "
                          "options.isolation = \"none\" to run them as the daemon's user, unwalled")
