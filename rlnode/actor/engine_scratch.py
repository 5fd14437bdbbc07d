"""An engine's scratch directory: where its processes put their RPC
sockets and temporary files, removed with the engine, and swept when the
daemon that made it is gone. ``engine.Engine`` makes and removes it;
``engine_env.engine_process_env`` points the processes at it.
"""

from __future__ import annotations

import os

from rlnode.log import get_logger

log = get_logger("rlnode.engine")


# vLLM's processes leave files behind in the temporary directory: a ZeroMQ
# socket per IPC channel (``VLLM_RPC_BASE_PATH``/<uuid>, several per engine
# start) and gloo's ``vllm_dist_<hex>`` rendezvous file. Nothing removes them
# once a process is killed, and an engine's own shutdown does not remove them
# all either: a host that restarts its actor for weeks fills /tmp with
# thousands (3,000 were counted on one test machine). Each engine therefore
# gets a scratch directory of its own, named after the daemon's pid, which
# its processes use as RPC base path and TMPDIR; the engine removes it when
# it has shut down, and an engine start removes those of daemons that are
# gone (killed -9: nothing of theirs ran at exit).
SCRATCH_PREFIX = "rlnode-engine-"
# A unix socket's path is at most 107 bytes; vLLM appends "/<uuid4>" (37).
_MAX_SOCKET_PATH = 107


def inductor_home() -> str:
    """Torch Inductor's default cache directory as this process sees it,
    ``<temporary directory>/torchinductor_<user>`` (the same rule as torch's
    ``cache_dir_utils.default_cache_dir``), before an engine's TMPDIR moves it."""
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def scratch_env(scratch: str) -> dict[str, str]:
    """The engine processes' environment for their scratch directory. Torch
    Inductor's compile cache stays where it was (it defaults to TMPDIR, and
    a cache removed with every engine would recompile at every start); its
    precompiled headers follow TMPDIR whatever the cache says, and
    make_engine_scratch links them back (see there)."""
    env = {"VLLM_RPC_BASE_PATH": scratch, "TMPDIR": scratch}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        env["TORCHINDUCTOR_CACHE_DIR"] = inductor_home()
    return env


def make_engine_scratch(engine_id: int) -> str:
    """A new scratch directory for engine ``engine_id`` of this process,
    under the operator's VLLM_RPC_BASE_PATH when set, else the temporary
    directory. ValueError when vLLM's socket paths would not fit in it."""
    import tempfile

    tempfile.gettempdir()  # cached now, so our engine's TMPDIR never becomes this process's
    parent = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    sweep_engine_scratch(parent)
    path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-{engine_id}-", dir=parent)
    if len(os.fsencode(path)) + 37 > _MAX_SOCKET_PATH:
        os.rmdir(path)
        raise ValueError(f"engine scratch directory {path!r} is too long for vLLM's unix sockets "
                         f"(at most {_MAX_SOCKET_PATH - 37} bytes): set TMPDIR or VLLM_RPC_BASE_PATH "
                         f"to a shorter directory")
    # Inductor keeps its precompiled C++ header under <TMPDIR>/torchinductor_
    # <user>/precompiled_headers (codecache._HEADER_DIR: deliberately not
    # TORCHINDUCTOR_CACHE_DIR), and the engine's first CPU step builds it when
    # it is missing: 15 s of g++ on 2 idle cores, over 30 s under load, while
    # the engine core answers nothing, weight pushes included (a 30 s push
    # timeout failed in CI that way). In a scratch removed with its engine,
    # every engine start paid it again. This link puts the header where it
    # would be without our TMPDIR, shared by every engine start; rmtree
    # removes a link, not what it points to.
    home = inductor_home()
    try:
        os.makedirs(home, exist_ok=True)
        os.symlink(home, os.path.join(path, os.path.basename(home)), target_is_directory=True)
    except OSError as e:  # slower first steps, nothing worse
        log.warning("engine.inductor_header_not_shared", home=home, error=repr(e))
    return path


def sweep_engine_scratch(parent: str) -> list[str]:
    """Remove the scratch directories under ``parent`` whose daemon is no
    longer running (its pid is gone). Returns what was removed."""
    removed = sweep_dead_dirs(parent, SCRATCH_PREFIX)
    if removed:
        log.info("engine.scratch_swept", removed=removed)
    return removed


def sweep_dead_dirs(parent: str, prefix: str) -> list[str]:
    """Remove the directories ``prefix<pid>-...`` under ``parent`` whose
    process is gone (a daemon killed with -9 never removes its own)."""
    import shutil

    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
