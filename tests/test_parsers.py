"""Tool calls and reasoning read by vLLM's own parsers (``model.tool_parser``,
``model.reasoning_parser``; ``rlnode/actor/parsing.py``), through both paths
that read completions: the native agent loop (``run_episode`` ->
``parse_action`` -> the cube's ``Action``) and the gateway (the openai SDK
against ``Gateway``, plain and streamed). The completions are real models'
published outputs or vLLM's own parser-test texts
(tests/data/tool_calls/cases.json says which); a scripted client stands in
for the engine, since no model here writes them. Also the start checks: an
unknown parser name, a cube with tools on a chat template without them
(SmolLM2's), and the shipped conf/templates/chatml-tools.jinja."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import openai
import pytest

from daemons import ROOT
from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import (
    TEMPLATE_WITH_TOOLS, ChatRenderer, EpisodeSettings, check_tools_rendered, make_renderer, parse_action, run_episode,
)
from rlnode.actor.gateway import Gateway
from rlnode.actor.parsing import CompletionParser, check_parser_names
from rlnode.config import ConfigError, ModelConfig, load_config
from rlnode.cubes.base import Action, CubeTask, CubeTaskRef, Evaluation, Reset, StepResult, ToolCall, ToolSpec
from rlnode.cubes.registry import make_cube
from test_examples_agents import ScriptedPolicy  # scripted replies, streamed token by token

CASES = json.loads((Path(__file__).parent / "data" / "tool_calls" / "cases.json").read_text())["cases"]
SETTINGS = EpisodeSettings(SamplingSettings(max_tokens=64), max_turns=4, max_model_len=2048)


def case_id(case) -> str:
    return case["name"]


def expected_calls(case) -> list[ToolCall]:
    return [ToolCall(name, args) for name, args in case["tool_calls"]]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    """The tiny model's tokenizer with the marker tokens the parsers look
    up, as the real models' vocabularies have them (Mistral's
    [TOOL_CALLS], Llama's <|python_tag|>, Qwen's <think>)."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    t.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|python_tag|>"]})
    t.add_tokens(["<think>", "</think>"])
    return t


class RecordingTask(CubeTask):
    """One turn: offers ``tools``, keeps the Action it was given."""

    def __init__(self, tools: list[ToolSpec]):
        self.ref, self._tools, self.actions = CubeTaskRef("rec", "t0"), tools, []

    async def reset(self) -> Reset:
        return Reset(observation="What now?")

    def tools(self) -> list[ToolSpec]:
        return self._tools

    async def step(self, action: Action) -> StepResult:
        self.actions.append(action)
        return StepResult("ok", done=True)

    async def evaluate(self) -> Evaluation:
        return Evaluation(reward=0.0, success=False)


def renderer_for(tok, case) -> ChatRenderer:
    return ChatRenderer(tok, parser=CompletionParser(tok, case["tool_parser"], case["reasoning_parser"]))


# -- the native loop -------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
async def test_native_loop_reads_the_models_format(tok, case):
    """run_episode decodes the completion (its end-of-turn token dropped),
    and the cube gets the content, the calls and any parse error."""
    task = RecordingTask([ToolSpec(**t["function"]) for t in case["tools"]])
    result = await run_episode(ScriptedPolicy(tok, [case["text"]]), renderer_for(tok, case), task, SETTINGS, "ep", "g")
    (action,) = task.actions
    assert action.tool_calls == expected_calls(case)
    assert action.text == case["content"].strip()
    if case["error"] is None:
        assert action.parse_error is None
    else:
        assert case["error"] in action.parse_error and action.parse_error.startswith("invalid tool call")
    assert result.termination_reason == "done"


def test_parse_action_reads_no_calls_on_a_turn_without_tools(tok):
    """As vllm serve: tool calls are read only when the turn offers tools."""
    parser = CompletionParser(tok, "mistral")
    text = CASES[2]["text"]
    assert parse_action(text, parser, []) == Action(text=text)


# -- the gateway -----------------------------------------------------------------


def _args(tool_calls) -> list[list]:
    return [[tc.function.name, json.loads(tc.function.arguments)] for tc in tool_calls or []]


@pytest.mark.parametrize("case", CASES, ids=case_id)
async def test_gateway_answers_as_vllm_serve(tok, case):
    """The openai SDK gets tool_calls, content and reasoning (``reasoning``
    as vllm serve 0.26-0.32 names it, and ``reasoning_content``); a stream
    adds up to the same message."""
    gw = Gateway(ScriptedPolicy(tok, [case["text"]] * 2), renderer_for(tok, case), SETTINGS, model_name="m")
    messages = [{"role": "user", "content": "What now?"}]
    async with gw.serve(), gw.session("ep") as s:
        client = openai.AsyncOpenAI(base_url=s.endpoint.base_url, api_key=s.endpoint.api_key, max_retries=0)
        r = await client.chat.completions.create(model="m", messages=messages, tools=case["tools"])
        stream = await client.chat.completions.create(model="m", messages=messages, tools=case["tools"], stream=True)
        chunks = [c async for c in stream]
        await client.close()
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert _args(msg.tool_calls) == case["tool_calls"]
    assert (msg.content or "") == case["content"]
    extra = msg.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content") == case["reasoning"]
    assert finish == ("tool_calls" if case["tool_calls"] else "stop")

    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = [(d.model_extra or {}).get("reasoning") for d in deltas if (d.model_extra or {}).get("reasoning")]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert content == case["content"] and _args(calls) == case["tool_calls"]
    assert reasoning == ([case["reasoning"]] if case["reasoning"] else [])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert gw.stats.errors == 0 and gw.stats.calls == 2


async def test_hermes_content_streams_before_the_call(tok):
    """With the default parser (hermes) the text before <tool_call> streams
    as the engine writes it; with a reasoning parser nothing streams before
    the end (the split is known only then), and all is in the final chunks."""
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    hermes = CompletionParser(tok, "hermes")
    content = hermes.parse(text, tools).content
    assert content == "Let me check. "
    growing = [hermes.stream_prefix(text[:k], tools_on=True) for k in range(len(text) + 1)]
    assert all(content.startswith(p) for p in growing)  # never a partial "<tool_call>"
    assert growing[len(content)] == content and hermes.stream_prefix(text, tools_on=False) == text
    thinking = CompletionParser(tok, "hermes", "deepseek_r1")
    assert {thinking.stream_prefix(text[:k], tools_on=on) for k in range(len(text) + 1) for on in (True, False)} == {""}
    assert CompletionParser(tok, "pythonic").stream_prefix("[f(x=1)]", tools_on=True) == ""


def test_the_prompt_reaches_the_parser_only_where_vllm_takes_it(tok, monkeypatch):
    """Parser.set_prompt_token_ids exists from 0.32 (vllm_compat's
    parser_prompt_ids): there the prompt is handed over, on 0.26-0.31 it is
    not (the call would fail), and the parse is the same."""
    from rlnode.actor import vllm_compat

    parser = CompletionParser(tok, "hermes")
    seen = []
    monkeypatch.setattr(parser._with_tools, "set_prompt_token_ids", lambda self, ids: seen.append(list(ids)),
                        raising=False)
    text, tools = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', [{"type": "function",
                                                                                   "function": {"name": "f"}}]
    snapshots = Path(__file__).parent / "data" / "vllm_api"
    old = vllm_compat.detect(json.loads((snapshots / "vllm-0.26.0.json").read_text()))
    new = vllm_compat.detect(json.loads((snapshots / "vllm-0.32.0.json").read_text()))
    assert (old.parser_prompt_ids, new.parser_prompt_ids) == (False, True)
    results = []
    for api in (old, new):
        with vllm_compat.override(api):
            results.append(parser.parse(text, tools, prompt_ids=[7, 8]))
    assert seen == [[7, 8]]
    assert results[0] == results[1] == ("", None, [ToolCall("f", {"x": 1})], None)


# -- configuration and start checks ----------------------------------------------


def test_unknown_parser_names_are_refused_naming_the_key(tok):
    with pytest.raises(ConfigError, match=r"model\.tool_parser = 'hermez' is not a parser .*known: .*hermes.*llama3_json"):
        check_parser_names("hermez", "")
    with pytest.raises(ConfigError, match=r"model\.reasoning_parser = 'r1' .*known: .*deepseek_r1.*qwen3"):
        check_parser_names("hermes", "r1")
    with pytest.raises(ConfigError, match=r"model\.tool_parser = 'openai' is not supported: gpt-oss"):
        check_parser_names("openai", "")
    check_parser_names("", "")
    with pytest.raises(ConfigError, match=r"model\.tool_parser"):
        make_renderer(tok, ModelConfig(tool_parser="hermez"))
    with pytest.raises(ConfigError, match=r"model\.chat_template: nowhere\.jinja is not a file"):
        make_renderer(tok, ModelConfig(chat_template="nowhere.jinja"))


def test_rlnode_check_names_an_unknown_parser(tmp_path):
    from rlnode.ops.check import check_parsers

    cfg = load_config(None, ["model.tool_parser=llama3", f"model.chat_template={tmp_path / 'none.jinja'}"])
    details = " | ".join(f.detail for f in check_parsers(cfg))
    assert "model.tool_parser = 'llama3'" in details and "llama3_json" in details
    assert "model.chat_template" in details and "none.jinja" in details
    ok = check_parsers(load_config(None, ["model.reasoning_parser=qwen3"]))
    assert [f.level for f in ok] == ["ok"] and "hermes" in ok[0].detail and "qwen3" in ok[0].detail


async def test_tools_on_a_template_without_tools_are_refused(smollm2_dir):
    """SmolLM2's own template renders no tools: arithmetic and python-math
    offer tools, so start stops and names model.chat_template and the
    shipped template; with that template it starts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cubes = {"arith": make_cube("arith", "arithmetic", {}, seed=0), "pm": make_cube("pm", "python-math", {}, seed=0)}
    plain = make_renderer(tok, ModelConfig(path=str(smollm2_dir)))
    assert not plain.renders_tools()
    with pytest.raises(ConfigError) as e:
        await check_tools_rendered(plain, cubes)
    msg = str(e.value)
    assert "cube 'arith' offers tools (submit_answer)" in msg
    assert "model.chat_template" in msg and TEMPLATE_WITH_TOOLS in msg
    await check_tools_rendered(plain, {})  # no cube, nothing to show
    template = str(ROOT / TEMPLATE_WITH_TOOLS)
    with_tools = make_renderer(tok, ModelConfig(path=str(smollm2_dir), chat_template=template))
    assert with_tools.renders_tools()
    await check_tools_rendered(with_tools, cubes)


async def test_actor_start_refuses_before_any_engine(smollm2_dir, tmp_path):
    """The check runs in ActorDaemon.start before the engines start: the
    refusal takes seconds and leaves nothing running."""
    from rlnode.actor.daemon import ActorDaemon

    conf = tmp_path / "c.toml"
    conf.write_text(textwrap.dedent(f"""
        [model]
        path = "{smollm2_dir}"
        [actor.engine]
        device = "cpu"
        [[actor.cubes]]
        id = "arith"
        kind = "arithmetic"
    """))
    daemon = ActorDaemon(load_config(conf))
    with pytest.raises(ConfigError, match=r"cube 'arith' offers tools .*model\.chat_template"):
        await daemon.start()
    assert all(e.llm is None for e in daemon.engines)


def test_chatml_tools_template_keeps_smollm2_and_round_trips_a_call(smollm2_dir):
    """Without tools it renders exactly what SmolLM2's own template does
    (its default system prompt included); it is prefix-stable (the native
    loop appends messages token for token); a call written in its assistant
    format is read back by the hermes parser."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    template = (ROOT / TEMPLATE_WITH_TOOLS).read_text()
    convo = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}, {"role": "user", "content": "ok"}]
    for msgs in (convo, [{"role": "system", "content": "Be brief."}, *convo]):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, chat_template=template) == \
                tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    renderer = ChatRenderer(tok, template)
    submit = ToolSpec("submit_answer", "Submit.", {"type": "object", "properties": {"answer": {"type": "integer"}}})
    first = renderer.first_prompt(None, "2+3?", [submit])
    text = renderer.decode(first)
    assert "# Tools" in text and '"name": "submit_answer"' in text and "SmolLM" in text
    call = {"type": "function", "function": {"name": "submit_answer", "arguments": {"answer": 5}}}
    whole = tok.apply_chat_template([{"role": "user", "content": "2+3?"},
                                     {"role": "assistant", "content": None, "tool_calls": [call]}],
                                    tools=[submit.as_chat_tool()], tokenize=False, chat_template=template)
    assert whole.startswith(text)
    reply = whole[len(text):].removesuffix("<|im_end|>\n")
    completion = renderer.encode(reply) + [renderer.eos_id]
    # The tool result appends to prompt + completion without re-rendering either.
    turn = renderer.next_message(completion, "tool", "correct")
    assert renderer.decode(first + completion + turn).endswith(
        "</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\ncorrect\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    action = parse_action(renderer.completion_text(completion, "stop"), renderer.parser, [submit])
    assert action == Action(text="", tool_calls=[ToolCall("submit_answer", {"answer": 5})])
