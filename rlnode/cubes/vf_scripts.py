"""Verifiers' PEP 723 scripts, prepared on the host for the walled runtime.

A verifiers harness runs its agent as a PEP 723 script (``prepare_uv_script``:
the null harness's chat program needs ``openai``, ``mcp``, ``httpx`` ...).
Upstream prepares it *inside* the runtime: it writes the script to a shared
scripts directory, ``mv``s it into place, installs ``uv`` with ``pip
--user`` (or curl), and lets ``uv sync --script`` fetch the dependencies.
Inside rlnode's box (``vf_runtime``) none of that can work, and none of it
should: the box has no network, and a scripts directory or uv cache that one
box could write would let one episode's tool calls plant code that every
later episode runs (a way out of the wall across episodes).

So the walled runtime prepares scripts here, outside every box, as the
daemon's user, with the ``uv`` that comes with ``rlnode[verifiers]``:

* the script is written to ``<root>/scripts/<sha256>.py`` (atomically, mode
  0644), where ``<root>`` is ``options.cache_dir`` or, when that is empty,
  ``$CACHE_DIRECTORY`` (systemd's ``CacheDirectory=``), ``$XDG_CACHE_HOME``
  or ``~/.cache``, followed by ``rlnode/verifiers``;
* ``uv sync --script --compile-bytecode`` builds its environment in
  ``<root>/uv`` (uv's cache) for the daemon's own interpreter, once per
  script per process (bytecode compiled here: a read-only environment would
  make every episode's interpreter compile ``openai`` again);
* the box sees ``<root>/scripts``, ``<root>/uv`` and the interpreter's
  installation read-only (``ro_paths``), and runs the script there.

The first preparation of a script on a node resolves its dependencies from
the package index (as any ``pip install`` would; uv reads ``UV_INDEX_URL``,
``UV_OFFLINE``, ``UV_FIND_LINKS`` and proxies from the daemon's
environment); later ones, and every episode, use the cache.

Owns: the cache root, the scripts and uv environments under it. Must not
start anything inside a box (``vf_runtime`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlnode.cubes.wall import isolation
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.vf_scripts")


def cache_root(configured: str = "", environ: dict[str, str] | None = None) -> Path:
    """Where rlnode keeps verifiers' scripts, uv cache and runtime folders:
    ``configured`` (options.cache_dir) or the user's cache directory."""
    if configured:
        return Path(configured).expanduser().absolute()
    environ = os.environ if environ is None else environ
    base = (environ.get("CACHE_DIRECTORY", "").split(":")[0] or environ.get("XDG_CACHE_HOME", "")
            or str(Path.home() / ".cache"))
    return Path(base).absolute() / "rlnode" / "verifiers"


def uv_binary() -> str | None:
    """The uv that comes with rlnode (beside the interpreter), else PATH's."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("uv")


class ScriptError(RuntimeError):
    """A script could not be prepared; the message names the cause and what to change."""


@dataclass(frozen=True)
class PreparedScript:
    path: str  # the script, under <root>/scripts
    interpreter: str  # its environment's python, under <root>/uv


class ScriptCache:
    """PEP 723 scripts and their uv environments under one root, prepared
    once per script per process (concurrent callers wait for the first)."""

    def __init__(self, root: Path):
        self.root = root
        self.scripts_dir = root / "scripts"
        self.uv_cache = root / "uv"
        self.runtimes_dir = root / "runtimes"
        # Every environment is built for the daemon's own interpreter
        # (uv sync --python), so this one installation is all they run from.
        self.python = isolation.interpreter(sys.executable)
        self._prepared: dict[str, PreparedScript] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def make_dirs(self) -> None:
        """The root and its folders, passable and readable by the box's uid."""
        for d in (self.root, self.scripts_dir, self.uv_cache, self.runtimes_dir):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o755)

    def ro_paths(self) -> list[str]:
        """What a box must see (read-only) to run any prepared script."""
        return [str(self.scripts_dir), str(self.uv_cache), os.path.dirname(os.path.dirname(self.python))]

    async def prepare(self, script: bytes, env: dict[str, str] | None = None) -> PreparedScript:
        digest = hashlib.sha256(script).hexdigest()
        if digest in self._prepared:
            return self._prepared[digest]
        async with self._locks.setdefault(digest, asyncio.Lock()):
            if digest not in self._prepared:
                self._prepared[digest] = await self._prepare(digest, script, env or {})
        return self._prepared[digest]

    async def _prepare(self, digest: str, script: bytes, env: dict[str, str]) -> PreparedScript:
        path = self.scripts_dir / f"{digest}.py"
        await asyncio.to_thread(self._write, path, script)
        uv = uv_binary()
        if uv is None:
            raise ScriptError("failed to prepare uv script: uv not found; it comes with rlnode's verifiers "
                              "extra (pip install 'rlnode[verifiers]', or pip install uv)")
        uv_env = {**{k: v for k, v in os.environ.items() if "API_KEY" not in k.upper()}, **env,
                  "UV_CACHE_DIR": str(self.uv_cache), "UV_PYTHON_DOWNLOADS": "never"}
        await self._uv(uv, ["sync", "--script", str(path), "-q", "--no-config", "--compile-bytecode",
                            "--python", self.python], uv_env, digest)
        found = await self._uv(uv, ["python", "find", "--script", str(path), "--no-config"], uv_env, digest)
        interpreter = found.strip().splitlines()[-1]
        log.info("verifiers.script_prepared", script=digest[:12], interpreter=interpreter)
        return PreparedScript(str(path), interpreter)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        if path.is_file() and path.read_bytes() == data:
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    async def _uv(self, uv: str, args: list[str], env: dict[str, str], digest: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            uv, *args, env=env, cwd=str(self.root), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled: uv and what it started go too
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, 9)
                await proc.wait()
        if proc.returncode != 0:
            raise ScriptError(
                f"failed to prepare uv script {digest[:12]} (uv {args[0]} exited {proc.returncode}: "
                f"{err.decode(errors='replace').strip()[-1500:]}): rlnode installs a harness script's "
                f"dependencies on the host into {self.uv_cache}, from the package index the daemon's "
                "environment names (UV_INDEX_URL, proxies; UV_OFFLINE=1 with UV_FIND_LINKS for an offline "
                "node)")
        return out.decode(errors="replace")


__all__ = ["PreparedScript", "ScriptCache", "ScriptError", "cache_root", "uv_binary"]
