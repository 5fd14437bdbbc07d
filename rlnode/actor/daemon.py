"""ActorDaemon: the actor role's lifecycle on one node.

Owns: this node's engines, its AdmissionRouter, the LLMClient episodes use,
the configured cubes and the RolloutScheduler. Startup brings every engine
and cube up (tearing down what was started if one fails); run() schedules
episodes and puts complete groups on ``self.groups``, where the trainer link
picks them up; shutdown cancels episodes in flight, closes cubes, stops
engines.
"""

from __future__ import annotations

import asyncio

from rlnode.actor.engine import Engine, SamplingSettings
from rlnode.actor.episode import ChatRenderer, EpisodeSettings
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.actor.scheduler import Group, RolloutScheduler, VersionSource
from rlnode.config import Config
from rlnode.cubes.base import Cube
from rlnode.log import get_logger

log = get_logger("rlnode.actor")


def episode_settings(cfg: Config) -> EpisodeSettings:
    s = cfg.actor.sampling
    return EpisodeSettings(
        sampling=SamplingSettings(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p),
        max_turns=cfg.actor.episode.max_turns,
        max_model_len=cfg.model.max_model_len,
        min_completion_tokens=cfg.actor.episode.min_completion_tokens,
    )


class ActorDaemon:
    name = "actor"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.peers = cfg.actor.peers
        ecfg = cfg.actor.engine
        self.engines = [Engine(i, cfg.model, ecfg) for i in range(ecfg.num_engines)]
        self.router = AdmissionRouter(
            ecfg.num_engines, cfg.actor.router.llm_max_rollouts, cfg.actor.router.affinity
        )
        self.client = LLMClient(self.engines, self.router)
        self.versions = VersionSource(0)
        self.cubes: dict[str, Cube] = {}
        self.scheduler: RolloutScheduler | None = None
        # Complete groups, for the trainer link. Bounded in effect by the
        # scheduler's staleness budget, not by the queue.
        self.groups: asyncio.Queue[Group] = asyncio.Queue()

    async def start(self) -> None:
        from rlnode.cubes.registry import close_cubes, open_cubes

        self.cubes = await open_cubes(self.cfg.actor.cubes, self.cfg.run.seed)
        started: list[Engine] = []
        try:
            # Sequential on purpose: concurrent engine starts on one host
            # race for memory and CPU and make start-up failures ambiguous.
            for engine in self.engines:
                await engine.start()
                started.append(engine)
            if self.cubes:
                self.scheduler = await self._make_scheduler()
        except BaseException:
            await asyncio.gather(*(e.shutdown() for e in started), return_exceptions=True)
            await close_cubes(self.cubes)
            raise
        log.info("actor.started", engines=len(self.engines), peers=self.peers,
                 llm_max_rollouts=self.router.capacity, cubes=list(self.cubes))

    async def _make_scheduler(self) -> RolloutScheduler:
        from transformers import AutoTokenizer

        cfg = self.cfg
        tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, cfg.model.tokenizer or cfg.model.path)
        sched = RolloutScheduler(
            self.cubes, {c.id: c.weight for c in cfg.actor.cubes}, [c.id for c in cfg.actor.cubes if c.eval],
            self.client, ChatRenderer(tok), cfg.actor.scheduler, episode_settings(cfg), self.versions,
            seed=cfg.run.seed, on_eval=lambda r: log.info("eval", version=r.version, cubes=r.cubes),
        )
        await sched.prepare()
        return sched

    async def run(self, stop: asyncio.Event) -> None:
        if self.scheduler is None:
            await stop.wait()
            return
        rollouts = asyncio.create_task(self.scheduler.run(self.groups), name="rollouts")
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([rollouts, stopping], return_when=asyncio.FIRST_COMPLETED)
            if rollouts.done():
                rollouts.result()  # a scheduler that ended on its own is an error: raise it
        finally:
            rollouts.cancel()
            stopping.cancel()
            await asyncio.gather(rollouts, return_exceptions=True)

    async def shutdown(self) -> None:
        from rlnode.cubes.registry import close_cubes

        await close_cubes(self.cubes)
        results = await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)
        for e, r in zip(self.engines, results):
            if isinstance(r, BaseException):
                log.error("engine.shutdown_failed", engine=e.engine_id, error=repr(r))
        stats = {c: s.summary() for c, s in self.scheduler.stats.items()} if self.scheduler else {}
        log.info("actor.stopped", leases=self.router.stats().leases_granted, cubes=stats)
