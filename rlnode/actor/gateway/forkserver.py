"""Gateway hosts are forked from one process that has already imported what
a host needs: transformers (and with it torch) and vLLM's output parsers.

Why: a host started with ``python -m`` spends ~6 s of CPU on those imports
(2 cores) before it can serve, at every start: each of ``gateway_hosts`` at
the daemon's start, and every restart after a host is lost, while that
host's episodes wait. Forked from this server, a host is serving in the
time it takes to load the tokenizer (0.01-0.3 s), and the imported pages
are shared by every host instead of copied into each (~0.5 GB apiece).

The server is this module run as ``python -m rlnode.actor.gateway.forkserver
FD``, started by the daemon at its first host start and one per daemon
process. It talks to the daemon over an inherited socketpair only: no
listening socket, no file, nothing pickled. The daemon sends one byte and a
new host's three descriptors (its channel, the TCP and unix listening
sockets: ``host.serve``); the server forks, the child becomes the host (a
session of its own, default signal dispositions, the daemon's socket
closed), and the server answers with the child's pid and a pidfd for it,
which the daemon signals and waits on (``ForkedHost``). A pidfd refers to
that one process, never to a pid reused after it (the server reaps its
children).

Ends when the daemon's end of the socket closes (the daemon exited or was
killed): a daemon killed -9 leaves no server, and its hosts end with their
channels as before. A server that died is started again at the next host
start.

Must not hold anything of an episode or a session: it only forks. Started
with an allowlisted environment (``host_env``): no credential of the
daemon's reaches the process that parses agents' HTTP.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading

# What the server (and so every host) keeps of the daemon's environment: the
# process basics, locale, and the settings of the libraries a host runs
# (transformers' tokenizer, vLLM's parsers, torch's threads). A host parses
# agents' HTTP, so no credential goes with it: HF_TOKEN, the ops token
# (RLNODE_HTTP_TOKEN), cloud keys and any name that looks like a secret are
# dropped even under an allowed prefix (VLLM_API_KEY).
HOST_ENV_ALLOW = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHASHSEED",
                  "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                  "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_ARENA_MAX")
HOST_ENV_PREFIXES = ("LC_", "VLLM_", "TORCH_")
SECRET_MARKERS = ("TOKEN", "SECRET", "KEY", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def host_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the fork server (and every gateway host) starts with."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if (k in HOST_ENV_ALLOW or k.startswith(HOST_ENV_PREFIXES))
            and not any(m in k.upper() for m in SECRET_MARKERS)}


_FORK = b"F"
_FORKED = struct.Struct("!ci")  # b"P", pid (with a pidfd) | b"E", errno
START_TIMEOUT_S = 120.0  # the server's imports (~6 s on 2 cores) before its first answer


class ForkServerError(OSError):
    """No host could be forked (the server could not start, or fork failed)."""


class ForkedHost:
    """A host process forked by the server: not a child of this process,
    so it is signalled and awaited through its pidfd."""

    def __init__(self, pid: int, pidfd: int):
        self.pid, self.pidfd = pid, pidfd

    @property
    def running(self) -> bool:
        if self.pidfd < 0:
            return False
        return not select.select([self.pidfd], [], [], 0)[0]  # a pidfd reads ready once its process ended

    def send_signal(self, sig: int) -> None:
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass  # ended already

    async def wait(self, timeout: float | None = None) -> bool:
        """Whether the process ended within ``timeout`` seconds."""
        if not self.running:
            return True
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        loop.add_reader(self.pidfd, lambda: ended.done() or ended.set_result(None))
        try:
            await asyncio.wait_for(ended, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(self.pidfd)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class HostForkServer:
    """The daemon's side: starts the server when first asked for a host
    (and again if it died), one request at a time. ``fork`` blocks (the
    first call for the server's imports): call it in a thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None

    @property
    def pid(self) -> int:
        """The server's pid (0: none running)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else 0

    def fork(self, fds: tuple[int, int, int]) -> ForkedHost:
        with self._lock:
            for attempt in (1, 2):  # a server found dead is started again once
                if self._sock is None:
                    self._start()
                try:
                    socket.send_fds(self._sock, [_FORK], list(fds))
                    msg, got, _, _ = socket.recv_fds(self._sock, _FORKED.size, 1)
                except OSError as e:
                    self._stop()
                    if attempt == 2:
                        raise ForkServerError(f"the gateway host fork server did not answer: {e}") from e
                    continue
                if len(msg) != _FORKED.size:  # it ended (b""): start another
                    for fd in got:
                        os.close(fd)
                    self._stop()
                    if attempt == 2:
                        raise ForkServerError("the gateway host fork server ended")
                    continue
                kind, value = _FORKED.unpack(msg)
                if kind != b"P" or len(got) != 1:
                    for fd in got:
                        os.close(fd)
                    if kind != b"E":  # out of step with this side: the next request gets a new server
                        self._stop()
                    raise ForkServerError(f"fork failed: {os.strerror(value)}" if kind == b"E"
                                          else "a malformed answer from the gateway host fork server")
                return ForkedHost(value, got[0])
        raise AssertionError("unreachable")

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "rlnode.actor.gateway.forkserver", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=host_env(),
                # Its own session, like the hosts: a terminal's Ctrl-C is the
                # daemon's to handle; the server ends with the daemon's socket.
                start_new_session=True)
        except OSError as e:
            ours.close()
            raise ForkServerError(f"cannot start the gateway host fork server: {e}") from e
        finally:
            theirs.close()
        ours.settimeout(START_TIMEOUT_S)
        self._sock = ours

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(5.0)  # it ends once its socket reads EOF
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


FORK_SERVER = HostForkServer()  # one per process: every HostedGateway of a daemon forks its hosts from it
atexit.register(FORK_SERVER.close)


# -- the server process ----------------------------------------------------------


def _preload() -> None:
    """What every host imports before it serves (``host._renderer``)."""
    from transformers import AutoTokenizer  # noqa: F401 - imports torch too

    from rlnode.actor import vllm_compat
    from rlnode.actor.gateway import host  # noqa: F401

    try:
        vllm_compat.output_parser_class("hermes", "")  # vLLM's parser registry and the default tool parser
        vllm_compat.chat_request(None)
    except Exception as e:  # the host itself meets this again, and the daemon is told why (HostFailed)
        print(f"rlnode gateway host fork server: preloading vLLM's parsers failed: {e!r}", file=sys.stderr)


def _reap(*_) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _become_host(daemon: socket.socket, fds: list[int]) -> None:
    daemon.close()
    os.setsid()  # as the server: Ctrl-C in a terminal is the daemon's to handle
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    gc.enable()  # for the host's own objects; the server's stay frozen
    code = 1
    try:
        from rlnode.actor.gateway import host

        code = host.main([str(fd) for fd in fds])
    finally:
        # As a host started on its own did: no interpreter teardown of
        # torch, transformers and vLLM's parser registry (2-3 s on 2 cores).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(fd: int) -> int:
    daemon = socket.socket(fileno=fd)
    # The preloaded objects are frozen out of the collector (gc.freeze
    # before each fork, the collector off here and on in the host): a full
    # collection in a host otherwise walks them all, 375-490 ms on 2 cores
    # (and copies 159 MiB of the shared pages into the host); frozen, 4 ms
    # and 6 MiB.
    gc.disable()
    _preload()
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(daemon, 1, 3)
        except OSError:
            return 0
        if msg != _FORK or len(fds) != 3:
            for f in fds:
                os.close(f)
            return 0 if not msg else 2  # the daemon is gone, or spoke out of turn
        # SIGCHLD held from the fork until the pidfd is open: the pidfd then
        # names this child even if it has ended, never a process that took
        # its pid after _reap.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        gc.freeze()
        try:
            pid = os.fork()
        except OSError as e:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            for f in fds:
                os.close(f)
            daemon.sendall(_FORKED.pack(b"E", e.errno or 0))
            continue
        if pid == 0:
            _become_host(daemon, fds)
        for f in fds:
            os.close(f)
        pidfd = os.pidfd_open(pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        try:
            socket.send_fds(daemon, [_FORKED.pack(b"P", pid)], [pidfd])
        except OSError:
            return 0
        finally:
            os.close(pidfd)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
