"""Model folders as the shipped units' user reads them (issue 46): what
rlnode builds is readable by every user, and a model file the daemon
cannot read stops it at start with the path, its mode and the fix, where
vLLM would report a missing file minutes later."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from daemons import ROOT
from rlnode.model_files import make_readable, model_unreadable, unreadable

NOBODY = 65534


def modes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): stat.filemode(p.stat().st_mode) for p in sorted(folder.rglob("*"))}


def test_the_tiny_model_and_a_saved_policy_are_readable_by_every_user(tmp_path):
    """save_pretrained writes model.safetensors 0600 through a temporary
    file, whatever the umask: the builders and the checkpoint's policy
    make every file 0644 and every folder 0755."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlnode.tiny_model import build_tiny_model
    from rlnode.trainer.checkpoint import save_hf_policy

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    policy = tmp_path / "policy"
    policy.mkdir(mode=0o700)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_hf_policy(model, str(model_dir), policy)
    for folder in (model_dir, policy):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        got = modes(folder)
        assert "model.safetensors" in got and "config.json" in got, got
        assert set(got.values()) == {"-rw-r--r--"}, got


def test_make_readable_leaves_links_alone(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x")
    secret.chmod(0o600)
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True, mode=0o700)
    (folder / "sub" / "w.bin").write_bytes(b"w")
    (folder / "sub" / "w.bin").chmod(0o600)
    (folder / "link").symlink_to(secret)
    make_readable(folder)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600  # the link's target is not ours to open up
    assert stat.S_IMODE((folder / "sub").stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / "sub" / "w.bin").stat().st_mode) == 0o644


def _reachable_by_all(path: Path) -> None:
    """Let other users traverse to ``path`` (pytest's folders are 0700)."""
    for p in [path, *path.parents]:
        if not stat.S_IMODE(p.stat().st_mode) & 0o001:
            p.chmod(stat.S_IMODE(p.stat().st_mode) | 0o711)


def _as_nobody(home: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``args`` as uid 65534 with a home of its own (as the unit's user has:
    the suite's XDG directories are root's, 0700, and torch's import fails
    on a cache directory it may not create)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**env, "HOME": str(home), "TMPDIR": str(home / "tmp")})


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a child as another user: needs root")
def test_a_model_file_the_daemon_cannot_read_stops_it_at_start_naming_the_file(tiny_model_dir, tmp_path):
    """A folder built by root before the unit existed (0600 weights, as
    save_pretrained leaves them): the daemon as the unit's user refuses to
    start, exit 2, naming model.path, the file, its mode and owner and the
    fix; `rlnode check` says the same. As root every file reads."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    make_readable(model)
    (model / "model.safetensors").chmod(0o600)
    _reachable_by_all(model)
    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    for p in (home, home / "tmp"):
        os.chown(p, NOBODY, NOBODY)
    assert unreadable(model) == [] and model_unreadable(str(model)) == []  # root reads everything

    done = _as_nobody(home, sys.executable, "-c", "import sys; from rlnode.model_files import model_unreadable; "
                      "print(model_unreadable(sys.argv[1]))", str(model), timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"model.path: {model}/model.safetensors: cannot read (mode -rw-------, owner root (uid 0)" in done.stdout
    assert f"chmod -R a+rX {model}" in done.stdout

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o777)
    daemon = _as_nobody(home, sys.executable, "-m", "rlnode", "--role", "actor", "--config", str(ROOT / "conf/demo.toml"),
                        "--set", f"model.path={model}", "--set", f"run.run_dir={run_dir}",
                        "--set", "run.progress=false", "--set", "http.actor_port=0", timeout=120)
    assert daemon.returncode == 2, daemon.stderr[-2000:]
    assert "refusing to start" in daemon.stderr and f"{model}/model.safetensors: cannot read" in daemon.stderr, \
        daemon.stderr[-2000:]

    # rlnode check's model finding, as that user (the check's own stack
    # probes import vLLM: not this test's subject).
    check = _as_nobody(home, sys.executable, "-c", "import sys; from rlnode.config import load_config; "
                       "from rlnode.ops.check import check_model; "
                       "print([(f.level, f.detail) for f in check_model(load_config(sys.argv[1], [f'model.path={sys.argv[2]}']))])",
                       str(ROOT / "conf/demo.toml"), str(model), timeout=120)
    assert check.returncode == 0, check.stderr[-2000:]
    assert f"{model}/model.safetensors: cannot read" in check.stdout and "('FAIL'," in check.stdout, check.stdout
