"""Shared pieces of the built-in cubes: seeded disjoint splits, answer
matching, and a task that is finished by a ``submit_answer`` tool call.

Owns: nothing stateful; helpers only.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from typing import Any

from rlnode.cubes.base import Action, CubeTask, CubeTaskRef, Evaluation, StepResult, ToolSpec

SUBMIT_ANSWER = ToolSpec(
    name="submit_answer",
    description="Submit your final answer. Ends the episode.",
    parameters={
        "type": "object",
        "properties": {"answer": {"type": ["number", "string"], "description": "the final answer"}},
        "required": ["answer"],
    },
)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def task_rng(seed: int, *parts: Any) -> random.Random:
    """A Random seeded from (seed, parts) — stable across runs and Python
    versions (no ``hash()`` randomisation)."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def split_index(task_id: str) -> tuple[str, int]:
    """``"train-00042"`` -> ("train", 42)."""
    split, _, idx = task_id.rpartition("-")
    if split not in ("train", "test") or not idx.isdigit():
        raise KeyError(f"bad task id {task_id!r}: expected train-N or test-N")
    return split, int(idx)


def first_number(text: str) -> float | None:
    m = _NUMBER.search(text)
    return float(m.group()) if m else None


def answers_match(given: Any, expected: Any, mode: str = "auto", tol: float = 1e-6) -> bool:
    """``numeric``: both parse as numbers and agree within ``tol`` (relative);
    ``exact``: stripped, case-folded strings equal; ``auto``: numeric when
    the expected answer is a number, else exact."""
    if mode == "auto":
        mode = "numeric" if _as_float(expected) is not None else "exact"
    if mode == "numeric":
        a, b = _as_float(given), _as_float(expected)
        if a is None or b is None:
            return False
        if a.is_integer() and b.is_integer():
            return int(a) == int(b)  # a relative tolerance would accept wrong large integers
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    return str(given).strip().casefold() == str(expected).strip().casefold()


def _as_float(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    try:
        return float(str(x).strip().replace(",", ""))
    except ValueError:
        return None


class SubmitAnswerTask(CubeTask):
    """A question answered through one ``submit_answer`` call.

    A plain-text reply or a malformed call gets an agent-visible error and the
    episode goes on (the turn limit ends it); the first well-formed
    ``submit_answer`` ends it and is scored.
    """

    def __init__(self, ref: CubeTaskRef, question: str, answer: Any, match: str = "auto",
                 extra_tools: list[ToolSpec] = ()):
        self.ref = ref
        self.question = question
        self.answer = answer
        self.match = match
        self.submitted: Any = None
        self._tools = [SUBMIT_ANSWER, *extra_tools]

    def tools(self) -> list[ToolSpec]:
        return self._tools

    async def step(self, action: Action) -> StepResult:
        if action.parse_error:
            return StepResult(f"Your tool call could not be parsed: {action.parse_error}",
                              error=action.parse_error, role="user")
        if not action.tool_calls:
            return StepResult("Please answer by calling the submit_answer tool.",
                              error="no tool call", role="user")
        call = action.tool_calls[0]
        if call.name != "submit_answer":
            return await self.other_tool(call.name, call.arguments)
        if "answer" not in call.arguments:
            return StepResult("submit_answer needs an 'answer' argument.",
                              error="missing argument: answer", role="tool")
        self.submitted = call.arguments["answer"]
        correct = answers_match(self.submitted, self.answer, self.match)
        return StepResult("Answer received.", reward=float(correct), done=True,
                          info={"correct": correct}, role="tool")

    async def other_tool(self, name: str, arguments: dict[str, Any]) -> StepResult:
        """Subclasses with more tools override this."""
        return StepResult(f"Unknown tool {name!r}. Available: submit_answer.",
                          error=f"unknown tool {name}", role="tool")

    async def evaluate(self) -> Evaluation:
        correct = self.submitted is not None and answers_match(self.submitted, self.answer, self.match)
        return Evaluation(reward=float(correct), success=correct,
                          info={"submitted": self.submitted, "expected": self.answer})
