"""``vf_guess``: a multi-turn number-guessing environment written with the
verifiers 0.4 API (``verifiers.v1``), shipped so the ``verifiers`` cube has
an environment that needs no download.

The model guesses a hidden number in 1..max_number; after each wrong guess
the environment answers "Higher." or "Lower." as the next user turn
(``feedback = "range"`` adds the interval left), until the guess is right or
``max_turns`` guesses are spent. It is the same game
as the built-in ``guessing`` cube, but played the verifiers way:

* ``GuessTaskset`` yields the tasks (secrets drawn in memory from a seed;
  ``split = "train" | "eval"`` draws disjoint task ids from separate
  streams);
* ``GuessEnv.run`` plays the user: it holds the agent's rollout open with
  ``agents.player.interaction(task)`` and answers each reply with feedback
  (verifiers 0.4 has no ``MultiTurnEnv``; an ``Env`` driving an
  ``Interaction`` is its multi-turn form, as in its TextArena taskset);
* ``GuessTask`` is the rubric: ``@vf.reward correct`` replays the recorded
  transcript against the secret (1.0 for a correct guess within the turn
  budget, minus ``turn_cost`` per extra guess), ``@vf.metric guesses``;
* ``GuessHarness`` is the agent program: one chat-completions call per
  segment, in-process, through the rollout's interception endpoint (the
  verifiers harness contract allows an in-process loop; the built-in
  ``null`` harness would install its program with ``uv`` from PyPI).

Importing this module needs ``verifiers`` (``pip install 'rlnode[verifiers]'``)
and does no I/O. ``load_environment(**kwargs)`` builds the env without
rlnode, e.g. for ``vf-eval``-style scripts.
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal

from openai import APIError, AsyncOpenAI
from pydantic import Field

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

SYSTEM_PROMPT = "You are playing a guessing game. Answer with one whole number and nothing else."

_INT = re.compile(r"-?\d+")


def first_int(text: str | None) -> int | None:
    m = _INT.search(text or "")
    return int(m.group()) if m else None


def play(answer: int, replies: list[str | None], max_turns: int) -> tuple[bool, int]:
    """Replay a transcript: (solved, guesses used). Replies past the turn
    budget or after the correct guess do not count."""
    for turn, reply in enumerate(replies[:max_turns], start=1):
        if first_int(reply) == answer:
            return True, turn
    return False, min(len(replies), max_turns)


def feedback(answer: int, guess: int | None, lo: int, hi: int, style: str) -> tuple[str, int, int]:
    """The user's answer to a wrong guess, and the interval left."""
    if guess is None:
        return "Reply with one whole number.", lo, hi
    word, lo, hi = ("Higher", max(lo, guess + 1), hi) if guess < answer else ("Lower", lo, min(hi, guess - 1))
    return (f"{word}. It is between {lo} and {hi}." if style == "range" else f"{word}."), lo, hi


class GuessTaskConfig(vf.TaskConfig):
    turn_cost: float = Field(0.0, ge=0.0, le=0.25)
    """Reward taken off per guess after the first, for a solved game (0 = a
    plain 1/0 reward)."""


class GuessConfig(vf.TasksetConfig):
    """``--env.taskset.*`` knobs (``env_args.taskset`` in an rlnode cube)."""

    task: GuessTaskConfig = GuessTaskConfig()
    max_number: int = Field(8, ge=2, le=1000)
    """Hidden numbers are drawn from 1..max_number."""
    max_turns: int = Field(4, ge=1, le=64)
    """Guesses allowed per game."""
    feedback: Literal["direction", "range"] = "direction"
    """"direction": "Higher." / "Lower."; "range" adds the interval left
    ("Higher. It is between 6 and 8."), which a small model can act on from
    the last message alone."""
    split: Literal["train", "eval"] = "train"
    """Which stream of tasks: train and eval draw from separate seeds."""
    num_tasks: int = Field(1000, ge=1)
    seed: int = 0


class GuessData(vf.TaskData):
    answer: int
    max_number: int
    max_turns: int
    feedback: str = "direction"


class GuessTask(vf.Task[GuessData, vf.State, GuessTaskConfig]):
    @property
    def key(self) -> str:
        return self.data.id or self.hash

    @vf.reward
    async def correct(self, task: GuessData, trace: vf.Trace) -> float:
        replies = [m.content for m in trace.assistant_messages]
        solved, used = play(task.answer, replies, task.max_turns)
        return max(0.0, 1.0 - self.config.turn_cost * (used - 1)) if solved else 0.0

    @vf.metric
    async def guesses(self, task: GuessData, trace: vf.Trace) -> float:
        return float(play(task.answer, [m.content for m in trace.assistant_messages], task.max_turns)[1])


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        cfg = self.config
        rng = random.Random(f"vf_guess:{cfg.seed}:{cfg.split}")
        prompt = (f"I am thinking of a whole number between 1 and {cfg.max_number}. "
                  f"You have {cfg.max_turns} guesses; after each wrong one I say Higher or Lower. Your guess?")
        for i in range(cfg.num_tasks):
            yield GuessTask(
                GuessData(id=f"{cfg.split}-{i:05d}", prompt=prompt, system_prompt=SYSTEM_PROMPT,
                          answer=rng.randint(1, cfg.max_number), max_number=cfg.max_number,
                          max_turns=cfg.max_turns, feedback=cfg.feedback),
                cfg.task,
            )


class GuessHarnessConfig(vf.HarnessConfig):
    pass


class GuessHarness(vf.Harness[GuessHarnessConfig]):
    """One model call per segment, made in-process; a resumed segment
    replays the conversation so far (``Harness.resume``'s default)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        except APIError as e:  # the interception recorded the cause (a @stop, a limit, the upstream)
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"model call failed: {e}")
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The guesser. Local runtime: the harness runs in-process and executes
    nothing, so no sandbox is needed."""


class GuessEnv(vf.Env[GuessEnvConfig]):
    """The environment plays the user: feedback after every wrong guess."""

    async def run(self, task: GuessTask, agents: vf.Agents) -> None:
        data = task.data
        lo, hi = 1, data.max_number
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()  # the prompted task: the model opens
            for turn in range(1, data.max_turns + 1):
                if segment.terminated:
                    break
                guess = first_int(segment.last_reply)
                if guess == data.answer or turn == data.max_turns:
                    break
                text, lo, hi = feedback(data.answer, guess, lo, hi, data.feedback)
                segment = await interaction.turn(text)


__all__ = ["GuessEnv", "GuessHarness", "GuessTaskset", "load_environment"]


def load_environment(**kwargs: Any) -> GuessEnv:
    """The env, configured like an ``[env]`` table: ``taskset`` (``GuessConfig``
    knobs), ``player`` (an ``AgentConfig``), ``timeout``, ``retries``."""
    from rlnode.cubes.verifiers_cube import env_config

    return GuessEnv(env_config(__name__, kwargs))
