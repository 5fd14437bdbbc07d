"""Run a command as a systemd unit would run it, without systemd as PID 1:
what ``rlnode check --as-unit UNIT`` and the suite's unit tests use to see
the wall (``rlnode/cubes/wall/isolation.py``) the way a shipped unit's daemon
sees it.

Emulated, from the unit file's ``[Service]`` section:

* ``User=`` / ``Group=``: the command runs as that uid and gid, with no
  supplementary groups and no capabilities (a non-root ``User=`` has none
  unless ``AmbientCapabilities=`` grants them; that key is refused here);
* ``NoNewPrivileges=``: no_new_privs;
* ``ProtectKernelTunables=``, ``ProtectControlGroups=``,
  ``ProtectKernelLogs=``: the read-only and inaccessible overmounts systemd
  makes under /proc and /sys (the paths below), in a private mount namespace.

These are what decide whether bubblewrap can build a box. The filesystem
settings (``ProtectSystem=``, ``ProtectHome=``, ``PrivateTmp=``,
``ReadWritePaths=``) and seccomp filters are not emulated: they change which
paths the daemon may write, which ``rlnode check``'s file findings cover as
that user. Needs root (it makes a mount namespace).
"""

from __future__ import annotations

import configparser
import grp
import os
import pwd
import shlex
from pathlib import Path

import msgspec

# The overmounts systemd makes for each setting (its namespace.c tables):
# made read-only, or hidden (inaccessible). Paths this kernel lacks are skipped.
PROTECT_KERNEL_TUNABLES_RO = (
    "/proc/acpi", "/proc/apm", "/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/latency_stats",
    "/proc/mtrr", "/proc/scsi", "/proc/sys", "/proc/sysrq-trigger", "/proc/timer_stats", "/sys")
PROTECT_KERNEL_TUNABLES_HIDDEN = ("/proc/kallsyms", "/proc/kcore")
PROTECT_CONTROL_GROUPS_RO = ("/sys/fs/cgroup",)
PROTECT_KERNEL_LOGS_HIDDEN = ("/proc/kmsg", "/dev/kmsg")


class UnitError(ValueError):
    """A unit file this emulation cannot run as its unit would."""


class UnitRestrictions(msgspec.Struct, frozen=True):
    """What of a unit's ``[Service]`` section decides the wall's start."""

    path: str
    user: str
    group: str
    no_new_privileges: bool
    read_only: tuple[str, ...]
    hidden: tuple[str, ...]


def _yes(value: str) -> bool:
    return value.strip().lower() in ("1", "yes", "true", "on")


def read_unit(path: str | Path) -> UnitRestrictions:
    """The restrictions of the unit file at ``path`` (a template's ``%i``
    needs no value: no emulated key uses it)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                       comment_prefixes=("#", ";"))
    parser.optionxform = str  # systemd's keys are case-sensitive
    try:
        with open(path) as f:
            parser.read_file(f)
    except (OSError, configparser.Error) as e:
        raise UnitError(f"{path}: cannot read the unit: {e}") from e
    if not parser.has_section("Service"):
        raise UnitError(f"{path}: no [Service] section")
    service = parser["Service"]
    if service.get("AmbientCapabilities", "").strip():
        raise UnitError(f"{path}: AmbientCapabilities= is not emulated; check the wall by running the unit itself")
    user = service.get("User", "root").strip()
    read_only: list[str] = []
    hidden: list[str] = []
    if _yes(service.get("ProtectKernelTunables", "no")):
        read_only += PROTECT_KERNEL_TUNABLES_RO
        hidden += PROTECT_KERNEL_TUNABLES_HIDDEN
    if _yes(service.get("ProtectControlGroups", "no")):
        read_only += PROTECT_CONTROL_GROUPS_RO
    if _yes(service.get("ProtectKernelLogs", "no")):
        hidden += PROTECT_KERNEL_LOGS_HIDDEN
    return UnitRestrictions(str(path), user, service.get("Group", "").strip() or user,
                            _yes(service.get("NoNewPrivileges", "no")), tuple(read_only), tuple(hidden))


def ids(unit: UnitRestrictions, user: str | None = None) -> tuple[int, int]:
    """The uid and gid the unit runs as (``user``: another user in its place,
    for a machine without the unit's); UnitError naming a missing one."""
    name = user or unit.user
    try:
        uid = int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid
        if user is not None:  # that user's own primary group
            gid = uid if name.isdigit() else pwd.getpwnam(name).pw_gid
        else:
            gid = int(unit.group) if unit.group.isdigit() else grp.getgrnam(unit.group).gr_gid
    except KeyError as e:
        raise UnitError(f"{unit.path}: User={name} (or its group) does not exist on this machine: create it "
                        "(README, multi-node) or name another with --unit-user") from e
    return uid, gid


def argv_as_unit(unit: UnitRestrictions, argv: list[str], *, user: str | None = None, prelude: str = "") -> list[str]:
    """``argv`` wrapped to run under ``unit``'s restrictions: a private mount
    namespace with its overmounts, then ``setpriv`` to its user. ``prelude``:
    shell run as root inside the namespace before the overmounts (a test
    showing the interpreter where the unit's user can reach it). The
    namespace, and every mount in it, ends with the command."""
    if os.geteuid() != 0:
        raise UnitError("emulating a unit needs root (it makes a mount namespace and switches user)")
    uid, gid = ids(unit, user)
    # An overmount per path: a bind of itself, made read-only; a hidden one
    # gets an empty read-only tmpfs (a directory) or /dev/null (a file).
    script = ["set -e", prelude] if prelude else ["set -e"]
    for p in unit.read_only:
        q = shlex.quote(p)
        script.append(f"if [ -e {q} ]; then mount --bind {q} {q} && mount -o remount,bind,ro {q}; fi")
    for p in unit.hidden:
        q = shlex.quote(p)
        script.append(f"if [ -d {q} ]; then mount -t tmpfs -o ro,mode=000 none {q}; "
                      f"elif [ -e {q} ]; then mount --bind /dev/null {q}; fi")
    drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all"] + (["--no-new-privs"] if unit.no_new_privileges else [])
    script.append(f'exec {shlex.join(drop)} -- "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(script), "sh", *argv]


async def probe_wall() -> dict:
    """The wall as this process's user sees it: whether bubblewrap boxes
    start, whether they get a procfs of their own, and why not; where
    boxes' cgroups would go, or why there are none."""
    import sys

    from rlnode.cubes.wall import isolation

    from rlnode.cubes.wall import box_cgroup

    works = await isolation.works("bwrap", sys.executable)
    return {"works": works, "fresh_procfs": isolation.fresh_procfs() if works else None,
            "why": "" if works else isolation.why_not("bwrap", sys.executable), "uid": os.geteuid(),
            "box_cgroups": box_cgroup.describe()}


if __name__ == "__main__":
    # `python -m rlnode.ops.as_unit`: the wall probe, as JSON, run by
    # `rlnode check --as-unit` inside the emulated unit.
    import asyncio
    import json

    print(json.dumps(asyncio.run(probe_wall())))
