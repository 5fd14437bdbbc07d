"""WeightPusher: gets the trainer's weights into every actor's engines.

Owns: the trainer side of the weight-update conversation over the link:
which actors form the current group epoch, re-forming the epoch when an
actor joins or leaves, and pushing a version to every member while their
engines keep generating. The bytes move through ``WeightBroadcaster``
(torch.distributed); the requests and replies through ``TrainerLink``.

The conversation, per actor (ControlRequest kinds; payloads carry the
msgspec-encoded ``GroupSpec`` / ``WeightUpdatePlan`` as bytes):
  "join_group"     {spec}  -> the actor's engines join epoch N (ranks given)
  "update_weights" {plan}  -> the engines pause (keep), receive, load, resume
The trainer runs its own side (rendezvous / broadcast) in a thread at the
same time. A member that fails or times out marks the epoch dirty: the next
push forms a new epoch without it (and with anyone who joined) and sends
the current weights, so a rejoining actor catches up at once.

Must not train, and must not block the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import time

from rlnode.link import LinkError
from rlnode.link.trainer_link import TrainerLink
from rlnode.log import get_logger
from rlnode.trainer.weights import WeightBroadcaster, update_tensors
from rlnode.weight_plan import WeightUpdateError, encode

log = get_logger("rlnode.trainer.sync")


class WeightPusher:
    def __init__(self, link: TrainerLink, broadcaster: WeightBroadcaster, model, request_timeout_s: float = 300.0):
        self.link = link
        self.broadcaster = broadcaster
        self.model = model
        self.request_timeout_s = request_timeout_s
        self.members: dict[str, tuple[str, list]] = {}  # peer_id -> (node_id, its engines)
        self.dirty = True
        self.lock = asyncio.Lock()  # one epoch change or push at a time
        self.last_push_s = 0.0
        self.pushes = 0
        self.failures = 0

    def membership_changed(self) -> None:
        self.dirty = True

    def _live_peers(self) -> dict[str, tuple[str, list]]:
        return {pid: (p.node_id, p.engines) for pid, p in self.link.peers().items() if p.connected and p.engines}

    async def push(self, version: int) -> bool:
        """Bring every connected actor to ``version``. Returns False when no
        actor is connected (nothing to do) or the push failed (it is retried
        with a fresh epoch on the next call)."""
        async with self.lock:
            if self.dirty or set(self._live_peers()) != set(self.members):
                if not await self._reform():
                    return False
            return await self._push(version)

    async def _requests(self, kind: str, payload_for) -> list[str]:
        """Send one request per member; returns the peers that failed."""
        peers = list(self.members)
        results = await asyncio.gather(*(
            self.link.request(pid, kind, payload_for(pid), timeout_s=self.request_timeout_s) for pid in peers
        ), return_exceptions=True)
        failed = []
        for pid, r in zip(peers, results):
            if isinstance(r, BaseException) or not r.ok:
                failed.append(pid)
                log.warning("weights.peer_failed", peer=pid, kind=kind,
                            error=repr(r) if isinstance(r, BaseException) else r.error)
        return failed

    async def _reform(self) -> bool:
        live = self._live_peers()
        self.members = live
        if not live:
            self.broadcaster.close_group()
            return False
        # Members are named "<node id>/<engine id>": how an actor finds its ranks.
        engines = [(f"{node}/{e.engine_id}", e.num_workers) for node, es in live.values() for e in es]
        spec = self.broadcaster.new_epoch(engines)
        blob = base64.b64encode(encode(spec)).decode()  # the payload carries text, not bytes
        own = asyncio.create_task(self.broadcaster.open_group_async(spec))
        failed = await self._requests("join_group", lambda pid: {"spec": blob})
        try:
            await own
        except WeightUpdateError as e:
            log.warning("weights.epoch_failed", epoch=spec.epoch, error=repr(e), failed_peers=failed)
            self.failures += 1
            self.dirty = True
            return False
        if failed:
            self.dirty = True
            return False
        self.dirty = False
        log.info("weights.epoch", epoch=spec.epoch, world_size=spec.world_size, peers=list(live))
        return True

    async def _push(self, version: int) -> bool:
        t0 = time.perf_counter()
        tensors = update_tensors(self.model)
        plan = self.broadcaster.plan(tensors, version)
        blob = base64.b64encode(encode(plan)).decode()
        own = asyncio.create_task(self.broadcaster.broadcast_async(plan, tensors))
        failed = await self._requests("update_weights", lambda pid: {"plan": blob})
        try:
            stats = await own
        except (WeightUpdateError, LinkError) as e:
            log.warning("weights.push_failed", version=version, error=repr(e), failed_peers=failed)
            self.failures += 1
            self.dirty = True
            return False
        if failed:
            self.failures += 1
            self.dirty = True
            return False
        self.last_push_s = time.perf_counter() - t0
        self.pushes += 1
        log.info("weights.pushed", version=version, epoch=plan.epoch, peers=len(self.members),
                 bytes=plan.nbytes, push_s=round(self.last_push_s, 3), broadcast_s=round(stats.total_s, 3)
                 if hasattr(stats, "total_s") else None)
        return True
