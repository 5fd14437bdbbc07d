"""Record, from a vLLM wheel, the API that ``rlnode.actor.vllm_compat`` relies on.

Reads the wheel (a zip) with ``ast``: nothing is installed or imported, so
CI with one vLLM can check the compat layer against every supported
release. Writes ``{"vllm": version, "symbols": {key: names | null}}`` for
exactly ``vllm_compat.SYMBOLS``; ``vllm_compat.live_snapshot()`` produces
the same format from the installed package (tests compare the two).

    python -m rlnode.tools.vllm_api_snapshot vllm-0.26.0-....whl -o tests/data/vllm_api/0.26.0.json

Must not import vLLM or torch.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile

from rlnode.actor.vllm_compat import SYMBOLS, Symbol, init_attrs_of


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + ([a.vararg] if a.vararg else []) + a.kwonlyargs
             + ([a.kwarg] if a.kwarg else [])]
    return [n for n in names if n != "self"]


def _find(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last top-level definition of ``name`` (later ones win, as at import)."""
    found = None
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            found = node
    return found


def symbol_from_source(source: str, sym: Symbol) -> list[str] | None:
    node: ast.stmt | None = None
    body = ast.parse(source).body
    for part in sym.qualname.split("."):
        node = _find(body, part)
        if node is None:
            return None
        body = node.body
    if sym.kind == "params":
        return _params(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if not isinstance(node, ast.ClassDef):
        return None
    if sym.kind == "fields":
        return sym.keep([n.target.id for n in node.body
                         if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)])
    init = _find(node.body, "__init__")
    return sym.keep(init_attrs_of(init)) if init is not None else []


def _module_source(wheel: zipfile.ZipFile, module: str) -> str | None:
    base = module.replace(".", "/")
    for path in (f"{base}.py", f"{base}/__init__.py"):
        try:
            return wheel.read(path).decode()
        except KeyError:
            continue
    return None


def wheel_version(path: str, wheel: zipfile.ZipFile) -> str:
    for name in wheel.namelist():
        if name.endswith(".dist-info/METADATA"):
            m = re.search(r"^Version: (\S+)$", wheel.read(name).decode(), re.M)
            if m:
                return m.group(1)
    raise ValueError(f"{path}: no dist-info METADATA with a Version")


def snapshot_wheel(path: str) -> dict:
    with zipfile.ZipFile(path) as wheel:
        symbols = {}
        for sym in SYMBOLS:
            source = _module_source(wheel, sym.module)
            symbols[sym.key] = None if source is None else symbol_from_source(source, sym)
        return {"vllm": wheel_version(path, wheel), "symbols": symbols}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel")
    p.add_argument("-o", "--out", help="JSON file (default: stdout)")
    a = p.parse_args(argv)
    text = json.dumps(snapshot_wheel(a.wheel), indent=1, sort_keys=True) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
