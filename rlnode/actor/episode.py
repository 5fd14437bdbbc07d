"""The agent loop: one episode of one cube task, as a coroutine.

Owns: turning cube observations into prompt token ids (``ChatRenderer``,
with ``model.chat_template``), completions into ``Action``s (read by vLLM's
parsers, ``parsing.py``), and every LLM call into a ``TrainingSample``; the
start check that a chat template shows the tools the cubes offer.
Token-in / token-out: the prompt of turn k+1 is the prompt of turn k, plus
the tokens the engine produced, plus the template tokens of the new message.
Nothing the engine produced is ever decoded and re-encoded into a prompt
(completions are decoded only to be read).

Stops at the cube's ``done``, at ``max_turns`` LLM calls, or when the context
has no room left for a completion (``min_completion_tokens``).

Deadlines: every call into the task (reset, each step, evaluate, close)
runs under the task's ``timeout_s`` (``cube_call``); one past it is
cancelled and fails the episode as a ``CubeTimeout``, which the scheduler
retries and then counts like any cube failure. LLM calls are outside it
(max_tokens bounds them, not the cube).

Must not decide how many episodes run or retry them (the scheduler's job);
failures of the cube or engine propagate as exceptions. The task is closed
exactly once, also on error and cancellation.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from typing import Any, Awaitable, Callable, TypeVar

import msgspec

from rlnode.actor.engine import Completion, SamplingSettings
from rlnode.actor.generation import LLMClient
from rlnode.actor.parsing import CompletionParser
from rlnode.actor.router import LeaseMetadata
from rlnode.config import ConfigError, ModelConfig
from rlnode.config.derived import chat_template_text
from rlnode.cubes.base import Action, Cube, CubeError, CubeTask, CubeTaskRef, ToolSpec
from rlnode.log import get_logger
from rlnode.wire import TrainingSample, pack_f32, pack_i32

log = get_logger("rlnode.actor")
T = TypeVar("T")

TEMPLATE_WITH_TOOLS = "conf/templates/chatml-tools.jinja"


def parse_action(text: str, parser: CompletionParser, tools: list[ToolSpec], output_ids: list[int] = (),
                 prompt_ids: list[int] | None = None) -> Action:
    """A completion's text as the cube sees it: its content (reasoning and
    call markup removed, ``model.reasoning_parser``), the tool calls
    ``model.tool_parser`` reads (only when the task offers ``tools``), and
    a malformed call as ``parse_error`` (shown to the agent), never an
    exception. ``output_ids``/``prompt_ids``: for parsers that read them."""
    p = parser.parse(text, [t.as_chat_tool() for t in tools], output_ids=output_ids, prompt_ids=prompt_ids)
    return Action(text=p.content.strip(), tool_calls=p.tool_calls, parse_error=p.error)


class ChatRenderer:
    """Applies the model's chat template one message at a time, in tokens,
    and reads completions back (``parser``: ``model.tool_parser`` /
    ``model.reasoning_parser``).

    The template is rendered for a fixed two-message base conversation with
    and without the new message; the difference is what the new message adds.
    This keeps templates that inject default system prompts or per-turn
    markup correct without re-rendering (and re-tokenising) the history.
    ``chat_template``: Jinja text used instead of the tokenizer's own
    (``model.chat_template``).
    """

    _BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer, chat_template: str | None = None, parser: CompletionParser | None = None):
        self.tok = tokenizer
        self.chat_template = chat_template or None
        self._parser = parser
        self.eos_id = tokenizer.eos_token_id
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self.vocab_size = len(tokenizer)  # ids an agent may send as its prompt (completions' token prompt)
        eos = tokenizer.eos_token
        self._closed = closed = self._render(self._BASE, None, add_generation_prompt=False)
        # Template text between the assistant's end-of-turn token and the next
        # message (e.g. "\n" for ChatML).
        self._after_eos = closed[closed.rindex(eos) + len(eos):] if eos in closed else ""
        # The most characters one token can stand for (byte-level vocabularies
        # spell a byte as one character, so this bounds decoded text too): a
        # text of C characters needs at least C // max_token_chars tokens.
        self.max_token_chars = max(1, max(map(len, tokenizer.get_vocab())))

    @property
    def parser(self) -> CompletionParser:
        """Built on first use (Hermes, no reasoning, unless given): it loads
        vLLM's parser registry."""
        if self._parser is None:
            self._parser = CompletionParser(self.tok)
        return self._parser

    def _render(self, messages, tools, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=self.chat_template,
        )

    def renders_tools(self) -> bool:
        """Whether the template shows tools to the model at all: a probe
        conversation rendered with a probe tool differs from it rendered
        without (a template with no tools section ignores ``tools``)."""
        probe = ToolSpec("rlnode_probe_tool", "Probe whether tools are rendered.",
                         {"type": "object", "properties": {"x": {"type": "string"}}}).as_chat_tool()
        msgs = [{"role": "user", "content": "u"}]
        return self._render(msgs, [probe], True) != self._render(msgs, None, True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def first_prompt(self, system: str | None, user: str, tools: list[ToolSpec]) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        chat_tools = [t.as_chat_tool() for t in tools] or None
        return self.encode(self._render(msgs, chat_tools, add_generation_prompt=True))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """A whole conversation, ending with the generation prompt (the
        gateway's first call of an episode, or after the agent edited its
        history)."""
        return self.encode(self._render(messages, tools or None, add_generation_prompt=True))

    def next_message(self, completion_ids: list[int], role: str, content: str) -> list[int]:
        """Tokens to append after a completion: close the assistant turn if
        the engine did not (length stop), then the new message and the
        generation prompt."""
        return self.next_messages(completion_ids, [{"role": role, "content": content}])

    def next_messages(self, completion_ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        """``next_message`` for several messages at once (e.g. the results of
        parallel tool calls, which some templates group into one turn)."""
        opened = self._render([*self._BASE, *messages], None, add_generation_prompt=True)
        if not opened.startswith(self._closed):
            raise ValueError("chat template re-renders earlier turns when a message is added; "
                             "token-in/token-out needs a prefix-stable template")
        delta = opened[len(self._closed):]
        head = [] if (completion_ids and completion_ids[-1] == self.eos_id) else [self.eos_id]
        return head + self.encode(self._after_eos + delta)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def completion_text(self, ids: list[int], finish_reason: str = "") -> str:
        """A completion's text for the parsers: special tokens kept (many
        vocabularies make call markers special), the token it stopped on
        dropped (the eos, or another special stop token such as Llama 3's
        ``<|eom_id|>`` after a call)."""
        return self.decode(ids[:-1] if self.ends_on_stop(ids, finish_reason) else ids)

    def ends_on_stop(self, ids: list[int], finish_reason: str = "") -> bool:
        """Whether the completion's last token is the stop token that
        ``completion_text`` drops."""
        return bool(ids) and (ids[-1] == self.eos_id or (finish_reason == "stop" and ids[-1] in self._special_ids))


def make_renderer(tokenizer, model: ModelConfig) -> ChatRenderer:
    """The renderer ``model`` asks for: its chat template and parsers.
    ConfigError naming the key when the template file is missing or a
    parser is unknown."""
    parser = CompletionParser(tokenizer, model.tool_parser, model.reasoning_parser)
    return ChatRenderer(tokenizer, chat_template_text(model), parser)


async def check_tools_rendered(renderer: ChatRenderer, cubes: dict[str, Cube], chat_template: str = "") -> None:
    """ConfigError when a cube offers tools that the chat template does not
    show the model (it would be rewarded for calling tools it never sees).
    A cube's tools are those of its first task (opened, reset, closed).
    ``chat_template``: the configured model.chat_template, for the message."""
    if not cubes or renderer.renders_tools():
        return
    for cid, cube in cubes.items():
        try:
            tools = await _first_task_tools(cube)
        except Exception as e:  # the probe is advisory; the scheduler meets a broken cube soon enough
            log.warning("actor.tools_probe_failed", cube=cid, error=repr(e)[:300])
            continue
        if tools:
            which = f"model.chat_template = {chat_template!r}" if chat_template else \
                "the model's own, model.chat_template is empty"
            raise ConfigError(
                f"cube {cid!r} offers tools ({', '.join(t.name for t in tools)}) but the chat template ({which}) "
                "renders no tools: the model would never see them. Set model.chat_template to a template with a "
                f"tools section, e.g. {TEMPLATE_WITH_TOOLS} (ChatML, Hermes <tool_call> markup, read by "
                "model.tool_parser = \"hermes\")")


async def _first_task_tools(cube: Cube) -> list[ToolSpec]:
    ids = await cube.task_ids("train") or await cube.task_ids("test")
    if not ids:
        return []
    task = await cube.open_task(ids[0])
    try:
        await cube_call(task, "reset", task.reset())
        return task.tools()
    finally:
        await close_task(task)


class CubeTimeout(CubeError):
    """A call into a cube task ran past the task's ``timeout_s``."""


async def cube_call(task: CubeTask, what: str, call: Awaitable[T]) -> T:
    """``await call`` (``what`` of ``task``: reset, step, evaluate, an
    agent's run) under the task's ``timeout_s``; past it the call is
    cancelled and CubeTimeout is raised. A TimeoutError the cube raises
    itself stays what it is."""
    try:
        async with asyncio.timeout(task.timeout_s) as deadline:
            return await call
    except TimeoutError:
        if not deadline.expired():
            raise
        raise CubeTimeout(f"cube {task.ref.cube_id!r}: {what} of task {task.ref.task_id!r} did not return within "
                          f"timeout_s = {task.timeout_s:g} s") from None


async def close_task(task: CubeTask) -> None:
    """``task.close()`` to its end, shielded from the episode's cancellation,
    and under the task's ``timeout_s``: a close that hangs is logged and left
    (the episode's result stands; its slot must not be held forever)."""
    await asyncio.shield(_close(task))


async def _close(task: CubeTask) -> None:
    try:
        await cube_call(task, "close", task.close())
    except CubeTimeout as e:  # logged here: a cancelled episode no longer awaits its close
        log.error("episode.close_timeout", cube=task.ref.cube_id, task=task.ref.task_id, error=str(e))


class EpisodeResult(msgspec.Struct):
    episode_id: str
    group_id: str
    cube_id: str
    task_id: str
    reward: float
    success: bool
    num_turns: int
    termination_reason: str  # "done" | "max_turns" | "context_limit"
    agent_errors: int  # agent-visible errors (malformed calls, bad args)
    duration_s: float
    samples: list[TrainingSample]
    # Seconds by phase of the episode (agent_s, evaluate_s and what the task
    # reports: AgentTask.phases); each LLM call's are on its sample's lease.
    phases: dict[str, float] = {}


class EpisodeSettings(msgspec.Struct):
    sampling: SamplingSettings
    max_turns: int
    max_model_len: int
    min_completion_tokens: int = 4
    # The lowest temperature an agent may ask for through the gateway
    # (actor.sampling.min_temperature); lower requests are raised to it.
    min_temperature: float = 1e-5
    # This episode's sampling seed (the scheduler derives it from the run
    # seed, the node, the group, the task, the attempt and the retry); each
    # LLM call samples with request_seed(seed, turn). None: the engine's
    # own generator (not reproducible under concurrency).
    seed: int | None = None
    # actor.episode.max_abs_reward: rewards outside +-this (or not finite)
    # fail the episode (check_reward).
    max_abs_reward: float = 1000.0


class RewardRefused(CubeError):
    """A reward that is not finite or is outside actor.episode.max_abs_reward."""


def check_reward(value: Any, source: str, bound: float) -> float:
    """``value`` as the episode's reward, or RewardRefused naming ``source``
    (the episode fails and is retried, then counted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardRefused(f"the reward from {source} is a {type(value).__name__}, not a number")
    value = float(value)
    if not math.isfinite(value) or abs(value) > bound:
        raise RewardRefused(f"the reward {value!r} from {source} is outside [-{bound:g}, {bound:g}] "
                            "(actor.episode.max_abs_reward)")
    return value


def request_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (stable across runs and machines).

    Why per request: an engine seeded once samples each request from one
    shared generator, in whatever order requests reach it, so the same run
    seed gives another run whenever timing differs. A seed per request makes
    each request's draws its own. Every attempt of a group gets its own
    seed: equal seeds would make a group's samples identical (same prompt,
    same weights) and zero their advantages."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


async def run_episode(
    client: LLMClient,
    renderer: ChatRenderer,
    task: CubeTask,
    settings: EpisodeSettings,
    episode_id: str,
    group_id: str,
    policy_version: Callable[[], int] = lambda: 0,
) -> EpisodeResult:
    t0 = time.monotonic()
    try:
        return await _play(client, renderer, task, settings, episode_id, group_id, policy_version, t0)
    finally:
        await close_task(task)  # shielded: a cancelled episode still releases its cube task


async def _play(client, renderer, task, settings, episode_id, group_id, policy_version, t0) -> EpisodeResult:
    reset = await cube_call(task, "reset", task.reset())
    tools = task.tools()
    prompt = renderer.first_prompt(reset.system, reset.observation, tools)
    pending: list[dict[str, Any]] = []
    engine: int | None = None
    agent_errors, reason = 0, "max_turns"
    for turn in range(settings.max_turns):
        room = settings.max_model_len - len(prompt)
        if room < settings.min_completion_tokens:
            reason = "context_limit"
            break
        sampling = msgspec.structs.replace(settings.sampling, max_tokens=min(settings.sampling.max_tokens, room),
                                           seed=None if settings.seed is None else request_seed(settings.seed, turn))
        version = policy_version()
        gen = await client.generate(prompt, sampling, affinity=engine)
        engine = gen.lease.engine_id
        c = gen.completion
        pending.append(dict(step_index=turn, prompt=prompt, completion=c, lease=gen.lease, version=version))
        action = parse_action(renderer.completion_text(c.token_ids, c.finish_reason), renderer.parser, tools,
                              c.token_ids, prompt)
        result = await cube_call(task, f"step {turn}", task.step(action))
        agent_errors += result.error is not None
        if result.done:
            reason = "done"
            break
        prompt = prompt + c.token_ids + renderer.next_message(c.token_ids, result.role, result.observation)
    evaluation = await cube_call(task, "evaluate", task.evaluate())
    reward = check_reward(evaluation.reward, f"cube {task.ref.cube_id!r}'s evaluator", settings.max_abs_reward)
    samples = [_sample(p, task, settings, episode_id, group_id, reward, reason, len(pending))
               for p in pending]
    return EpisodeResult(episode_id, group_id, task.ref.cube_id, task.ref.task_id, reward,
                         evaluation.success, len(pending), reason, agent_errors,
                         time.monotonic() - t0, samples)


def _sample(p, task, settings, episode_id, group_id, reward, reason, turns) -> TrainingSample:
    return training_sample(task.ref, episode_id, group_id, p["step_index"], p["prompt"], p["completion"], p["lease"],
                           p["version"], settings.sampling.temperature, reward, reason, turns)


def training_sample(ref: CubeTaskRef, episode_id: str, group_id: str, step_index: int, prompt: list[int],
                    c: Completion, lease: LeaseMetadata, policy_version: int, temperature: float, reward: float,
                    reason: str, turns: int) -> TrainingSample:
    """One LLM call of a finished episode, as the trainer receives it (also
    the gateway's episodes, ``agent_episode.py``)."""
    return TrainingSample(
        sample_id=f"{episode_id}/{step_index}",
        group_id=group_id,
        episode_id=episode_id,
        cube_id=ref.cube_id,
        task_id=ref.task_id,
        step_index=step_index,
        prompt_ids=pack_i32(prompt),
        completion_ids=pack_i32(c.token_ids),
        logprobs=pack_f32(c.logprobs),
        loss_mask=bytes([1]) * len(c.token_ids),
        reward=reward,
        finish_reason=c.finish_reason,
        termination_reason=reason,
        policy_version=policy_version,
        temperature=temperature,
        lease=lease,
        weight_versions=c.weight_versions,
        num_turns=turns,
    )
