"""One episode played by an external agent through the gateway.

The counterpart of ``episode.run_episode`` for ``AgentTask``s: rlnode does
not run the agent loop, the agent does (a user's OpenAI-SDK code, an Agents
SDK agent, a verifiers environment). This coroutine resets the task, opens a
gateway session (a base URL and key valid only while the episode runs),
awaits the agent, and turns the calls the gateway served into
``TrainingSample``s with the episode's reward. Reset, the agent's run,
evaluate and close each run under the task's ``timeout_s``
(``episode.cube_call``): past it the episode fails (retried, then counted).
The agent's run is admitted first (``agent_starts``: a few agents starting
at a time); its ``timeout_s`` counts from its admission, less the time its
LLM calls wait for a router permit (``actor.router.llm_max_rollouts``: the
node's generation capacity). Time in the engine counts: a stuck engine
still ends the episode.

Reward (``AgentTask.reward_source``): by default the task's evaluator, and
nothing the agent returns or posts counts (the policy writes the agent's
actions; a reward it can write is one it will learn to forge). With
``reward_source = "agent"``: a posted reward (``POST {env_url}/reward`` with
the episode's reward key), else the returned value, else the evaluator.
Every reward must be finite and within ``actor.episode.max_abs_reward``;
one that is not fails the episode, as does having none.

An agent that raises (any BaseException but cancellation: a foreign
``SystemExit`` must not end the daemon), exits non-zero or times out fails
the episode (the scheduler retries and counts it), unless the gateway itself ended the
episode first (``max_turns`` / context full): an agent that breaks on that
refusal has still played a whole episode. Closing the session aborts calls
still in flight, so nothing outlives the episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable

from rlnode.actor.agent_starts import AgentStarts
from rlnode.actor.episode import (
    EpisodeResult, EpisodeSettings, check_reward, close_task, cube_call, training_sample,
)
from rlnode.actor.gateway import Gateway, GatewayHostLost, GatewaySession
from rlnode.aio import wait_for_charged
from rlnode.cubes.base import AgentError, AgentTask, CubeError
from rlnode.log import get_logger
from rlnode.wire import TrainingSample

log = get_logger("rlnode.agent_episode")


class AgentFailed(CubeError):
    """The agent crashed, timed out or produced nothing to train on."""


def task_payload(task: AgentTask, reset, episode_id: str, reward_key: str = "") -> dict:
    """What the agent is told about its task (JSON; stdin of a command agent)."""
    return {
        "episode_id": episode_id,
        "cube_id": task.ref.cube_id,
        "task_id": task.ref.task_id,
        "prompt": reset.observation,
        "system": reset.system,
        "tools": [t.as_chat_tool() for t in task.tools()],
        "info": reset.info,
        # Only an agent whose reward counts may post one (stdin of a command
        # agent, never its environment: tools it runs inherit that).
        **({"reward_key": reward_key} if reward_key else {}),
    }


async def run_agent_episode(
    gateway: Gateway,
    task: AgentTask,
    settings: EpisodeSettings,
    episode_id: str,
    group_id: str,
    policy_version: Callable[[], int] = lambda: 0,
    starts: AgentStarts | None = None,
) -> EpisodeResult:
    """``starts``: the node's admission of agent starts (none: the agent
    starts at once)."""
    t0 = time.monotonic()
    try:
        reset = await cube_call(task, "reset", task.reset())
        async with gateway.session(episode_id, task, settings, policy_version) as s:
            t_wait = time.monotonic()
            async with starts.admit(s.agent_up) if starts is not None else contextlib.nullcontext():
                t_agent = time.monotonic()
                returned = await _drive(task, s, task_payload(task, reset, episode_id, s.reward_key))
            agent_s = time.monotonic() - t_agent
        result = await _result(task, s, returned, episode_id, group_id, t0, agent_s)
        if starts is not None:
            result.phases["start_wait_s"] = t_agent - t_wait
        return result
    finally:
        await close_task(task)  # shielded: a cancelled episode still releases its task


async def _contained(agent: Awaitable[float | None]) -> float | None:
    """The agent's coroutine, with SystemExit and KeyboardInterrupt turned
    into an episode error inside the task that runs it: asyncio re-raises
    those two out of the event loop itself when they leave a task (wait_for
    runs its awaitable as one), so catching them in the caller is too late."""
    try:
        return await agent
    except (SystemExit, KeyboardInterrupt) as e:
        raise AgentFailed(f"agent failed: {type(e).__name__}({e})") from None


async def _drive(task: AgentTask, s: GatewaySession, payload: dict) -> float | None:
    try:
        # The clock stops while a call of the episode waits for a router
        # permit: the node's generation capacity is not the agent's time.
        return await wait_for_charged(s.guard(_contained(task.run_agent(s.endpoint, payload))), task.timeout_s,
                                      s.queue_time)
    except asyncio.TimeoutError:
        await s.settle()
        if s.terminated:
            return None
        raise AgentFailed(f"agent timed out after {task.timeout_s:g}s ({len(s.calls)} LLM calls)") from None
    except asyncio.CancelledError:
        raise
    except GatewayHostLost:  # the gateway's process died: this episode fails, the next ones get a new one
        raise
    except BaseException as e:  # foreign code: SystemExit, KeyboardInterrupt, ... fail this episode only
        await s.settle()  # a refusal the agent broke on is known here before it is asked about
        if s.terminated:  # the gateway ended the episode; the agent broke on the refusal
            log.info("agent.stopped_by_gateway", episode=s.episode_id, reason=s.terminated, error=repr(e))
            return None
        if isinstance(e, AgentError):  # the agent's own failure, reported by the cube that runs it (its worker)
            raise AgentFailed(str(e)) from e
        if isinstance(e, CubeError):
            raise
        raise AgentFailed(f"agent failed: {e!r}") from e


async def _result(task: AgentTask, s: GatewaySession, returned: float | None, episode_id: str, group_id: str,
                  t0: float, agent_s: float) -> EpisodeResult:
    if not s.calls:
        raise AgentFailed("the agent made no LLM call through the gateway")
    success: bool | None = None
    evaluate_s = 0.0
    if task.reward_source == "agent" and s.posted_reward is not None:
        reward, success, source = s.posted_reward, s.posted_success, "the agent's POST env/reward"
    elif task.reward_source == "agent" and returned is not None:
        reward, source = returned, "the agent's return value"
    elif task.has_evaluator:
        if returned is not None:  # reward_source = "evaluator": not the agent's to decide
            s.gateway.stats.agent_rewards_ignored += 1
        t_eval = time.monotonic()
        ev = await cube_call(task, "evaluate", task.evaluate())
        evaluate_s = time.monotonic() - t_eval
        reward, success, source = ev.reward, ev.success, f"cube {task.ref.cube_id!r}'s evaluator"
    else:
        raise AgentFailed("no reward: the agent returned none, posted none, and the task has no evaluator")
    reward = check_reward(reward, source, s.settings.max_abs_reward)
    if success is None:
        success = reward > 0
    reason = s.terminated or "done"
    calls = sorted(s.calls, key=lambda c: c.step_index)
    samples = [_sample(c, task, episode_id, group_id, reward, reason, len(calls)) for c in calls]
    phases = {**task.phases(), "agent_s": agent_s, "evaluate_s": evaluate_s}
    return EpisodeResult(episode_id, group_id, task.ref.cube_id, task.ref.task_id, reward, bool(success),
                         len(calls), reason, s.agent_errors, time.monotonic() - t0, samples, phases)


def _sample(c, task: AgentTask, episode_id: str, group_id: str, reward: float, reason: str,
            turns: int) -> TrainingSample:
    return training_sample(task.ref, episode_id, group_id, c.step_index, c.prompt, c.generation.completion,
                           c.generation.lease, c.policy_version, c.temperature, reward, reason, turns)
