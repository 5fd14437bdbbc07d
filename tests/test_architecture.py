"""The architecture holds: the layer and independence contracts of
``.importlinter`` are kept (``make test`` also runs ``lint-imports``), and
no module of ``rlnode/`` takes part in an import cycle, lazy imports inside
functions included (a cycle makes one part impossible to import, change or
test without the others)."""

import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def import_cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_no_module_is_in_an_import_cycle():
    graph = grimp.build_graph("rlnode", include_external_packages=False)
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for m in ("a", "b", "c", "d"):
        graph.add_module(m)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_import_contracts_are_kept():
    # In a process of its own: import-linter's CLI reconfigures logging with
    # dictConfig, which disables every logger that exists (vLLM's, ours) for
    # the rest of the test session (measured: a later caplog test saw nothing).
    script = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(script), "--config", str(ROOT / ".importlinter"), "--no-cache", "--no-logo"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in r.stdout


def test_every_logger_comes_from_rlnode_log():
    """Our events go through ``rlnode.log.get_logger`` (one configuration,
    the version and context stamped on each): no module of ``rlnode/`` but
    ``log.py`` touches structlog or names a stdlib logger after itself
    (``logging.getLogger`` is for vLLM's loggers, to quiet or filter them)."""
    own_stdlib = re.compile(r"logging\.getLogger\((__name__|[\"']rlnode)")
    offenders = []
    for path in sorted((ROOT / "rlnode").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if (rel != "rlnode/log.py" and "structlog" in line) or own_stdlib.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def test_roles_know_the_cube_contract_not_a_cube():
    """The actor and the trainer see cubes through their contract
    (``cubes.base``) and the registry only: a role that imported one cube's
    implementation (``agent_episode`` once took ``AgentWorkerError`` from
    ``cubes.wall.agent_workers``) would tie every run to that cube."""
    graph = grimp.build_graph("rlnode", include_external_packages=False)
    allowed = {"rlnode.cubes", "rlnode.cubes.base", "rlnode.cubes.registry"}
    seen = []
    for role in ("rlnode.actor", "rlnode.trainer"):
        for m in sorted(graph.find_children(role) | graph.find_descendants(role)):
            seen += [f"{m} -> {c}" for c in sorted(graph.find_modules_directly_imported_by(m))
                     if c.startswith("rlnode.cubes.") and c not in allowed]
    assert seen == []


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
# A function may run longer when its docstring says why, in a sentence that
# starts with these words (docs/architecture.md, "Rooms").
LONG_REASON = "Long because "


def oversized_rooms(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES lines, and functions or methods over
    MAX_FUNCTION_LINES (``def`` to last line) whose docstring gives no
    reason starting with LONG_REASON."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        src = path.read_text()
        if (n := len(src.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{rel}: {n} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and LONG_REASON not in (ast.get_docstring(node) or ""):
                    found.append(f"{rel}:{node.lineno} {node.name}: {n} lines, no reason in its docstring")
    return found


def test_rooms_are_of_a_size_to_live_in():
    assert oversized_rooms(ROOT / "rlnode") == []


def test_the_room_check_finds_a_long_module_and_an_unexplained_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "a.py").write_text(f"def long():\n{body}\n\ndef fine():\n    return 1\n")
    (pkg / "b.py").write_text(f'def explained():\n    """{LONG_REASON}it is a table."""\n{body}')
    (pkg / "c.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized_rooms(pkg) == ["pkg/a.py:1 long: 81 lines, no reason in its docstring",
                                    f"pkg/c.py: {MAX_MODULE_LINES + 1} lines"]
