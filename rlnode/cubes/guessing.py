"""``guessing``: find a hidden number with higher/lower feedback.

The multi-step built-in: the right next guess depends on the feedback, so a
policy that ignores it is capped at ``max_turns / max_number`` success
(it can at best try distinct numbers), while binary search always wins when
``2**max_turns > max_number``. The agent answers in plain text ("5"); the
first integer in the reply is the guess.

``feedback = "range"`` states the remaining interval ("Higher. It is between
6 and 8."), which makes the state Markov: a small model only has to read the
last message (docs/design/vllm-cpu.md: with direction-only feedback a tiny model reacted to
the last hint only and plateaued).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rlnode.cubes.base import Action, Cube, CubeTask, CubeTaskRef, Evaluation, Reset, Split, StepResult, ToolSpec
from rlnode.cubes.tasks import first_number, split_index, task_rng


class GuessingOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Hidden numbers are drawn from 1..max_number.
    max_number: Annotated[int, Meta(ge=2, le=1000)] = 8
    # Guesses allowed; the episode ends at the first correct guess.
    max_turns: Annotated[int, Meta(ge=1, le=64)] = 4
    # "range": feedback states the remaining interval; "direction": only
    # higher/lower.
    feedback: Literal["range", "direction"] = "range"
    # Task instances per split (ids train-N / test-N).
    num_train_tasks: Annotated[int, Meta(ge=1)] = 10_000
    num_test_tasks: Annotated[int, Meta(ge=1)] = 64
    # Every wasted turn costs this much of the episode's reward, win or
    # lose: a reply with no number, or a guess outside the range the
    # feedback has already ruled in (a repeated guess included). With 0 a
    # wasted turn is free whenever a later guess still wins: the demo then
    # locked in "lower than 3" -> no number -> 1, which wins for 1 and loses
    # every attempt for 2 alike, a group with no signal (README "The demo
    # over seeds"). A valid guess costs nothing, so guessing 1 first for a
    # lucky one-turn win is not favoured over splitting the range. Must
    # leave a win worth more than a clean loss: cost * (max_turns - 1) < 1.
    wasted_turn_cost: Annotated[float, Meta(ge=0, lt=1)] = 0.0

    def __post_init__(self):
        if self.wasted_turn_cost * (self.max_turns - 1) >= 1:
            raise ValueError(f"wasted_turn_cost: expected wasted_turn_cost * (max_turns - 1) < 1 so that a win "
                             f"after {self.max_turns - 1} wasted turns still beats a loss, got "
                             f"{self.wasted_turn_cost} with max_turns {self.max_turns}")


class GuessingTask(CubeTask):
    def __init__(self, ref: CubeTaskRef, target: int, opts: GuessingOptions):
        self.ref = ref
        self.target = target
        self.opts = opts
        self.lo, self.hi = 1, opts.max_number
        self.guesses: list[int | None] = []
        self.wasted = 0  # replies with no number or outside [lo, hi]
        self.solved = False

    async def reset(self) -> Reset:
        n = self.opts.max_number
        return Reset(
            observation=f"Guess the hidden number between 1 and {n}. Reply with one number.",
            info={"max_number": n, "max_turns": self.opts.max_turns},
        )

    def tools(self) -> list[ToolSpec]:
        return []

    async def step(self, action: Action) -> StepResult:
        value = first_number(action.text)
        if value is None or value != int(value):
            self.guesses.append(None)  # a wasted turn still counts
            self.wasted += 1
            return StepResult("Reply with one whole number.", error="no number in reply",
                              done=len(self.guesses) >= self.opts.max_turns)
        guess = int(value)
        self.guesses.append(guess)
        if not self.lo <= guess <= self.hi:  # ruled out already (a repeat too)
            self.wasted += 1
        if guess == self.target:
            self.solved = True
            return StepResult("Correct!", reward=self.reward(), done=True, info={"guesses": len(self.guesses)})
        if guess < self.target:
            word, self.lo = "Higher", max(self.lo, guess + 1)
        else:
            word, self.hi = "Lower", min(self.hi, guess - 1)
        out_of_turns = len(self.guesses) >= self.opts.max_turns
        if self.opts.feedback == "range":
            return StepResult(f"{word}. It is between {self.lo} and {self.hi}.", done=out_of_turns)
        return StepResult(f"{word}.", done=out_of_turns)

    def reward(self) -> float:
        return float(self.solved) - self.opts.wasted_turn_cost * self.wasted

    async def evaluate(self) -> Evaluation:
        return Evaluation(reward=self.reward(), success=self.solved,
                          info={"target": self.target, "guesses": self.guesses})


class GuessingCube(Cube):
    runs_agents = False  # the actor plays every episode itself (rlnode/actor/episode.py)

    kind = "guessing"
    Options = GuessingOptions

    def __init__(self, cube_id: str, options: GuessingOptions, seed: int):
        self.cube_id = cube_id
        self.opts = options
        self.seed = seed

    async def task_ids(self, split: Split) -> list[str]:
        n = self.opts.num_train_tasks if split == "train" else self.opts.num_test_tasks
        return [f"{split}-{i:05d}" for i in range(n)]

    def target(self, task_id: str) -> int:
        split, idx = split_index(task_id)
        return task_rng(self.seed, self.kind, split, idx).randint(1, self.opts.max_number)

    async def open_task(self, task_id: str) -> CubeTask:
        return GuessingTask(CubeTaskRef(self.cube_id, task_id), self.target(task_id), self.opts)

    def feedback_ignoring_success(self) -> float:
        """Best success a policy that ignores feedback can reach: it can only
        try ``max_turns`` distinct numbers."""
        return min(1.0, self.opts.max_turns / self.opts.max_number)

    def random_success(self) -> float:
        """A policy guessing uniformly at random each turn (repeats allowed)."""
        return 1.0 - (1.0 - 1.0 / self.opts.max_number) ** self.opts.max_turns

    def reference_scores(self) -> dict[str, float]:
        return {"random": self.random_success(), "best_feedback_ignoring": self.feedback_ignoring_success()}
