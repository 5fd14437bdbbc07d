"""Loading: TOML file, then ``--set KEY.PATH=VALUE`` overrides, then one
strict msgspec conversion into ``Config`` and the cross-field checks.

Owns the one place where a config is validated (``load_config``) and the
form of its errors: each names the dotted key and what was expected, e.g.
``actor.router.llm_max_rollouts: expected `int` >= 1, got 0``. Must not
import torch or vllm.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

from rlnode.config.base import ConfigError, explain
from rlnode.config.checks import check_cross_field
from rlnode.config.sections import Config


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` -> (["a","b","c"], value). VALUE is read as a TOML value
    (``3``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``); anything that is not valid
    TOML is taken as a bare string, so ``--set model.path=/x/y`` works."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a section")
        node = child
    node[path[-1]] = value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
) -> Config:
    """Read TOML, apply ``--set`` overrides, validate once. Raises ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for item in overrides:
        keys, value = parse_override(item)
        _apply_override(data, keys, value)
    try:
        cfg = msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(explain(e, data)) from None
    check_cross_field(cfg)
    if not cfg.run.name:
        cfg.run.name = Path(path).stem if path else "rlnode"
    return cfg


def to_toml_dict(cfg: Config) -> dict[str, Any]:
    """The effective config as plain data (for logs and the run directory)."""
    return msgspec.to_builtins(cfg)
