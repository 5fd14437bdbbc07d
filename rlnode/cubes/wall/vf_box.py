"""One bubblewrap box that starts the processes of one verifiers runtime
(``vf_runtime.make_walled_runtime``), made like an agent's
(``agent_sandbox``).

One box per runtime, so the processes of one rollout share a loopback (a
tool server started with ``run_background`` is reachable by the harness
program) and nothing else. The box's first process (``BOX_INIT``) starts
what the daemon asks over one SEQPACKET socket (argv, environment and
working directory as JSON, the three stdio descriptors passed with it),
reports each one's exit, signals them, and mirrors loopback ports: every
URL verifiers hands to a program goes through ``host_url`` (the interception
server, MCP tool servers: ``vf_runtime``), so exactly those ports are relayed (box loopback
-> unix socket -> host loopback); the link, the ops endpoint and any other
port stay out of reach.

The runtime's working directory, bound read-write into the box, is on
the node's disk, so what the box writes there is
capped as a whole (``limits.disk_mib``, each file counted at least one
4 KiB block, so a flood of empty files counts too): the daemon sums it
every ``DISK_CHECK_S`` and ends a box past the cap; its episode's error
names the key. The box can overshoot by what it writes in one interval
(each file at most ``limits.file_mib``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from rlnode.cubes.wall import agent_sandbox, isolation
from rlnode.cubes.wall.agent_sandbox import AgentLimits, GatewayRelay
from rlnode.cubes.wall.box_cgroup import BoxCgroup
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.wall.vf_box")

# How often a box's working directory is summed against limits.disk_mib (s).
DISK_CHECK_S = 1.0

# The box's first process: python -I -S -c BOX_INIT CTL_FD RELAY_DIR NPROC,AS,NOFILE,CPU,FSIZE
BOX_INIT = agent_sandbox.SET_LIMITS + agent_sandbox.RELAY + r"""
import json, os, subprocess, sys, time
ctl = socket.socket(fileno=int(sys.argv[1]))
relay_dir = sys.argv[2]
set_limits(sys.argv[3])
send_lock = threading.Lock()
def send(obj):
    with send_lock:
        ctl.send(json.dumps(obj).encode())
ids, early, lock = {}, {}, threading.Lock()  # pid -> id; exits reaped before their pid was filed
def reap():
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            time.sleep(0.05)
            continue
        code = os.waitstatus_to_exitcode(status)
        with lock:
            if pid not in ids:
                early[pid] = code
                continue
            i = ids.pop(pid)
        send({"exit": i, "code": code})
threading.Thread(target=reap, daemon=True).start()
procs = {}
while True:
    try:
        msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 3)
    except OSError:
        msg, fds = b"", []
    if not msg:
        for p in procs.values():
            try:
                os.killpg(p.pid, 9)
            except OSError:
                pass
        os._exit(0)
    req = json.loads(msg)
    if req["op"] == "spawn":
        try:
            p = subprocess.Popen(req["argv"], stdin=fds[0], stdout=fds[1], stderr=fds[2], env=req["env"],
                                 cwd=req["cwd"], start_new_session=True)
            procs[req["id"]] = p
            send({"started": req["id"]})
            with lock:
                if p.pid in early:
                    send({"exit": req["id"], "code": early.pop(p.pid)})
                else:
                    ids[p.pid] = req["id"]
        except (OSError, ValueError) as e:
            send({"failed": req["id"], "error": "%s: %s" % (type(e).__name__, e)})
        finally:
            for fd in fds:
                os.close(fd)
    elif req["op"] == "signal":
        p = procs.get(req["id"])
        if p is not None:
            try:
                os.killpg(p.pid, req["sig"])
            except OSError:
                pass
    elif req["op"] == "listen":
        listen(req["port"], os.path.join(relay_dir, "%d.sock" % req["port"]))
        send({"listening": req["port"]})
"""


class BoxError(RuntimeError):
    """The box could not start a process (or is gone)."""


class Box:
    """One bubblewrap sandbox that starts the processes of one runtime."""

    def __init__(self, workdir: str, env: dict[str, str], limits: AgentLimits, ro_paths: list[str]):
        self.workdir, self.env, self.limits, self.ro_paths = workdir, env, limits, ro_paths
        self.over = ""  # why the daemon ended the box (its disk cap), "" otherwise
        self._disk_watch: asyncio.Future | None = None
        self.relay_dir = ""
        self.proc: asyncio.subprocess.Process | None = None
        self.ctl: socket.socket | None = None
        self.relays: dict[int, GatewayRelay] = {}
        self._ids = 0
        self._waiters: dict[Any, asyncio.Future] = {}  # ("started", id) / ("exit", id) / ("listening", port)
        self._lock = asyncio.Lock()
        self._ended = False  # the box is gone: every wait, now or later, fails
        self.output = isolation.OutputTail()
        self._draining: asyncio.Future | None = None
        self.group: BoxCgroup | None = None

    async def start(self) -> None:
        self.relay_dir = tempfile.mkdtemp(prefix="rlnode-vfbox-")
        os.chmod(self.relay_dir, 0o711)
        # The box's uid writes here and no other uid may: a root daemon's
        # box gets a fresh uid (owner of the folder), a user-namespace box
        # has the daemon's own.
        box_uid = isolation.fresh_uid() if os.geteuid() == 0 else None
        if box_uid is not None:
            os.chown(self.workdir, box_uid, box_uid)
        os.chmod(self.workdir, 0o700)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            prefix = isolation.agent_prefix(self.env, [self.relay_dir, *self.ro_paths], self.workdir,
                                            self.limits.tmp_mib * 2**20, rw_paths=(self.workdir,), uid=box_uid)
            argv = [*prefix, isolation.interpreter(sys.executable), "-I", "-S", "-c", BOX_INIT, str(theirs.fileno()),
                    self.relay_dir, self.limits.rlimits()]
            self.group = await agent_sandbox.box_cgroup(self.limits)
            if self.group is not None:
                argv = self.group.enter(argv)
            # Its own output (and whatever in the box writes to it, through
            # /proc/1/fd) into a bounded tail, never the daemon's journal.
            self.proc = await asyncio.create_subprocess_exec(
                *argv, env=agent_sandbox.inside_env(self.env), cwd="/", stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                pass_fds=(theirs.fileno(),), start_new_session=True)
            self._draining = asyncio.ensure_future(self.output.drain(self.proc.stdout))
            self._disk_watch = asyncio.ensure_future(self._watch_disk())
        except BaseException:
            ours.close()
            shutil.rmtree(self.relay_dir, ignore_errors=True)
            if self.group is not None:
                await self.group.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.ctl = ours
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_message)

    def _on_message(self) -> None:
        try:
            data = self.ctl.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the box is gone: every waiter learns it, and every later one (_future)
            asyncio.get_running_loop().remove_reader(self.ctl.fileno())
            self._ended = True
            why = agent_sandbox.with_verdict(self.ended_why(), self.group)
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(BoxError(why))
            return
        msg = json.loads(data)
        for kind in ("started", "failed", "exit", "listening"):
            if kind in msg:
                key = ("started" if kind == "failed" else kind, msg[kind])
                fut = self._waiters.setdefault(key, asyncio.get_running_loop().create_future())
                if fut.done():
                    continue
                if kind == "failed":
                    fut.set_exception(BoxError(msg["error"]))
                else:
                    fut.set_result(msg.get("code"))

    def ended_why(self) -> str:
        return f"the runtime's sandbox ended ({self.over})" if self.over else "the runtime's sandbox ended"

    async def _watch_disk(self) -> None:
        """End the box once its working directory holds more than
        ``limits.disk_mib``."""
        cap = self.limits.disk_mib * 2**20
        while self.proc is not None and self.proc.returncode is None:
            used = await asyncio.to_thread(folder_bytes, self.workdir)
            if used > cap:
                self.over = (f"it wrote {used / 2**20:.0f} MiB to its working directory, past limits.disk_mib = "
                             f"{self.limits.disk_mib}")
                log.warning("sandbox.disk_cap", workdir=self.workdir, used_mib=round(used / 2**20),
                            key="limits.disk_mib", cap_mib=self.limits.disk_mib, effect="the box was ended")
                self.kill_now()
                return
            await asyncio.sleep(DISK_CHECK_S)

    def _future(self, key) -> asyncio.Future:
        fut = self._waiters.setdefault(key, asyncio.get_running_loop().create_future())
        if self._ended and not fut.done():
            fut.set_exception(BoxError(self.ended_why()))
        return fut

    async def mirror(self, port: int) -> None:
        """Relay the box's loopback ``port`` to the host's."""
        async with self._lock:
            if port in self.relays:
                return
            relay = GatewayRelay(f"tcp://127.0.0.1:{port}", self.limits.connections)
            await relay.open(os.path.join(self.relay_dir, f"{port}.sock"))
            self.relays[port] = relay
            self.ctl.send(json.dumps({"op": "listen", "port": port}).encode())
        await self._future(("listening", port))

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int]) -> int:
        """Start ``argv`` in the box with ``fds`` as its stdio; its id."""
        self._ids += 1
        pid = self._ids
        msg = json.dumps({"op": "spawn", "id": pid, "argv": argv, "env": env, "cwd": cwd}).encode()
        if len(msg) > (1 << 20):
            raise BoxError("argv and environment exceed 1 MiB")
        try:
            socket.send_fds(self.ctl, [msg], list(fds))
        except OSError as e:
            raise BoxError(f"the runtime's sandbox is gone ({e})") from e
        await self._future(("started", pid))
        return pid

    async def wait(self, pid: int) -> int:
        return await asyncio.shield(self._future(("exit", pid)))

    def signal(self, pid: int, sig: int) -> None:
        if self.ctl is not None and self.proc is not None and self.proc.returncode is None:
            try:
                self.ctl.send(json.dumps({"op": "signal", "id": pid, "sig": int(sig)}).encode())
            except OSError:
                pass

    def kill_now(self) -> None:
        """Synchronous: the box and everything in it (its pid namespace ends with it)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    async def close(self) -> None:
        self.kill_now()
        if self._disk_watch is not None:
            self._disk_watch.cancel()
            await asyncio.gather(self._disk_watch, return_exceptions=True)
        if self.proc is not None:
            await self.proc.wait()
        if self._draining is not None:
            self._draining.cancel()
            await asyncio.gather(self._draining, return_exceptions=True)
        if self.ctl is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.ctl.fileno())
            except (ValueError, OSError):
                pass
            self.ctl.close()
        for relay in self.relays.values():
            await relay.__aexit__(None, None, None)
        shutil.rmtree(self.relay_dir, ignore_errors=True)
        if self.group is not None:
            await self.group.close()


def folder_bytes(folder: str) -> int:
    """Disk a folder's files take: allocated blocks, each entry at least
    one 4 KiB block (an inode costs the disk too). Links are not followed."""
    total = 0
    stack = [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # removed meanwhile, or not ours to list
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += max(st.st_blocks * 512, 4096)
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total
