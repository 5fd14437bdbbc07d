"""The guessing game, played by an agent written with the ``openai`` SDK's
Responses API (``client.responses``), as Codex-style agents are written:
``function_call`` items answered by ``function_call_output`` items, the
conversation carried by ``previous_response_id``.

rlnode trains it without knowing how it works: each episode it calls
``play(task, base_url, api_key)`` (or runs this file as a command, with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``RLNODE_ENV_URL`` set and the
task on stdin), and every response the agent asks for becomes a training
sample, token for token what the engine sampled. The gateway keeps an
episode's responses for ``previous_response_id`` while the episode runs.
The game lives in rlnode's ``guessing`` cube, reached at ``{env_url}/step``;
the reward comes from the cube's evaluator.

A plain-text reply counts as a guess too. ``play_resending`` is the same
agent sending the whole conversation each turn (``store=False`` style: the
output items appended to the input) instead of ``previous_response_id``;
``play_streamed`` reads each response as events.

    rlnode --role all --config examples/guess_responses_sdk.toml
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import openai

TLS = httpx.create_ssl_context()

GUESS_TOOL = {
    "type": "function",
    "name": "guess",
    "description": "Guess the hidden number.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
}


def env_url(base_url: str) -> str:
    """The episode's environment URL, next to its OpenAI base URL."""
    return os.environ.get("RLNODE_ENV_URL") or base_url.rsplit("/v1", 1)[0] + "/env"


async def play(task: dict, base_url: str, api_key: str, max_turns: int = 16, resend: bool = False,
               stream: bool = False) -> None:
    llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                             http_client=openai.DefaultAsyncHttpxClient(verify=TLS))
    env = httpx.AsyncClient(base_url=env_url(base_url), headers={"Authorization": f"Bearer {api_key}"}, timeout=60,
                            verify=TLS)
    instructions = task.get("system") or None
    new: list = [{"role": "user", "content": task["prompt"]}]  # this turn's input items
    history: list = []  # every item so far (resend)
    previous = None

    async def step(text: str) -> dict:
        return (await env.post("/step", json={"text": text})).raise_for_status().json()

    try:
        for _ in range(max_turns):
            ask = dict(model="policy", instructions=instructions, tools=[GUESS_TOOL],
                       input=history + new if resend else new,
                       **({} if resend or previous is None else {"previous_response_id": previous}))
            if stream:
                async with llm.responses.stream(**ask) as s:
                    response = await s.get_final_response()
            else:
                response = await llm.responses.create(**ask)
            previous = response.id
            history += new + [item.model_dump(exclude_none=True) for item in response.output]
            new = []
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                result = await step(response.output_text)
                if result["done"]:
                    return None
                new = [{"role": "user", "content": result["observation"]}]
                continue
            for call in calls:
                try:
                    number = str(json.loads(call.arguments).get("number", ""))
                except (ValueError, AttributeError):
                    number = ""
                result = await step(number)
                new.append({"type": "function_call_output", "call_id": call.call_id, "output": result["observation"]})
                if result["done"]:
                    return None
        return None
    finally:
        await llm.close()
        await env.aclose()


async def play_resending(task: dict, base_url: str, api_key: str) -> None:
    return await play(task, base_url, api_key, resend=True)


async def play_streamed(task: dict, base_url: str, api_key: str) -> None:
    return await play(task, base_url, api_key, stream=True)


if __name__ == "__main__":  # command mode: the task arrives on stdin
    asyncio.run(play(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
