"""Caps on a box as a whole: one cgroup per agent box, for its memory and
its process count, where the node lets the daemon make cgroups.

rlimits (``AgentLimits.rlimits``) bound each process of a box; a box of
many processes could still take ``processes x memory_mib`` of the node. A
box in a cgroup of its own is bounded as a whole: ``box_memory_mib`` of
memory (no swap beyond it) and ``processes`` tasks. Past the memory cap the
kernel's OOM killer picks inside that cgroup only (cgroup v2 kills the whole
box, ``memory.oom.group``); past the task cap fork fails with EAGAIN. The
episode then ends as its own error, and ``BoxCgroup.verdict`` names the cap
that was reached and the key to change.

Where (``BoxCgroups.here``, probed once per process):

* cgroup v2 (unified) with ``memory`` and ``pids`` in the daemon's cgroup,
  when that cgroup is delegated to it (systemd's ``Delegate=`` marks it with
  the ``trusted.delegate``/``user.delegate`` xattr) or already hands both
  to its children. Processes may not sit in a cgroup that hands
  controllers to children, so the daemon first moves its own processes
  into a leaf ``daemon/``; boxes are ``box-N`` beside it. A cgroup of
  someone else's (a login session, a container's that nobody delegated)
  is left alone.
* cgroup v1, a writable ``memory`` and ``pids`` hierarchy (a root daemon on
  a v1 or hybrid host): ``rlnode-PID/box-N`` under the daemon's own cgroup
  in each.
* neither (the shipped unit as written: ``ProtectControlGroups=yes`` makes
  the tree read-only): no box cgroup, logged once as ``sandbox.no_box_cgroup``
  with the reason; each process keeps its rlimits (address space, file size,
  CPU seconds; processes per uid for a root daemon's fresh uid).
  docs/security.md says what to set for box cgroups under the unit.

A box joins its cgroup before bwrap starts: ``enter`` puts a tiny ``sh``
in front of the argv that writes its own pid into the cgroup and then
execs, so nothing of the box ever runs outside it. ``close`` kills what is
left in it and removes it; a daemon killed -9 leaves ``rlnode-PID`` folders
that the next daemon on the node removes (``_sweep``).
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import itertools
import os
import signal
import threading
import time

from rlnode.log import get_logger

log = get_logger("rlnode.cubes.wall.sandbox")

CONTROLLERS = ("memory", "pids")
_probing = threading.Lock()
# Joins the cgroups named by its first N arguments, then execs the rest.
# Exit 125 (the box never started) when a join is refused.
ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n - 1)); done; exec "$@"'
SH = "/bin/sh"
# A box's processes are gone a moment after SIGKILL (zombies reaped by
# their parents); rmdir answers EBUSY until then.
REMOVE_TRIES, REMOVE_PAUSE_S = 200, 0.01


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _counter(path: str, key: str) -> int:
    """``key N`` from a flat-keyed cgroup file (memory.events, pids.events,
    memory.oom_control); 0 where the file or the key is missing."""
    try:
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _own_cgroups() -> dict[str, str]:
    """{controller or "" (v2): path} from /proc/self/cgroup."""
    found = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            found[c] = path
    return found


def _mounts() -> dict[str, tuple[str, str]]:
    """{controller or "" (v2): (mount point, the cgroup path at its root)}."""
    found: dict[str, tuple[str, str]] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) < 3:
            continue
        fstype, options = rfields[0], rfields[2].split(",")
        if fstype == "cgroup2":
            found.setdefault("", (fields[4], fields[3]))
        elif fstype == "cgroup":
            for c in CONTROLLERS:
                if c in options:
                    found.setdefault(c, (fields[4], fields[3]))
    return found


def _on_disk(mount: tuple[str, str], path: str) -> str:
    point, root = mount
    rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
    return os.path.normpath(os.path.join(point, rel))


def _delegated(path: str) -> bool:
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(path, name) == b"1":
                return True
        except OSError:
            pass
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all(folder: str) -> None:
    try:
        pids = _read(os.path.join(folder, "cgroup.procs")).split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def _remove_tree(folder: str) -> bool:
    """Kill and remove a cgroup folder and its children (deepest first);
    True when it is gone. Synchronous, brief: for sweeps and exit."""
    for _ in range(REMOVE_TRIES):
        try:
            for root, dirs, _files in os.walk(folder, topdown=False):
                _kill_all(root)
                os.rmdir(root)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY:  # not ours to remove (another user's, a read-only tree)
                return False
            time.sleep(REMOVE_PAUSE_S)
    return not os.path.exists(folder)


class BoxCgroup:
    """One box's cgroup (one folder per hierarchy)."""

    def __init__(self, folders: list[str], v2: bool, memory_mib: int, processes: int):
        self.folders, self.v2 = folders, v2
        self.memory_mib, self.processes = memory_mib, processes
        self._seen = self.events()

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (before its first instruction)."""
        procs = [os.path.join(f, "cgroup.procs") for f in self.folders]
        return [SH, "-c", ENTER, "rlnode-box", str(len(procs)), *procs, *argv]

    def events(self) -> tuple[int, int]:
        """(processes the OOM killer took, forks refused at the task cap)."""
        memory, pids = (self.folders[0], self.folders[0]) if self.v2 else self.folders
        oom = _counter(os.path.join(memory, "memory.events" if self.v2 else "memory.oom_control"), "oom_kill")
        return oom, _counter(os.path.join(pids, "pids.events"), "max")

    def verdict(self) -> str:
        """Which cap the box reached since the last verdict ("" if none):
        appended to the error of an episode that ended in this box."""
        (oom, refused), (oom0, refused0) = self.events(), self._seen
        self._seen = (oom, refused)
        why = []
        if oom > oom0:
            why.append(f"the box reached its memory cap (limits.box_memory_mib = {self.memory_mib}): the kernel "
                       f"killed {oom - oom0} of its processes")
        if refused > refused0:
            why.append(f"the box reached its process cap (limits.processes = {self.processes}): {refused - refused0} "
                       "forks refused")
        return "; ".join(why)

    async def close(self) -> None:
        """Kill what is left in the box's cgroup and remove it."""
        for folder in self.folders:
            for _ in range(REMOVE_TRIES):
                _kill_all(folder)
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        log.warning("sandbox.box_cgroup_left", path=folder, why=e.strerror)
                        break
                    await asyncio.sleep(REMOVE_PAUSE_S)
            else:
                log.warning("sandbox.box_cgroup_left", path=folder, why="its processes did not end",
                            effect="removed by this daemon at exit or by the next daemon on the node")


class BoxCgroups:
    """Where this daemon makes box cgroups, or why it cannot."""

    _here: BoxCgroups | None = None

    def __init__(self, parents: list[str], v2: bool, why_not: str = ""):
        self.parents, self.v2, self.why_not = parents, v2, why_not
        self._ids = itertools.count()

    @classmethod
    def here(cls) -> BoxCgroups:
        """The node's answer, probed once per process (logged once). Boxes
        that start together ask together (from threads): one probes, the
        others wait for its answer (a second probe would remove the first's
        folder, with its boxes in it)."""
        with _probing:
            return cls._probe_once()

    @classmethod
    def _probe_once(cls) -> BoxCgroups:
        if cls._here is None:
            try:
                cls._here = _probe()
            except OSError as e:
                cls._here = cls([], False, f"reading the cgroup tree failed: {e}")
            if cls._here.parents:
                log.info("sandbox.box_cgroups", version=2 if cls._here.v2 else 1, under=cls._here.parents)
            else:
                log.warning("sandbox.no_box_cgroup", reason=cls._here.why_not,
                            effect="each box process keeps its rlimits (options.limits), but a box of many "
                                   "processes is not capped as a whole",
                            fix="cgroup v2 with Delegate=memory pids on the unit and ProtectControlGroups=no "
                                "(docs/security.md)")
        return cls._here

    def new(self, memory_mib: int, processes: int) -> BoxCgroup | None:
        """A fresh cgroup with these caps; None where the node has none."""
        if not self.parents:
            return None
        name = f"box-{next(self._ids)}"
        folders = [os.path.join(p, name) for p in self.parents]
        made: list[str] = []
        try:
            for folder in folders:
                os.mkdir(folder)
                made.append(folder)
            memory_bytes = str(memory_mib * 2**20)
            if self.v2:
                (folder,) = folders
                _write(os.path.join(folder, "memory.max"), memory_bytes)
                _try_write(os.path.join(folder, "memory.swap.max"), "0")
                _write(os.path.join(folder, "memory.oom.group"), "1")
                _write(os.path.join(folder, "pids.max"), str(processes))
            else:
                memory, pids = folders
                _write(os.path.join(memory, "memory.limit_in_bytes"), memory_bytes)
                _try_write(os.path.join(memory, "memory.memsw.limit_in_bytes"), memory_bytes)
                _write(os.path.join(pids, "pids.max"), str(processes))
        except OSError:
            for folder in made:
                _remove_tree(folder)
            raise
        return BoxCgroup(folders, self.v2, memory_mib, processes)


def _try_write(path: str, text: str) -> None:
    """A knob the kernel may lack (no swap accounting)."""
    try:
        _write(path, text)
    except OSError:
        pass


def _locate() -> tuple[bool, list[str], str]:
    """(v2, the daemon's own cgroup folders to make boxes under, why not
    when there are none). Reads only."""
    own, mounts = _own_cgroups(), _mounts()
    if "" in mounts and "" in own:
        base = _on_disk(mounts[""], own[""])
        if set(CONTROLLERS) <= set(_read(os.path.join(base, "cgroup.controllers")).split()):
            enabled = set(CONTROLLERS) <= set(_read(os.path.join(base, "cgroup.subtree_control")).split())
            if not (enabled or _delegated(base)):
                return True, [], f"cgroup v2: {base} is not delegated to this daemon"
            if not os.access(base, os.W_OK):
                return True, [], f"cgroup v2: {base} is read-only here"
            return True, [base], ""
    if all(c in mounts and c in own for c in CONTROLLERS):
        bases = [_on_disk(mounts[c], own[c]) for c in CONTROLLERS]
        for base in bases:
            if not os.access(base, os.W_OK):
                return False, [], f"cgroup v1: {base} is not writable by this daemon"
        return False, bases, ""
    return False, [], "no cgroup hierarchy with the memory and pids controllers is mounted for this daemon"


def describe() -> dict:
    """Where boxes' cgroups would go (``under``, ``version``), or why there
    are none (``why``): for ``rlnode check``, reads only."""
    try:
        v2, bases, why = _locate()
    except OSError as e:
        return {"under": [], "version": 0, "why": f"reading the cgroup tree failed: {e}"}
    return {"under": bases, "version": 2 if v2 else 1, "why": why}


def _probe() -> BoxCgroups:
    v2, bases, why = _locate()
    if not bases:
        return BoxCgroups([], v2, why)
    if v2:
        return BoxCgroups([_v2_vacate(bases[0])], True)
    parents = []
    for base in bases:
        _sweep(base)
        node = os.path.join(base, f"rlnode-{os.getpid()}")
        _remove_tree(node)  # a daemon killed -9 that had this pid before us
        try:
            os.makedirs(node)
        except OSError as e:
            for made in parents:
                _remove_tree(made)
            return BoxCgroups([], False, f"cgroup v1: cannot make {node} ({e.strerror})")
        parents.append(node)
    atexit.register(lambda: [_remove_tree(p) for p in parents])
    return BoxCgroups(parents, False)


def _v2_vacate(base: str) -> str:
    """Enable memory and pids for ``base``'s children; the daemon's own
    processes move to the leaf ``base/daemon`` first (a v2 cgroup that
    hands controllers down holds no process). Boxes go beside it."""
    wanted = set(CONTROLLERS)
    if not wanted <= set(_read(os.path.join(base, "cgroup.subtree_control")).split()):
        leaf = os.path.join(base, "daemon")
        os.makedirs(leaf, exist_ok=True)
        for pid in _read(os.path.join(base, "cgroup.procs")).split():
            try:
                _write(os.path.join(leaf, "cgroup.procs"), pid)
            except ProcessLookupError:
                pass
        _write(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{c}" for c in CONTROLLERS))
    for name in os.listdir(base):
        if name.startswith("box-"):  # a daemon before this one was killed -9
            _remove_tree(os.path.join(base, name))
    return base


def _sweep(base: str) -> None:
    """Remove ``rlnode-PID`` folders of daemons no longer alive."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        head, _, pid = name.partition("-")
        if head == "rlnode" and pid.isdigit() and not _alive(int(pid)):
            _remove_tree(os.path.join(base, name))
