"""The cube contract: what an episode may ask of a benchmark.

A *cube* is a benchmark: a set of tasks split into train and test, the tools
an agent may call, and a way to score an episode. One ``CubeTask`` is one
episode's environment: ``reset`` -> observation, ``step(action)`` ->
observation, reward, done, info, error; ``evaluate`` -> reward, success;
``close``. Everything is async: a cube whose code blocks must run it in a
thread or a process (``run_blocking``), never on the event loop.

Owns: the types that cross the agent <-> cube boundary. Must not know about
engines, tokens or training: the agent loop (``rlnode/actor/episode.py``)
turns completions into ``Action``s and observations into prompt tokens.

Errors: ``CubeError`` is recoverable (the scheduler retries the episode);
a ``StepResult.error`` is an error *observation* the agent sees (bad tool
arguments, unknown tool), not a failure of the episode.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import threading
from typing import Any, Callable, Literal, TypeVar

import msgspec

T = TypeVar("T")


class CubeError(RuntimeError):
    """The cube failed (server down, task crashed): retry the episode."""


class AgentError(CubeError):
    """The episode's agent itself failed, as reported by the cube that runs
    it (it raised, or the process running it died): the agent's failure,
    not the cube's, so the episode fails as the agent's
    (``agent_episode.AgentFailed``)."""


class CubeTaskRef(msgspec.Struct, frozen=True, array_like=True):
    """Addresses a task across all cubes of a run."""

    cube_id: str
    task_id: str


class ToolSpec(msgspec.Struct):
    """A tool the agent may call; ``parameters`` is a JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {}

    def as_chat_tool(self) -> dict[str, Any]:
        """The OpenAI/HF chat-template form (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolCall(msgspec.Struct):
    name: str
    arguments: dict[str, Any] = {}


class Action(msgspec.Struct):
    """What the agent did in one turn: its text (tool-call markup removed)
    and the tool calls parsed from it. ``parse_error`` is set when the
    completion tried to call a tool but the call was malformed."""

    text: str
    tool_calls: list[ToolCall] = []
    parse_error: str | None = None


class Reset(msgspec.Struct):
    observation: str  # the first user message
    system: str | None = None  # optional system prompt
    info: dict[str, Any] = {}


class StepResult(msgspec.Struct):
    observation: str  # shown to the agent next (unless done)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = {}
    # An error the agent should see (bad arguments, unknown tool); the episode
    # goes on. Counted per cube.
    error: str | None = None
    # How the observation is rendered: a tool response or a user message.
    role: Literal["tool", "user"] = "user"


class Evaluation(msgspec.Struct):
    reward: float
    success: bool
    info: dict[str, Any] = {}


class CubeTask(abc.ABC):
    """One episode's environment. Used by one coroutine at a time."""

    ref: CubeTaskRef
    # Seconds each call the actor makes into the task may take: reset, each
    # step, evaluate, close (an AgentTask: also the agent's whole run). Past
    # it the call is cancelled and the episode fails (retried, then counted):
    # a call that never returns would hold its group and its credit forever.
    # A cube sets it per task, e.g. from its options.
    timeout_s: float = 600.0

    @abc.abstractmethod
    async def reset(self) -> Reset: ...

    @abc.abstractmethod
    def tools(self) -> list[ToolSpec]:
        """Tools offered to the agent (valid after reset)."""

    @abc.abstractmethod
    async def step(self, action: Action) -> StepResult: ...

    @abc.abstractmethod
    async def evaluate(self) -> Evaluation:
        """Score the episode (after done, or when the agent ran out of turns)."""

    async def close(self) -> None:
        """Release the task's resources. Called exactly once, also on error
        and cancellation."""


class AgentEndpoint(msgspec.Struct):
    """Where an external agent reaches the policy and its environment for
    one episode (served by the actor's gateway, ``rlnode/actor/gateway/``).
    Valid only while the episode runs."""

    base_url: str  # OpenAI-compatible base URL: http://HOST:PORT/episodes/TOKEN/v1
    api_key: str  # the bearer key for base_url (and env_url)
    env_url: str  # http://HOST:PORT/episodes/TOKEN/env: POST step / reward, GET tools
    model: str  # the model name to send (any name is accepted)
    # The bearer key for POST env_url/reward. Empty unless the task's
    # reward_source is "agent": by default no agent can post a reward, and
    # the api_key (which tools an agent runs can see) never can.
    reward_key: str = ""
    # A unix socket serving these episode routes and nothing else (no
    # /status, /metrics, /history): what a sandboxed agent's relay reaches.
    agent_socket: str = ""
    # Every agent socket of the gateway, in host order (agent_socket is one:
    # the host that serves this episode). A function agent's worker relays
    # to each on a port of its own (agent_sandbox.inside_url).
    agent_sockets: list[str] = []


class AgentTask(CubeTask):
    """A task played by an agent that rlnode does not run itself (a user's
    OpenAI-SDK loop, an Agents-SDK agent, a verifiers environment): it talks
    to the policy through the gateway's OpenAI API, and every LLM call it
    makes becomes a training sample. ``reset``/``step``/``evaluate`` are the
    environment the agent may reach at ``env_url``; a task with no evaluator
    of its own sets ``has_evaluator = False`` and ``reward_source = "agent"``.

    Reward provenance. With ``reward_source = "evaluator"`` (the default)
    the task's evaluator decides the reward: what ``run_agent`` returns and
    anything posted to ``env_url/reward`` are ignored (the gateway refuses
    the post). The policy's output runs as code inside the agent and its
    tools, so an agent-side reward is a reward the policy can write: a
    reward hack the optimiser finds. ``"agent"``: a posted reward, else the
    returned one, else the evaluator (if any) decides; only this source
    gets a ``reward_key``."""

    has_evaluator: bool = True
    has_environment: bool = True  # False: env/step answers 404 (no tools, no messages to the environment)
    reward_source: Literal["evaluator", "agent"] = "evaluator"
    # The agent's whole run; reset and evaluate each have the same bound.
    timeout_s: float = 600.0

    @abc.abstractmethod
    async def run_agent(self, endpoint: AgentEndpoint, task: dict[str, Any]) -> float | None:
        """Play one episode against ``endpoint``. ``task`` is the JSON-able
        task description (ids, first observation, system prompt, tools).
        Returns the reward, or None to take it from a posted reward or the
        task's evaluator. Raising fails the episode (the scheduler retries)."""

    def phases(self) -> dict[str, float]:
        """Seconds the last ``run_agent`` spent in phases the task can see
        inside the agent's run (a harness's start, its rubric, its
        teardown), by name ending in ``_s``; reported per cube beside the
        actor's own (``agent_s``, ``evaluate_s``, each LLM call's)."""
        return {}


Split = Literal["train", "test"]


class Cube(abc.ABC):
    """A benchmark. ``cube_id`` is its name in this run."""

    cube_id: str
    # Whether open_task may return AgentTasks (played by an external agent
    # through the actor's gateway). The actor starts the gateway (its host
    # processes and sockets) only when some cube says so, so a run of native
    # cubes has no gateway process. True unless the cube knows better: the
    # native cubes set False.
    runs_agents: bool = True

    async def start(self) -> None:
        """Bring the benchmark up (spawn a server, open files)."""

    @abc.abstractmethod
    async def task_ids(self, split: Split) -> list[str]:
        """Task ids of a split; train and test must be disjoint."""

    @abc.abstractmethod
    async def open_task(self, task_id: str) -> CubeTask:
        """A fresh environment for one episode of ``task_id``."""

    async def close(self) -> None:
        """Tear the benchmark down."""

    def reference_scores(self) -> dict[str, float]:
        """Known success rates of reference policies on this cube (e.g.
        ``{"random": 0.3, "best_feedback_ignoring": 0.5}``), for reports.
        Empty when unknown."""
        return {}


async def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking cube code in a thread of its own, off the event loop.

    Not the loop's default executor: a call that never returns is left
    behind when its deadline (``CubeTask.timeout_s``) cancels the await, and
    six such calls would fill that executor (min(32, cores + 4) threads on
    2 cores) and stall everything else that runs there. A daemon thread
    per call holds only itself, and never holds up the process's exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    ctx = contextvars.copy_context()

    def work() -> None:
        result, error = None, None
        try:
            result = ctx.run(fn, *args)
        except (SystemExit, KeyboardInterrupt) as e:  # this call's failure, not the daemon's exit
            error = CubeError(f"blocking cube code raised {e!r}")
        except BaseException as e:
            error = e
        with contextlib.suppress(RuntimeError):  # the loop closed while this call ran
            loop.call_soon_threadsafe(_settle, done, result, error)

    threading.Thread(target=work, name="rlnode-cube-blocking", daemon=True).start()
    return await done


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the awaiting coroutine was cancelled (its deadline passed)
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
