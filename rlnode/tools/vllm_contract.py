"""The vLLM API rlnode uses, found by reading rlnode's own source.

A hand-kept list of vLLM symbols misses what nobody thought to list: that
is how ``NCCL_UNIQUE_ID_BYTES`` (a 0.32 name) reached a code path that must
also run on 0.26, where importing it raises. This module derives the list
instead, with ``ast`` over every file under ``rlnode/`` (nothing is
imported or run):

* ``from vllm.x import A, B`` and ``import vllm.x [as m]``: module ``vllm.x``
  must define ``A`` and ``B`` (a ``name`` use);
* ``A.attr`` on such a name (``RequestOutputKind.FINAL_ONLY``,
  ``m.func``): ``A`` must have ``attr`` (an ``attr`` use);
* ``A(k=...)`` / ``A.meth(k=...)``: every keyword must be a parameter of the
  function, of ``A.__init__``, or a field of a dataclass / msgspec Struct
  (a ``call`` use). ``A(**kw)`` where ``kw = dict(k=...)``,
  ``kw["k2"] = ...`` and ``kw.update(k3=...)`` in the same function counts
  ``k``, ``k2`` and ``k3`` too;
* a class that subclasses a vLLM class and calls ``super().meth(...)``: the
  base must have ``meth``.

An import inside a ``try`` whose handler catches ImportError (or
Exception) is *optional*: it is recorded, but its absence is allowed.
What the scan cannot see, the methods rlnode calls on an ``AsyncLLM``
instance (the LoRA path's ``add_lora``, ``generate(lora_request=...)``)
and the values a vLLM ``Literal`` accepts (``max_lora_rank``), is listed
by hand in ``DECLARED``; ``contract()`` is the scan and that list.
Version-gated uses that go through ``rlnode.actor.vllm_compat`` are checked
there (``SYMBOLS``), with instance attributes this scan cannot see.

``rlnode/tools/vllm_api_snapshot.py`` resolves each use in a wheel and
stores the outcome per use key; ``violations`` compares a snapshot with the
current scan. Must not import vLLM or torch.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

from rlnode.actor.vllm_compat import parse_python

RLNODE_ROOT = Path(__file__).resolve().parent.parent


class Use(NamedTuple):
    """One thing rlnode's source takes from vLLM.

    ``kind``: ``name`` (``module`` defines ``qualname``), ``attr`` (the
    object at ``qualname`` has its last part as an attribute; a class's
    bases count), ``call`` (``keywords`` are accepted by calling it),
    ``values`` (``qualname`` is a ``Literal[...]`` alias that holds every
    one of ``keywords``, each written as in source: ``"16"``)."""

    module: str
    qualname: str
    kind: str
    keywords: tuple[str, ...] = ()
    optional: bool = False
    where: str = ""

    @property
    def key(self) -> str:
        """What a snapshot records the outcome under (keywords are checked
        against the recorded parameters, so they are not in the key)."""
        return f"{self.kind} {self.module}:{self.qualname}"


# --------------------------------------------------------------------------
# Scanning rlnode


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names: list[str] = []
    t = handler.type
    for node in (t.elts if isinstance(t, ast.Tuple) else [t]) if t is not None else []:
        if isinstance(node, ast.Name):
            names.append(node.id)
    return t is None or any(n in ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
                            for n in names)


def _dict_keys(func: ast.AST, var: str) -> tuple[str, ...] | None:
    """Keys of ``var`` built in ``func`` as ``var = dict(k=...)`` / ``{"k": ...}``
    and ``var["k"] = ...``; None when ``var`` is built some other way."""
    keys: list[str] = []
    seen = False
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == var:
                    v = node.value
                    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "dict" \
                            and not v.args and all(k.arg for k in v.keywords):
                        keys += [k.arg for k in v.keywords]
                        seen = True
                    elif isinstance(v, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                         for k in v.keys):
                        keys += [k.value for k in v.keys]
                        seen = True
                    else:
                        return None
                elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == var \
                        and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str):
                    keys.append(t.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == var:
            keys += [k.arg for k in node.keywords if k.arg]  # var.update(k=...)
    return tuple(dict.fromkeys(keys)) if seen else None


class _Scanner(ast.NodeVisitor):
    def __init__(self, relpath: str):
        self.relpath = relpath
        self.uses: list[Use] = []
        # local name -> (module, qualname or "" for a module object, optional)
        self.bound: dict[str, tuple[str, str, bool]] = {}
        self._optional = 0
        self._funcs: list[ast.AST] = []
        self._classes: list[tuple[str, str] | None] = []  # the vLLM base of each enclosing class

    def _at(self, node: ast.AST) -> str:
        return f"{self.relpath}:{node.lineno}"

    def _add(self, node, module, qualname, kind, keywords=(), optional=False):
        self.uses.append(Use(module, qualname, kind, tuple(keywords), optional, self._at(node)))

    # -- optional regions
    def visit_Try(self, node: ast.Try) -> None:
        optional = any(_catches_import_error(h) for h in node.handlers)
        self._optional += optional
        for stmt in node.body:
            self.visit(stmt)
        self._optional -= optional
        for part in (node.handlers, node.orelse, node.finalbody):
            for stmt in part:
                self.visit(stmt)

    # -- imports
    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level == 0 and (mod == "vllm" or mod.startswith("vllm.")):
            for alias in node.names:
                self._add(node, mod, alias.name, "name", optional=bool(self._optional))
                self.bound[alias.asname or alias.name] = (mod, alias.name, bool(self._optional))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "vllm" or alias.name.startswith("vllm."):
                parent, _, last = alias.name.rpartition(".")
                if parent:
                    self._add(node, parent, last, "name", optional=bool(self._optional))
                if alias.asname:
                    self.bound[alias.asname] = (alias.name, "", bool(self._optional))

    # -- scopes (a name bound in a function is visible below it in the file: good enough
    #    for import-at-use code, and a later rebinding of the name is rare here)
    def visit_FunctionDef(self, node) -> None:
        self._funcs.append(node)
        self.generic_visit(node)
        self._funcs.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        base = None
        for b in node.bases:
            if isinstance(b, ast.Name) and b.id in self.bound and self.bound[b.id][1]:
                base = self.bound[b.id][:2]
        self._classes.append(base)
        self.generic_visit(node)
        self._classes.pop()

    # -- uses
    def _resolve(self, node: ast.AST) -> tuple[str, str, bool] | None:
        """``Name`` or ``Name.attr...`` rooted at a vLLM import."""
        if isinstance(node, ast.Name) and node.id in self.bound:
            return self.bound[node.id]
        if isinstance(node, ast.Attribute):
            inner = self._resolve(node.value)
            if inner is not None:
                mod, qual, opt = inner
                return (mod, f"{qual}.{node.attr}" if qual else node.attr, opt)
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        inner = self._resolve(node.value)
        if inner is not None:
            mod, qual, opt = inner
            if qual:
                self._add(node, mod, f"{qual}.{node.attr}", "attr", optional=opt)
            else:  # an attribute of a module object: the module defines it
                self._add(node, mod, node.attr, "name", optional=opt)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        target = self._resolve(node.func)
        if target is not None:
            mod, qual, opt = target
            keywords = [k.arg for k in node.keywords if k.arg]
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name) and self._funcs:
                    keywords += _dict_keys(self._funcs[-1], k.value.id) or ()
            if qual:
                self._add(node, mod, qual, "call", keywords, opt)
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name) \
                and f.value.func.id == "super" and self._classes and self._classes[-1] is not None:
            mod, qual = self._classes[-1]
            self._add(node, mod, f"{qual}.{f.attr}", "attr")
        self.generic_visit(node)


def scan_source(source: str, relpath: str = "<source>") -> list[Use]:
    s = _Scanner(relpath)
    s.visit(parse_python(source))
    return s.uses


def scan(root: Path = RLNODE_ROOT) -> list[Use]:
    """Every vLLM use in the package at ``root`` (default: this rlnode)."""
    uses: list[Use] = []
    for path in sorted(root.rglob("*.py")):
        rel = f"{root.name}/{path.relative_to(root).as_posix()}"
        uses += scan_source(path.read_text(), rel)
    return uses


# Uses that broke rlnode once, recorded in every snapshot whether or not the
# source still has them, so a test can show the check catches them.
ONCE_BROKEN: tuple[Use, ...] = (
    # A 0.32 name imported on the NCCL path: ImportError on 0.26-0.31.
    Use("vllm.distributed.device_communicators.pynccl_wrapper", "NCCL_UNIQUE_ID_BYTES", "name"),
)


# The LoRA path (issue 38: engine args, adapters served per version, the
# worker extension): what it takes from vLLM that the scan cannot see
# (methods of an AsyncLLM instance, a Literal's values), required on every
# supported release. LoRARequest's first three fields are passed by position.
_LORA = "LoRA path (rlnode/actor/engine_adapters.py, engine_env.py, rlnode/weights/worker.py)"
LORA_ENGINE_ARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# rlnode.config.VLLM_LORA_RANKS, as vLLM writes them (a test keeps the two equal).
LORA_RANKS = ("1", "8", "16", "32", "64", "128", "256", "320", "512")
DECLARED: tuple[Use, ...] = (
    Use("vllm.engine.arg_utils", "AsyncEngineArgs", "call", LORA_ENGINE_ARGS, where=_LORA),
    Use("vllm.config.lora", "MaxLoRARanks", "values", LORA_RANKS, where=_LORA),
    # The worker extension reads the engine's adapter bound (rlnode/weights/worker.py).
    Use("vllm.config.vllm", "VllmConfig.lora_config", "attr", where=_LORA),
    Use("vllm.config.lora", "LoRAConfig.max_lora_rank", "attr", where=_LORA),
    Use("vllm.lora.request", "LoRARequest", "name", where=_LORA),
    Use("vllm.lora.request", "LoRARequest", "call", ("lora_name", "lora_int_id", "lora_path", "load_inplace"),
        where=_LORA),
    Use("vllm.v1.engine.async_llm", "AsyncLLM.add_lora", "call", ("lora_request",), where=_LORA),
    Use("vllm.v1.engine.async_llm", "AsyncLLM.remove_lora", "call", ("lora_id",), where=_LORA),
    Use("vllm.v1.engine.async_llm", "AsyncLLM.list_loras", "call", (), where=_LORA),
    Use("vllm.v1.engine.async_llm", "AsyncLLM.generate", "call", ("lora_request",), where=_LORA),
)


def contract(root: Path = RLNODE_ROOT) -> list[Use]:
    """What rlnode needs of vLLM: the scan of its source and ``DECLARED``."""
    return scan(root) + list(DECLARED)


def required_keys(uses: list[Use]) -> dict[str, list[Use]]:
    """Uses grouped by the key a snapshot records them under."""
    out: dict[str, list[Use]] = {}
    for u in uses:
        out.setdefault(u.key, []).append(u)
    return out


# --------------------------------------------------------------------------
# Checking a snapshot


def violations(uses: list[Use], snapshot: dict) -> list[str]:
    """What a release (its snapshot) lacks of ``uses``: one line per problem,
    naming the use's file and line. A key the snapshot never recorded is a
    problem too: rlnode started to use something new, re-snapshot."""
    recorded = snapshot.get("uses", {})
    who = f"vLLM {snapshot.get('vllm')} ({snapshot.get('dist', 'vllm')})"
    out: list[str] = []
    for key, group in required_keys(uses).items():
        where = ", ".join(sorted({u.where for u in group}))
        if key not in recorded:
            out.append(f"{who}: {key} used at {where} is not in the snapshot: re-run "
                       "`python -m rlnode.tools.vllm_api_snapshot` on that release's wheel")
            continue
        fact = recorded[key]
        required = [u for u in group if not u.optional]
        if fact["defined"] is None:
            continue  # cannot be told from the source (e.g. inherited from ctypes.Structure)
        if fact["defined"] is False:
            if required:
                out.append(f"{who} has no {key.split(' ', 1)[1]} (used at "
                           f"{', '.join(sorted({u.where for u in required}))})")
            continue
        if "values" in fact:
            for u in group:
                if bad := [v for v in u.keywords if v not in (fact["values"] or ())]:
                    out.append(f"{who}: {u.qualname} does not accept {', '.join(bad)} (used at {u.where}; it "
                               f"accepts {', '.join(fact['values'] or []) or 'nothing rlnode can read'})")
            continue
        params = fact.get("params")
        if params is None or "**" in params:
            continue
        for u in group:
            bad = [k for k in u.keywords if k not in params]
            if bad:
                out.append(f"{who}: {u.qualname}() takes no {', '.join(bad)} (used at {u.where}; "
                           f"it takes {', '.join(params) or 'nothing'})")
    return out


def iter_report(uses: list[Use]) -> Iterator[str]:
    for u in sorted(uses, key=lambda u: (u.key, u.where)):
        kw = f" ({', '.join(u.keywords)})" if u.keywords else ""
        yield f"{u.key}{kw}{' [optional]' if u.optional else ''}  {u.where}"
