"""``Gateway``: the routes, per-episode sessions and the request handlers:
read a call through its API's protocol (``protocols/``), build its prompt in
tokens, take one leased engine call, answer in that API's shape (or stream,
``stream.py``); the environment routes answer from the episode's cube
task."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import tempfile
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web

from rlnode.actor.engine import EngineError, SamplingSettings, sweep_dead_dirs
from rlnode.actor.episode import ChatRenderer, EpisodeSettings, request_seed
from rlnode.actor.gateway.api import (
    MAX_REQUEST_BYTES, TOKENIZE_INLINE_CHARS, EnvReward, EnvStep, GatewayError, cut_at_stop, read_body,
)
from rlnode.actor.gateway.protocols import BY_NAME, PROTOCOLS, Answer, Call, Protocol
from rlnode.actor.gateway.session import GatewaySession, GatewayStats, ServedCall
from rlnode.actor.gateway.stream import stream_completion
from rlnode.actor.generation import Generation, LLMClient
from rlnode.cubes.base import Action, CubeTask, ToolCall
from rlnode.log import get_logger
from rlnode.ops.netaddr import local_url_host

log = get_logger("rlnode.gateway")


AGENTS_DIR_PREFIX = "rlnode-gateway-"


# env/step's answer: msgspec, not json.dumps (a third of the cost, on the
# daemon's loop per call); what it cannot encode in a cube's ``info`` is
# written as its str(), as json.dumps(default=str) did.
_ENCODE = msgspec.json.Encoder(enc_hook=str).encode


def agent_gone(request: web.Request) -> bool:
    """The agent's connection is closed (it gave up on the call)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def make_agents_dir() -> str:
    """A private directory (0711: a sandbox's uid may reach the socket bound
    into it, nobody may list it) for the agents' socket, named after this
    process; those of processes now gone are swept first."""
    sweep_dead_dirs(tempfile.gettempdir(), AGENTS_DIR_PREFIX)
    home = tempfile.mkdtemp(prefix=f"{AGENTS_DIR_PREFIX}{os.getpid()}-")
    os.chmod(home, 0o711)
    return home


class Gateway:
    def __init__(self, client: LLMClient, renderer: ChatRenderer, settings: EpisodeSettings,
                 model_name: str = "rlnode", history: str = "extend"):
        self.client, self.renderer, self.settings = client, renderer, settings
        self.model_name = model_name
        self.history = history  # actor.gateway_history: "extend" | "render"
        self.url = ""  # http://HOST:PORT of whoever serves the routes (set by serve() or the daemon)
        # A unix socket serving the episode routes and nothing else: what
        # sandboxed agents reach, through their relay (rlnode/cubes/
        # agent_sandbox.py). The TCP port above may be the ops endpoint's,
        # which also serves /status, /metrics and /history.
        self.agent_socket = ""
        self.sessions: dict[str, GatewaySession] = {}
        self.stats = GatewayStats()

    @property
    def agent_sockets(self) -> list[str]:
        """Every agent socket of the gateway (one here; one per host for a
        HostedGateway), in slot order."""
        return [self.agent_socket] if self.agent_socket else []

    # -- serving ------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/episodes/{token}/v1/models", self._models)
        app.router.add_get("/episodes/{token}/v1/models/{model}", self._models)
        for proto in PROTOCOLS:
            app.router.add_post(f"/episodes/{{token}}{proto.route}", self._handler(proto))
        app.router.add_get("/episodes/{token}/env/tools", self._env_tools)
        app.router.add_post("/episodes/{token}/env/step", self._env_step)
        app.router.add_post("/episodes/{token}/env/reward", self._env_reward)

    def _handler(self, proto: Protocol) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve_call(request, proto)
        return handle

    @contextlib.asynccontextmanager
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator["Gateway"]:
        """Serve on a site of its own (an actor without its ops endpoint,
        tests, benchmarks), and the agents' socket."""
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        self.add_routes(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = site._server.sockets[0].getsockname()
            self.url = f"http://{local_url_host(host)}:{bound[1]}"
            async with self.serve_agents():
                yield self
        finally:
            await runner.cleanup()

    @contextlib.asynccontextmanager
    async def serve_agents(self) -> AsyncIterator[str]:
        """The agents' socket: the episode routes alone, on a unix socket in
        a private directory (0711: a sandbox's uid may connect to the socket
        bound into it, nobody may list the directory)."""
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        self.add_routes(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        home = await asyncio.to_thread(make_agents_dir)
        try:
            path = os.path.join(home, "agents.sock")
            await web.UnixSite(runner, path).start()
            os.chmod(path, 0o666)
            self.agent_socket = path
            yield path
        finally:
            self.agent_socket = ""
            try:
                await runner.cleanup()
            finally:
                # Inline, not in a thread: one socket file (instant), and it
                # must go even when this exit is itself cancelled.
                shutil.rmtree(home, ignore_errors=True)

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

    async def sync(self) -> None:
        """``stats`` is current (as ``HostedGateway.sync``; here it always is)."""

    def _session(self, request: web.Request, key: str | None = None) -> GatewaySession:
        s = self.sessions.get(request.match_info["token"])
        if s is None or s.closed:
            self.stats.unauthorized += 1
            raise GatewayError(404, "unknown or finished episode", code="episode_not_found")
        if key is None:
            s.check_key(request)
        s.agent_up.set()
        return s

    # -- handlers -------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        """The one model, in OpenAI's shape, or Anthropic's for its SDK
        (which sends ``anthropic-version``). Calls accept any model name
        (agents hard-code theirs); only this route says which one is
        served, and 404s another by name."""
        proto = BY_NAME["messages" if "anthropic-version" in request.headers else "chat"]
        try:
            self._session(request)
            asked = request.match_info.get("model")
            if asked is None:
                return web.json_response(proto.model_list(self.model_name))
            if asked != self.model_name:
                raise GatewayError(404, f"The model {asked!r} does not exist; this endpoint serves "
                                        f"{self.model_name!r} (calls may name any model)", code="model_not_found",
                                   param="model")
            return web.json_response(proto.model_card(self.model_name))
        except GatewayError as e:
            return proto.error_response(e)

    async def _serve_call(self, request: web.Request, proto: Protocol) -> web.StreamResponse:
        """One LLM call through ``proto``'s route, answered (errors too) in
        its API's shape."""
        try:
            s = self._session(request)
            call = proto.parse(await request.read(), s)
            return await self._complete(request, s, call, proto)
        except GatewayError as e:
            self.stats.errors += 1
            return proto.error_response(e)

    async def _complete(self, request: web.Request, s: GatewaySession, call: Call,
                        proto: Protocol) -> web.StreamResponse:
        settings = s.settings
        base = settings.sampling
        temperature = self._temperature(s, call)
        # The turn limit first: a refused call costs no template work. The
        # turn is checked and taken with no await between: concurrent calls
        # of one episode (tokenized in threads) cannot all pass the check.
        if s.next_step >= settings.max_turns:
            s.terminated = s.terminated or "max_turns"
            raise GatewayError(400, f"the episode used its {settings.max_turns} LLM calls (actor.episode.max_turns)",
                               code="max_turns_exceeded")
        step = s.next_step
        s.next_step += 1
        prompt, reset = await self._prompt(s, call)
        room = settings.max_model_len - len(prompt)
        if room < settings.min_completion_tokens:
            s.terminated = s.terminated or "context_limit"
            raise GatewayError(400, f"prompt of {len(prompt)} tokens leaves no room in the {settings.max_model_len}"
                                    "-token context", code="context_length_exceeded", param="messages")
        want = call.max_tokens or base.max_tokens
        # The episode's seed per call (an agent's own seed is mixed in, never
        # used alone: an agent that sends one fixed seed would otherwise make
        # every attempt of its group sample the same tokens).
        seed = call.seed if settings.seed is None else request_seed(settings.seed, step, call.seed)
        sampling = msgspec.structs.replace(base, temperature=temperature, seed=seed, stop=call.stop,
                                           max_tokens=max(1, min(want, base.max_tokens, room)))
        s.history_resets += reset
        self.stats.history_resets += reset
        version = s.policy_version()
        answer_id, created = f"{proto.id_prefix}{s.episode_id}-{step}", int(time.time())
        if call.stream:
            return await stream_completion(self, request, s, call, proto, prompt, sampling, step, version, reset,
                                           answer_id, created)
        gen = await self._generate(s, prompt, sampling, step=step, reset=reset, agent_seed=call.seed)
        delivered = False
        try:
            if agent_gone(request):  # it hung up during the call (a client timeout, then maybe a retry)
                raise ConnectionResetError("the agent hung up before the reply")
            answer = self._answer_of(gen, call, prompt, step, answer_id, created)
            self._record(s, call, prompt, gen, step, version, temperature, reset, answer)
            # Written here, not by aiohttp after the handler returns: a
            # write that fails must drop the call's sample.
            resp = web.json_response(proto.body(answer))
            await resp.prepare(request)
            await resp.write_eof()
            delivered = True
            proto.answered(answer, s)
            return resp
        finally:
            if not delivered:
                self._unsent(s, step)

    async def _prompt(self, s: GatewaySession, call: Call) -> tuple[list[int], bool]:
        """The call's prompt in token ids, and whether it is a history reset
        (it does not extend the episode's last prompt + completion)."""
        settings = s.settings
        if call.prompt_ids is not None:  # the agent's own ids: the engine gets exactly these
            vocab = self.renderer.vocab_size
            bad = next((t for t in call.prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise GatewayError(400, f"prompt token id {bad!r} is not in the model's vocabulary (0..{vocab - 1})",
                                   param="prompt")
            if len(call.prompt_ids) > settings.max_model_len:
                s.terminated = s.terminated or "context_limit"
                raise GatewayError(400, f"prompt of {len(call.prompt_ids)} tokens does not fit the "
                                        f"{settings.max_model_len}-token context", code="context_length_exceeded",
                                   param="prompt")
            return list(call.prompt_ids), s.has_history and not s.extends_ids(call.prompt_ids)
        if call.text is not None:
            match = s.extends_text(call.text)
            new_chars = len(call.text) - (0 if match is None else match.covered)
            base_len = 0 if match is None else len(match.ids)
            self._check_fits(s, base_len, new_chars, "prompt")
            rest = call.text if match is None else call.text[match.covered:]
            ids = (await asyncio.to_thread(self.renderer.encode, rest) if new_chars > TOKENIZE_INLINE_CHARS
                   else self.renderer.encode(rest))
            return ([] if match is None else match.ids) + ids, match is None and s.has_history
        messages, tools = call.messages, call.tools
        if self.history == "render":  # the template's rendering, as vllm serve builds it
            self._check_fits(s, 0, sum(len(m["content"]) for m in messages), "messages")
            try:
                prompt = await asyncio.to_thread(s.prompt_for, messages, tools, None)
            except (ValueError, TypeError) as e:
                raise GatewayError(400, f"chat template: {e}", param="messages") from e
            return prompt, s.has_history and not s.extends_ids(prompt)
        match = s.extends(messages, tools)
        new = messages if match is None else messages[match.covered:]
        new_chars = sum(len(m["content"]) for m in new)
        self._check_fits(s, 0 if match is None else len(match.ids), new_chars, "messages")
        try:
            if new_chars > TOKENIZE_INLINE_CHARS:  # long documents: off the event loop
                prompt = await asyncio.to_thread(s.prompt_for, messages, tools, match)
            else:
                prompt = s.prompt_for(messages, tools, match)
        except (ValueError, TypeError) as e:  # the template rejected the conversation
            raise GatewayError(400, f"chat template: {e}", param="messages") from e
        return prompt, match is None and s.has_history

    def _check_fits(self, s: GatewaySession, base_len: int, new_chars: int, param: str) -> None:
        """Even at the tokenizer's longest token, this much new text cannot
        fit: refused without tokenizing (a 64 MiB body would hold the loop)."""
        if base_len + new_chars // self.renderer.max_token_chars > s.settings.max_model_len:
            s.terminated = s.terminated or "context_limit"
            raise GatewayError(400, f"{new_chars} characters of new text cannot fit the {s.settings.max_model_len}"
                                    "-token context", code="context_length_exceeded", param=param)

    def _temperature(self, s: GatewaySession, call: Call) -> float:
        """The temperature the call samples at, checked against the run's
        (GatewayError for knobs the run refuses)."""
        settings = s.settings
        base = settings.sampling
        temperature = base.temperature if call.temperature is None else call.temperature
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
        if call.top_p is not None and abs(call.top_p - base.top_p) > 1e-9:
            raise GatewayError(400, f"top_p is fixed by the run (actor.sampling.top_p = {base.top_p})", param="top_p")
        return temperature

    async def _generate(self, s: GatewaySession, prompt: list[int], sampling: SamplingSettings,
                        on_tokens: Callable | None = None, *, step: int, reset: bool,
                        agent_seed: int | None) -> Generation:
        """One leased engine call, registered with the session so closing the
        episode aborts it. ``step``, ``reset``, ``agent_seed``: the call as
        the agent asked for it (the gateway host sends them to the daemon,
        ``host.py``; here ``sampling`` already holds them)."""
        task = asyncio.ensure_future(s.generate(self.client, prompt, sampling, on_tokens))
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

    def _answer_of(self, gen: Generation, call: Call, prompt: list[int], step: int, answer_id: str,
                created: int) -> Answer:
        """A completion as every API's reply is written from. A chat call's
        text is read by model.tool_parser (when it offered tools and
        tool_choice is not "none"; a call vLLM cannot read stays in the
        content, as vllm serve answers) and model.reasoning_parser; a raw
        prompt's (completions) is the text as it is. ``Answer.reply`` is what
        a re-sent history is matched against: content and calls, no
        reasoning (the agent sends back content and calls)."""
        comp = gen.completion
        text = self.renderer.completion_text(comp.token_ids, comp.finish_reason)
        length = comp.finish_reason == "length"
        hit = None
        if call.stop and comp.finish_reason == "stop":  # the agent sees the text before its stop sequence
            text, hit = cut_at_stop(text, call.stop)
        if call.messages is None:
            return Answer(answer_id, step, self.model_name, created, text, None, [], "length" if length else "stop",
                          prompt, comp.token_ids, call,
                          {"text": text, "stop_dropped": self.renderer.ends_on_stop(comp.token_ids, comp.finish_reason)},
                          hit)
        tools = call.tools if call.tools and call.tool_choice != "none" else None
        parsed = self.renderer.parser.parse(text, tools, output_ids=comp.token_ids, prompt_ids=prompt)
        content, calls = parsed.content, parsed.tool_calls
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in calls]
        finish = "tool_calls" if calls else ("length" if length else "stop")
        return Answer(answer_id, step, self.model_name, created, content, parsed.reasoning, calls, finish, prompt,
                      comp.token_ids, call, reply, hit)

    def _record(self, s: GatewaySession, call: Call, prompt: list[int], gen, step: int, version: int,
                temperature: float, reset: bool, answer: Answer) -> None:
        s.calls.append(ServedCall(step, prompt, gen, version, temperature, reset))
        s.remember(step, call, prompt, gen.completion.token_ids, answer.reply)
        self.stats.calls += 1

    def _unsent(self, s: GatewaySession, step: int) -> None:
        """Call ``step`` was answered by the engine but its reply did not
        reach the agent: not trained on (``GatewaySession.forget``)."""
        if s.forget(step):
            self.stats.unsent += 1
            log.info("gateway.reply_unsent", episode=s.episode_id, step=step)

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
            body = await env_step(s, await request.read())
        except GatewayError as e:
            self.stats.errors += 1
            return e.response()
        return web.Response(body=body, content_type="application/json")

    async def _env_reward(self, request: web.Request) -> web.Response:
        try:
            s = self._session(request, key="reward")
            if not s.reward_key:
                raise GatewayError(403, "this episode's reward comes from its task's evaluator; a posted reward "
                                        "counts only with reward_source = \"agent\" in the cube's options",
                                   code="reward_not_accepted", type="permission_error")
            s.check_key(request, s.reward_key)
            body = await read_body(request, EnvReward)
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


async def env_step(s: GatewaySession, raw: bytes) -> bytes:
    """POST env/step for session ``s`` (its task: the daemon's): the JSON
    body of the answer, or GatewayError."""
    try:
        body = msgspec.json.decode(raw, type=EnvStep)
    except msgspec.ValidationError as e:
        raise GatewayError(400, f"invalid request: {e}") from e
    except msgspec.DecodeError as e:
        raise GatewayError(400, f"request body is not JSON: {e}") from e
    if s.task is None or not getattr(s.task, "has_environment", True):
        raise GatewayError(404, "this episode has no environment", code="no_environment")
    calls = [ToolCall(body.tool, body.arguments)] if body.tool else []
    async with s.env_lock:  # one at a time per episode, in arrival order (asyncio.Lock is fair)
        if s.env_done:
            raise GatewayError(409, "the environment already ended this episode", code="episode_done")
        return await _step(s, Action(text=body.text, tool_calls=calls))


async def _step(s: GatewaySession, action: Action) -> bytes:
    try:
        result = await s.task.step(action)
    except NotImplementedError as e:
        raise GatewayError(404, f"this episode has no environment: {e}", code="no_environment") from e
    except Exception as e:  # the cube's failure, in OpenAI's error shape (not a bare 500)
        log.warning("gateway.env_step_failed", episode=s.episode_id, error=repr(e)[:300])
        raise GatewayError(500, f"the environment failed: {e!r}"[:1000], code="environment_error",
                           type="server_error") from e
    s.agent_errors += result.error is not None
    s.env_done = s.env_done or result.done
    return _ENCODE({"observation": result.observation, "reward": result.reward, "done": result.done,
                    "error": result.error, "info": result.info})
