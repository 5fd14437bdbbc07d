"""Engine guard: no vLLM process outlives the rlnode daemon that started it.

Owns: the link from each vLLM engine-core and worker process back to the
daemon. ``mark_owner()`` (called by ``Engine.start`` in the daemon) names the
daemon in an environment variable that the processes vLLM spawns inherit;
``install()`` runs in those processes as a vLLM *general plugin* (entry point
group ``vllm.general_plugins``, loaded by ``EngineCore.__init__`` and
``WorkerWrapperBase.init_worker``) and starts a thread that waits for the
daemon, and for the process's parent where that is another vLLM process (a
worker's engine core), to exit. When one does, the thread asks its own
process to stop (SIGTERM: vLLM's handlers shut the engine down cleanly and
release its shared memory) and, ``GRACE_S`` later, kills what is left of its
process and its children (SIGKILL). ``kill_children_since()`` is the daemon's side: an engine
start that is cancelled (a stop during start-up) kills the half-built
engine's process tree rather than wait 10-30 s for it to finish.

Why not the daemon's own shutdown: ``kill -9``, an interpreter crash or a
second SIGTERM (forced exit) never run it, and vLLM's processes do not notice
a dead front end: measured, an engine core and its worker kept running
(2.5 GB RSS each) after ``kill -9`` of their actor daemon. Why not
``prctl(PR_SET_PDEATHSIG)``: it fires when the *thread* that forked the child
exits, and ``AsyncLLM`` is built in an executor thread; nor could it be set
before vLLM's own code runs in the spawned process.

The daemon is identified by pid *and* start time, and watched through a pidfd
where the kernel has one, so a reused pid is never mistaken for it. Must not
touch a process that rlnode did not start: without the variable (a user's own
``vllm serve``), or in the daemon itself, ``install()`` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

# "<pid>:<start time in clock ticks since boot>" of the daemon that owns the
# engines. Not configuration: the only channel into processes vLLM spawns.
OWNER_ENV = "RLNODE_ENGINE_OWNER"
# The entry point's name in group vllm.general_plugins (pyproject.toml).
PLUGIN_NAME = "rlnode_engine_guard"
# Between SIGTERM to our own process (vLLM shuts down cleanly) and SIGKILL.
GRACE_S = 5.0
# Fallback poll period where pidfds are unavailable (non-Linux, kernel < 5.3).
POLL_S = 0.5
# How long an abandoned start waits for the processes it killed to die
# before it releases their shared memory (SIGKILL: milliseconds).
KILL_WAIT_S = 5.0

_installed = False


def _start_time(pid: int) -> str | None:
    """Start time of ``pid`` (field 22 of /proc/<pid>/stat), "" where /proc
    does not exist, None if the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode()
    except FileNotFoundError:
        if not os.path.isdir("/proc"):
            return ""
        return None
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return stat[stat.rindex(")") + 2 :].split()[19]


def owner_token(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid) or ''}"


class EngineGuardMissing(RuntimeError):
    """vLLM would not load the guard into its processes (fatal at engine start:
    engines would silently outlive a crashed daemon)."""


def check_registered() -> None:
    """Raise EngineGuardMissing unless vLLM will find the guard: an entry point
    ``PLUGIN_NAME`` in group ``vllm.general_plugins`` that names this module's
    ``install``. vLLM discovers plugins through installed distributions'
    metadata only, so rlnode imported from a source tree (``PYTHONPATH``, a
    copied folder) has none, and the guard would silently do nothing."""
    from importlib.metadata import entry_points

    target = f"{__name__}:install"
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == PLUGIN_NAME]
    if not found:
        raise EngineGuardMissing(
            f"rlnode's engine guard is not registered with vLLM (no entry point {PLUGIN_NAME!r} in group "
            "'vllm.general_plugins'): rlnode is imported from a source tree, not an installed distribution. "
            "Install it (`pip install -e .` in the checkout, or `make setup`); without the guard, vLLM's "
            "engine processes outlive a daemon that crashes or is killed with -9.")
    if not any(ep.value.replace(" ", "") == target for ep in found):
        raise EngineGuardMissing(
            f"the vLLM plugin {PLUGIN_NAME!r} points at {found[0].value!r}, not {target!r}: another rlnode "
            "installation's metadata is on the path; reinstall this one (`pip install -e .`).")


def mark_owner() -> None:
    """Name this process as the owner of the engines it is about to start.
    Refuses (EngineGuardMissing) when vLLM would not load the guard."""
    check_registered()
    os.environ[OWNER_ENV] = owner_token()
    # An operator's VLLM_PLUGINS allow-list would silently leave the guard
    # out (pyproject.toml registers it under this name).
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        os.environ["VLLM_PLUGINS"] = f"{allowed},{PLUGIN_NAME}" if allowed else PLUGIN_NAME


def spawned_children() -> set[int]:
    """Pids of this process's live multiprocessing children (vLLM spawns its
    engine core as one)."""
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()}


def kill_children_since(before: set[int]) -> list[int]:
    """SIGKILL the multiprocessing children started since ``before`` (an
    engine start being abandoned) and all their descendants (a worker still
    importing torch has no guard yet), then remove the shared memory they
    made (``release_shared_memory``). Returns the pids killed."""
    import multiprocessing

    import psutil  # a vLLM dependency

    killed: list[psutil.Process] = []
    for child in multiprocessing.active_children():
        if child.pid in before:
            continue
        tree = []
        try:
            proc = psutil.Process(child.pid)
            proc.suspend()  # stopped, it spawns nothing while we list its descendants
            tree = [*proc.children(recursive=True), proc]
            for sub in tree[:-1]:  # and none of them makes another segment meanwhile
                with contextlib.suppress(psutil.Error):
                    sub.suspend()
        except psutil.Error:
            pass
        segments = shared_memory_of([p.pid for p in tree])
        for proc in tree:
            try:
                proc.kill()
                killed.append(proc)
            except psutil.Error:
                pass
        child.kill()  # a no-op once the child has been reaped: no pid-reuse race
        _wait_dead(tree, KILL_WAIT_S)
        release_shared_memory(segments)
    return [p.pid for p in killed]


def _wait_dead(procs, timeout: float) -> None:
    """Until every one of ``procs`` is a zombie or gone (its mappings are
    released by then). Not ``psutil.wait_procs``: that reaps our own
    children, and multiprocessing would then never see its child exit."""
    import psutil

    def running(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)


# Name prefixes in /dev/shm of what Python's multiprocessing makes: shared
# memory (vLLM's message queues) and named semaphores.
_SHM_PREFIXES = ("psm_", "sem.mp-")


def shared_memory_of(pids: list[int]) -> set[str]:
    """Paths under /dev/shm of multiprocessing's shared memory and
    semaphores that ``pids`` map or hold open. Found by inode: a segment
    between its ``shm_open`` and its ``mmap`` is only an open descriptor,
    and glibc maps a named semaphore under a temporary name it then links
    to the real one."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                        inodes.add(int(parts[4]))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                        inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    found = set()
    with contextlib.suppress(OSError), os.scandir("/dev/shm") as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.name.startswith(_SHM_PREFIXES) and entry.inode() in inodes:
                    found.add(entry.path)
    return found


def release_shared_memory(segments: set[str]) -> list[str]:
    """Unlink ``segments`` of killed engine processes that no live process
    of this daemon still maps. Why here: a process killed between making a
    segment and registering it with multiprocessing's resource tracker
    leaves it behind for good (tmpfs: RAM until reboot); a SIGKILLed engine
    start is where that happens. Returns the paths removed."""
    import psutil  # a vLLM dependency

    if not segments:
        return []
    me = psutil.Process()
    live: set[str] = set()
    with contextlib.suppress(psutil.Error):
        live = shared_memory_of([me.pid, *(c.pid for c in me.children(recursive=True))])
    removed = []
    for path in sorted(segments - live):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def _parse(token: str) -> tuple[int, str] | None:
    pid, _, start = token.partition(":")
    try:
        return int(pid), start
    except ValueError:
        return None


def _is_owner_alive(pid: int, start: str) -> bool:
    now = _start_time(pid)
    if now is None:
        return False
    return not start or not now or now == start


def install() -> None:
    """vLLM general-plugin entry point (may run several times per process)."""
    global _installed
    owner = _parse(os.environ.get(OWNER_ENV, ""))
    if _installed or owner is None or owner[0] == os.getpid():
        return
    _installed = True
    threading.Thread(target=_watch, args=owner, name="rlnode-engine-guard", daemon=True).start()


def _open_owner(pid: int, start: str) -> int | None:
    """A pidfd of the owner (-1: no pidfds here), None if it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):
        fd = -1
    # Checked *after* opening: if the pid still has the owner's start time,
    # the pidfd refers to the owner, not to a process that reused its pid.
    return fd if _is_owner_alive(pid, start) else None


def _open_parent(owner_pid: int) -> int | None:
    """A pidfd of our parent where it is not the owner (a worker's engine
    core: if the daemon kills it mid-start, its workers must follow);
    -1 if there is nothing to watch, None if the parent is gone already."""
    import multiprocessing

    ppid = os.getppid()
    spawner = multiprocessing.parent_process()
    if spawner is not None and spawner.pid != ppid:
        return None  # reparented: the process that spawned us has exited
    if ppid == owner_pid or ppid <= 1:
        return -1
    try:
        fd = os.pidfd_open(ppid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):
        return -1
    # Still our parent after opening: the pidfd is the parent's, not a reuse.
    return fd if os.getppid() == ppid else None


def _watch(pid: int, start: str) -> None:
    owner = _open_owner(pid, start)
    parent = _open_parent(pid) if owner is not None else None
    if owner is not None and parent is not None:
        fds = [fd for fd in (owner, parent) if fd >= 0]
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        # Without an owner pidfd, poll its start time; a parent pidfd alone
        # is still waited on between those polls.
        timeout_ms = None if owner >= 0 else int(POLL_S * 1000)
        while not poller.poll(timeout_ms) and (owner >= 0 or _is_owner_alive(pid, start)):
            pass
    _stop_self(pid)


def _stop_self(owner_pid: int) -> None:
    me = os.getpid()
    try:
        with open("/proc/self/comm") as f:
            name = f.read().strip()
    except OSError:
        name = ""
    try:  # best effort: whoever read our stderr may be gone with the daemon (EPIPE)
        os.write(2, (f'{{"event": "engine_guard.stopping", "reason": "daemon or parent process gone", '
                     f'"owner": {owner_pid}, "pid": {me}, "process": "{name}"}}\n').encode())
    except OSError:
        pass
    os.kill(me, signal.SIGTERM)
    time.sleep(GRACE_S)
    # Still here: vLLM's shutdown hung (a stuck collective, a child that
    # ignores SIGTERM). Children first, so none is left orphaned.
    try:
        import psutil  # a vLLM dependency

        for child in psutil.Process(me).children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:
        pass
    os.kill(me, signal.SIGKILL)
