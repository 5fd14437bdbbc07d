"""The gateway's other APIs, each through its own unmodified SDK and the real
engine: Anthropic Messages (``anthropic``), OpenAI Responses and OpenAI
Completions (``openai``). Each: multi-turn samples token-exact (prompt k+1
extends prompt k + completion k; the engine's logprobs), streaming that
adds up to the whole reply, token ids in and out, and errors in the API's
own shape, raised as the SDK's own exception types. The translation alone
(no engine) is checked at the top. Tool loops run in
test_examples_agents.py (a scripted policy writes the calls)."""

import json

import anthropic
import openai
import pytest

from rlnode.actor.gateway.api import GatewayError
from rlnode.actor.gateway.protocols import BY_NAME
from rlnode.actor.gateway.protocols.messages import MessagesRequest, conversation
from rlnode.actor.gateway.protocols.responses import input_messages
from rlnode.cubes.openai_agent import anthropic_base
from test_gateway import check_parity, client_for, gateway, make_gateway, mode, router  # noqa: F401 (fixtures)


# -- the translation, no engine ---------------------------------------------------


def test_messages_become_the_conversation_the_template_renders():
    req = MessagesRequest(model="m", max_tokens=8, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                          messages=[
                              {"role": "user", "content": "Guess."},
                              {"role": "assistant", "content": [
                                  {"type": "thinking", "thinking": "hmm", "signature": "x"},
                                  {"type": "text", "text": "Let me try."},
                                  {"type": "tool_use", "id": "toolu_0_0", "name": "guess", "input": {"number": 4}}]},
                              {"role": "user", "content": [
                                  {"type": "tool_result", "tool_use_id": "toolu_0_0",
                                   "content": [{"type": "text", "text": "Lower."}, {"type": "text", "text": "1-3."}]},
                                  {"type": "text", "text": "Go on."}]}])
    assert conversation(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Guess."},
        {"role": "assistant", "content": "Let me try.",
         "tool_calls": [{"type": "function", "function": {"name": "guess", "arguments": {"number": 4}}}]},
        {"role": "tool", "content": "Lower.\n1-3.", "tool_call_id": "toolu_0_0"},
        {"role": "user", "content": "Go on."}]
    bad = MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}])
    with pytest.raises(GatewayError, match="image"):
        conversation(bad)


def test_response_items_become_the_conversation_the_template_renders():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Guess."}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me try.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_0_0", "name": "guess", "arguments": '{"number": 4}'},
             {"type": "function_call", "call_id": "call_0_1", "name": "guess", "arguments": '{"number": 5}'},
             {"type": "function_call_output", "call_id": "call_0_0", "output": "Lower."},
             {"type": "function_call_output", "call_id": "call_0_1", "output": "Lower."}]
    assert input_messages(items) == [
        {"role": "user", "content": "Guess."},
        {"role": "assistant", "content": "Let me try.", "tool_calls": [
            {"type": "function", "function": {"name": "guess", "arguments": {"number": 4}}},
            {"type": "function", "function": {"name": "guess", "arguments": {"number": 5}}}]},
        {"role": "tool", "content": "Lower.", "tool_call_id": "call_0_0"},
        {"role": "tool", "content": "Lower.", "tool_call_id": "call_0_1"}]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    with pytest.raises(GatewayError, match="item_reference"):
        input_messages([{"type": "item_reference", "id": "x"}])


def test_stop_sequences_cut_and_hold_back():
    from rlnode.actor.gateway.api import check_stop, cut_at_stop, hold_back_stop

    assert check_stop("END") == ("END",) and check_stop(["a", "bc"]) == ("a", "bc") and check_stop(None) == ()
    for bad in ([""], ["x"] * 17, ["x" * 257], [3]):
        with pytest.raises(GatewayError, match="stop"):
            check_stop(bad)
    assert cut_at_stop("one END two STOP", ("STOP", "END")) == ("one ", "END")  # the first in the text wins
    assert cut_at_stop("nothing", ("END",)) == ("nothing", None)
    # A stream shows neither a stop sequence nor a tail that may begin one.
    assert hold_back_stop("abc EN", ("END",)) == "abc " and hold_back_stop("abc E", ("END", "EX")) == "abc "
    assert hold_back_stop("abc END and more", ("END",)) == "abc " and hold_back_stop("abc", ()) == "abc"
    assert hold_back_stop("abc x", ("END",)) == "abc x"


def test_anthropic_base_url_is_the_episode_root():
    assert anthropic_base("http://h:1/episodes/T/v1") == "http://h:1/episodes/T"
    assert anthropic_base("http://h:1/episodes/T/v1/") == "http://h:1/episodes/T"


def test_each_api_has_its_route_and_its_error_shape():
    assert {p.name: p.route for p in BY_NAME.values()} == {
        "chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
        "messages": "/v1/messages"}
    e = GatewayError(401, "invalid API key for this episode", code="invalid_api_key", type="authentication_error")
    assert BY_NAME["messages"].error_body(e) == {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid API key for this episode"}}
    assert BY_NAME["responses"].error_body(e)["error"]["code"] == "invalid_api_key"


# -- Anthropic Messages, the anthropic SDK ------------------------------------------


def anthropic_for(session, **kw) -> anthropic.AsyncAnthropic:
    ep = session.endpoint
    return anthropic.AsyncAnthropic(base_url=anthropic_base(ep.base_url), api_key=kw.pop("api_key", ep.api_key),
                                    max_retries=0, timeout=60, **kw)


@pytest.mark.engine
async def test_messages_multi_turn_samples_are_exact(gateway, hf_model, tokenizer):
    async with gateway.session("ep-messages") as s:
        client = anthropic_for(s)
        messages = [{"role": "user", "content": "Guess 1-8."}]
        for turn in range(3):
            r = await client.messages.create(model="tiny", max_tokens=12, system="You guess numbers.",
                                             messages=messages)
            assert r.type == "message" and r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens")
            assert r.usage.input_tokens == len(s.calls[-1].prompt)
            assert r.usage.output_tokens == len(s.calls[-1].generation.completion.token_ids) <= 12
            assert [b.type for b in r.content] == ["text"]
            messages += [{"role": "assistant", "content": r.content},  # the SDK's own blocks, re-sent
                         {"role": "user", "content": f"higher ({turn})"}]
        await client.close()
    assert [c.step_index for c in s.calls] == [0, 1, 2] and s.history_resets == 0
    check_parity(s.calls, hf_model)
    first = tokenizer.apply_chat_template([{"role": "system", "content": "You guess numbers."},
                                           {"role": "user", "content": "Guess 1-8."}],
                                          add_generation_prompt=True, tokenize=False)
    assert s.calls[0].prompt == tokenizer.encode(first, add_special_tokens=False)


@pytest.mark.engine
async def test_messages_stream_adds_up_to_the_message(gateway, hf_model):
    async with gateway.session("ep-messages-stream") as s:
        client = anthropic_for(s)
        messages = [{"role": "user", "content": "Count."}]
        for _ in range(2):
            async with client.messages.stream(model="tiny", max_tokens=16, messages=messages) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            assert final.content[0].text == text
            assert final.usage.output_tokens == len(s.calls[-1].generation.completion.token_ids)
            assert final.stop_reason in ("end_turn", "max_tokens")
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
        await client.close()
    assert gateway.stats.streamed == 2 and s.history_resets == 0
    check_parity(s.calls, hf_model)


@pytest.mark.engine
async def test_messages_errors_are_anthropics(gateway):
    async with gateway.session("ep-messages-errors") as s:
        ask = dict(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        bad_key = anthropic_for(s, api_key="rlnode-wrong")
        with pytest.raises(anthropic.AuthenticationError) as e:
            await bad_key.messages.create(**ask)
        assert e.value.body["error"]["type"] == "authentication_error"
        await bad_key.close()
        client = anthropic_for(s)
        with pytest.raises(anthropic.BadRequestError, match="input_schema"):
            await client.messages.create(**ask, tools=[{"name": "guess", "description": "no schema"}])
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            await client.messages.create(**ask, tool_choice={"type": "any"})
        with pytest.raises(anthropic.BadRequestError, match="context") as e:  # 2048-token context
            await client.messages.create(model="tiny", max_tokens=4,
                                         messages=[{"role": "user", "content": "word " * 5000}])
        assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        with pytest.raises(anthropic.NotFoundError) as e:  # calls take any model name; this route names its own
            await client.models.retrieve("claude-elsewhere")
        assert e.value.body["error"]["type"] == "not_found_error"
        unknown = anthropic.AsyncAnthropic(base_url=anthropic_base(s.endpoint.base_url).replace(s.token, "nope"),
                                           api_key=s.endpoint.api_key, max_retries=0)
        with pytest.raises(anthropic.NotFoundError):
            await unknown.messages.create(**ask)
        await unknown.close(), await client.close()
    assert s.calls == []  # nothing refused reached the engine


# -- OpenAI Responses, the openai SDK ------------------------------------------------


@pytest.mark.engine
async def test_responses_multi_turn_samples_are_exact(gateway, hf_model, tokenizer):
    """Turn 2 names turn 1 by previous_response_id, turn 3 re-sends every
    item: both extend the last prompt + completion exactly."""
    async with gateway.session("ep-responses") as s:
        client = client_for(s)
        r1 = await client.responses.create(model="tiny", instructions="You guess numbers.", input="Guess 1-8.",
                                           max_output_tokens=12)
        assert r1.status in ("completed", "incomplete") and r1.output[0].type == "message"
        assert r1.usage.input_tokens == len(s.calls[0].prompt)
        assert r1.usage.output_tokens == len(s.calls[0].generation.completion.token_ids)
        r2 = await client.responses.create(model="tiny", instructions="You guess numbers.", input="higher",
                                           previous_response_id=r1.id, max_output_tokens=12)
        items = [{"role": "user", "content": "Guess 1-8."}, *[o.model_dump(exclude_none=True) for o in r1.output],
                 {"role": "user", "content": "higher"}, *[o.model_dump(exclude_none=True) for o in r2.output],
                 {"role": "user", "content": "lower"}]
        r3 = await client.responses.create(model="tiny", instructions="You guess numbers.", input=items,
                                           max_output_tokens=12)
        assert r3.usage.output_tokens == len(s.calls[2].generation.completion.token_ids)
        assert r3.usage.input_tokens == len(s.calls[2].prompt)
        await client.close()
    assert [c.step_index for c in s.calls] == [0, 1, 2] and s.history_resets == 0
    check_parity(s.calls, hf_model)


@pytest.mark.engine
async def test_responses_stream_adds_up_to_the_response(gateway, hf_model):
    async with gateway.session("ep-responses-stream") as s:
        client = client_for(s)
        previous = None
        for _ in range(2):
            seen, deltas = [], []
            async with client.responses.stream(model="tiny", input="Count.", max_output_tokens=16,
                                               **({"previous_response_id": previous} if previous else {})) as stream:
                async for event in stream:
                    seen.append((event.type, event.sequence_number))
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                final = await stream.get_final_response()
            assert [n for _, n in seen] == list(range(len(seen)))
            assert seen[0][0] == "response.created" and seen[-1][0] == "response.completed"
            assert final.output_text == "".join(deltas)
            assert final.usage.output_tokens == len(s.calls[-1].generation.completion.token_ids)
            previous = final.id
        await client.close()
    assert gateway.stats.streamed == 2 and s.history_resets == 0
    check_parity(s.calls, hf_model)


@pytest.mark.engine
async def test_responses_errors_are_openais(gateway):
    async with gateway.session("ep-responses-errors") as s:
        client = client_for(s)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model="tiny", input="hi", previous_response_id="resp_elsewhere")
        assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
        with pytest.raises(openai.BadRequestError, match="function tools"):
            await client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
        with pytest.raises(openai.BadRequestError, match="context_length|cannot fit"):
            await client.responses.create(model="tiny", input="word " * 5000)
        assert (await client.models.retrieve("tiny")).id == "tiny"
        with pytest.raises(openai.NotFoundError) as e:
            await client.models.retrieve("gpt-elsewhere")
        assert e.value.code == "model_not_found"
        wrong = openai.AsyncOpenAI(base_url=s.endpoint.base_url, api_key="rlnode-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.responses.create(model="tiny", input="hi")
        await wrong.close(), await client.close()
    assert s.calls == []


# -- OpenAI Completions: a raw prompt, token ids in and out ------------------------


@pytest.mark.engine
async def test_completions_text_and_token_ids(gateway, hf_model, tokenizer):
    from rlnode.actor.episode import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    async with gateway.session("ep-completions") as s:
        client = client_for(s)
        r1 = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, seed=1,
                                             extra_body={"return_token_ids": True})
        c0 = s.calls[0]
        assert c0.prompt == tokenizer.encode("Once upon a time", add_special_tokens=False)
        choice = r1.choices[0].model_dump()
        assert choice["prompt_token_ids"] == c0.prompt and choice["token_ids"] == c0.generation.completion.token_ids
        # The text grows by the completion and more: the prompt extends the
        # last prompt + completion (the stop token the text dropped aside).
        text = "Once upon a time" + r1.choices[0].text + " then"
        await client.completions.create(model="tiny", prompt=text, max_tokens=8, seed=2)
        done = c0.generation.completion
        head = c0.prompt + (done.token_ids[:-1] if renderer.ends_on_stop(done.token_ids, done.finish_reason)
                            else done.token_ids)
        assert s.calls[1].prompt[: len(head)] == head and not s.calls[1].history_reset
        # Token ids in: the engine gets exactly these.
        ids = s.calls[1].prompt + s.calls[1].generation.completion.token_ids
        await client.completions.create(model="tiny", prompt=ids, max_tokens=4, seed=3)
        assert s.calls[2].prompt == ids and not s.calls[2].history_reset
        stream = await client.completions.create(model="tiny", prompt="Count:", max_tokens=8, stream=True, seed=4)
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        last = s.calls[3].generation.completion
        assert streamed == renderer.completion_text(last.token_ids, last.finish_reason)
        with pytest.raises(openai.BadRequestError, match="vocabulary"):
            await client.completions.create(model="tiny", prompt=[len(tokenizer) + 5], max_tokens=4)
        await client.close()
    assert s.history_resets == 1 and s.calls[3].history_reset  # the "Count:" call
    check_parity(s.calls[:3], hf_model)


@pytest.mark.engine
async def test_chat_returns_token_ids_when_asked(gateway):
    async with gateway.session("ep-chat-ids") as s:
        client = client_for(s)
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, extra_body={"return_token_ids": True})
        body = r.model_dump()
        assert body["prompt_token_ids"] == s.calls[0].prompt
        assert body["choices"][0]["token_ids"] == s.calls[0].generation.completion.token_ids
        plain = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=6)
        assert "prompt_token_ids" not in json.loads(plain.model_dump_json(exclude_unset=True))
        await client.close()


# -- histories the chat template rewrites ----------------------------------------


@pytest.mark.parametrize("history", ["extend", "render"])
async def test_a_reasoning_reply_resent_without_its_reasoning(history, tiny_model_dir):
    """A reasoning model's reply comes back from the agent without its
    reasoning (as Qwen3's and DeepSeek-R1's templates drop it from earlier
    turns). actor.gateway_history = "extend": the next prompt is the last
    prompt + the sampled tokens (reasoning included) + the new message, one
    growing context. "render": the template's rendering of the conversation
    as sent (no reasoning), which does not extend the last prompt and is
    counted. Either way each sample holds exactly what the engine saw and
    sampled, each sampled token in one sample only."""
    from transformers import AutoTokenizer

    from rlnode.actor.episode import ChatRenderer, EpisodeSettings
    from rlnode.actor.engine import SamplingSettings
    from rlnode.actor.gateway import Gateway
    from rlnode.actor.parsing import CompletionParser
    from test_examples_agents import ScriptedPolicy

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<think>", "</think>"])  # as the reasoning models' vocabularies have them
    renderer = ChatRenderer(tok, parser=CompletionParser(tok, "hermes", "deepseek_r1"))
    policy = ScriptedPolicy(tok, ["<think>plan A</think>3", "<think>plan B</think>2"])
    settings = EpisodeSettings(SamplingSettings(max_tokens=64), max_turns=8, max_model_len=2048)
    gw = Gateway(policy, renderer, settings, history=history)
    messages = [{"role": "user", "content": "Guess 1-5."}]
    async with gw.serve(), gw.session("ep-think") as s:
        client = client_for(s)
        r = await client.chat.completions.create(model="m", messages=messages)
        msg = r.choices[0].message
        assert msg.content == "3" and msg.model_extra["reasoning"] == "plan A"
        messages += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": "Lower."}]
        await client.chat.completions.create(model="m", messages=messages)
        await client.close()
    c0, c1 = s.calls
    sampled = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]
               for t in ("<think>plan A</think>3", "<think>plan B</think>2")]
    assert [c.generation.completion.token_ids for c in s.calls] == sampled == [p[-len(x):] for p, x in zip(
        [c.prompt + c.generation.completion.token_ids for c in s.calls], sampled)]
    head = c0.prompt + c0.generation.completion.token_ids
    if history == "extend":
        assert c1.prompt[: len(head)] == head and "plan A" in tok.decode(c1.prompt)
        assert s.history_resets == 0 and not c1.history_reset
    else:
        assert c1.prompt == renderer.render(messages, None) and "plan A" not in tok.decode(c1.prompt)
        assert s.history_resets == 1 and c1.history_reset


def test_the_trainer_counts_the_turns_that_extend():
    from rlnode.actor.router import LeaseMetadata
    from rlnode.trainer.buffer import count_extending_turns
    from rlnode.wire import TrainingSample, pack_f32, pack_i32

    def call(ep, k, prompt, completion):
        return TrainingSample(f"{ep}/{k}", "g", ep, "c", "t", k, pack_i32(prompt), pack_i32(completion),
                              pack_f32([0.0] * len(completion)), bytes([1]) * len(completion), 0.0, "stop", "done",
                              0, 1.0, LeaseMetadata(1, 0, 0.0, 0.0))

    samples = [call("a", 0, [1, 2], [3]), call("a", 1, [1, 2, 3, 4], [5]), call("a", 2, [1, 9], [6]),  # 1 of 2
               call("b", 1, [7], [8]), call("b", 0, [5], [6]),  # out of order, not extending: 0 of 1
               call("c", 0, [1], [2]), call("c", 2, [1, 2, 3], [4])]  # call 1 untrained: no pair
    assert count_extending_turns(samples) == (3, 1)


async def test_reasoning_and_calls_reach_each_api_in_its_own_shape(tiny_model_dir):
    """A reasoning model's reply with a tool call (deepseek_r1 and hermes
    parsers, a scripted policy): a thinking block and a tool_use block
    (Messages), a reasoning item and a function_call item (Responses), the
    same whole or streamed."""
    from transformers import AutoTokenizer

    from rlnode.actor.episode import ChatRenderer, EpisodeSettings
    from rlnode.actor.engine import SamplingSettings
    from rlnode.actor.gateway import Gateway
    from rlnode.actor.parsing import CompletionParser
    from test_examples_agents import CALL_4, ScriptedPolicy

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<think>", "</think>"])
    renderer = ChatRenderer(tok, parser=CompletionParser(tok, "hermes", "deepseek_r1"))
    reply = "<think>four is in the middle</think>Trying. " + CALL_4
    policy = ScriptedPolicy(tok, [reply] * 4)
    settings = EpisodeSettings(SamplingSettings(max_tokens=64), max_turns=8, max_model_len=2048)
    gw = Gateway(policy, renderer, settings)
    tool = {"type": "object", "properties": {"number": {"type": "integer"}}}
    async with gw.serve(), gw.session("ep-shapes") as s:
        a = anthropic_for(s)
        ask = dict(model="m", max_tokens=64, messages=[{"role": "user", "content": "go"}],
                   tools=[{"name": "guess", "input_schema": tool}])
        whole = await a.messages.create(**ask)
        async with a.messages.stream(**ask) as stream:
            streamed = await stream.get_final_message()
        for m in (whole, streamed):
            assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
            assert m.content[0].thinking == "four is in the middle" and m.content[1].text == "Trying. "
            assert (m.content[2].name, m.content[2].input) == ("guess", {"number": 4})
        o = client_for(s)
        ask = dict(model="m", input="go", tools=[{"type": "function", "name": "guess", "parameters": tool}])
        whole = await o.responses.create(**ask)
        async with o.responses.stream(**ask) as stream:
            streamed = await stream.get_final_response()
        for r in (whole, streamed):
            assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
            assert r.output[0].content[0].text == "four is in the middle" and r.output_text == "Trying. "
            assert (r.output[2].name, json.loads(r.output[2].arguments)) == ("guess", {"number": 4})
        await a.close(), await o.close()
    assert gw.stats.errors == 0 and len(s.calls) == 4


@pytest.mark.engine
async def test_stop_sequences_cut_the_text_and_keep_the_sampled_tokens(gateway, hf_model, tokenizer):
    """An agent's stop sequence (Messages' stop_sequences, Chat's stop): the
    engine ends at the token that completes it, the sample keeps that token
    (it was sampled), the agent gets the text before it, whole or streamed
    (a stream never shows a part of it). Seeded calls, so the same prompt
    samples the same tokens with and without the stop sequence."""
    prompt = [{"role": "user", "content": "Say something."}]
    async with gateway.session("ep-stop-free") as free:
        c = client_for(free)
        for seed in range(10):  # a reply long enough to stop inside
            r = await c.chat.completions.create(model="tiny", messages=prompt, max_tokens=16, seed=seed)
            text, ids = r.choices[0].message.content or "", free.calls[-1].generation.completion.token_ids
            at = next((i for i in range(3, len(text) - 1) if text[i:i + 2].isalnum()), None)
            if at is not None:
                break
        await c.close()
    assert at is not None, "no reply of 5+ characters in 10 seeds"
    stop = text[at:at + 2]
    cut = text[: text.find(stop)]
    # The shortest prefix of the free completion whose text holds the stop sequence.
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    async with gateway.session("ep-stop") as s:
        a = anthropic_for(s)
        m = await a.messages.create(model="tiny", max_tokens=16, messages=prompt, stop_sequences=[stop],
                                    extra_body={"seed": seed})
        assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (cut, "stop_sequence", stop)
        async with a.messages.stream(model="tiny", max_tokens=16, messages=prompt, stop_sequences=[stop],
                                     extra_body={"seed": seed}) as stream:
            deltas = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        assert "".join(deltas) == final.content[0].text == cut and all(stop not in d for d in deltas)
        o = client_for(s)
        r = await o.chat.completions.create(model="tiny", messages=prompt, max_tokens=16, seed=seed, stop=stop)
        assert (r.choices[0].message.content or "", r.choices[0].finish_reason) == (cut, "stop")
        with pytest.raises(openai.BadRequestError, match="stop"):
            await o.chat.completions.create(model="tiny", messages=prompt, stop=[""])
        await a.close(), await o.close()
    # The seed reaches the engine mixed per call only under an episode seed; here it is the agent's own.
    for call in s.calls:
        assert call.generation.completion.token_ids == ids[:k] and call.generation.completion.finish_reason == "stop"
    check_parity(s.calls[:1], hf_model)
