"""What every config module builds on: the error type, the Struct base of
every section, the bounded number types, and the rewrite of msgspec's
validation messages into ``dotted.key: what was expected``.

Owns no knob. Imports only msgspec and the standard library (no torch, no
vLLM, no other rlnode module): the CLI validates a config before anything
heavy is loaded.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
Fraction = Annotated[float, Meta(gt=0, le=1)]


class ConfigError(ValueError):
    """A config that cannot run; the message names the key."""


class Section(Struct, forbid_unknown_fields=True, kw_only=True):
    """One TOML table: an unknown key is an error, fields are keyword-only."""


def _dotted(path: str) -> str:
    """msgspec's ``$.a.b[0]`` -> ``a.b[0]``."""
    return path.removeprefix("$").lstrip(".")


def _lookup(data: Any, dotted: str) -> Any:
    node = data
    for part in dotted.replace("[", ".").replace("]", "").split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


_MISSING = object()


def explain(err: msgspec.ValidationError, data: Any) -> str:
    """A validation error of ``data`` as ``dotted.key: what was expected,
    got VALUE`` (or ``dotted.key: unknown key ...``)."""
    # msgspec messages look like "Expected `int`, got `str` - at `$.a.b`" or
    # "Object contains unknown field `x` - at `$.a`". Rewrite them so the
    # dotted key comes first, which is what an operator greps for.
    msg = str(err)
    what, _, where = msg.partition(" - at `")
    where = _dotted(where.rstrip("`"))
    if what.startswith("Object contains unknown field `"):
        name = what.split("`")[1]
        key = f"{where}.{name}" if where else name
        return f"{key}: unknown key (not part of the [{where or 'top-level'}] section)"
    if not where:
        return what
    what = f"{what[0].lower()}{what[1:]}"
    value = _lookup(data, where)
    if ", got" not in what and value is not _MISSING:
        what += f", got {value!r}"
    return f"{where}: {what}"
