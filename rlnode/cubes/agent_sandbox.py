"""Command agents under OS isolation: they reach the gateway and nothing else.

An agent command is the user's code, but what it does is the policy's: the
tool calls it runs are model output. So by default (``openai-agent`` option
``isolation = "bwrap"``) the command runs under bubblewrap, as the python
sandbox's snippets do (``isolation.agent_prefix``): its own pid namespace (no
``/proc/<daemon>/environ``), a network namespace with loopback only (no link
port, no CURVE endpoint, no internet), a fresh unprivileged uid without
capabilities, a read-only view of the system, the Python installation and
the agent's own files, and a size-bounded private ``/tmp`` (also ``HOME``).
No run dir, key file or daemon file is visible.

The one way out is the gateway. The sandbox's loopback is its own, so:

    agent --TCP 127.0.0.1:PORT--> bootstrap (in the sandbox, this file's
        BOOTSTRAP) --unix socket--> GatewayRelay (the daemon) --TCP--> gateway

The bootstrap listens on the gateway's own port inside the sandbox, so the
episode's URLs only change host (``127.0.0.1``), starts the agent command
(stdin, stdout, stderr and the allowlisted environment pass through) and
exits with its status. The relay's socket lives in a private directory
bound read-only into that one sandbox (a socket is connectable on a
read-only mount) and accepts connections only while the episode runs.

``isolation = "none"`` runs the command bare, as the daemon's user: an
operator's explicit choice, logged as an error at start.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from urllib.parse import urlsplit, urlunsplit

from rlnode.config import ConfigError
from rlnode.cubes import isolation
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.agent_sandbox")

# Writable /tmp (and HOME) of one agent sandbox.
TMP_BYTES = 256 * 2**20
SOCKET_NAME = "gateway.sock"

# Runs as the sandbox's first process: python -I -S -c BOOTSTRAP SOCKET PORT ARGV...
BOOTSTRAP = r"""
import socket, subprocess, sys, threading
sock_path, port, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(64)
def pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
def serve():
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(sock_path)
        except OSError:
            conn.close()
            continue
        threading.Thread(target=pipe, args=(conn, up), daemon=True).start()
        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
threading.Thread(target=serve, daemon=True).start()
try:
    child = subprocess.Popen(argv)
except OSError as e:
    print(f"rlnode agent sandbox: cannot start {argv[0]!r}: {e}", file=sys.stderr)
    sys.exit(127)
code = child.wait()
sys.exit(128 - code if code < 0 else code)
"""


class GatewayRelay:
    """A unix socket whose connections are piped to the gateway's TCP port,
    for one sandboxed agent. ``async with GatewayRelay(url) as relay``."""

    def __init__(self, gateway_url: str):
        parts = urlsplit(gateway_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.dir = ""
        self.socket = ""
        self._server: asyncio.AbstractServer | None = None
        self._pipes: set[asyncio.Task] = set()

    async def __aenter__(self) -> "GatewayRelay":
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
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._pipes.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            self._pipes.discard(task)
            return
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


def inside_url(url: str) -> str:
    """``url`` as the sandboxed agent reaches it: same port, its own loopback."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{parts.port or 80}"))


def sandboxed_argv(command: list[str], env: dict[str, str], relay: GatewayRelay, cwd: str,
                   ro_paths: list[str]) -> list[str]:
    """The whole argv that runs ``command`` in its sandbox. Files the command
    names (its script, a config) are made absolute and shown read-only;
    ``cwd`` (the option, if set) and ``ro_paths`` too; the working
    directory is ``cwd`` or the private /tmp/home."""
    base = cwd or os.getcwd()
    argv, shown = [], [relay.dir, *ro_paths] + ([cwd] if cwd else [])
    shown += [p for p in env.get("PYTHONPATH", "").split(":") if p and os.path.isdir(p)]
    for i, arg in enumerate(command):
        path = arg if os.path.isabs(arg) else os.path.join(base, arg)
        if (i == 0 or not arg.startswith("-")) and os.path.isfile(path):
            # Absolute, not resolved: a venv's python is found by the path it
            # is started as (pyvenv.cfg next to its bin/).
            path = os.path.abspath(path)
            argv.append(path)
            shown.append(path)
        elif i == 0 and (found := shutil.which(arg, path=env.get("PATH"))):
            argv.append(found)
        else:
            argv.append(arg)
    inside_env = {**env, "HOME": "/tmp/home", "TMPDIR": "/tmp"}
    prefix = isolation.agent_prefix(inside_env, [os.path.abspath(p) for p in shown if p],
                                    os.path.abspath(cwd) if cwd else "/tmp/home", TMP_BYTES)
    exe = isolation.interpreter(sys.executable)
    return [*prefix, exe, "-I", "-S", "-c", BOOTSTRAP, relay.socket, str(relay.port), *argv]


async def check(requested: str, cube_id: str) -> None:
    """At cube start: the isolation this cube's agents will run under works
    here, or a config error naming the option. ``none`` is logged as an error."""
    if requested == "none":
        log.error("agent.unisolated", cube=cube_id, key="options.isolation",
                  warning="agent commands and the tools they run have the daemon's user, files and network")
        return
    if not await isolation.works("bwrap", sys.executable):
        why = isolation.why_not("bwrap", sys.executable)
        raise ConfigError(f"cube {cube_id!r}: options.isolation = \"bwrap\" cannot run agents here ({why}): "
                         "install bubblewrap (apt-get install bubblewrap), or set options.isolation = \"none\" "
                         "to run them as the daemon's user")
