"""A small cluster of real hosts on one machine, for the multi-host tests.

Each node (a trainer, N actors) is its own network namespace with its own
address on a bridge, and runs the real daemon (``ip netns exec NS python -m
rlnode ...``) with CurveZMQ on, as users run it off loopback. The bridge
lives in a namespace of its own (the "switch"), so the test touches nothing
of the machine's own network: every address it uses exists only inside the
namespaces it created, and ``close`` deletes them all (processes first),
also when a test fails.

Faults, injected where a real network breaks:

* ``cut(node)`` / ``heal(node)``: the node's port on the switch goes down /
  up (a partition: nothing in or out, no RST, no FIN).
* ``drop_to(node, peer)`` / ``undrop(node)``: frames from ``node`` to
  ``peer`` go to a MAC address nobody has, while ``peer``'s frames still
  arrive (a half-open link; this kernel has no netem and no tc actions, a
  static neighbour entry needs neither).
* ``Node.kill()``: kill -9 of the node's daemon.

Each node's HTTP endpoint listens on loopback inside its namespace (all on
the same port: each namespace has its own loopback); the test reaches it
from a thread that enters the namespace (``setns``) only to connect.

The hostname resolves to 127.0.0.1 here (/etc/hosts), as on many real hosts:
anything that advertises what the hostname resolves to is caught.
"""

from __future__ import annotations

import ctypes
import errno
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import session_pids
from daemons import ROOT, sweep_after_kill, wait_for_status

CLONE_NEWNET = 0x40000000
SUBNET = "10.213.0"  # exists only inside the cluster's namespaces
HTTP_PORT = 8470
LINK_PORT = 5555
_libc = ctypes.CDLL(None, use_errno=True)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


def netns_supported() -> str | None:
    """None when this process may create network namespaces and veth pairs,
    else the reason it may not."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    probe = f"rlprobe{os.getpid()}"
    try:
        done = sh("ip", "netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if done.returncode != 0:
        return f"ip netns add refused (needs CAP_NET_ADMIN): {done.stderr.strip()}"
    try:
        veth = sh("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if veth.returncode != 0:
            return f"veth refused: {veth.stderr.strip()}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None


def in_netns(ns: str, fn):
    """Run ``fn()`` on a thread that entered network namespace ``ns`` (a
    namespace is per thread: the test's own threads stay where they are)."""
    out: dict = {}

    def run():
        try:
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({ns})")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class ThreadFreeze:
    """Stops single threads of another process, the rest of it running on:
    ptrace stops are per thread (PTRACE_SEIZE, then PTRACE_INTERRUPT), where
    SIGSTOP stops every thread of a process. ``thaw`` detaches (the threads
    run on); so does the kernel if this process dies first. Every call must
    come from the thread that froze them (ptrace's tracer is a thread)."""

    SEIZE, INTERRUPT, DETACH = 0x4206, 0x4207, 17
    WALL = 0x40000000  # waitpid's __WALL: a tracee that is another process's thread

    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.restype = ctypes.c_long
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.frozen: list[int] = []

    def _ptrace(self, op: int, tid: int) -> None:
        if self.libc.ptrace(op, tid, None, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"ptrace({op:#x}, {tid}): {os.strerror(err)}")

    def freeze(self, tid: int) -> bool:
        """Stop thread ``tid``; False when it has ended already."""
        try:
            self._ptrace(self.SEIZE, tid)
        except OSError as e:
            if e.errno == errno.ESRCH:
                return False
            raise
        self.frozen.append(tid)
        self._ptrace(self.INTERRUPT, tid)
        os.waitpid(tid, self.WALL)  # it has stopped
        return True

    def thaw(self) -> None:
        while self.frozen:
            tid = self.frozen.pop()
            try:
                self._ptrace(self.DETACH, tid)
            except OSError:  # gone (its process ended)
                pass


class Node:
    """One host: a namespace, its address, its port on the switch, and the
    daemon it runs (at most one at a time)."""

    def __init__(self, cluster: Cluster, name: str, index: int):
        self.cluster, self.name = cluster, name
        self.ns = f"{cluster.prefix}-{name}"
        self.addr = f"{SUBNET}.{index}"
        self.ifname = f"{cluster.prefix}{name}"[:15]  # the switch's end of the veth
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.starts = 0
        self.stop_requested: subprocess.Popen | None = None  # the daemon already sent SIGTERM

    # ---- the daemon ------------------------------------------------------------

    def start(self, args: list[str]) -> None:
        self.starts += 1
        logs = self.cluster.log_dir
        self.log_path = logs / f"{self.name}.{self.starts}.log"
        env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, sys.executable, "-m", "rlnode", *args, "--log-json"],
            stdout=open(logs / f"{self.name}.{self.starts}.out", "w"), stderr=open(self.log_path, "w"),
            env=env, cwd=ROOT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def freeze(self, frozen: bool = True) -> None:
        """SIGSTOP (or SIGCONT) its whole session: it sends nothing more."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def threads_named(self, name: str) -> list[int]:
        """Native ids of the threads called ``name`` in any process of its session."""
        tids = []
        for pid in session_pids(self.proc.pid) if self.proc is not None else ():
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                        tids.append(int(tid))
                except OSError:
                    pass
        return tids

    def kill(self) -> None:
        """kill -9, no goodbye. The whole session goes, multiprocessing's
        resource tracker with it, so nothing would unlink the shared memory
        its engine made (400 MB of tmpfs per engine): the test does."""
        if self.proc is not None:
            from rlnode.actor.engine_guard import release_shared_memory, shared_memory_of

            session = session_pids(self.proc.pid)
            segments = shared_memory_of(list(session))
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and session_pids(self.proc.pid):
                time.sleep(0.05)
            release_shared_memory(segments)
            sweep_after_kill()

    def request_stop(self) -> None:
        """SIGTERM once: a second one is the daemon's forced exit."""
        if self.proc is not None and self.proc.poll() is None and self.stop_requested is not self.proc:
            self.proc.send_signal(signal.SIGTERM)
            self.stop_requested = self.proc

    def terminate(self, timeout: float = 60) -> int | None:
        if self.proc is None:
            return None
        self.request_stop()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    # ---- its HTTP endpoint ----------------------------------------------------------

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes] | None:
        """(status, body) of GET path on the node's endpoint, None when it
        does not answer."""
        def request():
            conn = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=timeout)
            try:
                conn.request("GET", path)
                r = conn.getresponse()
                return r.status, r.read()
            finally:
                conn.close()

        try:
            return in_netns(self.ns, request)
        except OSError:
            return None

    def status(self) -> dict | None:
        got = self.get("/status")
        return json.loads(got[1]) if got and got[0] == 200 else None

    def must_status(self, timeout: float = 30) -> dict:
        """/status, retried while the daemon is too busy to answer."""
        return self.wait(lambda st: st, timeout, "/status to answer")

    def healthy(self) -> bool | None:
        got = self.get("/healthz")
        return None if got is None else got[0] == 200

    def events(self, name: str) -> list[dict]:
        out = []
        for p in sorted(self.cluster.log_dir.glob(f"{self.name}.*.log")):
            for line in p.read_text().splitlines():
                if line.startswith("{") and f'"event": "{name}"' in line:
                    out.append(json.loads(line))
        return out

    def wait(self, pred, timeout: float, what: str):
        """Poll /status until ``pred(status)`` is truthy; returns its value."""
        return wait_for_status(self, pred, timeout, what)


class Cluster:
    """A trainer and ``actors`` actor hosts on one bridge (see the module doc)."""

    def __init__(self, work: Path, actors: tuple[str, ...] = ("a1", "a2")):
        self.prefix = f"rl{os.getpid() % 100000}"
        self.log_dir = work / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.switch = f"{self.prefix}-sw"
        self.nodes = {name: Node(self, name, i + 1) for i, name in enumerate(("t", *actors))}
        self._made: list[str] = []

    @property
    def trainer(self) -> Node:
        return self.nodes["t"]

    def actors(self) -> list[Node]:
        return [n for name, n in self.nodes.items() if name != "t"]

    def up(self) -> Cluster:
        sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes.values():
            self.add_node(node)
        return self

    def add_node(self, node: Node) -> None:
        sh("ip", "netns", "add", node.ns)
        self._made.append(node.ns)
        sh("ip", "-n", node.ns, "link", "set", "lo", "up")
        # Made inside the node's namespace, so nothing ever exists in ours.
        sh("ip", "-n", node.ns, "link", "add", "eth0", "type", "veth", "peer", "name", node.ifname)
        sh("ip", "-n", node.ns, "link", "set", node.ifname, "netns", self.switch)
        sh("ip", "-n", self.switch, "link", "set", node.ifname, "master", "br0", "up")
        sh("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
        sh("ip", "-n", node.ns, "link", "set", "eth0", "up")

    def readdress(self, node: Node, index: int) -> None:
        """The node comes back with another address (a new DHCP lease, a
        rescheduled VM)."""
        sh("ip", "-n", node.ns, "addr", "del", f"{node.addr}/24", "dev", "eth0")
        node.addr = f"{SUBNET}.{index}"
        sh("ip", "-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")

    # ---- faults ----------------------------------------------------------------------

    def cut(self, node: Node) -> None:
        sh("ip", "-n", self.switch, "link", "set", node.ifname, "down")

    def heal(self, node: Node) -> None:
        sh("ip", "-n", self.switch, "link", "set", node.ifname, "up")

    def drop_to(self, node: Node, peer: Node) -> None:
        """Frames from ``node`` to ``peer`` vanish; ``peer``'s still arrive."""
        sh("ip", "-n", node.ns, "neigh", "replace", peer.addr, "lladdr", "02:00:00:00:00:01",
           "dev", "eth0", "nud", "permanent")

    def undrop(self, node: Node, peer: Node) -> None:
        sh("ip", "-n", node.ns, "neigh", "del", peer.addr, "dev", "eth0", check=False)

    # ---- teardown --------------------------------------------------------------------

    def close(self) -> None:
        for node in self.nodes.values():
            node.kill()
        # Anything still inside (an engine core that outlived its parent).
        for ns in self._made:
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self._made):
            sh("ip", "netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Cluster:
        try:
            return self.up()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
