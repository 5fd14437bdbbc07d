"""The guessing game, played by an agent written with the ``openai`` SDK.

rlnode trains it without knowing how it works: each episode it calls
``play(task, base_url, api_key)`` (or runs this file as a command, with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``RLNODE_ENV_URL`` set and the
task on stdin), and every chat completion the agent asks for becomes a
training sample. The game itself lives in rlnode's ``guessing`` cube; the
agent reaches it at ``{env_url}/step``. The reward comes from the cube's
evaluator, so ``play`` returns None.

The agent offers the model a ``guess`` tool; a plain-text reply counts as a
guess too (a small model learns the text form first).

    rlnode --role all --config examples/guess_openai_sdk.toml
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import openai

# Built once: each HTTP client would make its own TLS context otherwise
# (tens of ms of CPU per episode, on the actor's event loop), though the
# gateway is plain http.
TLS = httpx.create_ssl_context()

GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Guess the hidden number.",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}


def env_url(base_url: str) -> str:
    """The episode's environment URL, next to its OpenAI base URL."""
    return os.environ.get("RLNODE_ENV_URL") or base_url.rsplit("/v1", 1)[0] + "/env"


async def play(task: dict, base_url: str, api_key: str, max_turns: int = 16) -> None:
    llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                             http_client=openai.DefaultAsyncHttpxClient(verify=TLS))
    env = httpx.AsyncClient(base_url=env_url(base_url), headers={"Authorization": f"Bearer {api_key}"}, timeout=60,
                            verify=TLS)
    messages: list = [{"role": "user", "content": task["prompt"]}]
    try:
        for _ in range(max_turns):
            reply = (await llm.chat.completions.create(model="policy", messages=messages, tools=[GUESS_TOOL]))
            msg = reply.choices[0].message
            messages.append(msg)
            if msg.tool_calls:
                for call in msg.tool_calls:
                    try:
                        number = str(json.loads(call.function.arguments).get("number", ""))
                    except (ValueError, AttributeError):
                        number = ""
                    result = (await env.post("/step", json={"text": number})).raise_for_status().json()
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result["observation"]})
                    if result["done"]:
                        return None
            else:
                result = (await env.post("/step", json={"text": msg.content or ""})).raise_for_status().json()
                if result["done"]:
                    return None
                messages.append({"role": "user", "content": result["observation"]})
        return None
    finally:
        await llm.close()
        await env.aclose()


if __name__ == "__main__":  # command mode: the task arrives on stdin
    asyncio.run(play(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
