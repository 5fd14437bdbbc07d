"""``python-math``: integer questions that pay off computing, with a sandboxed
Python tool.

Owns: the procedural problems (families in ``FAMILIES``, each derived
deterministically from (seed, split, index)), the ``run_python`` and
``submit_answer`` tools, and exact scoring. Must not run agent code anywhere
but ``rlnode.cubes.wall.sandbox.run_python`` (one fresh process per call, isolated
by the OS: bubblewrap, else unshare; with neither, every run_python call
fails with a CubeError unless ``sandbox.isolation = "none"`` is set), and
must not block the event loop: answers are computed in a worker thread.

Splits: a problem belongs to the test split when a hash of its text falls in
one bucket of ``_BUCKETS``, else to train; each split draws candidates until
one lands in its own buckets, so train and test never share a problem,
whatever the seed.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Annotated, Any, Callable

import msgspec
from msgspec import Meta

from rlnode.cubes.base import (Action, Cube, CubeError, CubeTask, CubeTaskRef, Evaluation, Reset, Split,
                               StepResult, ToolCall, ToolSpec, run_blocking)
from rlnode.cubes.wall.sandbox import SandboxError, SandboxLimits, SandboxResult, run_python
from rlnode.cubes.tasks import split_index, task_rng

_BUCKETS = 8  # one in eight problem texts is test material
_MAX_CALLS_PER_TURN = 4
_MAX_ANSWER_CHARS = 10_000

RUN_PYTHON = ToolSpec(
    name="run_python",
    description=("Run a Python 3 program (standard library only, no network, no files outside its "
                 "working directory) and return what it prints. Use print() to see values."),
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the complete program to run"}},
        "required": ["code"],
        "additionalProperties": False,
    },
)
SUBMIT_ANSWER = ToolSpec(
    name="submit_answer",
    description="Submit your final answer (a number). Ends the episode.",
    parameters={
        "type": "object",
        "properties": {"answer": {"type": ["number", "string"], "description": "the final answer, e.g. 285"}},
        "required": ["answer"],
        "additionalProperties": False,
    },
)
_HOW = ("Call a tool: run_python with {\"code\": \"...\"} to compute, then submit_answer with "
        "{\"answer\": <number>}.")
SYSTEM = ("You solve math problems exactly. Write Python programs with the run_python tool to compute, "
          "then give the final integer with the submit_answer tool.")

Problem = tuple[str, Callable[[], int]]  # question text, answer (computed lazily)


# ---- problem families: rng -> (text, answer thunk) -------------------------

def _sum_squares(rng: random.Random) -> Problem:
    a = rng.randint(1, 10_000)
    b = a + rng.randint(10_000, 1_000_000)

    def s(n: int) -> int:
        return n * (n + 1) * (2 * n + 1) // 6

    return f"What is the sum of i*i for all integers i from {a} to {b} inclusive?", lambda: s(b) - s(a - 1)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.2e9 (bases 2, 3, 5, 7)."""
    if n < 2 or n % 2 == 0:
        return n == 2
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in (2, 3, 5, 7):
        x = pow(a, d, n)
        if x in (1, n - 1) or a % n == 0:
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _product_mod(rng: random.Random) -> Problem:
    a = rng.randint(2, 100)
    b = a + rng.randint(1_000, 20_000)
    m = rng.randint(10**8, 10**9)
    while not _is_prime(m):  # a prime above b: the product is never trivially 0
        m += 1

    def solve() -> int:
        p = 1
        for i in range(a, b + 1):
            p = p * i % m
        return p

    return f"What is the product of all integers from {a} to {b} inclusive, modulo {m}?", solve


def _count_primes(rng: random.Random) -> Problem:
    n = rng.randint(10_000, 500_000)

    def solve() -> int:
        sieve = bytearray([1]) * n
        sieve[:2] = b"\x00\x00"
        for i in range(2, math.isqrt(n - 1) + 1):
            if sieve[i]:
                sieve[i * i::i] = bytes(len(range(i * i, n, i)))
        return sum(sieve)

    return f"How many prime numbers are less than {n}?", solve


def _digit_sum_power(rng: random.Random) -> Problem:
    base = rng.randint(2, 999)
    # At most ~4000 digits: str() of larger ints is refused by default (3.11).
    exp = rng.randint(50, int(4000 / math.log10(base)))
    return (f"What is the sum of the decimal digits of {base}^{exp} ({base} to the power {exp})?",
            lambda: sum(map(int, str(base**exp))))


def _fibonacci_mod(rng: random.Random) -> Problem:
    n = rng.randint(10_000, 1_000_000)
    m = rng.randint(1_000, 10**9)

    def fib(k: int) -> tuple[int, int]:  # (F(k), F(k+1)) mod m, fast doubling
        if k == 0:
            return 0, 1
        f, g = fib(k // 2)
        c, d = f * (2 * g - f) % m, (f * f + g * g) % m
        return (d, (c + d) % m) if k % 2 else (c, d)

    return (f"The Fibonacci numbers are F(0) = 0, F(1) = 1, F(k) = F(k-1) + F(k-2). "
            f"What is F({n}) modulo {m}?", lambda: fib(n)[0])


def _collatz_steps(rng: random.Random) -> Problem:
    start = rng.randint(10**5, 10**9)

    def solve() -> int:
        n, steps = start, 0
        while n != 1:
            n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
        return steps

    return (f"Start from n = {start} and repeatedly replace n by n/2 if n is even or by 3n+1 if n is "
            f"odd. How many replacements does it take to reach 1?", solve)


def _divisor_sum(rng: random.Random) -> Problem:
    n = rng.randint(10**6, 10**9)

    def solve() -> int:
        total, d = 0, 1
        while d * d <= n:
            if n % d == 0:
                total += d + (n // d if d * d != n else 0)
            d += 1
        return total

    return f"What is the sum of all positive divisors of {n} (including 1 and {n})?", solve


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "sum_squares": _sum_squares,
    "product_mod": _product_mod,
    "count_primes": _count_primes,
    "digit_sum_power": _digit_sum_power,
    "fibonacci_mod": _fibonacci_mod,
    "collatz_steps": _collatz_steps,
    "divisor_sum": _divisor_sum,
}


class PythonMathProblem(msgspec.Struct, frozen=True):
    family: str
    question: str
    answer: int


def is_test_problem(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "little") % _BUCKETS == 0


def make_problem(seed: int, split: Split, index: int, families: list[str]) -> PythonMathProblem:
    """The problem of ``{split}-{index}``; pure and deterministic. Blocking
    (up to tens of ms): call it through ``run_blocking``."""
    for attempt in range(10_000):
        rng = task_rng(seed, "python-math", split, index, attempt)
        family = rng.choice(sorted(families))
        question, solve = FAMILIES[family](rng)
        if is_test_problem(question) == (split == "test"):
            return PythonMathProblem(family, question, solve())
    raise CubeError(f"no {split} problem found for index {index}")  # p < 1e-500


# ---- answers and observations ----------------------------------------------

_BOXED = re.compile(r"^\\boxed\{(.*)\}$")


def parse_number(value: Any) -> Fraction | None:
    """A submitted answer as an exact number: JSON numbers, or strings like
    "285", "1,234", "2.5e3", "$42$", "\\boxed{7}"; None if not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(value) if math.isfinite(value) else None
    if not isinstance(value, str) or len(value) > _MAX_ANSWER_CHARS:
        return None
    text = value.strip().strip("$").strip()
    if m := _BOXED.match(text):
        text = m.group(1)
    text = text.replace(",", "").replace("_", "").replace(" ", "")
    try:
        return Fraction(Decimal(text))
    except (InvalidOperation, ValueError, OverflowError):
        return None


def format_run(r: SandboxResult, limits: SandboxLimits) -> str:
    """What the agent sees of one run: output, then why it stopped."""
    parts = []
    if r.stdout:
        parts.append(r.stdout.rstrip("\n"))
        if r.stdout_truncated:
            parts.append(f"[stdout truncated to {limits.max_output_bytes} bytes]")
    if r.stderr:
        parts.append("[stderr]\n" + r.stderr.rstrip("\n"))
        if r.stderr_truncated:
            parts.append(f"[stderr truncated to {limits.max_output_bytes} bytes]")
    reasons = {
        "wall_timeout": f"[killed: time limit of {limits.wall_timeout_s:g} s exceeded]",
        "cpu_limit": f"[killed: CPU limit of {limits.cpu_seconds} s exceeded]",
        "memory": f"[memory limit of {limits.memory_mib} MiB exceeded]",
        "output_limit": "[killed: too much output]",
        "signal": f"[killed by signal {-(r.exit_code or 0)}]",
    }
    if r.killed_reason is not None:
        parts.append(reasons[r.killed_reason])
    elif r.exit_code not in (0, None) and not r.stderr:
        parts.append(f"[exit code {r.exit_code}]")
    return "\n".join(parts) or "(no output; use print() to show values)"


# ---- the cube -----------------------------------------------------------------

class PythonMathOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Task instances per split (ids train-N / test-N).
    num_train_tasks: Annotated[int, Meta(ge=1, le=10_000_000)] = 10_000
    num_test_tasks: Annotated[int, Meta(ge=1, le=1_000_000)] = 200
    # Problem families to draw from, a non-empty subset of FAMILIES.
    families: list[str] = msgspec.field(default_factory=lambda: list(FAMILIES))
    # Limits of each run_python call (wall/CPU time, memory, output, files,
    # processes) and its OS isolation layer (`isolation`, default "auto").
    sandbox: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    # Sandboxed runs at once over all episodes of this cube: each is a
    # process, and episodes far outnumber cores.
    max_parallel_runs: Annotated[int, Meta(ge=1, le=1024)] = 4
    # Longest program run_python accepts, in characters.
    max_code_chars: Annotated[int, Meta(ge=1, le=1_000_000)] = 20_000

    def __post_init__(self):
        bad = [f for f in self.families if f not in FAMILIES]
        if bad or not self.families:
            raise ValueError(f"families: expected a non-empty subset of {list(FAMILIES)}, got {self.families}")


class PythonMathTask(CubeTask):
    def __init__(self, ref: CubeTaskRef, problem: PythonMathProblem, opts: PythonMathOptions,
                 runs: asyncio.Semaphore):
        self.ref, self.problem, self.opts, self.runs = ref, problem, opts, runs
        self.submitted: Any = None
        self.correct = False
        self.done = False

    async def reset(self) -> Reset:
        self.submitted, self.correct, self.done = None, False, False
        limit = self.opts.sandbox.wall_timeout_s
        text = (f"{self.problem.question}\n\nThe answer is an integer. Compute it with the run_python tool "
                f"(Python standard library, {limit:g} s per run), then call submit_answer.")
        return Reset(observation=text, system=SYSTEM, info={"family": self.problem.family})

    def tools(self) -> list[ToolSpec]:
        return [RUN_PYTHON, SUBMIT_ANSWER]

    async def step(self, action: Action) -> StepResult:
        if self.done:
            return StepResult("The episode is over.", done=True, error="episode already over")
        if action.parse_error:
            return StepResult(f"Your tool call could not be parsed: {action.parse_error}. {_HOW}",
                              error=f"parse error: {action.parse_error}", role="user")
        if not action.tool_calls:
            return StepResult(f"No tool call found. {_HOW}", error="no tool call", role="user")
        calls = action.tool_calls
        observations, errors = [], []
        for call in calls[:_MAX_CALLS_PER_TURN]:
            observation, error = await self._call(call)
            observations.append(observation if len(calls) == 1 else f"[{call.name}]\n{observation}")
            if error:
                errors.append(error)
            if self.done:
                break
        if len(calls) > _MAX_CALLS_PER_TURN and not self.done:
            observations.append(f"[only the first {_MAX_CALLS_PER_TURN} tool calls of a turn are run]")
        reward = float(self.correct) if self.done else 0.0
        return StepResult("\n\n".join(observations), reward=reward, done=self.done,
                          info={"correct": self.correct} if self.done else {},
                          error="; ".join(errors) or None, role="tool")

    async def _call(self, call: ToolCall) -> tuple[str, str | None]:
        """One tool call -> (observation, error or None)."""
        if call.name == "run_python":
            return await self._run_python(call.arguments)
        if call.name == "submit_answer":
            return self._submit(call.arguments)
        return (f"Unknown tool {call.name!r}. Available tools: run_python(code), submit_answer(answer).",
                f"unknown tool {call.name!r}")

    async def _run_python(self, args: dict[str, Any]) -> tuple[str, str | None]:
        code = args.get("code")
        if set(args) - {"code"}:
            extra = ", ".join(sorted(set(args) - {"code"}))
            return f"run_python takes one argument, code; got unexpected {extra}.", f"unexpected arguments: {extra}"
        if not isinstance(code, str) or not code.strip():
            return ("run_python needs a 'code' argument: a non-empty string with the program.",
                    "missing or invalid argument: code")
        if len(code) > self.opts.max_code_chars:
            return (f"The program is too long ({len(code)} characters, limit {self.opts.max_code_chars}).",
                    "code too long")
        async with self.runs:
            try:
                result = await run_python(code, self.opts.sandbox)
            except SandboxError as e:
                raise CubeError(f"python sandbox failed: {e}") from e
        return format_run(result, self.opts.sandbox), None

    def _submit(self, args: dict[str, Any]) -> tuple[str, str | None]:
        if "answer" not in args or set(args) - {"answer"}:
            return ("submit_answer takes exactly one argument, answer (a number).",
                    "missing or unexpected arguments")
        value = parse_number(args["answer"])
        if value is None:
            shown = repr(args["answer"])[:80]
            return (f"The answer must be a number, e.g. {{\"answer\": 285}}; got {shown}.",
                    "invalid argument: answer")
        self.submitted, self.done = args["answer"], True
        self.correct = value == self.problem.answer
        return "Answer submitted.", None

    async def evaluate(self) -> Evaluation:
        return Evaluation(reward=float(self.correct), success=self.correct,
                          info={"submitted": self.submitted, "expected": self.problem.answer,
                                "family": self.problem.family})


class PythonMathCube(Cube):
    runs_agents = False  # the actor plays every episode itself (rlnode/actor/episode.py)

    kind = "python-math"
    Options = PythonMathOptions

    def __init__(self, cube_id: str, options: PythonMathOptions, seed: int):
        self.cube_id = cube_id
        self.opts = options
        self.seed = seed
        self.runs = asyncio.Semaphore(options.max_parallel_runs)

    def _size(self, split: Split) -> int:
        return self.opts.num_train_tasks if split == "train" else self.opts.num_test_tasks

    async def task_ids(self, split: Split) -> list[str]:
        return [f"{split}-{i:05d}" for i in range(self._size(split))]

    def problem(self, task_id: str) -> PythonMathProblem:
        """Blocking; raises KeyError for an id outside the splits."""
        split, index = split_index(task_id)
        if index >= self._size(split):
            raise KeyError(f"task id {task_id!r} out of range: {split} has {self._size(split)} tasks")
        return make_problem(self.seed, split, index, self.opts.families)

    async def open_task(self, task_id: str) -> CubeTask:
        problem = await run_blocking(self.problem, task_id)
        return PythonMathTask(CubeTaskRef(self.cube_id, task_id), problem, self.opts, self.runs)
