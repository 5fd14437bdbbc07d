"""The wall as the shipped actor unit runs the daemon (issue 46): not root,
no_new_privs, and systemd's read-only overmounts under /proc and /sys
(``ProtectKernelTunables=``), emulated without systemd as PID 1 by
``rlnode/ops/as_unit.py``. There bubblewrap takes its user-namespace
branch, where the kernel refuses a fresh procfs while /proc has locked
overmounts: boxes get an empty /proc instead. The escape tests then run on
that path, as uid 65534, where the box has the test's own kernel uid, so
file modes protect nothing and only the bind view keeps the keys out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from daemons import ROOT
from rlnode.config import load_config
from rlnode.ops.as_unit import UnitError, argv_as_unit, read_unit
from rlnode.cubes.wall import box_cgroup
from rlnode.ops.check import check_wall

UNIT = ROOT / "systemd" / "rlnode-actor@.service"
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="emulating a unit needs root (a mount namespace)")


def test_the_actor_units_restrictions_are_read_from_the_shipped_file(tmp_path):
    unit = read_unit(UNIT)
    assert (unit.user, unit.group, unit.no_new_privileges) == ("rlnode", "rlnode", True)
    assert "/proc/sys" in unit.read_only and "/sys/fs/cgroup" in unit.read_only  # ProtectKernelTunables, ...ControlGroups
    granted = tmp_path / "granted.service"
    granted.write_text("[Service]\nUser=x\nAmbientCapabilities=CAP_SYS_ADMIN\n")
    with pytest.raises(UnitError, match="AmbientCapabilities"):
        read_unit(granted)


def _showing_the_interpreter() -> str:
    """Shell for the unit's namespace, run as root before the drop: where
    the interpreter's installation sits under a folder other users cannot
    pass (root's 0700 home, on this machine), that folder becomes an empty
    0755 tmpfs with the installation bound back in, as a deployed venv
    (/opt/rlnode) is readable by the unit's user. Inside the namespace only."""
    base = Path(os.path.realpath(sys.base_prefix))
    blocked = next((p for p in reversed(base.parents) if p != Path("/") and not os.stat(p).st_mode & 0o001), None)
    if blocked is None:
        return ""
    keep = blocked / base.relative_to(blocked).parts[0]
    return (f"mkdir /mnt/keep && mount --rbind {keep} /mnt/keep && "
            f"mount -t tmpfs -o mode=0755 tmpfs {blocked} && mkdir {keep} && mount --move /mnt/keep {keep}")


# Inside the unit's namespace: a tmpfs on /mnt, the unit user's home and
# temporary files in it (the unit's StateDirectory and PrivateTmp stand-in):
# short enough for vLLM's socket paths, and gone with the namespace.
NOBODY_HOME = "/mnt/home"
PRELUDE_HOME = f"mount -t tmpfs -o mode=0755 tmpfs /mnt && mkdir -m 0700 {NOBODY_HOME} && chown {NOBODY}:{NOBODY} {NOBODY_HOME}"


def _prelude() -> str:
    return " && ".join(p for p in (PRELUDE_HOME, _showing_the_interpreter()) if p)


@needs_root
def test_rlnode_check_probes_the_wall_as_the_unit_runs_it():
    """A config with an agent cube: `rlnode check --as-unit` finds the boxes
    start (user namespace, empty /proc: a warning that names the unit
    setting); a unit user the machine lacks is a failure naming it."""
    cfg = load_config(str(ROOT / "conf" / "demo.toml"),
                      ['actor.cubes=[{id = "agent", kind = "openai-agent", options = {command = ["true"]}}]'])
    found, groups = check_wall(cfg, "actor", str(UNIT), "nobody", prelude=_prelude())
    assert found.level == "WARN", found
    assert "uid 65534 in a user namespace" in found.detail and "ProtectKernelTunables" in found.detail
    # The unit's read-only cgroup tree: no box cgroups, said with the settings that give them.
    assert groups.level == "WARN" and "no cgroup of their own" in groups.detail, groups
    assert "Delegate=memory pids" in groups.detail and "ProtectControlGroups=no" in groups.detail
    (missing,) = check_wall(cfg, "actor", str(UNIT))  # User=rlnode: not on this machine
    assert missing.level == "FAIL" and "User=rlnode" in missing.detail and "--unit-user" in missing.detail
    here, groups = check_wall(cfg, "actor")  # as root: privileged bwrap, a fresh uid per run
    assert here.level == "ok" and "fresh uid" in here.detail, here
    if box_cgroup.describe()["under"]:  # a root daemon on this host makes box cgroups
        assert groups.level == "ok" and "capped as a whole" in groups.detail, groups


# The escape tests, each run as a function agent's worker and as a command:
# /proc and environment of the daemon, a secret file, the run dir, the link
# port, the internet, writing outside /tmp (agent_wall); the node's real
# CURVE keys, and its Register and GroupDelivery under them; and snippets
# (python-math's sandbox) writing, forking, allocating and connecting.
ESCAPES = ["tests/test_agent_wall.py::test_an_agent_reaches_the_gateway_and_nothing_else",
           "tests/test_agent_wall.py::test_an_agent_cannot_take_the_nodes_link_keys",
           "tests/test_sandbox.py::test_unhooked_writes_land_only_in_the_private_tmpfs",
           "tests/test_sandbox.py::test_unhooked_socket_cannot_reach_the_hosts_loopback",
           "tests/test_sandbox.py::test_unhooked_fork_bomb_is_contained"]


# What the nested run keeps of this session's environment.
UNIT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "VLLM_CONFIGURE_LOGGING")


@needs_root
@pytest.mark.engine
def test_the_escape_tests_pass_as_the_actor_unit_runs_them():
    """The wall's escape tests, in a pytest run as the unit runs the daemon
    (uid 65534, no_new_privs, the unit's overmounts). Before boxes could do
    without a procfs, every one failed here: the cube refused to start
    ("bwrap: Can't mount proc on /newroot/proc")."""
    if not os.path.isdir("/mnt"):
        pytest.skip("no /mnt to put the unit user's home on")
    # A unit's environment is its own, not this session's: caches the
    # session's torch set for itself (TORCHINDUCTOR_CACHE_DIR, in root's
    # 0700 session folder) must not follow (CI at 456f38f failed on that).
    env = {k: v for k, v in os.environ.items() if k in UNIT_ENV or k.startswith("LC_")}
    env.update(HOME=NOBODY_HOME, TMPDIR=NOBODY_HOME, RLNODE_TEST_TMP_ROOT=NOBODY_HOME, CI="true")
    argv = argv_as_unit(read_unit(UNIT), [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          "-p", "no:xdist", "-W", "ignore::DeprecationWarning", *ESCAPES],
                        user="nobody", prelude=_prelude())
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.search(r"\b7 passed\b", summary) and "skipped" not in summary, summary
