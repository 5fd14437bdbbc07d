"""The byte-bounded gate in front of a weight epoch's TCPStore.

A TCPStore server keeps whatever its clients write, with no limit on keys
or values, and has no authentication: anyone who reaches the rendezvous
port could grow the trainer's memory without bound. So the trainer's store
server listens on loopback only, and the advertised rendezvous socket
belongs to this gate, which relays each connection to it and counts what
clients send:

* at most ``max_conns`` connections at once (more are closed at accept);
* at most ``max_conn_bytes`` sent by one connection, and ``max_total_bytes``
  by all of them over the gate's life: the store can hold no more than that
  (a connection over either is cut, and counted).

Members send little: proofs, gloo's addresses, a sealed NCCL id, and the
polls of the admission (under 1 MiB per rank over a whole epoch timeout).
Replies (server to client) are not counted; back-pressure keeps the gate's
own buffers bounded. The gate is needed only while the group forms: rank 0
stops it once its transport is up, and from then on the port refuses.

It runs in its own process (``python -I store_gate.py``, standard library
only, so it starts in tens of milliseconds and never imports torch): its
memory is not the trainer's, and a member in the trainer's own process
blocked in a store call that holds the GIL cannot stall the relay. It exits
on SIGTERM, or when its parent is gone, and prints one JSON line of counts.

Layer: a subsystem helper of ``rendezvous`` (its only user); imports only
the standard library, and nothing of rlnode, so it can run as a script.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import sys
import time

READ_CHUNK = 64 * 1024
# A direction's unsent bytes above this: stop reading its source until the
# other side drained them (a client that does not read its replies cannot
# make the gate buffer without bound).
MAX_PENDING = 1024 * 1024


class _Pipe:
    """One client connection and its upstream connection to the store."""

    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client, self.upstream = client, upstream
        self.sent = 0  # bytes the client sent (relayed or not)
        self.out = {client: bytearray(), upstream: bytearray()}  # pending, by destination

    def peer(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client


class StoreGate:
    def __init__(self, listen: socket.socket, upstream: tuple[str, int], max_conns: int, max_conn_bytes: int,
                 max_total_bytes: int):
        self.listen, self.upstream = listen, upstream
        self.max_conns, self.max_conn_bytes, self.max_total_bytes = max_conns, max_conn_bytes, max_total_bytes
        self.sel = selectors.DefaultSelector()
        self.pipes: dict[socket.socket, _Pipe] = {}
        self.counts = {"accepted": 0, "refused": 0, "cut": 0, "bytes_in": 0, "peak_conns": 0}
        self.stopping = False
        listen.setblocking(False)
        self.sel.register(listen, selectors.EVENT_READ)

    # -- the loop --------------------------------------------------------------

    def run(self, parent: int) -> None:
        while not self.stopping:
            for key, events in self.sel.select(timeout=0.5):
                if key.fileobj is self.listen:
                    self._accept()
                else:
                    self._ready(key.fileobj, events)
            if os.getppid() != parent:  # the trainer died (kill -9): nothing may outlive it
                break
        for sock in list(self.pipes):
            self._close(self.pipes.get(sock))

    def _accept(self) -> None:
        try:
            client, _ = self.listen.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self.pipes) // 2 >= self.max_conns:
            self.counts["refused"] += 1
            client.close()
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:  # the store is gone (the epoch is closing)
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe = _Pipe(client, upstream)
        self.pipes[client] = self.pipes[upstream] = pipe
        self.sel.register(client, selectors.EVENT_READ)
        self.sel.register(upstream, selectors.EVENT_READ)
        self.counts["accepted"] += 1
        self.counts["peak_conns"] = max(self.counts["peak_conns"], len(self.pipes) // 2)

    def _ready(self, sock: socket.socket, events: int) -> None:
        pipe = self.pipes.get(sock)
        if pipe is None:
            return
        if events & selectors.EVENT_WRITE and not self._flush(pipe, sock):
            return
        if events & selectors.EVENT_READ:
            self._read(pipe, sock)

    def _read(self, pipe: _Pipe, sock: socket.socket) -> None:
        try:
            data = sock.recv(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(pipe)
            return
        if sock is pipe.client:
            pipe.sent += len(data)
            self.counts["bytes_in"] += len(data)
            if pipe.sent > self.max_conn_bytes or self.counts["bytes_in"] > self.max_total_bytes:
                self.counts["cut"] += 1
                self._close(pipe)
                return
        dest = pipe.peer(sock)
        pipe.out[dest] += data
        self._flush(pipe, dest)

    def _flush(self, pipe: _Pipe, dest: socket.socket) -> bool:
        """Send what is pending to ``dest``; False if the pipe closed."""
        buf = pipe.out[dest]
        if buf:
            try:
                n = dest.send(buf)
                del buf[:n]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(pipe)
                return False
        self._interest(pipe, dest)
        self._interest(pipe, pipe.peer(dest))
        return True

    def _interest(self, pipe: _Pipe, sock: socket.socket) -> None:
        """Read ``sock`` unless its peer's backlog is full; write it while
        it has a backlog of its own; neither: not watched until that
        changes."""
        events = (selectors.EVENT_READ if len(pipe.out[pipe.peer(sock)]) <= MAX_PENDING else 0) | \
                 (selectors.EVENT_WRITE if pipe.out[sock] else 0)
        watched = sock in self.sel.get_map()
        if events and watched:
            self.sel.modify(sock, events)
        elif events:
            self.sel.register(sock, events)
        elif watched:
            self.sel.unregister(sock)

    def _close(self, pipe: _Pipe | None) -> None:
        if pipe is None:
            return
        for s in (pipe.client, pipe.upstream):
            self.pipes.pop(s, None)
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()


# The limits rank 0 starts the gate with. Connections: members hold one or
# two each; an idle intruder's connections cost the store little, and
# refusing them early would let them lock members out. Bytes: what
# bounds the store's memory.
MAX_CONNS = 256
MAX_CONN_BYTES = 4 * 1024 * 1024
MAX_TOTAL_BYTES = 64 * 1024 * 1024


class GateProcess:
    """The trainer's handle on a running gate (``start``, then ``stop``)."""

    def __init__(self, listen: socket.socket, upstream_port: int, max_conns: int = MAX_CONNS,
                 max_conn_bytes: int = MAX_CONN_BYTES, max_total_bytes: int = MAX_TOTAL_BYTES):
        import subprocess

        fd = listen.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "--listen-fd", str(fd),
             "--upstream-port", str(upstream_port), "--parent", str(os.getpid()), "--max-conns", str(max_conns),
             "--max-conn-bytes", str(max_conn_bytes), "--max-total-bytes", str(max_total_bytes)],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        listen.close()  # the gate holds the socket now: nothing else answers on the port
        ready = self.proc.stdout.readline()
        if not ready:
            code = self.proc.wait()
            raise OSError(f"the store gate exited ({code}) before it was ready")
        self.counts: dict | None = None

    def stop(self, timeout: float = 10.0) -> dict:
        """SIGTERM, wait, and return the gate's counts (empty if it died)."""
        if self.counts is not None:
            return self.counts
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except Exception:  # stuck: it holds nothing worth waiting for
            self.proc.kill()
            out, _ = self.proc.communicate()
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        try:
            self.counts = json.loads(lines[-1]) if lines else {}
        except ValueError:
            self.counts = {}
        return self.counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen-fd", type=int, required=True, help="the bound, listening rendezvous socket")
    p.add_argument("--upstream-port", type=int, required=True, help="the store server's port on 127.0.0.1")
    p.add_argument("--parent", type=int, required=True, help="pid to outlive never")
    p.add_argument("--max-conns", type=int, required=True)
    p.add_argument("--max-conn-bytes", type=int, required=True)
    p.add_argument("--max-total-bytes", type=int, required=True)
    a = p.parse_args(argv)
    listen = socket.socket(fileno=a.listen_fd)
    gate = StoreGate(listen, ("127.0.0.1", a.upstream_port), a.max_conns, a.max_conn_bytes, a.max_total_bytes)

    def stop(*_):
        gate.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C on the trainer's terminal: the trainer decides
    print(json.dumps({"ready": True}), flush=True)
    t0 = time.monotonic()
    gate.run(a.parent)
    listen.close()
    print(json.dumps({**gate.counts, "up_s": round(time.monotonic() - t0, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
