"""OpenAI (legacy) Completions: ``POST /v1/completions``, a raw prompt and
no chat template. ``prompt`` is a string, or token ids (a list of ints, as
``vllm serve`` takes them: the engine gets exactly those ids). With
``return_token_ids`` the choice carries vLLM's ``prompt_token_ids`` and
``token_ids``. The text is the completion decoded as the engine produced
it, less the stop token it ended on (vLLM's default decode drops every
special token); a later prompt that begins with this prompt + that text
extends the episode's last prompt + completion token for token."""

from __future__ import annotations

from typing import Any

import msgspec

from rlnode.actor.gateway.api import GatewayError, check_stop, decode_body
from rlnode.actor.gateway.protocols.base import Answer, Call, Protocol, StreamWriter, sse
from rlnode.actor.gateway.protocols.chat import check_n, openai_usage


class CompletionRequest(msgspec.Struct):
    prompt: str | list[Any]  # a string, token ids, or a batch of one of either
    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = 16  # OpenAI's default for this API
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None
    return_token_ids: bool | None = None


class Completions(Protocol):
    name = "completions"
    route = "/v1/completions"
    id_prefix = "cmpl-"

    def parse(self, raw: bytes, session) -> Call:
        req = decode_body(raw, CompletionRequest)
        check_n(req.n)
        if req.best_of not in (None, 1):
            raise GatewayError(400, "best_of must be 1 (one sample per call)", param="best_of")
        if req.echo:
            raise GatewayError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise GatewayError(400, "suffix is not supported (no fill-in-the-middle)", param="suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise GatewayError(400, "one prompt per call (a batch of prompts would be several samples)",
                                   param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt or not all(type(t) is int for t in prompt):
                raise GatewayError(400, "prompt must be a string or a non-empty list of token ids", param="prompt")
            text, ids = None, prompt
        else:
            if not prompt:
                raise GatewayError(400, "prompt must not be empty", param="prompt")
            text, ids = prompt, None
        return Call(text=text, prompt_ids=ids, temperature=req.temperature, top_p=req.top_p,
                    max_tokens=req.max_tokens, seed=req.seed, stop=check_stop(req.stop), stream=bool(req.stream),
                    include_usage=bool((req.stream_options or {}).get("include_usage")),
                    return_token_ids=bool(req.return_token_ids))

    def body(self, answer: Answer) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": answer.content, "finish_reason": answer.finish,
                                  "logprobs": None}
        if answer.call.return_token_ids:
            choice["prompt_token_ids"] = answer.prompt
            choice["token_ids"] = answer.completion
        return {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model,
                "choices": [choice], "usage": openai_usage(answer)}

    def stream(self, answer_id: str, model: str, created: int, call: Call, prompt: list[int]) -> StreamWriter:
        return _CompletionStream(answer_id, model, created, call, prompt)


class _CompletionStream(StreamWriter):
    def __init__(self, answer_id: str, model: str, created: int, call: Call, prompt: list[int]):
        self.id, self.model, self.created, self.call, self.prompt = answer_id, model, created, call, prompt

    def _chunk(self, text: str, finish: str | None = None, **choice_extra) -> bytes:
        return sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None,
                                 **choice_extra}]})

    def open(self) -> bytes:
        return b""

    def text(self, delta: str) -> bytes:
        return self._chunk(delta)

    def close(self, answer: Answer, sent: str) -> bytes:
        extra = {"prompt_token_ids": answer.prompt, "token_ids": answer.completion} if self.call.return_token_ids \
            else {}
        out = [self._chunk(answer.content[len(sent):], answer.finish, **extra)]
        if self.call.include_usage:
            out.append(sse({"id": self.id, "object": "text_completion", "created": self.created,
                            "model": self.model, "choices": [], "usage": openai_usage(answer)}))
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def error(self, e: GatewayError) -> bytes:
        return sse({"error": {"message": e.message, "type": e.type, "code": e.code}})
