"""The OpenAI-compatible gateway: agents rlnode does not run itself.

An agent written against the OpenAI API (the ``openai`` SDK, the Agents SDK,
a verifiers environment, LangChain, a shell script with curl) gets, per
episode, a base URL ``http://HOST:PORT/episodes/{token}/v1`` and an API key.
Each ``POST .../chat/completions`` is one LLM call of that episode: it takes
one AdmissionRouter lease and one Engine request, like a native turn, and
becomes one ``TrainingSample`` when the episode ends.

Token parity. The engine sees token ids, never re-tokenised text. When the
agent re-sends the conversation (as chat agents do), the gateway compares it
with what it has served: if the earlier messages are exactly the ones it saw
plus the assistant messages it returned, the new prompt is the previous
prompt + the tokens the engine produced + the template tokens of the new
messages only (``ChatRenderer.next_messages``), so prompt k+1 extends prompt
k + completion k token for token. If the agent edited its history (dropped a
turn, rewrote a message, changed its tools) the conversation is rendered
afresh and the reset is counted (``history_resets``): that sample is still
exact for what the engine saw, but it no longer extends the previous one.

The token is unguessable (``secrets``), lives only while its episode runs,
and the API key travels in the Authorization header (paths end up in access
logs; headers do not). Unknown or finished episodes get 404, a wrong key
401, bad requests 400, all in OpenAI's error shape.

The environment side (``/episodes/{token}/env``): ``GET tools``, ``POST
step`` (a tool call or a message, answered by the cube task), ``POST reward``
(the agent's own reward for the episode). A posted reward needs the
episode's *reward key*, not its API key, and exists only for tasks with
``reward_source = "agent"`` (``AgentTask``): everything else is refused
(403) and counted, because the API key is in every tool the agent runs.

Per-call cost. A call's fixed cost is what an agent pays on every turn, so
the path keeps it small: the turn limit is checked before anything is
parsed into tokens; the re-sent history is compared as plain dicts (no
re-serialisation); a body whose text cannot fit the context even at the
tokenizer's longest token is refused before tokenizing; large new messages
are tokenized in a thread, off the event loop; streaming takes vLLM's DELTA
outputs.

Owns: sessions, request validation, prompt construction, tool-call parsing,
streaming. Must not decide rewards or retries (``agent_episode.py`` and the
scheduler do).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import secrets
import time
from typing import Any, AsyncIterator, Callable

import msgspec
from aiohttp import web

from rlnode.actor.engine import EngineError, SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings, parse_action, request_seed
from rlnode.actor.generation import Generation, LLMClient
from rlnode.cubes.base import Action, AgentEndpoint, CubeTask, ToolCall
from rlnode.log import get_logger
from rlnode.ops.netaddr import local_url_host

log = get_logger("rlnode.gateway")

TOOL_OPEN = "<tool_call>"
# Long agent histories (tool outputs, documents) outgrow aiohttp's 1 MiB default.
MAX_REQUEST_BYTES = 64 * 2**20
# New message text above this many characters is tokenized in a thread.
TOKENIZE_INLINE_CHARS = 32_768


class GatewayError(Exception):
    """Answered in OpenAI's error shape: ``{"error": {"message", "type",
    "param", "code"}}``."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


class ChatRequest(msgspec.Struct):
    """The fields of ``POST /chat/completions`` the gateway honours; unknown
    fields (``store``, ``metadata``, ``user``, ...) are ignored."""

    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None


# -- messages ------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise GatewayError(400, f"{where}: only text content parts are supported", param="messages")
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise GatewayError(400, f"{where}: content must be a string or a list of text parts", param="messages")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object when they are JSON (the SDKs send a
    JSON string, templates want an object)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw if raw is not None else {}


def template_message(m: Any, i: int) -> dict[str, Any]:
    """An OpenAI message as the chat template renders it (also the form the
    gateway compares histories in)."""
    if not isinstance(m, dict):
        raise GatewayError(400, f"messages[{i}] must be an object", param="messages")
    role = m.get("role")
    if role == "developer":  # the newer name of the system role
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise GatewayError(400, f"messages[{i}].role {role!r} is not one of system, developer, user, "
                                "assistant, tool", param="messages")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"messages[{i}]")}
    if role == "assistant" and m.get("tool_calls"):
        calls = []
        for tc in m["tool_calls"]:
            f = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise GatewayError(400, f"messages[{i}].tool_calls: each needs function.name", param="messages")
            calls.append({"type": "function", "function": {"name": f["name"], "arguments": _arguments(f.get("arguments"))}})
        out["tool_calls"] = calls
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a re-sent (template) message is the one served before.
    Tool-call ids are left out: templates do not render them and some SDKs
    rewrite them."""
    if a.get("tool_call_id") == b.get("tool_call_id"):
        return a == b
    return {k: v for k, v in a.items() if k != "tool_call_id"} == {k: v for k, v in b.items() if k != "tool_call_id"}


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Content and tool calls of a completion (Hermes ``<tool_call>`` markup).
    The content is the text before the first call plus whatever is left
    after the calls, so a stream of the text before the first call is always
    a prefix of it. A malformed call leaves the whole text as content."""
    at = text.find(TOOL_OPEN)
    if at < 0:
        return text, []
    action = parse_action(text[at:])
    if action.parse_error or not action.tool_calls:
        return text, []
    return text[:at] + action.text, action.tool_calls


def _stream_safe(text: str, tools_on: bool) -> str:
    """The part of a growing completion that can be streamed as content now:
    never a (possibly partial) tool-call tag, never half a UTF-8 character."""
    if tools_on:
        at = text.find(TOOL_OPEN)
        if at >= 0:
            text = text[:at]
        else:
            for k in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
                if TOOL_OPEN.startswith(text[-k:]):
                    text = text[:-k]
                    break
    return text.rstrip("\ufffd")


# -- sessions ------------------------------------------------------------------


class GatewayStats(msgspec.Struct):
    sessions: int = 0  # episodes served
    calls: int = 0  # chat completions answered
    streamed: int = 0  # of which streamed
    history_resets: int = 0  # calls whose history was not an extension of the last one
    errors: int = 0  # requests answered with an error
    unauthorized: int = 0  # unknown token or wrong key
    temperature_floored: int = 0  # calls that asked below actor.sampling.min_temperature (raised to it)
    rewards_refused: int = 0  # POST env/reward refused: not the task's reward source, wrong key, out of bounds
    agent_rewards_ignored: int = 0  # rewards an agent returned where the evaluator decides


class ServedCall(msgspec.Struct):
    """One answered LLM call, waiting for the episode's reward."""

    step_index: int
    prompt: list[int]
    generation: Generation
    policy_version: int
    temperature: float
    history_reset: bool


class GatewaySession:
    """One episode's view of the gateway: valid from ``Gateway.session`` to
    its exit."""

    def __init__(self, gateway: "Gateway", episode_id: str, task: CubeTask | None, settings: EpisodeSettings,
                 policy_version: Callable[[], int]):
        self.gateway, self.episode_id, self.task, self.settings = gateway, episode_id, task, settings
        self.policy_version = policy_version
        self.token = secrets.token_urlsafe(24)
        self.api_key = "rlnode-" + secrets.token_urlsafe(24)
        # Only where the agent decides the reward (no task: a bare session of
        # a test or benchmark, whose only reward source is the agent).
        agent_reward = task is None or getattr(task, "reward_source", "evaluator") == "agent"
        self.reward_key = "rlnode-reward-" + secrets.token_urlsafe(24) if agent_reward else ""
        self.calls: list[ServedCall] = []
        self.next_step = 0
        self.history_resets = 0
        self.agent_errors = 0  # environment errors the agent saw (bad tool args)
        self.terminated: str | None = None  # "max_turns" | "context_limit" once the gateway refused a call
        self.env_done = False
        self.posted_reward: float | None = None
        self.posted_success: bool | None = None
        self.closed = False
        # History state of the newest answered call (by step: a call that
        # started earlier but finished later must not overwrite it).
        self._remembered_step = -1
        self._history: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] = []
        self._ids: list[int] = []
        self._last_completion: list[int] = []
        self._empty_reply = False
        self._engine: int | None = None
        self._inflight: set[asyncio.Task] = set()

    @property
    def endpoint(self) -> AgentEndpoint:
        root = f"{self.gateway.url}/episodes/{self.token}"
        return AgentEndpoint(f"{root}/v1", self.api_key, f"{root}/env", self.gateway.model_name, self.reward_key)

    def check_key(self, request: web.Request, key: str | None = None) -> None:
        key = self.api_key if key is None else key
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            self.gateway.stats.unauthorized += 1
            raise GatewayError(401, "invalid API key for this episode", code="invalid_api_key",
                               type="authentication_error")

    # -- prompt ---------------------------------------------------------------

    def extends(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int | None:
        """How many of ``messages`` the newest answered call already covers
        (its history and reply), or None when the request does not extend it
        (the history is then rendered afresh and counted as a reset).
        Dict equality, element by element: no per-call re-serialisation."""
        n = len(self._history)
        if not n or (tools or []) != self._tools:
            return None
        if len(messages) > n and all(_same(a, b) for a, b in zip(messages, self._history)):
            return n
        # Some SDKs (the Agents SDK) drop an empty assistant reply from
        # their history. The engine did produce that turn (an end of turn
        # token), so the prompt keeps it: still the exact extension.
        if self._empty_reply and len(messages) >= n and all(_same(a, b) for a, b in zip(messages, self._history[:-1])):
            return n - 1
        return None

    def prompt_for(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   covered: int | None) -> list[int]:
        """Prompt token ids for a request; ``covered`` is ``extends()``."""
        renderer = self.gateway.renderer
        if covered is not None:
            return self._ids + renderer.next_messages(self._last_completion, messages[covered:])
        return renderer.render(messages, tools)

    def remember(self, step: int, messages: list[dict[str, Any]], tools, prompt: list[int], completion: list[int],
                 reply: dict[str, Any]) -> None:
        if step < self._remembered_step:  # concurrent calls: the newer one already set the history
            return
        self._remembered_step = step
        self._history = messages + [reply]
        self._empty_reply = not reply["content"] and not reply.get("tool_calls")
        self._tools = tools or []
        self._ids = prompt + completion
        self._last_completion = completion

    async def close(self) -> None:
        """End the episode's access: the token stops working and calls still
        running are aborted in the engine (their leases are returned)."""
        self.closed = True
        tasks = list(self._inflight)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- the gateway -----------------------------------------------------------------


class Gateway:
    def __init__(self, client: LLMClient, renderer: ChatRenderer, settings: EpisodeSettings,
                 model_name: str = "rlnode"):
        self.client, self.renderer, self.settings = client, renderer, settings
        self.model_name = model_name
        self.url = ""  # http://HOST:PORT of whoever serves the routes (set by serve() or the daemon)
        self.sessions: dict[str, GatewaySession] = {}
        self.stats = GatewayStats()

    # -- serving ------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/episodes/{token}/v1/models", self._models)
        app.router.add_post("/episodes/{token}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{token}/env/tools", self._env_tools)
        app.router.add_post("/episodes/{token}/env/step", self._env_step)
        app.router.add_post("/episodes/{token}/env/reward", self._env_reward)

    @contextlib.asynccontextmanager
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator["Gateway"]:
        """Serve on a site of its own (an actor without its ops endpoint,
        tests, benchmarks)."""
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        self.add_routes(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = site._server.sockets[0].getsockname()
            self.url = f"http://{local_url_host(host)}:{bound[1]}"
            yield self
        finally:
            await runner.cleanup()

    @contextlib.asynccontextmanager
    async def session(self, episode_id: str, task: CubeTask | None = None, settings: EpisodeSettings | None = None,
                      policy_version: Callable[[], int] = lambda: 0) -> AsyncIterator[GatewaySession]:
        if not self.url:
            raise RuntimeError("the gateway is not served (Gateway.serve or the actor's HTTP endpoint)")
        s = GatewaySession(self, episode_id, task, settings or self.settings, policy_version)
        self.sessions[s.token] = s
        self.stats.sessions += 1
        try:
            yield s
        finally:
            self.sessions.pop(s.token, None)
            await s.close()

    def _session(self, request: web.Request, key: str | None = None) -> GatewaySession:
        s = self.sessions.get(request.match_info["token"])
        if s is None or s.closed:
            self.stats.unauthorized += 1
            raise GatewayError(404, "unknown or finished episode", code="episode_not_found")
        if key is None:
            s.check_key(request)
        return s

    # -- handlers -------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except GatewayError as e:
            return e.response()
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlnode"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            s = self._session(request)
            req = await _read(request, ChatRequest)
            return await self._complete(request, s, req)
        except GatewayError as e:
            self.stats.errors += 1
            return e.response()

    async def _complete(self, request: web.Request, s: GatewaySession, req: ChatRequest) -> web.StreamResponse:
        settings = s.settings
        base = settings.sampling
        if req.n not in (None, 1):
            raise GatewayError(400, "n must be 1 (one sample per call)", param="n")
        if req.stop:
            raise GatewayError(400, "stop sequences are not supported: samples are token-exact and end at the "
                                    "model's end of turn", param="stop")
        temperature = base.temperature if req.temperature is None else req.temperature
        if base.temperature == 0:  # greedy evaluation (scheduler.eval_temperature = 0): not trained on
            temperature = 0.0
        elif not 0 < temperature <= base.temperature + 1e-9:
            raise GatewayError(400, f"temperature must be in (0, {base.temperature}] (actor.sampling.temperature; "
                                    "samples are scored at logits / temperature)", param="temperature")
        elif temperature < (floor := min(settings.min_temperature, base.temperature)):
            # The trainer would refuse the whole group for it (and a tiny T
            # scales gradients by 1/T): sampled at the floor instead. (An
            # evaluation below the floor keeps its own temperature.)
            if self.stats.temperature_floored == 0:
                log.warning("gateway.temperature_floored", asked=temperature, floor=floor,
                            key="actor.sampling.min_temperature")
            self.stats.temperature_floored += 1
            temperature = floor
        if req.top_p is not None and abs(req.top_p - base.top_p) > 1e-9:
            raise GatewayError(400, f"top_p is fixed by the run (actor.sampling.top_p = {base.top_p})", param="top_p")
        tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
        if tool_choice not in ("auto", "none"):
            raise GatewayError(400, "tool_choice must be 'auto' or 'none' (forcing a call needs guided decoding)",
                               param="tool_choice")
        if not req.messages:
            raise GatewayError(400, "messages must not be empty", param="messages")
        # The turn limit first: a refused call costs no template work.
        if s.next_step >= settings.max_turns:
            s.terminated = s.terminated or "max_turns"
            raise GatewayError(400, f"the episode used its {settings.max_turns} LLM calls (actor.episode.max_turns)",
                               code="max_turns_exceeded")
        messages = [template_message(m, i) for i, m in enumerate(req.messages)]
        tools = req.tools or None
        tools_on = bool(tools) and tool_choice != "none"
        covered = s.extends(messages, tools)
        new = messages if covered is None else messages[covered:]
        new_chars = sum(len(m["content"]) for m in new)
        base_len = 0 if covered is None else len(s._ids)
        # Even at the tokenizer's longest token, this much text cannot fit:
        # refused without tokenizing (a 64 MiB body would hold the loop).
        if base_len + new_chars // self.renderer.max_token_chars > settings.max_model_len:
            s.terminated = s.terminated or "context_limit"
            raise GatewayError(400, f"{new_chars} characters of new messages cannot fit the {settings.max_model_len}"
                                    "-token context", code="context_length_exceeded", param="messages")
        try:
            if new_chars > TOKENIZE_INLINE_CHARS:  # long documents: tokenized off the event loop
                prompt = await asyncio.to_thread(s.prompt_for, messages, tools, covered)
            else:
                prompt = s.prompt_for(messages, tools, covered)
        except (ValueError, TypeError) as e:  # the template rejected the conversation
            raise GatewayError(400, f"chat template: {e}", param="messages") from e
        reset = covered is None and s._remembered_step >= 0
        room = settings.max_model_len - len(prompt)
        if room < settings.min_completion_tokens:
            s.terminated = s.terminated or "context_limit"
            raise GatewayError(400, f"prompt of {len(prompt)} tokens leaves no room in the {settings.max_model_len}"
                                    "-token context", code="context_length_exceeded", param="messages")
        want = req.max_completion_tokens or req.max_tokens or base.max_tokens
        step = s.next_step
        # The episode's seed per call (an agent's own seed is mixed in, never
        # used alone: an agent that sends one fixed seed would otherwise make
        # every attempt of its group sample the same tokens).
        seed = req.seed if settings.seed is None else request_seed(settings.seed, step, req.seed)
        sampling = msgspec.structs.replace(base, temperature=temperature, seed=seed,
                                           max_tokens=max(1, min(want, base.max_tokens, room)))
        s.next_step += 1
        s.history_resets += reset
        self.stats.history_resets += reset
        version = s.policy_version()
        if req.stream:
            return await self._stream(request, s, req, messages, tools, tools_on, prompt, sampling, step, version, reset)
        gen = await self._generate(s, prompt, sampling)
        reply, finish, calls = self._reply(s, gen, step, tools_on)
        self._record(s, messages, tools, prompt, gen, step, version, temperature, reset, reply)
        body = {
            "id": f"chatcmpl-{s.episode_id}-{step}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": _openai_message(reply, calls, step), "finish_reason": finish,
                         "logprobs": None}],
            "usage": _usage(prompt, gen),
        }
        return web.json_response(body)

    async def _generate(self, s: GatewaySession, prompt: list[int], sampling: SamplingSettings,
                        on_tokens: Callable | None = None) -> Generation:
        """One leased engine call, registered with the session so closing the
        episode aborts it."""
        task = asyncio.ensure_future(self.client.generate(prompt, sampling, affinity=s._engine, on_tokens=on_tokens))
        s._inflight.add(task)
        try:
            gen = await task
        except EngineError as e:
            raise GatewayError(503, f"engine failed: {e}", code="engine_error", type="server_error") from e
        finally:
            s._inflight.discard(task)
        if s.closed:
            raise GatewayError(404, "the episode ended during the call", code="episode_not_found")
        if gen.completion.finish_reason == "abort":
            raise GatewayError(503, "the engine aborted the request", code="engine_error", type="server_error")
        s._engine = gen.lease.engine_id
        return gen

    def _reply(self, s: GatewaySession, gen: Generation, step: int,
               tools_on: bool) -> tuple[dict[str, Any], str, list[ToolCall]]:
        ids = gen.completion.token_ids
        text = self.renderer.decode(ids[:-1] if ids and ids[-1] == self.renderer.eos_id else ids)
        content, calls = split_tool_calls(text) if tools_on else (text, [])
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in calls]
        finish = "tool_calls" if calls else ("length" if gen.completion.finish_reason == "length" else "stop")
        return reply, finish, calls

    def _record(self, s, messages, tools, prompt, gen, step, version, temperature, reset, reply) -> None:
        s.calls.append(ServedCall(step, prompt, gen, version, temperature, reset))
        s.remember(step, messages, tools, prompt, gen.completion.token_ids, reply)
        self.stats.calls += 1

    async def _stream(self, request, s, req, messages, tools, tools_on, prompt, sampling, step, version,
                      reset) -> web.StreamResponse:
        """Server-sent events in OpenAI's chunk format. Content streams as the
        engine produces it; tool calls come whole at the end (a partial call
        cannot be parsed)."""
        latest: list[Any] = [()]
        grew = asyncio.Event()
        text = _IncrementalText(self.renderer)

        def on_tokens(ids) -> None:
            latest[0] = ids
            grew.set()

        cid, created = f"chatcmpl-{s.episode_id}-{step}", int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra) -> bytes:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        gen_task = asyncio.ensure_future(self._generate(s, prompt, sampling, on_tokens))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sent = ""
        try:
            # The status line goes out before the first token: from here on
            # errors travel as an error event.
            await resp.prepare(request)
            await resp.write(chunk({"role": "assistant", "content": ""}))
            while not gen_task.done():
                waiter = asyncio.ensure_future(grew.wait())
                await asyncio.wait([gen_task, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                grew.clear()
                safe = _stream_safe(text.update(latest[0]), tools_on)
                if len(safe) > len(sent) and safe.startswith(sent):
                    await resp.write(chunk({"content": safe[len(sent):]}))
                    sent = safe
            try:
                gen = gen_task.result()
            except GatewayError as e:
                self.stats.errors += 1
                await resp.write(b"data: " + json.dumps({"error": {"message": e.message, "type": e.type,
                                                                     "code": e.code}}).encode() + b"\n\n")
                return resp
            reply, finish, calls = self._reply(s, gen, step, tools_on)
            content = reply["content"]
            if not content.startswith(sent):  # cannot happen with a prefix-stable decode; keep parity honest
                log.warning("gateway.stream_diverged", episode=s.episode_id, step=step)
                reply["content"] = content = sent
            if len(content) > len(sent):
                await resp.write(chunk({"content": content[len(sent):]}))
            if calls:
                msg = _openai_message(reply, calls, step)
                await resp.write(chunk({"tool_calls": [dict(tc, index=i) for i, tc in enumerate(msg["tool_calls"])]}))
            self._record(s, messages, tools, prompt, gen, step, version, sampling.temperature, reset, reply)
            self.stats.streamed += 1
            await resp.write(chunk({}, finish))
            if (req.stream_options or {}).get("include_usage"):
                body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [], "usage": _usage(prompt, gen)}
                await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            # A client that went away mid-stream: abort the engine request.
            if not gen_task.done():
                gen_task.cancel()
                await asyncio.gather(gen_task, return_exceptions=True)

    # -- environment ------------------------------------------------------------

    async def _env_tools(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request)
        except GatewayError as e:
            return e.response()
        tools = s.task.tools() if s.task is not None else []
        return web.json_response({"tools": [t.as_chat_tool() for t in tools]})

    async def _env_step(self, request: web.Request) -> web.Response:
        """Body: ``{"tool": NAME, "arguments": {...}}`` or ``{"text": ...}``
        (a message to the environment). Answers the cube task's StepResult."""
        try:
            s = self._session(request)
            body = await _read(request, _EnvStep)
            if s.task is None or not getattr(s.task, "has_environment", True):
                raise GatewayError(404, "this episode has no environment", code="no_environment")
            if s.env_done:
                raise GatewayError(409, "the environment already ended this episode", code="episode_done")
            calls = [ToolCall(body.tool, body.arguments)] if body.tool else []
            try:
                result = await s.task.step(Action(text=body.text, tool_calls=calls))
            except NotImplementedError as e:
                raise GatewayError(404, f"this episode has no environment: {e}", code="no_environment") from e
            except Exception as e:  # the cube's failure, in OpenAI's error shape (not a bare 500)
                log.warning("gateway.env_step_failed", episode=s.episode_id, error=repr(e)[:300])
                raise GatewayError(500, f"the environment failed: {e!r}"[:1000], code="environment_error",
                                   type="server_error") from e
        except GatewayError as e:
            self.stats.errors += 1
            return e.response()
        s.agent_errors += result.error is not None
        s.env_done = s.env_done or result.done
        return web.json_response({"observation": result.observation, "reward": result.reward, "done": result.done,
                                  "error": result.error, "info": result.info}, dumps=_dumps)

    async def _env_reward(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request, key="reward")
            if not s.reward_key:
                raise GatewayError(403, "this episode's reward comes from its task's evaluator; a posted reward "
                                        "counts only with reward_source = \"agent\" in the cube's options",
                                   code="reward_not_accepted", type="permission_error")
            s.check_key(request, s.reward_key)
            body = await _read(request, _EnvReward)
            bound = s.settings.max_abs_reward
            if not (math.isfinite(body.reward) and abs(body.reward) <= bound):
                raise GatewayError(400, f"reward must be a finite number within [-{bound:g}, {bound:g}] "
                                        "(actor.episode.max_abs_reward)", param="reward")
        except GatewayError as e:
            self.stats.errors += 1
            if e.status != 404:
                self.stats.rewards_refused += 1
            return e.response()
        s.posted_reward, s.posted_success = body.reward, body.success
        return web.json_response({"ok": True})


class _IncrementalText:
    """The text of a growing completion, decoding only what is new (a
    whole-sequence decode per engine step would be quadratic in its length).
    A window of already-decoded tokens is decoded again with the new ones,
    so byte-level pieces that join into one character come out whole; a
    trailing partial character waits for its next token."""

    def __init__(self, renderer: ChatRenderer):
        self.renderer = renderer
        self.text = ""
        self.prefix = 0  # decoding window starts here
        self.read = 0  # tokens up to here are in self.text

    def update(self, ids) -> str:
        ids = list(ids[self.prefix:])
        if ids and ids[-1] == self.renderer.eos_id:
            ids = ids[:-1]
        done = self.read - self.prefix
        if len(ids) > done:
            head = self.renderer.decode(ids[:done])
            new = self.renderer.decode(ids)
            if len(new) > len(head) and not new.endswith("\ufffd"):
                self.text += new[len(head):]
                self.prefix, self.read = self.read, self.prefix + len(ids)
        return self.text


class _EnvStep(msgspec.Struct):
    tool: str = ""
    arguments: dict[str, Any] = {}
    text: str = ""


class _EnvReward(msgspec.Struct):
    reward: float
    success: bool | None = None


async def _read(request: web.Request, cls: type):
    raw = await request.read()
    try:
        return msgspec.json.decode(raw, type=cls)
    except msgspec.ValidationError as e:
        raise GatewayError(400, f"invalid request: {e}") from e
    except msgspec.DecodeError as e:
        raise GatewayError(400, f"request body is not JSON: {e}") from e


def _openai_message(reply: dict[str, Any], calls: list[ToolCall], step: int) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply["content"] if reply["content"] or not calls else None}
    if calls:
        msg["tool_calls"] = [{"id": f"call_{step}_{i}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                             for i, c in enumerate(calls)]
    return msg


def _usage(prompt: list[int], gen: Generation) -> dict[str, int]:
    n = len(gen.completion.token_ids)
    return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)
