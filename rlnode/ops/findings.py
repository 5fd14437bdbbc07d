"""One finding of ``rlnode check``: a level, a short topic and what was seen.
Shared by the checks in ``ops/check.py`` (config vs machine) and
``ops/stack.py`` (the software stack a GPU run depends on)."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL = "ok", "WARN", "FAIL"


@dataclass
class Finding:
    level: str  # ok | WARN | FAIL
    what: str  # short topic: model, gpus, ports, rendezvous, vllm, nccl, ...
    detail: str
