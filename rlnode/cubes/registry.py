"""Cube registry: name -> Cube class, for built-ins and plug-ins.

A cube class declares ``kind`` (its registry name), an ``Options`` msgspec
Struct (its knobs, validated like the rest of the config) and a constructor
``(cube_id: str, options: Options, seed: int)``. Third-party packages ship
cubes through the ``rlnode.cubes`` entry-point group:

    [project.entry-points."rlnode.cubes"]
    my-bench = "my_pkg.cube:MyCube"
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

import msgspec

from rlnode.cubes.base import Cube

ENTRY_POINT_GROUP = "rlnode.cubes"

# Built-ins are imported lazily, by module path, so loading the registry (and
# the config) stays cheap.
BUILTIN: dict[str, str] = {
    "guessing": "rlnode.cubes.guessing:GuessingCube",
    "arithmetic": "rlnode.cubes.arithmetic:ArithmeticCube",
    "python-math": "rlnode.cubes.python_math:PythonMathCube",
    "jsonl": "rlnode.cubes.jsonl:JsonlCube",
    "cube-protocol": "rlnode.cubes.protocol:ProtocolCube",
    "verifiers": "rlnode.cubes.verifiers_cube:VerifiersCube",
    "openai-agent": "rlnode.cubes.openai_agent:OpenAIAgentCube",
}
_registered: dict[str, type[Cube]] = {}


class UnknownCube(KeyError):
    pass


def register_cube(cls: type[Cube]) -> type[Cube]:
    """Class decorator for cubes defined in code (tests, notebooks)."""
    _registered[cls.kind] = cls
    return cls


def _load_ref(ref: str) -> type[Cube]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def cube_class(kind: str) -> type[Cube]:
    if kind in _registered:
        return _registered[kind]
    if kind in BUILTIN:
        return _load_ref(BUILTIN[kind])
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == kind:
            return ep.load()
    known = sorted({*BUILTIN, *_registered, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
    raise UnknownCube(f"unknown cube kind {kind!r}; known: {', '.join(known)}")


def parse_options(kind: str, options: dict[str, Any]) -> Any:
    """Validate a cube's options table; raises msgspec.ValidationError with
    the path inside the table."""
    return msgspec.convert(options, cube_class(kind).Options, strict=True)


def make_cube(cube_id: str, kind: str, options: dict[str, Any], seed: int) -> Cube:
    cls = cube_class(kind)
    return cls(cube_id, parse_options(kind, options), seed)


async def open_cubes(specs, seed: int, guarded: dict[str, str] | None = None) -> dict[str, Cube]:
    """Build and start every configured cube (``CubeConfig``s); if one fails
    to start, the ones already started are closed again. ``guarded``:
    {config key: path} no agent box may be shown (``isolation.guard_paths``),
    set before the first cube starts."""
    if guarded is not None:
        from rlnode.cubes.wall.isolation import guard_paths

        guard_paths(guarded)
    cubes: dict[str, Cube] = {}
    try:
        for spec in specs:
            cube = make_cube(spec.id, spec.kind, spec.options, seed)
            await cube.start()
            cubes[spec.id] = cube
    except BaseException:
        await close_cubes(cubes)
        raise
    return cubes


async def close_cubes(cubes: dict[str, Cube]) -> None:
    import asyncio

    await asyncio.gather(*(c.close() for c in cubes.values()), return_exceptions=True)
