"""OS-level isolation of sandboxed snippets: which layer wraps the child, and
its command line. The security boundary of ``rlnode.cubes.wall.sandbox`` lives
here; the bootstrap's audit hook there is only a friendly error message.

Owns: the choice of layer (probed per interpreter and layer; a definite
answer is cached for the process, a timed-out probe is not: the next run
probes again with a longer timeout; the choice logged once, a downgrade
from bwrap under ``auto`` logged as a warning with its reason), the argv prefix that puts the interpreter inside it, and the
uid the snippet runs as. Must not touch the caller's process (no rlimits,
uid or cwd changes here: every restriction is applied by the wrapper or by
the child's bootstrap before the snippet's first instruction).

Layers, strongest first (``SandboxLimits.isolation``):

* ``bwrap``: bubblewrap. New pid, net (loopback only), ipc, uts (and cgroup)
  namespaces; a read-only view of /usr, /lib*, /bin and the Python
  installation (its site-packages hidden) and nothing else: no /etc, /home,
  /root, /work, run dir or daemon files; /proc of the new pid namespace
  (or an empty /proc where the kernel refuses that mount: ``_fresh_procfs``); a
  minimal /dev; a size-bounded private tmpfs /tmp holding the working dir,
  the only writable place. Empty environment but PATH/LC_ALL/HOME/TMPDIR:
  the caller starts bwrap with exactly that environment, which bwrap hands
  to the child. Never ``--setenv``: bwrap's argv is readable by every local
  user in /proc/PID/cmdline, and an agent's environment holds its episode
  key.
  The snippet's kernel uid is unprivileged, so RLIMIT_NPROC holds: a
  root daemon runs bwrap privileged (no user namespace) and ``setpriv``
  switches to a fresh uid from ``UID_BASE`` (one per run, so concurrent runs
  do not share a process count) with no capabilities, an empty bounding set
  and no_new_privs; a non-root daemon (the systemd units' user) runs bwrap
  in a user namespace as 65534, where the kernel counts processes per
  namespace. That uid is the daemon's own kernel uid outside the box, so
  file modes protect nothing there: the bind view is the wall, and no box
  is shown a guarded path (``guard_paths``; docs/security.md). ``--die-with-
  parent`` and the pid namespace end every process of the run when bwrap
  dies.
* ``unshare``: util-linux ``unshare`` (root only): new net, pid (own /proc),
  ipc and uts namespaces and the bootstrap's drop to 65534 (nobody); files
  are protected only by nobody's permissions, not by a private view.
* ``none``: the bare child, as the daemon's user. Only as an explicit
  operator choice; logged as an error at first use.

``auto`` takes the first layer that works and refuses (SandboxError) when
neither does: snippets never run behind the audit hook alone by default.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import shutil
import sys
import sysconfig
from typing import Literal

import msgspec

from rlnode.log import get_logger

log = get_logger("rlnode.cubes.wall.sandbox")

Isolation = Literal["auto", "bwrap", "unshare", "none"]
Layer = Literal["bwrap", "unshare", "none"]

# uid/gid 65534: the kernel's overflow id, "nobody" everywhere.
NOBODY = 65534
# Kernel uids for snippets of a root daemon under bwrap: one drawn per run
# from [UID_BASE, UID_BASE + UID_SPAN), owned by no file on the host.
UID_BASE, UID_SPAN = 1_200_000_000, 1 << 24


class SandboxUnavailable(RuntimeError):
    """No isolation layer that the configuration allows works on this host."""


class ShownPathRefused(ValueError):
    """A path to be shown in a box is, holds or lies inside a guarded one."""


# Paths no box may be shown, {config key: real path}: the run dir (link keys,
# checkpoints), the key folder, the HTTP token file, the Hugging Face cache
# (its token). The actor daemon sets them at start (``guard_paths``); every
# agent box checks what it shows against them (``agent_prefix``). A box under
# the units has the daemon's kernel uid (docs/security.md), so the bind view
# is all that keeps these out.
_guarded: dict[str, str] = {}


def guard_paths(paths: dict[str, str]) -> None:
    """Set the guarded paths (empty values skipped), replacing earlier ones."""
    _guarded.clear()
    _guarded.update({key: os.path.realpath(path) for key, path in paths.items() if path})


def shown_conflict(path: str) -> str | None:
    """``KEY (PATH)`` of the guarded path that showing ``path`` would show
    (the same, inside it, or holding it), or None. Resolved as bwrap binds
    it: through symlinks."""
    shown = os.path.realpath(path)
    for key, guarded in _guarded.items():
        if shown == guarded or shown.startswith(guarded + "/") or guarded.startswith(shown.rstrip("/") + "/"):
            return f"{key} ({guarded})"
    return None


class Wrap(msgspec.Struct, frozen=True):
    layer: Layer
    # argv that precedes the interpreter's own argv.
    prefix: list[str]
    # uid the bootstrap drops to (-1: none; the wrapper did or there is no need).
    drop_uid: int
    network_isolated: bool
    privileges_dropped: bool


# {(layer, exe): works}: definite probe answers only, once per interpreter.
_works: dict[tuple[str, str], bool] = {}
# Seconds a probe may take. A probe starts an interpreter inside the layer:
# well under a second when idle, but a loaded host (a training step on every
# core) can stretch it past any fixed bound, so a timeout is not an answer:
# each timed-out probe doubles the next one's bound, up to PROBE_TIMEOUT_MAX_S.
PROBE_TIMEOUT_S = 10.0
PROBE_TIMEOUT_MAX_S = 120.0
_probe_timeout: dict[tuple[str, str], float] = {}
# Why each layer last failed its probe, for the downgrade warning and errors.
_why: dict[tuple[str, str], str] = {}
# Choices (and downgrades) already logged, so each appears once per process.
_logged: set[tuple[str, ...]] = set()
# Whether bwrap may mount a fresh procfs for the box (False once a probe saw
# the kernel refuse it). In a user namespace (a non-root daemon) the kernel
# mounts proc only while the caller's /proc is fully visible; systemd's
# ProtectKernelTunables= (and a container's masked /proc) overmounts parts of
# it read-only, so under the shipped units the mount fails. The box then has
# an empty /proc: no process of its own or anyone's is visible, so it is no
# weaker, but programs that read /proc/self see nothing
# (docs/security.md, "Under the systemd units").
_fresh_procfs = True
PROC_REFUSED = "Can't mount proc"


def interpreter(exe: str) -> str:
    """The real interpreter binary (a venv's ``python`` is a symlink to it)."""
    return os.path.realpath(exe)


def _python_dirs(real_exe: str) -> tuple[list[str], list[str]]:
    """Directories to show read-only (the installation) and to hide under an
    empty tmpfs (its site-packages: -S never loads them)."""
    base = os.path.realpath(sys.base_prefix)
    show = [base]
    exe_dir = os.path.dirname(os.path.dirname(real_exe))
    if not real_exe.startswith(base + "/"):
        show.append(exe_dir)
    hide = []
    for root in show:
        for key in ("purelib", "platlib"):
            p = os.path.realpath(sysconfig.get_path(key, vars={"base": root, "platbase": root}))
            if os.path.isdir(p) and p not in hide:
                hide.append(p)
    return [d for d in show if not d.startswith("/usr/")], hide


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


@functools.cache
def _bwrap_bin() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def _unshare_bin() -> str | None:
    return shutil.which("unshare")


@functools.cache
def _setpriv_bin() -> str | None:
    return shutil.which("setpriv")


def _bwrap_head(root: bool) -> list[str]:
    """bwrap, its namespaces and the system's read-only view: what snippets
    and agents share. No environment here: the caller starts bwrap with the
    child's (allowlisted) environment, which bwrap passes on, so no value
    is ever on an argv (/proc/PID/cmdline is world-readable)."""
    bwrap = _bwrap_bin()
    if bwrap is None:
        raise SandboxUnavailable("bwrap not found: install bubblewrap (apt-get install bubblewrap)")
    args = [bwrap, "--die-with-parent", "--new-session"]
    if root:
        # Privileged bwrap, no user namespace: setpriv (_drop_privileges)
        # moves the child to an unprivileged kernel uid, where RLIMIT_NPROC holds.
        args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    return args + _system_binds()


def bwrap_prefix(real_exe: str, workdir: str, tmp_bytes: int) -> list[str]:
    """bwrap argv for one run; ``workdir`` is the path inside, on the tmpfs.
    Start it with the child's environment (``env=``), never more."""
    root = os.geteuid() == 0
    args = _bwrap_head(root)
    show, hide = _python_dirs(real_exe)
    args += _ro_binds(show)
    for d in hide:
        args += ["--tmpfs", d]
    args += [*_proc_args(), "--dev", "/dev",
             "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
             "--perms", "0777", "--dir", workdir, "--chdir", workdir, "--remount-ro", "/", "--"]
    return args + _drop_privileges(root)


def _proc_args() -> list[str]:
    """The box's /proc: a fresh procfs of its own pid namespace, or (where the
    kernel refuses that mount, ``_fresh_procfs``) an empty directory."""
    return ["--proc", "/proc"] if _fresh_procfs else ["--dir", "/proc"]


def _ro_binds(paths: list[str], rw: tuple[str, ...] = ()) -> list[str]:
    """Read-only binds of ``paths`` (and read-write ones of ``rw``), their
    parents made passable first."""
    args: list[str] = []
    for d in [*paths, *rw]:
        # bwrap would create missing parents with the host's modes (/root is
        # 0700): the sandbox's uid must be able to pass through them.
        parents, p = [], d
        while (p := os.path.dirname(p)) != "/":
            parents.insert(0, p)
        for parent in parents:
            args += ["--perms", "0755", "--dir", parent]
    for d in paths:
        args += ["--ro-bind", d, d]
    for d in rw:
        args += ["--bind", d, d]
    return args


def fresh_uid() -> int:
    """A kernel uid for one run of a root daemon's box, owned by no file."""
    return UID_BASE + random.randrange(UID_SPAN)


def _drop_privileges(root: bool, uid: int | None = None) -> list[str]:
    """setpriv to ``uid`` (default a fresh one) with no capabilities (a root
    daemon's privileged bwrap); nothing for a user-namespace bwrap."""
    if not root:
        return []
    setpriv = _setpriv_bin()
    if setpriv is None:
        raise SandboxUnavailable("setpriv (util-linux) not found")
    uid = str(fresh_uid() if uid is None else uid)
    return [setpriv, "--reuid", uid, "--regid", uid, "--clear-groups", "--bounding-set", "-all",
            "--inh-caps", "-all", "--no-new-privs", "--"]


AGENT_PUBLIC_ETC = ("/etc/ssl/certs", "/etc/ssl/openssl.cnf", "/etc/ca-certificates", "/etc/pki/tls/certs",
                    "/etc/hosts", "/etc/nsswitch.conf", "/etc/localtime")


def agent_prefix(env: dict[str, str], ro_paths: list[str], chdir: str, tmp_bytes: int,
                 rw_paths: tuple[str, ...] = (), uid: int | None = None) -> list[str]:
    """bwrap argv for an agent (``rlnode/cubes/wall/agent_sandbox.py``): the
    snippets' namespaces (pid, net with loopback only, ipc, uts) and fresh
    unprivileged uid, but with the Python installation whole (an agent
    imports its SDKs) and ``ro_paths`` (the agent's own files, the gateway
    relay's socket) read-only. Writable: a size-bounded /tmp and
    ``rw_paths`` (a verifiers runtime's working directory, owned by
    ``uid``: the box's kernel uid when the daemon is root, else its own).
    ``env`` is the environment bwrap will be started with (read here for
    its CA paths only: it is never put on the argv)."""
    root = os.geteuid() == 0
    args = _bwrap_head(root)
    # The private /tmp first: shown paths under the host's /tmp (the gateway
    # relay's socket) are bound over it, not hidden by it.
    args += [*_proc_args(), "--dev", "/dev", "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    # Public system files SDKs read at import (CA bundles for the SSL context
    # httpx builds even for a plain-HTTP gateway; hosts for "localhost").
    public = [p for p in AGENT_PUBLIC_ETC if os.path.exists(p)]
    public += [p for p in (env.get("SSL_CERT_FILE"), env.get("SSL_CERT_DIR")) if p and os.path.exists(p)]
    for path in [*ro_paths, *rw_paths, chdir]:
        if conflict := shown_conflict(path):
            raise ShownPathRefused(f"{path} would show {conflict} to the box")
    ro_paths = [*ro_paths, *public]
    pys = {os.path.realpath(sys.base_prefix), os.path.abspath(sys.prefix)}
    shown = sorted({p for p in pys | {os.path.abspath(p) for p in ro_paths} if not p.startswith("/usr/")})
    # A path inside another shown one is shown by it already.
    shown = [p for p in shown if not any(p.startswith(q + "/") for q in shown)]
    args += _ro_binds(shown, rw_paths)
    args += ["--perms", "0777", "--dir", "/tmp/home", "--chdir", chdir, "--remount-ro", "/", "--"]
    return args + _drop_privileges(root, uid)


def unshare_prefix() -> list[str]:
    unshare = _unshare_bin()
    if unshare is None or os.geteuid() != 0:
        raise SandboxUnavailable("unshare needs root here")
    return [unshare, "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc", "--"]


class OutputTail:
    """A child's output, read as it comes and dropped but for the last
    ``limit`` bytes: a flood costs the daemon no memory."""

    def __init__(self, limit: int = 4096):
        self.limit, self.tail, self.total = limit, bytearray(), 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.total += len(chunk)
            self.tail += chunk[-self.limit:]
            del self.tail[:-self.limit]

    def text(self) -> str:
        return self.tail.decode(errors="replace").strip()


async def _exits_zero(argv: list[str], timeout_s: float) -> tuple[bool | None, str]:
    """Run a probe command: (True, "") when it exits 0, (False, the last line
    of its stderr) when it fails, (None, "") when it is still running after
    ``timeout_s`` (killed: no answer)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, cwd="/", start_new_session=True, env=PROBE_ENV)
    except OSError as e:
        return False, str(e)
    try:
        async with asyncio.timeout(timeout_s):
            # A probe's stderr is a line or a traceback: its tail says why.
            err_tail = OutputTail(PROBE_STDERR_BYTES)
            await err_tail.drain(proc.stderr)
            ok = await proc.wait() == 0
    except TimeoutError:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        await proc.wait()
        return None, ""
    lines = [line.strip() for line in err_tail.text().splitlines() if line.strip()]
    return ok, "" if ok else (lines[-1] if lines else f"exit status {proc.returncode}")


def _probe_argv(layer: Layer, real_exe: str) -> list[str]:
    # The probe imports what snippets need, as the uid they will run as, and
    # checks that the interpreter found its own stdlib (not the host's).
    if layer == "bwrap":
        prefix = bwrap_prefix(real_exe, "/tmp/probe", 1 << 20)
        code = f"import fractions, json.decoder, sys; assert sys.prefix == {sys.base_prefix!r}"
        return [*prefix, real_exe, "-I", "-S", "-B", "-c", code]
    code = (f"import posix; posix.setgroups([]); posix.setgid({NOBODY}); posix.setuid({NOBODY}); "
            "import fractions, json.decoder")
    return [*unshare_prefix(), real_exe, "-I", "-S", "-B", "-c", code]


# A probe's whole environment (it runs as the sandboxed child would).
PROBE_ENV = {"PATH": "/usr/bin:/bin"}
PROBE_STDERR_BYTES = 64 << 10


def _hint(stderr: str) -> str:
    """The setting behind a bwrap error a host commonly gives, or ""."""
    if "namespace" in stderr or "uid map" in stderr:
        return ("; unprivileged user namespaces look disabled here (sysctls user.max_user_namespaces, "
                "kernel.unprivileged_userns_clone, or Ubuntu's kernel.apparmor_restrict_unprivileged_userns "
                "without an AppArmor profile for bwrap): allow them, or run the daemon as root")
    return ""


async def works(layer: Layer, exe: str) -> bool:
    """Whether ``layer`` runs ``exe`` here; when not, ``_why`` says why."""
    global _fresh_procfs
    key = (layer, exe)
    if key in _works:
        return _works[key]
    try:
        argv = _probe_argv(layer, interpreter(exe))
    except SandboxUnavailable as e:
        ok: bool | None = False
        _why[key] = f"{layer}: {e}"
    else:
        timeout_s = _probe_timeout.get(key, PROBE_TIMEOUT_S)
        ok, err = await _exits_zero(argv, timeout_s)
        if not ok and layer == "bwrap" and PROC_REFUSED in err and _fresh_procfs:
            # The kernel refused the box a procfs (see _fresh_procfs): the
            # same box with an empty /proc.
            _fresh_procfs = False
            ok, err = await _exits_zero(_probe_argv(layer, interpreter(exe)), timeout_s)
            if ok:
                log.warning("sandbox.no_procfs", reason=f"bwrap: {PROC_REFUSED.lower()} in a user namespace",
                            effect="boxes get an empty /proc: programs that read /proc/self see nothing",
                            fix="run the daemon without read-only overmounts under /proc (the actor unit's "
                                "ProtectKernelTunables=; see docs/security.md), or as root")
            else:
                _fresh_procfs = True
        if ok is None:
            # Not cached: a slow probe says the host is busy, not that the
            # layer is broken. The next run asks again, allowing longer.
            _probe_timeout[key] = min(2 * timeout_s, PROBE_TIMEOUT_MAX_S)
            _why[key] = f"{layer}: probe timed out after {timeout_s:g} s"
            return False
        if not ok:
            _why[key] = f"{layer}: probe failed ({err}){_hint(err)}"
    _works[key] = ok  # concurrent first calls may both probe; they agree
    return ok


def fresh_procfs() -> bool:
    """Whether boxes get a procfs of their own (after a bwrap probe)."""
    return _fresh_procfs


def why_not(layer: Layer, exe: str) -> str:
    """Why ``layer`` failed its last probe for ``exe`` (after ``works``)."""
    return _why.get((layer, exe), f"{layer} does not run here")


async def choose(requested: Isolation, exe: str) -> Layer:
    """The layer for ``requested``, or SandboxUnavailable; logged once."""
    if requested == "none":
        layer: Layer = "none"
    else:
        candidates: tuple[Layer, ...] = ("bwrap", "unshare") if requested == "auto" else (requested,)
        failed: list[str] = []
        for layer in candidates:
            if await works(layer, exe):
                break
            failed.append(_why.get((layer, exe), layer))
        else:
            if any("timed out" in f for f in failed):
                raise SandboxUnavailable(
                    f"no OS isolation for this snippet (isolation={requested!r}; {'; '.join(failed)}): the "
                    "host was too busy to answer the probe; it is probed again on the next run")
            raise SandboxUnavailable(
                f"no OS isolation for snippets (isolation={requested!r}; {'; '.join(failed)}): fix that "
                "(`rlnode check` probes it), or set isolation = \"none\" to run snippets unisolated, as the "
                "daemon's user")
        if failed:
            # auto took a weaker layer than it prefers: files are then
            # protected by nobody's permissions only. Never silent; once per
            # reason (a timed-out probe is retried, so it can recur).
            reason = "; ".join(failed)
            if (requested, layer, reason) not in _logged:
                _logged.add((requested, layer, reason))
                log.warning("sandbox.isolation_downgraded", requested=requested, layer=layer, reason=reason,
                            key="sandbox.isolation")
    if (requested, layer) not in _logged:
        _logged.add((requested, layer))
        if layer == "none":
            log.error("sandbox.isolation", layer=layer, requested=requested,
                      warning="snippets run UNISOLATED as the daemon's user; the audit hook is no boundary")
        else:
            log.info("sandbox.isolation", layer=layer, requested=requested)
    return layer


def wrap(layer: Layer, exe: str, workdir: str, tmp_bytes: int) -> Wrap:
    """How to start one run under ``layer`` (already chosen by ``choose``);
    the caller starts it with the child's environment."""
    if layer == "bwrap":
        return Wrap("bwrap", bwrap_prefix(interpreter(exe), workdir, tmp_bytes), -1, True, True)
    if layer == "unshare":
        return Wrap("unshare", unshare_prefix(), NOBODY, True, True)
    return Wrap("none", [], -1, False, False)
