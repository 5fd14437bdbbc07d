"""Built-in cubes, the registry and tool-call parsing, driven by scripted
actions (no LLM: these are the cube rules themselves)."""

import json
import sys

import msgspec
import pytest

from rlnode.actor.episode import parse_action
from rlnode.cubes.base import Action, CubeError, ToolCall, ToolSpec
from rlnode.cubes.registry import UnknownCube, cube_class, make_cube


def act(text="", calls=()):
    return Action(text=text, tool_calls=[ToolCall(n, a) for n, a in calls])


async def test_guessing_range_feedback_and_binary_search_wins():
    cube = make_cube("g", "guessing", {"max_number": 8, "max_turns": 4}, seed=3)
    for tid in (await cube.task_ids("test"))[:20]:
        task = await cube.open_task(tid)
        await task.reset()
        lo, hi, done = 1, 8, False
        while not done:
            guess = (lo + hi) // 2
            r = await task.step(act(str(guess)))
            done = r.done
            if not done:
                assert r.observation.startswith(("Higher", "Lower"))
                lo, hi = map(int, r.observation.rstrip(".").split("between ")[1].split(" and "))
        ev = await task.evaluate()
        assert ev.success and ev.reward == 1.0


async def test_guessing_ends_after_max_turns_and_counts_bad_replies():
    cube = make_cube("g", "guessing", {"max_number": 8, "max_turns": 3, "feedback": "direction"}, seed=0)
    task = await cube.open_task("train-00000")
    target = cube.target("train-00000")
    wrong = 1 if target != 1 else 2
    r1 = await task.step(act("no idea"))
    assert r1.error and not r1.done
    r2 = await task.step(act(f"I guess {wrong}"))
    assert r2.observation in ("Higher.", "Lower.") and not r2.done
    r3 = await task.step(act(str(wrong)))
    assert r3.done and r3.reward == 0.0
    assert (await task.evaluate()).success is False
    assert cube.feedback_ignoring_success() == pytest.approx(3 / 8)


async def test_guessing_wasted_turn_cost_prices_wasted_turns_only():
    """wasted_turn_cost c: each reply with no number, or outside the range the
    feedback already ruled in (a repeat too), costs c, win or lose; a valid
    guess costs nothing however late the win; success is unchanged. A cost
    that would make a win no better than a clean loss is refused, naming
    the key."""
    cube = make_cube("g", "guessing", {"max_number": 5, "max_turns": 3, "wasted_turn_cost": 0.2}, seed=0)
    tid = next(t for t in await cube.task_ids("train") if cube.target(t) == 3)
    cases = ((["3"], 1.0, True), (["1", "5", "3"], 1.0, True),  # valid guesses are free
             (["no idea", "3"], 0.8, True),
             (["4", "5", "3"], 0.8, True),  # 5 after "lower than 4": outside 1..3
             (["1", "1", "3"], 0.8, True),  # a repeat is outside 2..5
             (["?", "??", "3"], 0.6, True),
             (["?", "1", "1"], -0.4, False), (["1", "2", "4"], 0.0, False))
    for replies, reward, success in cases:
        task = await cube.open_task(tid)
        await task.reset()
        for text in replies:
            r = await task.step(act(text))
        assert r.done and r.reward == pytest.approx(reward if success else 0.0), replies
        ev = await task.evaluate()  # the episode's reward
        assert ev.reward == pytest.approx(reward) and ev.success is success, replies
    with pytest.raises(msgspec.ValidationError, match="wasted_turn_cost"):
        make_cube("g", "guessing", {"max_turns": 3, "wasted_turn_cost": 0.5}, seed=0)


async def test_guessing_is_deterministic_and_splits_disjoint():
    a = make_cube("g", "guessing", {}, seed=1)
    b = make_cube("g", "guessing", {}, seed=1)
    ids = await a.task_ids("train")
    assert [a.target(t) for t in ids[:50]] == [b.target(t) for t in ids[:50]]
    assert not set(ids) & set(await a.task_ids("test"))
    assert len({a.target(t) for t in ids[:200]}) == 8  # every number occurs


async def test_arithmetic_submit_answer_and_disjoint_splits():
    cube = make_cube("a", "arithmetic", {"max_operand": 9, "ops": ["+", "*"]}, seed=5)
    train = {cube.problem(t)[0] for t in await cube.task_ids("train")}
    test = {cube.problem(t)[0] for t in await cube.task_ids("test")}
    assert train and test and not train & test
    assert len(train) + len(test) == 10 * 2 * 10
    tid = (await cube.task_ids("test"))[0]
    question, answer = cube.problem(tid)
    task = await cube.open_task(tid)
    assert question in (await task.reset()).observation
    assert [t.name for t in task.tools()] == ["submit_answer"]
    r = await task.step(act("", [("submit_answer", {"answer": answer + 1})]))
    assert r.done and r.reward == 0.0
    task = await cube.open_task(tid)
    bad = await task.step(act("the answer is 3"))
    assert bad.error == "no tool call" and not bad.done
    unknown = await task.step(act("", [("calculator", {"x": 1})]))
    assert unknown.error and "unknown tool" in unknown.error
    missing = await task.step(act("", [("submit_answer", {"value": 1})]))
    assert missing.error == "missing argument: answer"
    ok = await task.step(act("", [("submit_answer", {"answer": str(answer)})]))
    assert ok.done and ok.reward == 1.0
    assert (await task.evaluate()).success


async def test_arithmetic_in_text_scores_the_replys_first_number():
    """answer_mode = "text": no tools; the first number of the reply is the
    answer, so restating the question first ("8 - 9 = -1") answers 8."""
    tool = make_cube("a", "arithmetic", {"max_operand": 9, "ops": ["-"]}, seed=5)
    cube = make_cube("a", "arithmetic", {"max_operand": 9, "ops": ["-"], "answer_mode": "text"}, seed=5)
    tid = (await cube.task_ids("test"))[0]
    assert cube.problem(tid) == tool.problem(tid)  # the same split, whatever the mode
    question, answer = cube.problem(tid)
    task = await cube.open_task(tid)
    assert task.tools() == [] and (await task.reset()).observation == f"What is {question}? Reply with the number only."
    r = await task.step(act(f"{answer}"))
    assert r.done and r.reward == 1.0 and (await task.evaluate()).success
    restated = await (await cube.open_task(tid)).step(act(f"{question} = {answer}"))
    assert restated.done and restated.reward == float(int(question.split()[0]) == answer)


async def test_jsonl_single_file_split_and_scoring(tmp_path):
    f = tmp_path / "qa.jsonl"
    rows = [{"question": f"capital #{i}?", "answer": "Paris" if i % 2 else 3.5, "id": f"q{i}"} for i in range(200)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cube = make_cube("j", "jsonl", {"path": str(f), "test_fraction": 0.25}, seed=0)
    await cube.start()
    train, test = await cube.task_ids("train"), await cube.task_ids("test")
    assert not set(train) & set(test) and len(train) + len(test) == 200
    assert 25 <= len(test) <= 75
    t = await cube.open_task("q1")
    await t.reset()
    r = await t.step(act("", [("submit_answer", {"answer": " paris "})]))
    assert r.reward == 1.0
    t = await cube.open_task("q2")
    r = await t.step(act("", [("submit_answer", {"answer": "3.50"})]))
    assert r.reward == 1.0  # numeric match


async def test_jsonl_text_mode_and_explicit_files(tmp_path):
    (tmp_path / "tr.jsonl").write_text('{"question": "1+1?", "answer": 2}\n')
    (tmp_path / "te.jsonl").write_text('{"question": "2+2?", "answer": 4, "metadata": {"src": "x"}}\n')
    cube = make_cube("j", "jsonl", {"train_path": str(tmp_path / "tr.jsonl"), "test_path": str(tmp_path / "te.jsonl"),
                                    "answer_mode": "text"}, seed=0)
    await cube.start()
    assert await cube.task_ids("train") == ["train-line1"]
    assert await cube.task_ids("test") == ["test-line1"]
    task = await cube.open_task((await cube.task_ids("test"))[0])
    assert task.tools() == []
    r = await task.step(act("It is 4."))
    assert r.done and r.reward == 1.0


async def test_jsonl_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "a", "answer": 1}\n{"question": 5}\n')
    cube = make_cube("j", "jsonl", {"path": str(f)}, seed=0)
    with pytest.raises(CubeError, match=r"bad\.jsonl:2:"):
        await cube.start()


def test_registry_unknown_and_entry_point(tmp_path, monkeypatch):
    with pytest.raises(UnknownCube, match="unknown cube kind 'nope'"):
        cube_class("nope")
    # A plug-in package, installed the way pip would: a dist-info with an
    # entry point in the rlnode.cubes group.
    pkg = tmp_path / "mycube_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from rlnode.cubes.guessing import GuessingCube\n"
        "class MyCube(GuessingCube):\n    kind = 'my-cube'\n")
    dist = tmp_path / "mycube_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mycube-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rlnode.cubes]\nmy-cube = mycube_pkg:MyCube\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = cube_class("my-cube")
    assert cls.__name__ == "MyCube" and cls.__module__ == "mycube_pkg"
    cube = make_cube("mine", "my-cube", {"max_number": 4}, seed=0)
    assert cube.opts.max_number == 4
    with pytest.raises(msgspec.ValidationError):
        make_cube("mine", "my-cube", {"max_number": "four"}, seed=0)
    sys.modules.pop("mycube_pkg", None)


async def test_fault_injection_is_a_test_cube_every_daemon_finds():
    """Fault injection lives in tests/ (tests/plugins/rlnode_test_cubes.py),
    not in the production guessing cube: ``faulty-guessing`` fails every
    Nth train task in reset, on every attempt, and is otherwise guessing
    with the same hidden numbers. It is a plug-in like any other, so a
    daemon the tests start as a subprocess finds it too (conftest.py puts
    its directory on PYTHONPATH)."""
    import subprocess

    with pytest.raises(msgspec.ValidationError, match="fail_reset_every"):
        make_cube("g", "guessing", {"fail_reset_every": 4}, seed=0)
    faulty = make_cube("f", "faulty-guessing", {"max_number": 5, "fail_reset_every": 4}, seed=7)
    plain = make_cube("g", "guessing", {"max_number": 5}, seed=7)
    failed = []
    for tid in [*(await faulty.task_ids("train"))[:9], *(await faulty.task_ids("test"))[:5]]:
        assert faulty.target(tid) == plain.target(tid)
        task = await faulty.open_task(tid)
        try:
            await task.reset()
        except CubeError as e:
            assert "injected reset failure" in str(e)
            failed.append(tid)
            continue
        assert (await task.step(act(str(plain.target(tid))))).reward == 1.0
    assert failed == ["train-00000", "train-00004", "train-00008"]
    out = subprocess.run([sys.executable, "-c", "from rlnode.cubes.registry import cube_class; "
                          "print(cube_class('faulty-guessing').__module__)"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "rlnode_test_cubes"


def test_parse_action_variants(tokenizer):
    """The default reader (vLLM's hermes parser, model.tool_parser): what a
    cube sees of a completion. tests/test_parsers.py has the other formats."""
    from rlnode.actor.parsing import CompletionParser

    hermes = CompletionParser(tokenizer)
    tools = [ToolSpec("submit_answer"), ToolSpec("f")]

    def parse(text):
        return parse_action(text, hermes, tools)

    a = parse('Let me answer. <tool_call>{"name": "submit_answer", "arguments": {"answer": 4}}</tool_call>')
    assert a == Action(text="Let me answer.", tool_calls=[ToolCall("submit_answer", {"answer": 4})])
    s = parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert s.tool_calls == [ToolCall("f", {"x": 1})]
    two = parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c.name for c in two.tool_calls] == ["a", "b"]
    # vLLM's hermes parser reads all calls or none: one without arguments
    # (or any malformed one) is a parse error, shown to the agent.
    for bad in ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>["f"]</tool_call>',
                '<tool_call>{"name": "f"', '<tool_call>{"name": "a"}</tool_call>'):
        a = parse(bad)
        assert a.tool_calls == [] and a.parse_error.startswith("invalid tool call: <tool_call>"), bad
    # Cut off after a complete call (a length stop before </tool_call>): still the call.
    assert parse('<tool_call>{"name": "f", "arguments": {}}').tool_calls == [ToolCall("f", {})]
    assert parse("42") == Action(text="42")
    # A turn that offers no tools reads no call (as vllm serve).
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_action(text, hermes, []) == Action(text=text)
