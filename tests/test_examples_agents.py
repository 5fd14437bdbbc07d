"""The example agents (``examples/guess_*.py``) trained through the gateway.

* The Agents SDK guesser plays the guessing game through the real gateway
  and the real tiny engine (the ``openai-agent`` cube, ``run_agent_episode``):
  one sample per LLM call, prompt k+1 extends prompt k + completion k token
  for token, the reward is the game's.
* A tool-call round trip, against a *scripted policy*: the tiny random model
  never writes ``<tool_call>`` markup, so a stand-in for ``LLMClient``
  returns pre-tokenised completions. It checks the SDK side (the Agents SDK
  gets ``tool_calls``, runs the tool against the game, re-sends the history,
  and the gateway extends the last prompt exactly), also when streamed; and
  the openai-SDK example's samples are token for token the native loop's
  for the same replies.
* ``rlnode --role all --config examples/guess_openai_sdk.toml``, shortened:
  training steps happen on samples from the ``openai-agent`` cube and no
  episode or group is lost.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import openai
import pytest
import torch

from conftest import assert_engine_idle, reference_logprobs
from daemons import ROOT, free_port
from rlnode.actor.agent_episode import run_agent_episode
from rlnode.actor.engine import Completion, SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings
from rlnode.actor.gateway import make_gateway
from rlnode.actor.generation import Generation, LLMClient
from rlnode.actor.router import AdmissionRouter, LeaseMetadata
from rlnode.config import ActorConfig, ModelConfig
from rlnode.cubes.base import ToolSpec
from rlnode.cubes.registry import make_cube
from rlnode.cubes.tasks import first_number
from rlnode.wire import unpack_f32, unpack_i32

AGENTS_SDK = ROOT / "examples" / "guess_agents_sdk.py"
ANTHROPIC_SDK = ROOT / "examples" / "guess_anthropic_sdk.py"
RESPONSES_SDK = ROOT / "examples" / "guess_responses_sdk.py"
GAME = {"kind": "guessing", "options": {"max_number": 5, "max_turns": 3, "feedback": "range"}}


def load_example(path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def agent_cube(path=AGENTS_SDK, fn="play"):
    cube = make_cube("guess", "openai-agent", {"agent": f"{path}:{fn}", "env": GAME}, seed=0)
    await cube.start()
    return cube


async def task_with_target(cube, target: int) -> str:
    return next(t for t in await cube.task_ids("train") if cube.inner.target(t) == target)


def rows(sample):
    return unpack_i32(sample.prompt_ids).tolist(), unpack_i32(sample.completion_ids).tolist()


def assert_extends(samples) -> None:
    """Prompt k+1 starts with prompt k + completion k, token for token."""
    for prev, nxt in zip(samples, samples[1:]):
        p, c = rows(prev)
        assert rows(nxt)[0][: len(p) + len(c)] == p + c


# -- the real engine -------------------------------------------------------------


@pytest.mark.engine
async def test_agents_sdk_agent_plays_through_the_gateway(engine, tokenizer, hf_model):
    settings = EpisodeSettings(SamplingSettings(max_tokens=4, temperature=1.0), max_turns=8, max_model_len=2048)
    router = AdmissionRouter(1, 16)
    renderer = ChatRenderer(tokenizer)
    gw = default_gateway(LLMClient([engine], router), tokenizer, settings, model_name="tiny")
    cube = await agent_cube()
    ids = (await cube.task_ids("train"))[:4]
    async with gw.serve():
        tasks = [await cube.open_task(t) for t in ids]
        results = await asyncio.gather(*(run_agent_episode(gw, t, settings, f"ep{i}", "g0")
                                         for i, t in enumerate(tasks)))
    await cube.close()
    assert router.in_flight == [0]
    await assert_engine_idle(engine)

    assert gw.stats.history_resets == 0 and gw.stats.errors == 0
    assert gw.stats.calls == sum(len(r.samples) for r in results)
    for task_id, r in zip(ids, results):
        # One sample per LLM call, in call order; every call was a guess.
        assert [s.step_index for s in r.samples] == list(range(r.num_turns))
        assert 1 <= r.num_turns <= 3 and r.termination_reason == "done"
        assert_extends(r.samples)
        # The SDK offered the model its guess tool (rendered by the template).
        assert '"name": "guess"' in tokenizer.decode(rows(r.samples[0])[0])
        # The reward is the game's: solved iff the last plain-text reply
        # named the target; the game ended then, or after its 3 guesses.
        guesses = []
        for s in r.samples:
            c = rows(s)[1]
            guesses.append(first_number(renderer.decode(c[:-1] if c[-1] == renderer.eos_id else c)))
        target = cube.inner.target(task_id)
        assert r.reward == float(guesses[-1] == target) and r.success == (r.reward == 1.0)
        assert target not in guesses[:-1]
        assert r.num_turns == 3 or r.reward == 1.0
    # The samples carry the engine's logprobs of the policy that is trained.
    s = results[0].samples[-1]
    ref = reference_logprobs(hf_model, *rows(s), s.temperature)
    assert (ref - torch.tensor(unpack_f32(s.logprobs))).abs().max().item() < 1e-4


# -- a scripted policy: tool calls the tiny model would not write ---------------


class ScriptedPolicy:
    """A stand-in for ``LLMClient`` (same ``generate`` signature) whose
    completions are fixed texts, tokenised, ending in the end-of-turn token.
    Streams them token by token through ``on_tokens`` like the engine."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tok, self.texts = tokenizer, list(texts)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_token_ids, sampling, affinity=None, on_tokens=None,
                       on_admitted=None) -> Generation:
        if on_admitted is not None:  # no router: admitted at once
            on_admitted()
        self.prompts.append(list(prompt_token_ids))
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        if on_tokens is not None:
            for k in range(1, len(ids) + 1):
                on_tokens(ids[:k])
                await asyncio.sleep(0)
        return Generation(Completion(ids, [-1.0] * len(ids), "stop"), LeaseMetadata(0, 0, 0.0, 0.0))


SCRIPTED = EpisodeSettings(SamplingSettings(max_tokens=64), max_turns=8, max_model_len=2048)
CALL_4 = '<tool_call>{"name": "guess", "arguments": {"number": 4}}</tool_call>'


def scripted_gateway(tokenizer, texts):
    policy = ScriptedPolicy(tokenizer, texts)
    return policy, default_gateway(policy, tokenizer, SCRIPTED)


def default_gateway(client, tokenizer, settings, model_name="rlnode"):
    """The gateway where the daemon runs it by default (actor.gateway_host);
    a host process builds its renderer from the tokenizer's directory."""
    return make_gateway(ActorConfig().gateway_host, client, ChatRenderer(tokenizer),
                        ModelConfig(path=tokenizer.name_or_path), settings, model_name)


async def test_agents_sdk_tool_call_round_trip_extends_the_prompt(tokenizer):
    """Guess 4 by tool call ("Lower. It is between 1 and 3."), then "2" as
    text: the SDK ran the tool, and the second prompt is the first + the
    call + exactly the template tokens of the tool result."""
    renderer = ChatRenderer(tokenizer)
    cube = await agent_cube()
    policy, gw = scripted_gateway(tokenizer, [CALL_4, "2"])
    async with gw.serve():
        r = await run_agent_episode(gw, await cube.open_task(await task_with_target(cube, 2)), SCRIPTED, "ep", "g")
    assert (r.reward, r.num_turns, r.termination_reason) == (1.0, 2, "done")
    assert gw.stats.history_resets == 0 and r.agent_errors == 0
    (p0, c0), (p1, _) = rows(r.samples[0]), rows(r.samples[1])
    tool_turn = renderer.next_messages(c0, [{"role": "tool", "content": "Lower. It is between 1 and 3."}])
    assert p1 == p0 + c0 + tool_turn == policy.prompts[1]

    # A tool call that wins ends the run: no LLM call after "Correct!".
    policy, gw = scripted_gateway(tokenizer, [CALL_4, "never asked"])
    async with gw.serve():
        r = await run_agent_episode(gw, await cube.open_task(await task_with_target(cube, 4)), SCRIPTED, "ep", "g")
    assert (r.reward, r.num_turns, len(policy.texts)) == (1.0, 1, 1)
    await cube.close()


@pytest.mark.parametrize("path,fn", [
    (ANTHROPIC_SDK, "play"), (ANTHROPIC_SDK, "play_streamed"),  # Messages: tool_use -> tool_result
    (RESPONSES_SDK, "play"), (RESPONSES_SDK, "play_resending"), (RESPONSES_SDK, "play_streamed"),  # Responses
    (AGENTS_SDK, "play_responses"),  # the Agents SDK on its default model, OpenAIResponsesModel
], ids=["messages", "messages-streamed", "responses-previous-id", "responses-resent", "responses-streamed",
        "agents-sdk-responses"])
async def test_sdk_agents_tool_loop_extends_the_prompt(path, fn, tokenizer):
    """Each SDK's own tool loop, unmodified: guess 4 by a tool call (the
    reply read by the hermes parser, handed to the agent in its API's
    shape), the game's answer back as that API's tool result, then "2" as
    text. The second prompt is the first + the call + exactly the template
    tokens of the tool result, as with chat completions."""
    renderer = ChatRenderer(tokenizer)
    cube = await agent_cube(path, fn)
    policy, gw = scripted_gateway(tokenizer, [CALL_4, "2"])
    async with gw.serve():
        r = await run_agent_episode(gw, await cube.open_task(await task_with_target(cube, 2)), SCRIPTED, "ep", "g")
    await cube.close()
    assert (r.reward, r.num_turns, r.termination_reason, r.agent_errors) == (1.0, 2, "done", 0)
    assert gw.stats.history_resets == 0 and gw.stats.errors == 0
    (p0, c0), (p1, _) = rows(r.samples[0]), rows(r.samples[1])
    assert '"name": "guess"' in tokenizer.decode(p0)  # the agent's tool, offered to the model
    tool_turn = renderer.next_messages(c0, [{"role": "tool", "content": "Lower. It is between 1 and 3."}])
    assert p1 == p0 + c0 + tool_turn == policy.prompts[1]


async def test_gateway_samples_equal_the_native_loops(tokenizer):
    """The same replies, once through the openai-SDK example and the gateway,
    once through rlnode's own loop with the task advertising the same guess
    tool: the training samples hold the same token ids, so what the model
    learns from differs only by what an agent puts in the conversation."""
    from rlnode.actor.episode import run_episode
    from rlnode.bench.gateway import Advertised, load_example

    replies = ["3", "1", "2"]  # target 2: "Lower. It is between 1 and 2.", "Higher. ...", "Correct!"
    cube = await agent_cube(ROOT / "examples" / "guess_openai_sdk.py")
    tid = await task_with_target(cube, 2)
    _, gw = scripted_gateway(tokenizer, replies)
    async with gw.serve():
        agent = await run_agent_episode(gw, await cube.open_task(tid), SCRIPTED, "ep", "g")
    await cube.close()
    native_cube = make_cube("guess", "guessing", GAME["options"], seed=0)
    tool = ToolSpec(**load_example().GUESS_TOOL["function"])
    native = await run_episode(ScriptedPolicy(tokenizer, replies), ChatRenderer(tokenizer),
                               Advertised(await native_cube.open_task(tid), [tool]), SCRIPTED, "ep", "g")
    assert (agent.reward, agent.num_turns) == (native.reward, native.num_turns) == (1.0, 3)
    assert [rows(s) for s in agent.samples] == [rows(s) for s in native.samples]


async def test_empty_reply_keeps_the_history(tokenizer):
    """The Agents SDK drops an empty assistant message from its history; the
    gateway keeps that turn (the engine produced it), so the next prompt
    still extends the last one."""
    cube = await agent_cube()
    _, gw = scripted_gateway(tokenizer, ["", "2"])
    async with gw.serve():
        r = await run_agent_episode(gw, await cube.open_task(await task_with_target(cube, 2)), SCRIPTED, "ep", "g")
    await cube.close()
    assert (r.reward, r.num_turns, r.agent_errors) == (1.0, 2, 1)  # "" was a wasted guess
    assert gw.stats.history_resets == 0
    assert_extends(r.samples)


async def test_streamed_tool_calls_arrive_as_openai_deltas(tokenizer):
    tool = {"type": "function", "function": {"name": "guess", "parameters": {"type": "object"}}}
    _, gw = scripted_gateway(tokenizer, ["Let me see. " + CALL_4])
    async with gw.serve(), gw.session("ep-stream") as s:
        client = openai.AsyncOpenAI(base_url=s.endpoint.base_url, api_key=s.endpoint.api_key, max_retries=0)
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                                      tools=[tool], stream=True)
        content, calls, finish = "", {}, None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:  # assembled by index, as OpenAI clients do
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        await client.close()
    assert content == "Let me see. " and finish == "tool_calls"
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("call_0_0", "guess", {"number": 4})]


async def test_agents_sdk_streamed_run_executes_the_streamed_tool_call(tokenizer):
    """``Runner.run_streamed``: the SDK assembles the streamed call, runs the
    example's guess tool against the game and re-sends the history."""
    from agents import OpenAIChatCompletionsModel, RunConfig, Runner

    ex = load_example(AGENTS_SDK)
    cube = await agent_cube()
    task = await cube.open_task(await task_with_target(cube, 2))
    reset = await task.reset()
    _, gw = scripted_gateway(tokenizer, [CALL_4, "2"])
    async with gw.serve(), gw.session("ep-sdk-stream", task) as s:
        client = openai.AsyncOpenAI(base_url=s.endpoint.base_url, api_key=s.endpoint.api_key, max_retries=0)
        agent = ex.AGENT.clone(model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        game = ex.Game(s.endpoint.env_url, s.endpoint.api_key)
        run = Runner.run_streamed(agent, [{"role": "user", "content": reset.observation}], context=game,
                                  max_turns=4, run_config=RunConfig(tracing_disabled=True))
        async for _ in run.stream_events():
            pass
        await client.close(), await game.close()
    await task.close(), await cube.close()
    assert run.final_output == "2" and not game.done  # the text answer is play()'s to post
    assert gw.stats.streamed == 2 and s.history_resets == 0
    assert "<tool_response>Lower. It is between 1 and 3.</tool_response>" in tokenizer.decode(s.calls[1].prompt)
    c0 = s.calls[0]
    assert s.calls[1].prompt[: len(c0.prompt) + len(c0.generation.completion.token_ids)] == \
        c0.prompt + c0.generation.completion.token_ids


# -- the example config, end to end ----------------------------------------------


def _log_events(stderr: str) -> list[dict]:
    """The daemon's JSON log events. The agent processes share its stderr,
    so one line can hold two records written at once ("{...}{...}"): each
    is decoded where it starts."""
    dec, out = json.JSONDecoder(), []
    for line in stderr.splitlines():
        i = line.find("{")
        while i != -1:
            try:
                obj, end = dec.raw_decode(line, i)
            except ValueError:
                i = line.find("{", i + 1)
                continue
            if isinstance(obj, dict) and "event" in obj:
                out.append(obj)
            i = line.find("{", end)
    return out


@pytest.mark.engine
@pytest.mark.parametrize("config", ["guess_openai_sdk.toml", "guess_anthropic_sdk.toml", "guess_responses_sdk.toml"])
def test_example_config_trains_through_the_gateway(config, tiny_model_dir, tmp_path):
    """``rlnode --role all --config examples/CONFIG``, cut to 3 steps of 4
    groups, for the agents on Chat Completions, Anthropic Messages and the
    Responses API: each step trains whole groups of openai-agent samples,
    and no episode fails, no group is dropped, every delivery is acked. Its
    ops endpoint is exposed (0.0.0.0, a token), and the gateway hosts' port
    stays on loopback (actor.gateway_bind)."""
    steps, groups, attempts = 3, 4, 4
    r = subprocess.run(
        [sys.executable, "-m", "rlnode", "--role", "all", "--config", f"examples/{config}", "--log-json",
         "--set", f"model.path={tiny_model_dir}", "--set", f"run.run_dir={tmp_path / 'run'}",
         "--set", "run.progress=false", "--set", f"trainer.max_steps={steps}",
         "--set", f"actor.scheduler.groups_per_step={groups}", "--set", f"actor.scheduler.attempts={attempts}",
         "--set", "actor.scheduler.eval_every=0", "--set", f"trainer.port={free_port()}",
         "--set", "http.trainer_port=0", "--set", "http.actor_port=0",
         # The ops endpoint exposed, as on a real node: agents need no more than loopback.
         "--set", 'http.host="0.0.0.0"', "--set", 'http.token="test-ops-token-0123456789"',
         "--set", f"trainer.weights.base_port={free_port()}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_records = [x for x in records if "step" in x]
    assert [x["step"] for x in step_records] == list(range(1, steps + 1))
    for x in step_records:
        # Each episode makes 1..3 LLM calls (one per guess), each one sample.
        assert x["groups"] == groups and groups * attempts <= x["samples"] <= 3 * groups * attempts
        assert x["weights_pushed"] and x["dropped_stale"] == 0
        # Multi-turn episodes' calls extend one another token for token
        # (actor.gateway_history = "extend"), counted by the trainer.
        assert x.get("turns_extending_fraction", 1.0) == 1.0
    assert sum(x["turn_pairs"] for x in step_records) > 0  # guesses after a miss
    events = _log_events(r.stderr)
    names = {e["event"] for e in events}
    assert not names & {"episode.failed", "group.dropped", "agent.stopped_by_gateway"}, names
    stopped = next(e for e in events if e["event"] == "actor.stopped")
    cube = stopped["cubes"]["guess5"]
    assert cube["errors"] == 0 and cube["retries"] == 0 and cube["groups_dropped"] == 0
    assert cube["episodes"] >= steps * groups * attempts
    # The gateway hosts' port is on loopback, not on the ops endpoint's 0.0.0.0.
    serving = next(e for e in events if e["event"] == "gateway.serving")
    assert serving["bind"] == "127.0.0.1" and serving["url"].startswith("http://127.0.0.1:"), serving
    assert "gateway.exposed" not in names
    flushed = next(e for e in events if e["event"] == "actor.link_flushed")
    assert flushed["all_acked"] and flushed["unacked"] == 0
    # An agent cube on the node: the loopback link runs under CurveZMQ with
    # keys of its own (owner-only), at both ends.
    keys = tmp_path / "run" / "link-keys"
    assert next(e for e in events if e["event"] == "link.curve_auto")["curve_dir"] == str(keys)
    assert next(e for e in events if e["event"] == "link.trainer.started")["curve"] is True
    assert next(e for e in events if e["event"] == "link.actor.started")["curve"] is True
    assert (keys.stat().st_mode & 0o777) == 0o700 and (keys / "trainer.key_secret").stat().st_mode & 0o077 == 0
