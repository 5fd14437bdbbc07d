"""Model folders as other users read them.

Owns: the modes of the model folders rlnode writes (``rlnode tiny-model``,
``rlnode pretrained``, ``rlnode sft``'s ``final/``, a run's policy in each
checkpoint and in ``final/``) and the report of model files the reading
process cannot open. Must not touch: secrets (link keys, tokens), which stay
owner-only where they are written.

Why: the shipped units run the daemon as its own user (``User=rlnode``),
while models are typically built by whoever installed them, often root.
``save_pretrained`` writes ``model.safetensors`` through a temporary file,
so it lands as 0600 whatever the umask, and a folder made with ``mkdtemp``
is 0700: the service user then fails on a file it cannot open, in a message
(vLLM's, transformers') that names a missing file instead.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o755
FILE_MODE = 0o644


def make_readable(folder: str | os.PathLike) -> None:
    """Every directory under ``folder`` (itself included) 0755 and every
    file 0644: a model folder is for every daemon user to read, and nobody
    else's to write. Links are left alone (not followed)."""
    root = Path(folder)
    os.chmod(root, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, DIR_MODE)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


def unreadable(folder: str | os.PathLike) -> list[str]:
    """The files and directories under ``folder`` this process cannot
    read, each as one line naming the path, its mode and owner, and who
    this process runs as (the folder itself included; [] when all read)."""
    root = Path(folder)
    me = os.geteuid() if hasattr(os, "geteuid") else None
    found: list[str] = []

    def note(path: str, what: str) -> None:
        try:
            st = os.stat(path)
            mode, owner = stat.filemode(st.st_mode), _user(st.st_uid)
        except OSError:
            mode, owner = "?", "?"
        found.append(f"{path}: {what} (mode {mode}, owner {owner}; this process runs as {_user(me)})")

    if not os.access(root, os.R_OK | os.X_OK):
        note(str(root), "cannot list")
        return found
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: note(e.filename, "cannot list")):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.exists(path) and not os.access(path, os.R_OK):
                note(path, "cannot read")
        for name in list(dirnames):
            path = os.path.join(dirpath, name)
            if not os.access(path, os.R_OK | os.X_OK):
                note(path, "cannot list")
                dirnames.remove(name)
    return found


def _user(uid: int | None) -> str:
    if uid is None:
        return "?"
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def model_unreadable(path: str, tokenizer: str = "") -> list[str]:
    """``unreadable`` for model.path and a separate model.tokenizer folder,
    each line naming the setting and the fix; [] when every file reads (or
    a folder does not exist: that is reported as such elsewhere)."""
    lines = []
    for key, folder in (("model.path", path), ("model.tokenizer", tokenizer)):
        if folder and os.path.isdir(folder) and (key == "model.path" or folder != path):
            lines += [f"{key}: {line}: make it readable to this user (chmod -R a+rX {folder}), or rebuild it "
                      "with rlnode (its builders write 0644 files in 0755 folders)" for line in unreadable(folder)]
    return lines
