"""The guessing game, played by an agent written with the OpenAI Agents SDK.

rlnode trains it without knowing how it works: each episode it calls
``play(task, base_url, api_key)`` (or runs this file as a command, with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``RLNODE_ENV_URL`` set and the
task on stdin), and every chat completion the Agents SDK asks for becomes a
training sample. The game lives in rlnode's ``guessing`` cube; the agent
reaches it at ``{env_url}/step``. The reward comes from the cube's
evaluator, so ``play`` returns None.

How it differs from a stock Agents SDK agent:

* the model is ``OpenAIChatCompletionsModel`` on the episode's base URL
  (``play``; ``play_responses`` runs the same agent on the SDK's default,
  ``OpenAIResponsesModel``: the gateway serves both APIs), and tracing is
  off (it would export to api.openai.com);
* the ``guess`` tool ends the run as soon as the game is over
  (``tool_use_behavior``): one more LLM call after "Correct!" would only add
  a sample nobody learns from;
* a plain-text final answer counts as a guess too (posted to the game, whose
  feedback comes back as the next user message), so an untrained model that
  never calls tools still plays; this is also what a small model learns
  first.

    rlnode --role all --config examples/guess_agents_sdk.toml
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
from agents import (Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, OpenAIResponsesModel, RunConfig,
                    RunContextWrapper, Runner, ToolsToFinalOutputResult, function_tool, set_tracing_disabled)
from agents.tool import FunctionToolResult
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

# Built once: an HTTP client makes its own TLS context otherwise (~30-50 ms
# of CPU each, twice per episode, on the actor's event loop), though the
# gateway is plain http.
TLS = httpx.create_ssl_context()

# LLM calls one episode may make here; the gateway's actor.episode.max_turns
# usually ends it first (its refusal ends the episode without failing it).
MAX_LLM_CALLS = 16


def env_url(base_url: str) -> str:
    """The episode's environment URL, next to its OpenAI base URL."""
    return os.environ.get("RLNODE_ENV_URL") or base_url.rsplit("/v1", 1)[0] + "/env"


class Game:
    """One episode's game, reached over HTTP (the run context of the agent)."""

    def __init__(self, url: str, api_key: str):
        self.http = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60,
                                      verify=TLS)
        self.done = False

    async def step(self, text: str) -> str:
        result = (await self.http.post("/step", json={"text": text})).raise_for_status().json()
        self.done = result["done"]
        return result["observation"]

    async def close(self) -> None:
        await self.http.aclose()


@function_tool
async def guess(ctx: RunContextWrapper[Game], number: int) -> str:
    """Guess the hidden number."""
    return await ctx.context.step(str(number))


def stop_when_done(ctx: RunContextWrapper[Game], results: list[FunctionToolResult]) -> ToolsToFinalOutputResult:
    """After a tool call: stop the run if the game is over, else let the
    model read the feedback."""
    if ctx.context.done:
        return ToolsToFinalOutputResult(is_final_output=True, final_output=str(results[-1].output))
    return ToolsToFinalOutputResult(is_final_output=False)


# No instructions of its own: the task's system prompt (if any) is used, so
# the model sees the same conversation as rlnode's native loop plus the tool.
AGENT = Agent[Game](name="guesser", tools=[guess], tool_use_behavior=stop_when_done)


async def play(task: dict, base_url: str, api_key: str, responses: bool = False) -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                         http_client=DefaultAsyncHttpxClient(verify=TLS))
    model = (OpenAIResponsesModel if responses else OpenAIChatCompletionsModel)(model="policy", openai_client=client)
    agent = AGENT.clone(model=model, instructions=task.get("system") or None)
    game = Game(env_url(base_url), api_key)
    items: list = [{"role": "user", "content": task["prompt"]}]
    calls = 0
    try:
        while not game.done and calls < MAX_LLM_CALLS:
            try:
                result = await Runner.run(agent, items, context=game, max_turns=MAX_LLM_CALLS - calls,
                                          run_config=RunConfig(tracing_disabled=True))
            except MaxTurnsExceeded:
                return None
            calls += len(result.raw_responses)
            if game.done:  # ended by a guess tool call
                return None
            # A plain-text answer is a guess: its feedback is the next user turn.
            observation = await game.step(str(result.final_output or ""))
            # (An empty reply leaves no item in the SDK's history; the gateway
            # keeps that turn in the prompt all the same.)
            items = result.to_input_list() + [{"role": "user", "content": observation}]
        return None
    finally:
        await client.close()
        await game.close()


async def play_responses(task: dict, base_url: str, api_key: str) -> None:
    """The same agent on the Responses API (the SDK's default model)."""
    return await play(task, base_url, api_key, responses=True)


if __name__ == "__main__":  # command mode: the task arrives on stdin
    asyncio.run(play(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
