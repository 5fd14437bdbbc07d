"""RolloutScheduler: turns cube tasks into complete groups of episodes.

Owns: which task runs next (cubes drawn by weight), how many groups may be in
flight (the staleness budget), episode retries, periodic evaluation on the
test splits, and per-cube counters. Emits only *complete* groups: a group
whose episode failed past its retries is dropped and counted, never sent
half-full (its advantage baseline would be wrong).

Admission: a group starts only with a credit from a ``GroupGate``. Under
a trainer that is the link's ``ActorCredits``: the trainer owns the
staleness budget across all actors (``rlnode.link.credits``). Without a
trainer (a standalone actor, benchmarks, tests) ``VersionBudget`` counts
the same budget locally: at most ``(version + max_lag + 1) *
groups_per_step`` groups started, net of dropped ones. Either way the
credit of a dropped group is given back, so drops never stall a run.

Must not touch engines or tokens directly (episodes do, through LLMClient).
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Callable, Protocol

import msgspec

from rlnode.actor.agent_starts import AgentStarts
from rlnode.actor.durations import PhaseDurations
from rlnode.actor.episode import ChatRenderer, EpisodeResult, EpisodeSettings, request_seed, run_episode
from rlnode.actor.generation import LLMClient
from rlnode.config import SchedulerConfig
from rlnode.aio import spawn
from rlnode.cubes.base import AgentTask, Cube, CubeError, CubeTaskRef
from rlnode.log import get_logger
from rlnode.wire import EpisodeSummary, GroupDelivery

log = get_logger("rlnode.scheduler")


class VersionSource:
    """The policy version the actor's engines hold; ``wait_changed`` wakes on
    every update."""

    def __init__(self, version: int = 0):
        self.version = version
        self._changed = asyncio.Event()

    def set(self, version: int) -> None:
        self.version = version
        self.wake()

    def wake(self) -> None:
        """Wake the waiters without a new version (a budget freed up)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()


class GroupGate(Protocol):
    """Where the scheduler gets the right to start a group."""

    async def acquire(self) -> str: ...  # waits for a credit; returns its session ("" = local)

    def give_back(self, session: str) -> None: ...  # the group of that credit was dropped


class VersionBudget:
    """The staleness budget counted by one actor alone (no trainer link)."""

    def __init__(self, versions: VersionSource, groups_per_step: int, max_lag: int):
        self.versions, self.groups_per_step, self.max_lag = versions, groups_per_step, max_lag
        self.started = 0  # net of dropped groups

    def budget(self) -> int:
        return (self.versions.version + self.max_lag + 1) * self.groups_per_step

    async def acquire(self) -> str:
        while self.started >= self.budget():
            await self.versions.wait_changed()
        self.started += 1
        return ""

    def give_back(self, session: str) -> None:
        self.started -= 1
        self.versions.wake()


class CubeStats(msgspec.Struct):
    episodes: int = 0  # completed episodes
    successes: int = 0
    errors: int = 0  # episodes failed after all retries
    retries: int = 0
    agent_errors: int = 0  # agent-visible errors (malformed calls, bad args)
    reward_sum: float = 0.0
    turns_sum: int = 0
    groups: int = 0  # complete groups emitted
    groups_dropped: int = 0  # groups lost to a failed episode
    llm_calls: int = 0  # LLM calls of completed episodes
    # Of them, replies cut by max_tokens or the context (finish_reason
    # "length"): a high share means the budget, not the policy, ends replies.
    length_cut: int = 0
    prompt_tokens: int = 0  # over the LLM calls of completed episodes
    completion_tokens: int = 0
    # Seconds per phase of completed episodes and their LLM calls.
    durations: PhaseDurations = msgspec.field(default_factory=PhaseDurations)

    def record(self, ep: EpisodeResult) -> None:
        self.durations.record(ep.phases, ep.samples)
        self.prompt_tokens += sum(s.lease.prompt_tokens for s in ep.samples)
        self.completion_tokens += sum(s.lease.completion_tokens for s in ep.samples)
        self.episodes += 1
        self.llm_calls += len(ep.samples)
        self.length_cut += sum(s.finish_reason == "length" for s in ep.samples)
        self.successes += ep.success
        self.agent_errors += ep.agent_errors
        self.reward_sum += ep.reward
        self.turns_sum += ep.num_turns

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.episodes if self.episodes else 0.0

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def turns_mean(self) -> float:
        return self.turns_sum / self.episodes if self.episodes else 0.0

    def summary(self) -> dict:
        return {"episodes": self.episodes, "success_rate": self.success_rate, "reward_mean": self.reward_mean,
                "turns_mean": self.turns_mean, "errors": self.errors, "retries": self.retries,
                "agent_errors": self.agent_errors, "groups": self.groups, "groups_dropped": self.groups_dropped,
                "llm_calls": self.llm_calls, "length_cut": self.length_cut,
                "length_cut_fraction": self.length_cut / self.llm_calls if self.llm_calls else 0.0,
                "prompt_tokens_mean": self.prompt_tokens / self.llm_calls if self.llm_calls else 0.0,
                "completion_tokens_mean": self.completion_tokens / self.llm_calls if self.llm_calls else 0.0,
                "phases_s": self.durations.summary()}


class Group(msgspec.Struct):
    """``attempts`` finished episodes of one task."""

    group_id: str
    ref: CubeTaskRef
    start_version: int
    episodes: list[EpisodeResult]
    credit_session: str = ""  # the trainer incarnation whose credit started it


class EvalReport(msgspec.Struct):
    version: int
    cubes: dict[str, dict]  # cube id -> CubeStats.summary()


class RolloutScheduler:
    def __init__(
        self,
        cubes: dict[str, Cube],
        weights: dict[str, float],
        eval_cubes: list[str],
        client: LLMClient,
        renderer: ChatRenderer,
        cfg: SchedulerConfig,
        episode: EpisodeSettings,
        versions: VersionSource,
        seed: int = 0,
        on_eval: Callable[[EvalReport], None] | None = None,
        id_prefix: str = "",
        gate: GroupGate | None = None,
        gateway=None,
        node_id: str = "",
        incarnation: str = "",
    ):
        self.cubes, self.cfg, self.episode = cubes, cfg, episode
        self.eval_episode = episode
        if cfg.eval_temperature >= 0:
            self.eval_episode = msgspec.structs.replace(
                episode, sampling=msgspec.structs.replace(episode.sampling, temperature=cfg.eval_temperature))
        self.client, self.renderer, self.versions = client, renderer, versions
        self.gate = gate or VersionBudget(versions, cfg.groups_per_step, cfg.max_lag)
        # Serves the episodes of AgentTasks (external agents); rlnode.actor.gateway.Gateway.
        self.gateway = gateway
        self.train_cubes = [c for c, w in weights.items() if w > 0]
        self.weights = [weights[c] for c in self.train_cubes]
        self.eval_cubes = eval_cubes
        self.on_eval = on_eval
        # Group ids must be unique across actors and actor restarts (the
        # trainer drops duplicates by id): the daemon passes node + incarnation.
        self.id_prefix = id_prefix
        # Task draws: per node and per incarnation (a start of the daemon).
        # Two actors of one run must not play the same tasks in the same
        # order, nor may a crash-looping actor replay its first tasks, with
        # the same sampling seeds, after every restart.
        self.rng = random.Random(f"{seed}/{node_id}/{incarnation}" if node_id or incarnation else seed)
        # Sampling seeds: (run seed, node and incarnation, group index, task,
        # attempt, retry, turn) -> one seed per LLM call
        # (episode.request_seed). Eval episodes leave the incarnation out:
        # a version's eval is the same on every start.
        self.seed, self.node_id = seed, node_id
        self.draw_id = f"{node_id}/{incarnation}" if incarnation else node_id
        self.stats = {c: CubeStats() for c in cubes}
        self.eval_stats: dict[str, CubeStats] = {}
        self.started_groups = 0
        self.groups_failed = 0  # groups lost to an error after admission (their credit given back)
        self.groups_cancelled = 0  # groups cancelled mid-play (a stop): their credit given back too
        self.waiting_for_credit = False
        # Indices of groups started and not yet handed to ``out`` or dropped.
        self.in_flight_indices: set[int] = set()
        self.in_flight_groups = 0
        self.max_in_flight_groups = 0
        self.episodes_in_flight = 0
        self.eval_in_flight = 0
        self.max_eval_in_flight = 0
        self._train_ids: dict[str, list[str]] = {}
        self._test_ids: dict[str, list[str]] = {}
        self._slots = asyncio.Semaphore(cfg.max_concurrent_episodes)
        self.agent_starts = AgentStarts(cfg.max_starting_agents)
        self._eval_slots = asyncio.Semaphore(max(1, math.floor(cfg.eval_share * cfg.max_concurrent_episodes)))
        self._tasks: set[asyncio.Task] = set()

    async def prepare(self) -> None:
        for cid in self.train_cubes:
            self._train_ids[cid] = await self.cubes[cid].task_ids("train")
            if not self._train_ids[cid]:
                raise ValueError(f"cube {cid!r} has no train tasks")
        for cid in self.eval_cubes:
            self._test_ids[cid] = await self.cubes[cid].task_ids("test")

    # -- admission -------------------------------------------------------------

    async def admit(self) -> str:
        """Wait for the right to start one group; returns its credit session."""
        self.waiting_for_credit = True
        try:
            return await self.gate.acquire()
        finally:
            self.waiting_for_credit = False

    def next_task(self) -> CubeTaskRef:
        cid = self.rng.choices(self.train_cubes, self.weights)[0]
        return CubeTaskRef(cid, self.rng.choice(self._train_ids[cid]))

    # -- main loop -------------------------------------------------------------

    async def run(self, out: asyncio.Queue) -> None:
        """Start groups as the budget allows and put complete ones on ``out``;
        runs until cancelled (cancellation cancels every group in flight)."""
        eval_task = asyncio.create_task(self._eval_loop()) if self.cfg.eval_every and self.eval_cubes else None
        try:
            while True:
                session = await self.admit()
                ref = self.next_task()
                index = self.started_groups
                self.started_groups += 1
                self.in_flight_indices.add(index)
                self._spawn(self._run_group(ref, index, out, session))
        finally:
            if eval_task:
                eval_task.cancel()
            await self.cancel_all()

    def _spawn(self, coro) -> asyncio.Task:
        return spawn(self._tasks, coro)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_group(self, ref: CubeTaskRef, index: int, out: asyncio.Queue, session: str = "") -> None:
        try:
            await self._play_group(ref, index, out, session)
        finally:
            self.in_flight_indices.discard(index)

    async def _play_group(self, ref: CubeTaskRef, index: int, out: asyncio.Queue, session: str) -> None:
        """Play one admitted group. Its credit leaves exactly one way: the
        group is handed to ``out`` (which owns it from then on, refusals
        included), or the credit is given back: dropped episodes, an error,
        or cancellation (a credit kept by a group that will never arrive
        would stay in this actor's hands for the rest of the run)."""
        group_id = f"{self.id_prefix}g{index:07d}"
        settled = False  # handed to `out`, or its credit given back
        try:
            seed = request_seed(self.seed, self.draw_id, "train", index, ref.cube_id, ref.task_id)
            settled = await self._play_admitted(ref, group_id, out, session, seed)
        except BaseException as e:
            if not settled:
                self.gate.give_back(session)
                if isinstance(e, asyncio.CancelledError):
                    self.groups_cancelled += 1
                else:
                    self.groups_failed += 1
                    log.error("group.failed", group=group_id, cube=ref.cube_id, task=ref.task_id,
                              error=repr(e)[:300], total=self.groups_failed)
            raise

    async def _play_admitted(self, ref: CubeTaskRef, group_id: str, out: asyncio.Queue, session: str,
                             seed: int) -> bool:
        start_version = self.versions.version
        self.in_flight_groups += 1
        self.max_in_flight_groups = max(self.max_in_flight_groups, self.in_flight_groups)
        try:
            results = await asyncio.gather(*(
                self._episode_with_retries(ref, f"{group_id}/e{j}", group_id, self.stats[ref.cube_id],
                                           seed=request_seed(seed, j))
                for j in range(self.cfg.attempts)
            ))
        finally:
            self.in_flight_groups -= 1
        stats = self.stats[ref.cube_id]
        if any(r is None for r in results):
            stats.groups_dropped += 1
            self.gate.give_back(session)  # its credit goes back: another group may start
            log.warning("group.dropped", group=group_id, cube=ref.cube_id, task=ref.task_id,
                        failed=sum(r is None for r in results))
            return True
        stats.groups += 1
        await out.put(Group(group_id, ref, start_version, results, session))
        return True

    async def _episode_with_retries(self, ref, episode_id, group_id, stats: CubeStats,
                                    settings: EpisodeSettings | None = None,
                                    seed: int | None = None) -> EpisodeResult | None:
        settings = settings or self.episode
        for attempt in range(self.cfg.max_retries + 1):
            if seed is not None and settings is not None:  # a retry samples anew: it may have failed on what it drew
                settings = msgspec.structs.replace(settings, seed=request_seed(seed, "retry", attempt))
            try:
                result = await self._one_episode(ref, episode_id, group_id, settings)
            except asyncio.CancelledError:
                raise
            # Cube/engine failures are retried, never fatal. BaseException:
            # foreign code (a verifiers env, an agent) may raise SystemExit or
            # KeyboardInterrupt, which must end this episode, not the daemon.
            except BaseException as e:
                log.warning("episode.failed", episode=episode_id, cube=ref.cube_id, task=ref.task_id,
                            attempt=attempt, error=repr(e))
                if attempt == self.cfg.max_retries:
                    stats.errors += 1
                    return None
                stats.retries += 1
                await asyncio.sleep(min(self.cfg.retry_backoff_s * 2**attempt, self.cfg.retry_backoff_max_s))
                continue
            stats.record(result)
            return result
        return None

    async def _one_episode(self, ref, episode_id, group_id, settings: EpisodeSettings) -> EpisodeResult:
        async with self._slots:
            self.episodes_in_flight += 1
            try:
                task = await self.cubes[ref.cube_id].open_task(ref.task_id)
                if isinstance(task, AgentTask):
                    from rlnode.actor.agent_episode import run_agent_episode

                    if self.gateway is None:
                        await task.close()
                        raise CubeError(f"cube {ref.cube_id!r} opened an agent task, but it says runs_agents = False, "
                                        "so this actor started no gateway for external agents")
                    return await run_agent_episode(self.gateway, task, settings, episode_id, group_id,
                                                   lambda: self.versions.version, self.agent_starts)
                return await run_episode(self.client, self.renderer, task, settings, episode_id,
                                         group_id, lambda: self.versions.version)
            finally:
                self.episodes_in_flight -= 1

    # -- evaluation --------------------------------------------------------------

    async def _eval_loop(self) -> None:
        last = None
        while True:
            v = self.versions.version
            if v % self.cfg.eval_every == 0 and v != last:
                last = v
                report = await self.evaluate(v)
                if self.on_eval:
                    self.on_eval(report)
            await self.versions.wait_changed()

    async def evaluate(self, version: int, episodes: int | None = None,
                       on_episode: Callable[[str], None] | None = None) -> EvalReport:
        """Run ``episodes`` test episodes per eval cube (cycling through the
        test split) within the eval share of the capacity. ``on_episode(cube_id)``
        is called as each one ends (progress bars)."""
        n = episodes or self.cfg.eval_episodes
        stats = {cid: CubeStats() for cid in self.eval_cubes}

        async def one(cid: str, i: int) -> None:
            ids = self._test_ids[cid]
            ref = CubeTaskRef(cid, ids[i % len(ids)])
            async with self._eval_slots:
                self.eval_in_flight += 1
                self.max_eval_in_flight = max(self.max_eval_in_flight, self.eval_in_flight)
                try:
                    await self._episode_with_retries(
                        ref, f"eval-v{version}-{cid}-{i}", f"eval-v{version}", stats[cid], self.eval_episode,
                        seed=request_seed(self.seed, self.node_id, "eval", version, cid, i))
                finally:
                    self.eval_in_flight -= 1
                    if on_episode:
                        on_episode(cid)

        await asyncio.gather(*(one(cid, i) for cid in self.eval_cubes if self._test_ids[cid] for i in range(n)))
        self.eval_stats = stats
        report = EvalReport(version, {cid: s.summary() for cid, s in stats.items()})
        log.info("eval.done", version=version, **{f"{c}_success": round(s.success_rate, 3) for c, s in stats.items()})
        return report


def group_to_delivery(group: Group, node_id: str) -> GroupDelivery:
    """Flatten a scheduler ``Group`` into the message the link sends.
    Samples keep their order: episode by episode, LLM call by LLM call."""
    return GroupDelivery(
        group_id=group.group_id,
        node_id=node_id,
        cube_id=group.ref.cube_id,
        task_id=group.ref.task_id,
        start_version=group.start_version,
        episodes=[EpisodeSummary(e.episode_id, e.reward, e.success, e.num_turns, e.termination_reason)
                  for e in group.episodes],
        samples=[s for e in group.episodes for s in e.samples],
        credit_session=group.credit_session,
    )
