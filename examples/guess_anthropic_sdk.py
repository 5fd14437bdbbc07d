"""The guessing game, played by an agent written with the ``anthropic`` SDK
(the Messages API), as a Claude-style agent is written: a tool loop of
``tool_use`` and ``tool_result`` blocks.

rlnode trains it without knowing how it works: each episode it calls
``play(task, base_url, api_key)`` (or runs this file as a command, with
``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` / ``RLNODE_ENV_URL`` set and
the task on stdin), and every message the agent asks for becomes a training
sample, token for token what the engine sampled. ``base_url`` is the
episode's OpenAI base URL (``.../v1``); the anthropic SDK wants the part
before ``/v1``. The game lives in rlnode's ``guessing`` cube, reached at
``{env_url}/step``; the reward comes from the cube's evaluator.

A plain-text reply counts as a guess too (a small model learns the text
form first). ``play_streamed`` is the same agent reading each reply as a
stream (``messages.stream``).

    rlnode --role all --config examples/guess_anthropic_sdk.toml
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import anthropic
import httpx

# Built once: each HTTP client would make its own TLS context otherwise
# (tens of ms of CPU per episode), though the gateway is plain http.
TLS = httpx.create_ssl_context()

GUESS_TOOL = {
    "name": "guess",
    "description": "Guess the hidden number.",
    "input_schema": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
}
# The Messages API requires max_tokens; the run's actor.sampling.max_tokens
# caps it (the gateway samples min(asked, the run's)).
MAX_TOKENS = 1024


def env_url(base_url: str) -> str:
    """The episode's environment URL, next to its OpenAI base URL."""
    return os.environ.get("RLNODE_ENV_URL") or base_url.rsplit("/v1", 1)[0] + "/env"


def anthropic_base(base_url: str) -> str:
    return base_url.removesuffix("/").removesuffix("/v1")


async def play(task: dict, base_url: str, api_key: str, max_turns: int = 16, stream: bool = False) -> None:
    llm = anthropic.AsyncAnthropic(base_url=anthropic_base(base_url), api_key=api_key, max_retries=0,
                                   http_client=anthropic.DefaultAsyncHttpxClient(verify=TLS))
    env = httpx.AsyncClient(base_url=env_url(base_url), headers={"Authorization": f"Bearer {api_key}"}, timeout=60,
                            verify=TLS)
    system = {"system": task["system"]} if task.get("system") else {}
    messages: list = [{"role": "user", "content": task["prompt"]}]

    async def step(text: str) -> dict:
        return (await env.post("/step", json={"text": text})).raise_for_status().json()

    try:
        for _ in range(max_turns):
            ask = dict(model="policy", max_tokens=MAX_TOKENS, messages=messages, tools=[GUESS_TOOL], **system)
            if stream:
                async with llm.messages.stream(**ask) as s:
                    reply = await s.get_final_message()
            else:
                reply = await llm.messages.create(**ask)
            messages.append({"role": "assistant", "content": reply.content})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                result = await step("".join(b.text for b in reply.content if b.type == "text"))
                if result["done"]:
                    return None
                messages.append({"role": "user", "content": result["observation"]})
                continue
            results = []
            for use in uses:
                result = await step(str((use.input or {}).get("number", "")))
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": result["observation"]})
                if result["done"]:
                    return None
            messages.append({"role": "user", "content": results})
        return None
    finally:
        await llm.close()
        await env.aclose()


async def play_streamed(task: dict, base_url: str, api_key: str) -> None:
    return await play(task, base_url, api_key, stream=True)


if __name__ == "__main__":  # command mode: the task arrives on stdin
    base = os.environ["ANTHROPIC_BASE_URL"].removesuffix("/") + "/v1"
    asyncio.run(play(json.load(sys.stdin), base, os.environ["ANTHROPIC_API_KEY"]))
