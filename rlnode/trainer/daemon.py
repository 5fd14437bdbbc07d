"""TrainerDaemon: the trainer role's lifecycle.

Owns (as the trainer is built out): the sample link, the buffer, the
optimizer loop, the weight broadcast and checkpoints. For now it starts,
reports its configured endpoint and stops cleanly.
"""

from __future__ import annotations

import asyncio

from rlnode.config import Config
from rlnode.log import get_logger

log = get_logger("rlnode.trainer")


class TrainerDaemon:
    name = "trainer"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    async def start(self) -> None:
        t = self.cfg.trainer
        log.info("trainer.started", bind=f"{t.bind_host}:{t.port}", model=self.cfg.model.path)

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def shutdown(self) -> None:
        log.info("trainer.stopped")
