"""One episode's view of the gateway (``GatewaySession``): its token and
keys, the calls it was served, and the history matching that keeps
multi-turn samples token-exact (a re-sent conversation extends the previous
prompt + completion by the template tokens of its new messages only)."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from typing import Any, Awaitable, Callable, NamedTuple, TypeVar

import msgspec
from aiohttp import web

from rlnode.actor.episode import EpisodeSettings
from rlnode.actor.gateway.api import GatewayError
from rlnode.actor.generation import Generation
from rlnode.cubes.base import AgentEndpoint, CubeTask


T = TypeVar("T")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a re-sent (template) message is the one served before.
    Tool-call ids are left out: templates do not render them and some SDKs
    rewrite them."""
    if a.get("tool_call_id") == b.get("tool_call_id"):
        return a == b
    return {k: v for k, v in a.items() if k != "tool_call_id"} == {k: v for k, v in b.items() if k != "tool_call_id"}



class GatewayStats(msgspec.Struct):
    sessions: int = 0  # episodes served
    calls: int = 0  # chat completions answered
    streamed: int = 0  # of which streamed
    history_resets: int = 0  # calls whose history was not an extension of the last one
    errors: int = 0  # requests answered with an error
    unauthorized: int = 0  # unknown token or wrong key
    temperature_floored: int = 0  # calls that asked below actor.sampling.min_temperature (raised to it)
    rewards_refused: int = 0  # POST env/reward refused: not the task's reward source, wrong key, out of bounds
    unsent: int = 0  # calls answered by the engine whose reply never reached the agent: samples dropped
    agent_rewards_ignored: int = 0  # rewards an agent returned where the evaluator decides


class ServedCall(msgspec.Struct):
    """One answered LLM call, waiting for the episode's reward."""

    step_index: int
    prompt: list[int]
    generation: Generation
    policy_version: int
    temperature: float
    history_reset: bool


class HistoryMatch(NamedTuple):
    """What a request extends, taken in one go: the newest answered call's
    prompt + completion (``ids``), its completion, and how many of the
    request's messages they cover. A call that finishes while this prompt is
    tokenized (in a thread) replaces the session's history, not this."""

    covered: int
    ids: list[int]
    last_completion: list[int]


class TextMatch(NamedTuple):
    """What of a raw prompt the last raw prompt + completion cover."""

    covered: int  # characters
    ids: list[int]


class GatewaySession:
    """One episode's view of the gateway: valid from ``Gateway.session`` to
    its exit."""

    def __init__(self, gateway, episode_id: str, task: CubeTask | None, settings: EpisodeSettings,
                 policy_version: Callable[[], int], keys: tuple[str, str, str] | None = None):
        """``keys``: (token, api key, reward key) chosen by the daemon (a
        gateway host's copy of a session); else made here."""
        self.gateway, self.episode_id, self.task, self.settings = gateway, episode_id, task, settings
        # What serves the episode's routes (its url and agent_socket): the
        # gateway, or a gateway host's slot (hosted.py).
        self.serving = gateway
        self.policy_version = policy_version
        self.token = secrets.token_urlsafe(24)
        self.api_key = "rlnode-" + secrets.token_urlsafe(24)
        # Only where the agent decides the reward (no task: a bare session of
        # a test or benchmark, whose only reward source is the agent).
        agent_reward = task is None or getattr(task, "reward_source", "evaluator") == "agent"
        self.reward_key = "rlnode-reward-" + secrets.token_urlsafe(24) if agent_reward else ""
        if keys is not None:
            self.token, self.api_key, self.reward_key = keys
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
        # A raw prompt's history (completions): the text the agent saw, and
        # the ids that stand for it.
        self._text: str | None = None
        self._text_ids: list[int] | None = None
        self._engine: int | None = None
        self._inflight: set[asyncio.Task] = set()
        # The history before the newest remembered call, while that call's
        # reply may still fail to reach the agent (``forget``).
        self._undo: tuple[int, tuple] | None = None
        # One environment call at a time: a cube task is a sequential
        # environment (its state after step k is the input of step k+1).
        self.env_lock = asyncio.Lock()
        # Set at the agent's first request (a model or env call): its start
        # is over (agent_starts.AgentStarts releases its slot).
        self.agent_up = asyncio.Event()
        # Time some call of this episode waited for a router permit: the
        # node's generation capacity, not the agent's doing (queue_time).
        self._queued = 0
        self._queued_since = 0.0
        self._queued_s = 0.0

    @property
    def endpoint(self) -> AgentEndpoint:
        root = f"{self.serving.url}/episodes/{self.token}"
        return AgentEndpoint(f"{root}/v1", self.api_key, f"{root}/env", self.gateway.model_name, self.reward_key,
                             self.serving.agent_socket, self.gateway.agent_sockets)

    def check_key(self, request: web.Request, key: str | None = None) -> None:
        """The key as a bearer token (OpenAI's SDKs) or in ``x-api-key``
        (Anthropic's)."""
        key = self.api_key if key is None else key
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")
        if not given or not hmac.compare_digest(given.strip().encode(), key.encode()):
            self.gateway.stats.unauthorized += 1
            raise GatewayError(401, "invalid API key for this episode", code="invalid_api_key",
                               type="authentication_error")

    # -- prompt ---------------------------------------------------------------

    @property
    def has_history(self) -> bool:
        """Whether a call was answered (a request that does not extend it is
        a history reset)."""
        return self._remembered_step >= 0

    def extends(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> HistoryMatch | None:
        """What of ``messages`` the newest answered call already covers (its
        history and reply), or None when the request does not extend it (the
        history is then rendered afresh and counted as a reset).
        Dict equality, element by element: no per-call re-serialisation."""
        n = len(self._history)
        if not n or (tools or []) != self._tools:
            return None
        if len(messages) > n and all(_same(a, b) for a, b in zip(messages, self._history)):
            return HistoryMatch(n, self._ids, self._last_completion)
        # Some SDKs (the Agents SDK) drop an empty assistant reply from
        # their history. The engine did produce that turn (an end of turn
        # token), so the prompt keeps it: still the exact extension.
        if self._empty_reply and len(messages) >= n and all(_same(a, b) for a, b in zip(messages, self._history[:-1])):
            return HistoryMatch(n - 1, self._ids, self._last_completion)
        return None

    def prompt_for(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   match: HistoryMatch | None) -> list[int]:
        """Prompt token ids for a request; ``match`` is ``extends()``."""
        renderer = self.gateway.renderer
        if match is not None:
            return match.ids + renderer.next_messages(match.last_completion, messages[match.covered:])
        return renderer.render(messages, tools)

    def extends_text(self, text: str) -> TextMatch | None:
        """A raw prompt (``/v1/completions``) that begins with the last one
        + the text of its completion: how much of it that covers, and their
        ids."""
        if self._text is None or not text.startswith(self._text):
            return None
        return TextMatch(len(self._text), self._text_ids)

    def extends_ids(self, ids: list[int]) -> bool:
        """Whether the agent's own prompt ids begin with the last prompt +
        completion."""
        n = len(self._ids)
        return bool(n) and len(ids) >= n and ids[:n] == self._ids

    def remember(self, step: int, call, prompt: list[int], completion: list[int], reply: dict[str, Any]) -> None:
        """Call ``step`` (a ``protocols.Call``) was answered with
        ``completion``: what the next call is matched against. ``reply``: the
        answer as the template renders it (a raw prompt's: ``{"text"}``)."""
        if step < self._remembered_step:  # concurrent calls: the newer one already set the history
            return
        self._undo = (step, self._history_state())
        self._remembered_step = step
        self._ids = prompt + completion
        self._last_completion = completion
        self._tools = call.tools or []
        if call.messages is not None:
            self._history = call.messages + [reply]
            self._empty_reply = not reply["content"] and not reply.get("tool_calls")
        else:
            self._history, self._empty_reply = [], False
        self._text = self._text_ids = None
        if call.text is not None:
            # What the agent saw: its prompt and the completion's text, whose
            # stop token (dropped from the text) is not in the ids it extends.
            self._text = call.text + reply["text"]
            self._text_ids = prompt + (completion[:-1] if reply.get("stop_dropped") else completion)

    def _history_state(self) -> tuple:
        return (self._remembered_step, self._history, self._empty_reply, self._tools, self._ids,
                self._last_completion, self._text, self._text_ids)

    def forget(self, step: int) -> bool:
        """Call ``step`` was answered but its reply never reached the agent
        (it hung up first, or the write failed): its sample is dropped and,
        when it is the newest call, the history is what it was before it,
        so the agent's retry extends the conversation it did see. The turn
        stays taken (the engine did the work; an agent that keeps hanging up
        must not get unbounded calls). True when anything was forgotten."""
        n = len(self.calls)
        self.calls = [c for c in self.calls if c.step_index != step]
        forgot = len(self.calls) < n
        if self._undo is not None and self._undo[0] == step and self._remembered_step == step:
            (self._remembered_step, self._history, self._empty_reply, self._tools, self._ids,
             self._last_completion, self._text, self._text_ids) = self._undo[1]
            forgot = True
        if self._undo is not None and self._undo[0] == step:
            self._undo = None
        return forgot

    # -- the node's queue ----------------------------------------------------

    def queue_time(self) -> float:
        """Seconds so far during which some call of this episode waited for
        a router permit (actor.router.llm_max_rollouts): the episode's
        deadline does not count them (agent_episode)."""
        return self._queued_s + (time.monotonic() - self._queued_since if self._queued else 0.0)

    def _queue(self, delta: int) -> None:
        if delta > 0 and not self._queued:
            self._queued_since = time.monotonic()
        self._queued += delta
        if delta < 0 and not self._queued:
            self._queued_s += time.monotonic() - self._queued_since

    async def generate(self, client, prompt: list[int], sampling, on_tokens=None):
        """``client.generate`` for a call of this episode, its wait for a
        permit counted in ``queue_time``."""
        admitted = False

        def on_admitted() -> None:
            nonlocal admitted
            admitted = True
            self._queue(-1)

        self._queue(+1)
        try:
            return await client.generate(prompt, sampling, affinity=self._engine, on_tokens=on_tokens,
                                         on_admitted=on_admitted)
        finally:
            if not admitted:
                self._queue(-1)

    async def settle(self) -> None:
        """Wait until every decision the gateway took for this episode
        (``terminated``, a posted reward) is visible here. Nothing to wait
        for on the daemon's own loop; a gateway host's session
        (``hosted.py``) asks the host."""

    async def guard(self, agent: Awaitable[T]) -> T:
        """Await the episode's agent; a session whose gateway host is lost
        fails it instead (``hosted.py``)."""
        return await agent

    async def close(self) -> None:
        """End the episode's access: the token stops working and calls still
        running are aborted in the engine (their leases are returned)."""
        self.closed = True
        tasks = list(self._inflight)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
