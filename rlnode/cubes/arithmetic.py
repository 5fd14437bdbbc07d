"""``arithmetic``: a question answered through the ``submit_answer`` tool,
or, with ``answer_mode = "text"``, in the reply itself (its first number is
the answer: a model that writes "7 + 5 = 12" answers 7). Text mode needs no
tool format, so it suits a pretrained model whose chat template has none
(SmolLM2's), and its success starts where the model's habit of restating the
question leaves it.

Problems ``a OP b`` are enumerated from the operand range, shuffled with the
seed and cut into disjoint train and test sets, so no test question is ever
trained on.
"""

from __future__ import annotations

import itertools
import operator
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rlnode.cubes.base import Cube, CubeTask, CubeTaskRef, Reset, Split
from rlnode.cubes.jsonl import TextAnswerTask
from rlnode.cubes.tasks import SubmitAnswerTask, split_index, task_rng

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class ArithmeticOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Operands are drawn from 0..max_operand.
    max_operand: Annotated[int, Meta(ge=1, le=10_000)] = 20
    # Operators to use, a subset of "+", "-", "*".
    ops: list[str] = msgspec.field(default_factory=lambda: list(OPS))
    # Share of the problem space held out as the test split, (0, 1).
    test_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.2
    # Cap on the test split size (the rest of the held-out share is unused).
    max_test_tasks: Annotated[int, Meta(ge=1)] = 200
    # "tool": the answer goes through submit_answer; "text": the reply's
    # first number is the answer (one turn, no tools).
    answer_mode: Literal["tool", "text"] = "tool"

    def __post_init__(self):
        bad = [o for o in self.ops if o not in OPS]
        if bad or not self.ops:
            raise ValueError(f"ops: expected a non-empty subset of {list(OPS)}, got {self.ops}")


class ArithmeticTask(SubmitAnswerTask):
    async def reset(self) -> Reset:
        return Reset(observation=f"What is {self.question}? Answer with the submit_answer tool.")


class ArithmeticTextTask(TextAnswerTask):
    async def reset(self) -> Reset:
        return Reset(observation=f"What is {self.question}? Reply with the number only.")


class ArithmeticCube(Cube):
    runs_agents = False  # the actor plays every episode itself (rlnode/actor/episode.py)

    kind = "arithmetic"
    Options = ArithmeticOptions

    def __init__(self, cube_id: str, options: ArithmeticOptions, seed: int):
        self.cube_id = cube_id
        self.opts = options
        space = list(itertools.product(range(options.max_operand + 1), options.ops, range(options.max_operand + 1)))
        task_rng(seed, self.kind).shuffle(space)
        n_test = max(1, int(len(space) * options.test_fraction))
        self._splits = {"test": space[: min(n_test, options.max_test_tasks)], "train": space[n_test:]}

    async def task_ids(self, split: Split) -> list[str]:
        return [f"{split}-{i:05d}" for i in range(len(self._splits[split]))]

    def problem(self, task_id: str) -> tuple[str, int]:
        split, idx = split_index(task_id)
        a, op, b = self._splits[split][idx]
        return f"{a} {op} {b}", OPS[op](a, b)

    async def open_task(self, task_id: str) -> CubeTask:
        question, answer = self.problem(task_id)
        cls = ArithmeticTextTask if self.opts.answer_mode == "text" else ArithmeticTask
        return cls(CubeTaskRef(self.cube_id, task_id), question, answer, match="numeric")
