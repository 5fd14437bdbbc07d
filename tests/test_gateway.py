"""The OpenAI-compatible gateway with the real openai client and the real
engine: completions, streaming, history parity, auth, errors, no leaks.
The tests taking ``mode`` run against both places the gateway can run
(``actor.gateway_host``): "inline" on this loop, "process" in a gateway
host process (more of its own in test_gateway_host.py)."""

import asyncio

import msgspec
import numpy as np
import openai
import pytest
import torch

from conftest import assert_engine_idle, reference_logprobs
from rlnode.actor.engine import SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings
from rlnode.actor.gateway import Gateway, HostedGateway
from rlnode.actor.gateway.stream import stream_safe
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.config import ModelConfig

pytestmark = pytest.mark.engine

SETTINGS = EpisodeSettings(SamplingSettings(max_tokens=16, temperature=1.0), max_turns=6, max_model_len=2048)


@pytest.fixture
def router():
    return AdmissionRouter(1, 16)


@pytest.fixture(params=["inline", "process"])
def mode(request):
    return request.param


@pytest.fixture
def make_gateway(mode, engine, tokenizer, tiny_model_dir):
    """The gateway in ``mode``: inline (a ChatRenderer of the test's
    tokenizer) or a host process (which builds the same from the model dir)."""

    def make(router, settings=SETTINGS, model_name="rlnode", engine=engine):
        client = LLMClient([engine], router)
        if mode == "process":
            return HostedGateway(client, ModelConfig(path=str(tiny_model_dir)), settings, model_name=model_name)
        return Gateway(client, ChatRenderer(tokenizer), settings, model_name=model_name)

    return make


@pytest.fixture
async def gateway(make_gateway, engine, router):
    gw = make_gateway(router, model_name="tiny")
    async with gw.serve():
        yield gw
    assert router.in_flight == [0]
    await assert_engine_idle(engine)


def client_for(session) -> openai.AsyncOpenAI:
    ep = session.endpoint
    return openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, timeout=60)


def check_parity(calls, hf_model):
    """Logprobs are the engine's (re-scored by transformers) and prompt k+1
    extends prompt k + completion k token for token."""
    for c in calls:
        comp = c.generation.completion
        ref = reference_logprobs(hf_model, c.prompt, comp.token_ids, c.temperature)
        assert (ref - torch.tensor(comp.logprobs)).abs().max().item() < 1e-4
    for prev, nxt in zip(calls, calls[1:]):
        head = prev.prompt + prev.generation.completion.token_ids
        assert nxt.prompt[: len(head)] == head
        assert not nxt.history_reset


async def test_models_and_multi_turn_history_parity(gateway, hf_model, tokenizer):
    async with gateway.session("ep-parity") as s:
        client = client_for(s)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        messages = [{"role": "system", "content": "You guess numbers."}, {"role": "user", "content": "Guess 1-8."}]
        for turn in range(3):
            r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
            msg = r.choices[0].message
            assert r.usage.prompt_tokens == len(s.calls[-1].prompt)
            assert r.usage.completion_tokens == len(s.calls[-1].generation.completion.token_ids) <= 12
            assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
            assert r.choices[0].finish_reason in ("stop", "length")
            messages += [msg, {"role": "user", "content": f"higher ({turn})"}]  # the SDK's own message object
        await client.close()
    assert [c.step_index for c in s.calls] == [0, 1, 2]
    assert s.history_resets == 0
    check_parity(s.calls, hf_model)
    # The first prompt is exactly the template's rendering of the conversation.
    first = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert s.calls[0].prompt == tokenizer.encode(first, add_special_tokens=False)


async def test_streaming_matches_and_extends(gateway, hf_model):
    async with gateway.session("ep-stream") as s:
        client = client_for(s)
        messages = [{"role": "user", "content": "Count."}]
        for _ in range(2):
            stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                          stream=True, stream_options={"include_usage": True})
            parts, finish, usage = [], None, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for ch in chunk.choices:
                    parts.append(ch.delta.content or "")
                    finish = ch.finish_reason or finish
            text = "".join(parts)
            comp = s.calls[-1].generation.completion
            assert usage.completion_tokens == len(comp.token_ids)
            assert finish in ("stop", "length")
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
        await client.close()
    assert gateway.stats.streamed == 2
    check_parity(s.calls, hf_model)


async def test_edited_history_starts_a_new_row_and_is_counted(gateway, tokenizer):
    async with gateway.session("ep-edit") as s:
        client = client_for(s)
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}])
        edited = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "something else"},
                  {"role": "user", "content": "b"}]
        await client.chat.completions.create(model="tiny", messages=edited)
        await client.close()
    assert r.choices[0].message.content != "something else"
    assert s.history_resets == 1 and s.calls[1].history_reset
    rendered = tokenizer.apply_chat_template(edited, add_generation_prompt=True, tokenize=False)
    assert s.calls[1].prompt == tokenizer.encode(rendered, add_special_tokens=False)


async def test_tokens_and_keys_are_checked(gateway):
    async with gateway.session("ep-auth") as s:
        ep = s.endpoint
        wrong = openai.AsyncOpenAI(base_url=ep.base_url, api_key="rlnode-guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        foreign = openai.AsyncOpenAI(base_url=ep.base_url.replace(s.token, "not-a-token"), api_key=ep.api_key,
                                     max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await foreign.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        await wrong.close(), await foreign.close()
    # Expired: the episode ended, its URL and key are dead.
    late = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        await late.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    await late.close()
    assert e.value.body["code"] == "episode_not_found"
    await gateway.sync()  # a host's counters
    assert not s.calls and gateway.stats.unauthorized == 3


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": 1.5}, "temperature"),
    ({"temperature": 0.0}, "temperature"),
    ({"n": 2}, "n"),
    ({"stop": ["\n", ""]}, "stop"),  # an empty stop sequence (stop sequences are honoured: test_gateway_protocols)
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tool_choice"),
])
async def test_bad_requests_get_openai_errors(gateway, kwargs, param):
    async with gateway.session("ep-bad") as s:
        client = client_for(s)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], **kwargs)
        await client.close()
    assert e.value.body["param"] == param and e.value.body["message"]
    assert not s.calls


async def test_lower_temperature_is_the_samples_temperature(gateway, hf_model):
    async with gateway.session("ep-temp") as s:
        client = client_for(s)
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             temperature=0.5)
        await client.close()
    assert s.calls[0].temperature == 0.5
    check_parity(s.calls, hf_model)


async def test_a_temperature_below_the_floor_is_raised_to_it(make_gateway, router, hf_model):
    """An agent asking for T = 0.05 would make the trainer refuse the whole
    group (and scale its gradients by 1/T): it is sampled, recorded and
    scored at actor.sampling.min_temperature, and counted."""
    floored = msgspec.structs.replace(SETTINGS, min_temperature=0.25)
    gw = make_gateway(router)
    async with gw.serve():
        async with gw.session("ep-floor", settings=floored) as s:
            client = client_for(s)
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 temperature=0.05)
            await client.close()
    assert s.calls[0].temperature == 0.25 and gw.stats.temperature_floored == 1
    check_parity(s.calls, hf_model)


async def test_max_turns_and_context_limit_end_the_episode(make_gateway, router):
    settings = EpisodeSettings(SamplingSettings(max_tokens=8), max_turns=2, max_model_len=2048)
    gw = make_gateway(router, settings)
    async with gw.serve(), gw.session("ep-limits") as s:
        client = client_for(s)
        for _ in range(2):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        await s.settle()  # what a host decided is known here
        assert e.value.body["code"] == "max_turns_exceeded" and s.terminated == "max_turns"
        async with gw.session("ep-long") as s2:
            c2 = client_for(s2)
            with pytest.raises(openai.BadRequestError) as e:
                await c2.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 3000}])
            await c2.close()
        assert e.value.body["code"] == "context_length_exceeded" and s2.terminated == "context_limit"
        await client.close()


async def test_limits_are_checked_before_tokenizing(engine, tokenizer, router, monkeypatch):
    """A call past max_turns, and a body whose text cannot fit the context
    even at the longest token, are refused without tokenizing anything (a
    64 MiB body would otherwise hold the event loop in the tokenizer)."""
    settings = EpisodeSettings(SamplingSettings(max_tokens=4), max_turns=1, max_model_len=2048)
    renderer = ChatRenderer(tokenizer)
    gw = Gateway(LLMClient([engine], router), renderer, settings)
    encoded: list[int] = []
    encode = renderer.encode
    monkeypatch.setattr(renderer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    huge = "x" * (renderer.max_token_chars * 2048 + 1000)
    async with gw.serve(), gw.session("ep-huge") as s:
        client = client_for(s)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": huge}])
        assert e.value.body["code"] == "context_length_exceeded" and s.terminated == "context_limit"
        assert encoded == []
        async with gw.session("ep-turns") as s2:
            c2 = client_for(s2)
            await c2.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            encoded.clear()
            with pytest.raises(openai.BadRequestError) as e:
                await c2.chat.completions.create(model="m", messages=[{"role": "user", "content": huge}])
            assert e.value.body["code"] == "max_turns_exceeded" and encoded == []
            await c2.close()
        await client.close()


class HeldEngine:
    """The real engine, with the calls of ``max_tokens`` held at a gate the
    test opens: which of two calls finishes first, or whether a call's
    client is gone before its reply exists, is the test's choice, not the
    clock's. ``after``: the engine runs the call first, its result waits."""

    def __init__(self, engine, max_tokens: int, after: bool = False):
        self.engine, self.max_tokens, self.after = engine, max_tokens, after
        self.arrived, self.release = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt_token_ids, sampling, **kwargs):
        held = sampling.max_tokens == self.max_tokens
        if held and not self.after:
            self.arrived.set()
            await self.release.wait()
        out = await self.engine.generate(prompt_token_ids, sampling, **kwargs)
        if held and self.after:
            self.arrived.set()
            await self.release.wait()
        return out


async def test_a_call_that_finishes_late_does_not_rewind_the_history(make_gateway, engine, router, hf_model):
    """Two calls of one episode in flight at once: the earlier-started one
    (long) is held in the engine until the later one (short) has returned.
    The history stays the later call's, so the agent's next call extends
    it, token for token."""
    held = HeldEngine(engine, max_tokens=16)
    gw = make_gateway(router, model_name="tiny", engine=held)
    async with gw.serve():
        async with gw.session("ep-race") as s:
            client = client_for(s)
            slow = asyncio.create_task(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "long"}], max_tokens=16))
            await asyncio.wait_for(held.arrived.wait(), 60)  # the long call is in, held
            messages = [{"role": "user", "content": "short"}]
            quick = await client.chat.completions.create(model="m", messages=messages, max_tokens=1)
            held.release.set()
            await slow
            assert [c.step_index for c in s.calls] == [1, 0]  # the short call finished first
            messages += [quick.choices[0].message, {"role": "user", "content": "next"}]
            await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
            await client.close()
    assert s.history_resets == 0 and not s.calls[-1].history_reset
    check_parity([s.calls[0], s.calls[2]], hf_model)
    assert router.in_flight == [0]
    await assert_engine_idle(engine)


async def test_env_step_without_an_environment_is_404(gateway, tmp_path):
    import httpx

    from rlnode.cubes.registry import make_cube

    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "prompt": "p"}\n')
    cube = make_cube("c", "openai-agent", {"agent": "json:dumps", "tasks": str(path), "reward_source": "agent"}, 0)
    await cube.start()
    task = await cube.open_task("a")
    async with gateway.session("ep-noenv", task) as s:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s.api_key}"}) as http:
            r = await http.post(s.endpoint.env_url + "/step", json={"text": "hi"})
    await task.close(), await cube.close()
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_environment"


async def test_ending_an_episode_aborts_its_calls(gateway, engine, router):
    """A session closed while a (streamed) call runs: the engine request is
    aborted and the lease returned; the fixture checks both."""
    async with gateway.session("ep-abort") as s:
        client = client_for(s)
        long = SETTINGS.sampling.max_tokens
        task = asyncio.create_task(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=long))
        while not s._inflight:
            await asyncio.sleep(0.005)
    with pytest.raises(openai.APIError):
        await task
    await client.close()
    assert not s.calls


def test_tool_call_reply_and_stream_prefix(tokenizer):
    """The reply's content and calls (the default parser, hermes): what was
    streamed before the call is always a prefix of the final content."""
    parser = ChatRenderer(tokenizer).parser
    tools = [{"type": "function", "function": {"name": "guess"}}]
    text = 'Let me try. <tool_call>{"name": "guess", "arguments": {"n": 4}}</tool_call>'
    p = parser.parse(text, tools)
    assert p.content == "Let me try. " and [(c.name, c.arguments) for c in p.tool_calls] == [("guess", {"n": 4})]
    for k in range(len(text) + 1):
        assert p.content.startswith(stream_safe(text[:k], True, parser))
    bad = "x <tool_call>{not json</tool_call>"
    assert parser.parse(bad, tools)[:3] == (bad, None, [])
    assert parser.parse("plain", tools) == ("plain", None, [], None)
    assert parser.parse(text, None) == (text, None, [], None)  # tool_choice "none" / no tools: text as is


class _GatewayRole:
    """The part of the actor role the ops endpoint sees (routes + bound URL)."""

    name = "actor"

    def __init__(self, gw):
        self.gw = gw

    def add_http_routes(self, app):
        self.gw.add_routes(app)

    def http_bound(self, url):
        self.gw.url = url

    def healthy(self):
        return True, ""

    def status(self):
        return {}

    def prometheus(self):
        return []

    def gauges(self):
        return {}

    def history(self):
        return {}


async def test_mounted_on_the_ops_endpoint_behind_its_token(engine, tokenizer, router):
    """On the ops endpoint, everything else needs the ops bearer token;
    episode paths need their own key instead (agents never see the ops token)."""
    import aiohttp

    from rlnode.ops.http import OpsServer

    gw = Gateway(LLMClient([engine], router), ChatRenderer(tokenizer), SETTINGS)
    ops = OpsServer([_GatewayRole(gw)], "127.0.0.1", 0, token="ops-secret")
    await ops.start()
    try:
        assert gw.url == f"http://127.0.0.1:{ops.port}"
        async with gw.session("ep-ops") as s, aiohttp.ClientSession() as http:
            client = client_for(s)
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            assert r.usage.completion_tokens == len(s.calls[0].generation.completion.token_ids)
            await client.close()
            async with http.get(f"{gw.url}/status", headers={"Authorization": f"Bearer {s.api_key}"}) as resp:
                assert resp.status == 401  # an episode key is not the ops token
            async with http.get(f"{gw.url}/status", headers={"Authorization": "Bearer ops-secret"}) as resp:
                assert resp.status == 200
    finally:
        await ops.close()


async def test_greedy_evaluation_settings_win_over_the_agents_temperature(make_gateway, router):
    greedy = EpisodeSettings(SamplingSettings(max_tokens=8, temperature=0.0), max_turns=4, max_model_len=2048)
    gw = make_gateway(router)
    outs = []
    async with gw.serve():
        for _ in range(2):
            async with gw.session("ep-eval", settings=greedy) as s:
                client = client_for(s)
                r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                         temperature=0.7)
                outs.append(s.calls[0].generation.completion.token_ids)
                await client.close()
            assert s.calls[0].temperature == 0.0 and r.choices[0].message is not None
    assert outs[0] == outs[1]  # greedy: the same tokens twice


async def test_a_reply_the_agent_never_got_is_not_trained(make_gateway, router, engine, hf_model):
    """The agent gives up on a call (a client timeout) after the engine has
    run it and before its reply reaches the agent, then retries. The call
    it never saw is not trained on, and the retry extends the history the
    agent did see. The finished call is held at a gate until the gateway
    has dropped it: otherwise a reply written just before the hang-up was
    noticed (a loaded host) would count as delivered, the clock's choice."""
    settings = EpisodeSettings(SamplingSettings(max_tokens=512, ignore_eos=True), max_turns=6, max_model_len=2048)
    held = HeldEngine(engine, max_tokens=512, after=True)
    gw = make_gateway(router, settings, engine=held)
    async with gw.serve(), gw.session("ep-hangup") as s:
        client = client_for(s)
        messages = [{"role": "user", "content": "x"}]
        first = asyncio.create_task(client.chat.completions.create(model="tiny", messages=messages))
        try:
            await asyncio.wait_for(held.arrived.wait(), 120)  # the engine ran it; its reply waits
            first.cancel()  # httpx closes the connection of a cancelled request
            with pytest.raises(asyncio.CancelledError):
                await first
            if isinstance(gw, HostedGateway):  # the host reports the hang-up and the daemon drops the call
                async with asyncio.timeout(60):
                    while s._inflight:
                        await asyncio.sleep(0.002)
            else:
                # Inline, the server is on this loop: the client's close and
                # the server's end of file are events ready before this timer.
                await asyncio.sleep(0.05)
        finally:
            held.release.set()
        async with asyncio.timeout(60):  # dropped (process) or found unsent at its write (inline)
            while s._inflight:
                await asyncio.sleep(0.002)
        await s.settle()
        retry = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        messages += [retry.choices[0].message, {"role": "user", "content": "next"}]
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        await s.settle()
        await client.close()
    assert router.in_flight == [0]
    await assert_engine_idle(engine)
    assert [c.step_index for c in s.calls] == [1, 2]
    assert s.history_resets == 0 and not s.calls[-1].history_reset
    check_parity(s.calls, hf_model)


async def test_concurrent_calls_cannot_pass_the_turn_limit(make_gateway, router, mode, monkeypatch):
    """Calls of one episode at once, each tokenized in a thread (an await
    between the turn check and taking the turn, were there one): exactly
    max_turns of them run, the rest are refused."""
    from rlnode.actor.gateway import server

    monkeypatch.setattr(server, "TOKENIZE_INLINE_CHARS", 0)  # every call tokenized off the loop
    settings = EpisodeSettings(SamplingSettings(max_tokens=2), max_turns=2, max_model_len=2048)
    gw = make_gateway(router, settings)
    async with gw.serve(), gw.session("ep-burst") as s:
        client = client_for(s)
        outcomes = await asyncio.gather(*(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"call {i}"}])
            for i in range(6)), return_exceptions=True)
        await s.settle()
        await client.close()
    refused = [o for o in outcomes if isinstance(o, openai.BadRequestError)]
    assert len(s.calls) == 2 and len(refused) == 4, outcomes
    assert all(o.body["code"] == "max_turns_exceeded" for o in refused)


async def test_one_episodes_environment_calls_run_one_at_a_time(gateway):
    """POST env/step of one episode, many at once: the task sees them one
    after another (a cube task is a sequential environment)."""
    import httpx

    from rlnode.cubes.base import CubeTask, CubeTaskRef, StepResult

    class Probe(CubeTask):
        ref = CubeTaskRef("probe", "t")

        def __init__(self):
            self.running = self.most = self.steps = 0

        async def reset(self):
            raise NotImplementedError

        def tools(self):
            return []

        async def step(self, action):
            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(0.01)
            self.running -= 1
            self.steps += 1
            return StepResult(observation=action.text)

        async def evaluate(self):
            raise NotImplementedError

    task = Probe()
    async with gateway.session("ep-env", task) as s:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s.api_key}"}) as http:
            replies = await asyncio.gather(*(http.post(s.endpoint.env_url + "/step", json={"text": str(i)})
                                             for i in range(8)))
    assert [r.status_code for r in replies] == [200] * 8
    assert task.steps == 8 and task.most == 1
