"""``jsonl``: bring your own questions.

Each line of the file is a JSON object ``{"question": str, "answer": any}``
with optional ``"id"`` and ``"metadata"``. Either give separate train and test
files, or one file that is split by a seeded hash of each question's id
(stable when lines are added or reordered). Scoring: ``numeric`` (within a
relative tolerance), ``exact`` (case-folded string), or ``auto`` (numeric when
the expected answer is a number). The agent answers with ``submit_answer``,
or in plain text when ``answer_mode = "text"``.

Bad lines are reported with their line number at start-up, never mid-run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rlnode.cubes.base import Action, Cube, CubeError, CubeTask, CubeTaskRef, Reset, Split, StepResult
from rlnode.cubes.tasks import SubmitAnswerTask, answers_match, first_number


class JsonlOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # One file split by hash (with test_fraction) ...
    path: str = ""
    # ... or explicit train/test files (both set, path empty).
    train_path: str = ""
    test_path: str = ""
    # Share of `path`'s questions held out for test, [0, 1).
    test_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    match: Literal["auto", "numeric", "exact"] = "auto"
    answer_mode: Literal["tool", "text"] = "tool"
    # Text put before each question.
    instruction: str = ""


class JsonlRecord(msgspec.Struct):
    question: str
    answer: Any
    id: str | int | None = None
    metadata: dict[str, Any] = {}


def read_jsonl(path: str | Path, id_prefix: str = "") -> list[JsonlRecord]:
    """Records of a JSONL file; lines without an id get ``{id_prefix}line{N}``."""
    decoder = msgspec.json.Decoder(JsonlRecord)
    records = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = decoder.decode(line)
            except msgspec.DecodeError as e:
                raise CubeError(f"{path}:{n}: {e}") from None
            if rec.id is None:
                rec.id = f"{id_prefix}line{n}"
            records.append(rec)
    return records


class JsonlTask(SubmitAnswerTask):
    instruction = ""

    async def reset(self) -> Reset:
        prefix = f"{self.instruction}\n" if self.instruction else ""
        return Reset(observation=prefix + self.question)


class TextAnswerTask(JsonlTask):
    """The reply itself is the answer (first number, or the whole text)."""

    def tools(self):
        return []

    async def step(self, action: Action) -> StepResult:
        text = action.text.strip()
        num = first_number(text)
        self.submitted = num if (self.match != "exact" and num is not None) else text
        correct = answers_match(self.submitted, self.answer, self.match)
        return StepResult("Answer received.", reward=float(correct), done=True, info={"correct": correct})


class JsonlCube(Cube):
    runs_agents = False  # the actor plays every episode itself (rlnode/actor/episode.py)

    kind = "jsonl"
    Options = JsonlOptions

    def __init__(self, cube_id: str, options: JsonlOptions, seed: int):
        if bool(options.path) == bool(options.train_path or options.test_path):
            raise ValueError("jsonl: set either `path`, or `train_path` and `test_path`")
        self.cube_id = cube_id
        self.opts = options
        self.seed = seed
        self._splits: dict[str, list[JsonlRecord]] = {}
        self._by_id: dict[str, JsonlRecord] = {}

    async def start(self) -> None:
        o = self.opts
        if o.path:
            records = read_jsonl(o.path)
            test = [r for r in records if self._is_test(r)]
            train = [r for r in records if not self._is_test(r)]
        else:
            train, test = read_jsonl(o.train_path, "train-"), read_jsonl(o.test_path, "test-")
        self._splits = {"train": train, "test": test}
        self._by_id = {str(r.id): r for r in records_of(train, test)}

    def _is_test(self, rec: JsonlRecord) -> bool:
        h = hashlib.sha256(f"{self.seed}:{rec.id}".encode()).digest()
        return int.from_bytes(h[:8], "little") / 2**64 < self.opts.test_fraction

    async def task_ids(self, split: Split) -> list[str]:
        return [str(r.id) for r in self._splits[split]]

    async def open_task(self, task_id: str) -> CubeTask:
        rec = self._find(task_id)
        cls = TextAnswerTask if self.opts.answer_mode == "text" else JsonlTask
        task = cls(CubeTaskRef(self.cube_id, task_id), rec.question, rec.answer, self.opts.match)
        if isinstance(task, JsonlTask):
            task.instruction = self.opts.instruction
        return task

    def _find(self, task_id: str) -> JsonlRecord:
        try:
            return self._by_id[task_id]
        except KeyError:
            raise KeyError(f"no task {task_id!r} in {self.cube_id}") from None


def records_of(*splits: list[JsonlRecord]) -> list[JsonlRecord]:
    seen: set[str] = set()
    out = []
    for recs in splits:
        for r in recs:
            if str(r.id) in seen:
                raise CubeError(f"duplicate question id {r.id!r}")
            seen.add(str(r.id))
            out.append(r)
    return out
