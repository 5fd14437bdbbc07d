"""ActorDaemon: the actor role's lifecycle on one node.

Owns: this node's engines, its AdmissionRouter and the LLMClient episodes use.
Startup brings every engine up (and tears down those already started if one
fails); shutdown stops them. Episodes, the rollout scheduler and the trainer
link plug in here as they are built.
"""

from __future__ import annotations

import asyncio

from rlnode.actor.engine import Engine, SamplingSettings
from rlnode.actor.episode import EpisodeSettings
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.config import Config
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

    async def start(self) -> None:
        started: list[Engine] = []
        try:
            # Sequential on purpose: concurrent engine starts on one host
            # race for memory and CPU and make start-up failures ambiguous.
            for engine in self.engines:
                await engine.start()
                started.append(engine)
        except BaseException:
            await asyncio.gather(*(e.shutdown() for e in started), return_exceptions=True)
            raise
        log.info("actor.started", engines=len(self.engines), peers=self.peers,
                 llm_max_rollouts=self.router.capacity)

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def shutdown(self) -> None:
        results = await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)
        for e, r in zip(self.engines, results):
            if isinstance(r, BaseException):
                log.error("engine.shutdown_failed", engine=e.engine_id, error=repr(r))
        log.info("actor.stopped", router=self.router.stats().leases_granted)
