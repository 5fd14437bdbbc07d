"""The guessing game, played by an agent on the legacy Completions API
(``client.completions``): a raw transcript prompt, no chat template and no
tools, as older harnesses write it.

rlnode trains it without knowing how it works: each episode it calls
``play(task, base_url, api_key)`` (or runs this file as a command, with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``RLNODE_ENV_URL`` set and the
task on stdin). The transcript grows by the model's reply and the game's
feedback, so each prompt begins with the last prompt + the completion's
text and the gateway extends the last prompt + completion token for token.

    rlnode bench gateway --protocol completions
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import openai

TLS = httpx.create_ssl_context()


def env_url(base_url: str) -> str:
    """The episode's environment URL, next to its OpenAI base URL."""
    return os.environ.get("RLNODE_ENV_URL") or base_url.rsplit("/v1", 1)[0] + "/env"


async def play(task: dict, base_url: str, api_key: str, max_turns: int = 16) -> None:
    llm = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                             http_client=openai.DefaultAsyncHttpxClient(verify=TLS))
    env = httpx.AsyncClient(base_url=env_url(base_url), headers={"Authorization": f"Bearer {api_key}"}, timeout=60,
                            verify=TLS)
    transcript = f"{task.get('system') or ''}\n{task['prompt']}\nGuess:".lstrip()
    try:
        for _ in range(max_turns):
            reply = await llm.completions.create(model="policy", prompt=transcript, max_tokens=64)
            text = reply.choices[0].text
            result = (await env.post("/step", json={"text": text})).raise_for_status().json()
            if result["done"]:
                return None
            transcript += f"{text}\n{result['observation']}\nGuess:"
        return None
    finally:
        await llm.close()
        await env.aclose()


if __name__ == "__main__":  # command mode: the task arrives on stdin
    asyncio.run(play(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
