"""The python-math cube driven by scripted Actions (no LLM): real sandbox
runs, exact scoring, agent-visible errors for malformed turns, and
deterministic, disjoint train/test splits."""

from __future__ import annotations

import re
from fractions import Fraction

import msgspec
import pytest

from rlnode.cubes.base import Action, ToolCall
from rlnode.cubes.python_math import FAMILIES, PythonMathCube, is_test_problem, make_problem, parse_number
from rlnode.cubes.registry import make_cube

SANDBOX = {"wall_timeout_s": 3.0, "cpu_seconds": 1}


def cube(seed: int = 0, **options) -> PythonMathCube:
    options.setdefault("sandbox", SANDBOX)
    return make_cube("pm", "python-math", options, seed)


def call(name: str, **arguments) -> Action:
    return Action(text="", tool_calls=[ToolCall(name, arguments)])


async def open_sum_squares(seed: int = 0):
    task = await cube(seed, families=["sum_squares"]).open_task("train-00003")
    reset = await task.reset()
    a, b = map(int, re.search(r"from (\d+) to (\d+)", reset.observation).groups())
    return task, reset, a, b


async def test_registry_builds_the_cube_and_validates_options():
    c = cube(num_train_tasks=7, num_test_tasks=3)
    assert c.kind == "python-math" and c.cube_id == "pm"
    assert await c.task_ids("train") == [f"train-{i:05d}" for i in range(7)]
    assert await c.task_ids("test") == ["test-00000", "test-00001", "test-00002"]
    assert c.opts.sandbox.wall_timeout_s == 3.0
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        cube(max_turns=3)
    with pytest.raises(msgspec.ValidationError, match="families"):
        cube(families=["calculus"])
    with pytest.raises(msgspec.ValidationError):
        cube(sandbox={"memory_mib": 1})
    with pytest.raises(KeyError):
        await c.open_task("test-00003")
    with pytest.raises(KeyError):
        await c.open_task("valid-00000")


async def test_splits_are_disjoint_and_deterministic():
    train = [make_problem(3, "train", i, list(FAMILIES)) for i in range(400)]
    test = [make_problem(3, "test", i, list(FAMILIES)) for i in range(80)]
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(is_test_problem(p.question) for p in test)
    assert not any(is_test_problem(p.question) for p in train)
    assert {p.family for p in train} == set(FAMILIES)
    # Same (seed, split, index) -> same problem, through the cube too.
    c = cube(3)
    assert c.problem("train-00005") == train[5] and c.problem("test-00007") == test[7]
    assert [make_problem(3, "test", i, list(FAMILIES)) for i in range(80)] == test
    other = [make_problem(4, "train", i, list(FAMILIES)) for i in range(400)]
    assert sum(p == q for p, q in zip(train, other)) < 5


async def test_scripted_episode_with_the_right_answer():
    task, reset, a, b = await open_sum_squares()
    assert reset.observation.startswith(f"What is the sum of i*i for all integers i from {a} to {b}")
    assert reset.system and reset.info == {"family": "sum_squares"}
    assert [t.name for t in task.tools()] == ["run_python", "submit_answer"]
    assert task.tools()[0].as_chat_tool()["function"]["parameters"]["required"] == ["code"]

    ran = await task.step(call("run_python", code=f"print(sum(i*i for i in range({a}, {b} + 1)))"))
    expected = sum(i * i for i in range(a, b + 1))
    assert (ran.observation, ran.role, ran.error, ran.done, ran.reward) == (str(expected), "tool", None, False, 0.0)

    done = await task.step(call("submit_answer", answer=int(ran.observation)))
    assert (done.done, done.reward, done.error, done.info) == (True, 1.0, None, {"correct": True})
    ev = await task.evaluate()
    assert (ev.reward, ev.success, ev.info["expected"]) == (1.0, True, expected)
    after = await task.step(call("submit_answer", answer=0))
    assert after.done and after.error == "episode already over"
    assert (await task.evaluate()).success


async def test_scripted_episode_with_a_wrong_answer():
    task, _, a, b = await open_sum_squares()
    expected = sum(i * i for i in range(a, b + 1))
    done = await task.step(call("submit_answer", answer=str(expected + 1)))
    assert (done.done, done.reward, done.info) == (True, 0.0, {"correct": False})
    ev = await task.evaluate()
    assert (ev.reward, ev.success, ev.info["submitted"]) == (0.0, False, str(expected + 1))


async def test_answers_are_compared_exactly():
    assert parse_number(285) == parse_number(285.0) == parse_number(" 285 ") == 285
    assert parse_number("1,234,567") == 1234567 and parse_number("$42$") == 42
    assert parse_number("\\boxed{7}") == 7 and parse_number("2.5e3") == 2500
    assert parse_number("0.1") == Fraction(1, 10)
    for bad in (True, None, "abc", "nan", "inf", float("inf"), [1], "1/2x"):
        assert parse_number(bad) is None
    # A big integer off by one is wrong (no float tolerance).
    task, _, a, b = await open_sum_squares()
    expected = sum(i * i for i in range(a, b + 1))
    assert expected > 10**15
    done = await task.step(call("submit_answer", answer=f"{expected - 1:,}"))
    assert done.done and done.reward == 0.0


async def test_malformed_turns_get_errors_and_the_episode_goes_on():
    task, _, _, _ = await open_sum_squares()
    cases = [
        (Action(text="<tool_call>{bad", parse_error="unterminated <tool_call>"), "parse error", "user"),
        (Action(text="The answer is 285."), "no tool call", "user"),
        (call("calculator", expr="1+1"), "unknown tool 'calculator'", "tool"),
        (call("run_python"), "missing or invalid argument: code", "tool"),
        (call("run_python", code=123), "missing or invalid argument: code", "tool"),
        (call("run_python", code="print(1)", timeout=5), "unexpected arguments: timeout", "tool"),
        (call("submit_answer"), "missing or unexpected arguments", "tool"),
        (call("submit_answer", answer="about forty"), "invalid argument: answer", "tool"),
        (call("submit_answer", answer=True), "invalid argument: answer", "tool"),
    ]
    for action, error, role in cases:
        r = await task.step(action)
        assert (r.done, r.reward, r.role) == (False, 0.0, role), action
        assert r.error and r.error.startswith(error), (action, r.error)
        assert r.observation
    plain = await task.step(Action(text="285"))
    assert "run_python" in plain.observation and "submit_answer" in plain.observation
    ev = await task.evaluate()
    assert (ev.reward, ev.success, ev.info["submitted"]) == (0.0, False, None)


async def test_run_python_reports_failures_to_the_agent():
    task, _, _, _ = await open_sum_squares()
    r = await task.step(call("run_python", code="x = 1"))
    assert r.observation == "(no output; use print() to show values)" and r.error is None
    r = await task.step(call("run_python", code="print('partial')\n1/0"))
    assert r.observation.startswith("partial\n[stderr]\nTraceback") and "ZeroDivisionError" in r.observation
    r = await task.step(call("run_python", code="import sys\nsys.exit(3)"))
    assert r.observation == "[exit code 3]"
    r = await task.step(call("run_python", code="while True: pass"))
    assert r.observation == "[killed: CPU limit of 1 s exceeded]" and not r.done
    r = await task.step(call("run_python", code="print(open('/etc/passwd').read())"))
    assert "sandbox: reading outside the working directory" in r.observation and "root:" not in r.observation


async def test_several_calls_in_one_turn_run_in_order():
    task, _, a, b = await open_sum_squares()
    expected = sum(i * i for i in range(a, b + 1))
    action = Action(text="", tool_calls=[
        ToolCall("run_python", {"code": "print(2 + 2)"}),
        ToolCall("submit_answer", {"answer": expected}),
        ToolCall("run_python", {"code": "print('never runs')"}),
    ])
    r = await task.step(action)
    assert r.observation == "[run_python]\n4\n\n[submit_answer]\nAnswer submitted."
    assert (r.done, r.reward) == (True, 1.0)
