"""The peer table of ``TrainerLink`` (a part of it: ``trainer_link`` says
how the parts fit): registration (protocol, identity, the rules of
``peers.register_problem``, a key still authorized), one row per node
(a new incarnation replaces the old), and liveness: the tick task sends
heartbeats and repeats grants, marks a silent peer gone, ends the session
of a node whose key was revoked. Every join and leave is a ``PeerEvent``;
a leaving peer's pending control requests fail with ``PeerGone`` and its
credits go back to the ledger. Must not touch groups: ``trainer_groups``.
"""

from __future__ import annotations

import asyncio
import copy
import time

from rlnode.link.base import LinkError, PeerGone
from rlnode.link.peers import PeerEvent, PeerInfo, register_problem
from rlnode.log import get_logger
from rlnode.wire import (
    PROTOCOL_VERSION, REJECT_IDENTITY, REJECT_PROTOCOL, CreditGrant, Heartbeat, Register, Reject, Welcome,
)

log = get_logger("rlnode.link.trainer")


class PeerTable:
    """``TrainerLink``'s registrations and liveness (state: the link's)."""

    def peers(self) -> dict[str, PeerInfo]:
        return {pid: copy.copy(p) for pid, p in self._peers.items()}

    def _on_register(self, peer_id: str, msg: Register, key_name: str) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            return self._unexpected(peer_id, REJECT_PROTOCOL,
                                    f"actor speaks {msg.protocol_version}, trainer {PROTOCOL_VERSION}")
        if not msg.node_id or peer_id != f"{msg.node_id}/{msg.incarnation}":
            return self._unexpected(peer_id, REJECT_IDENTITY, f"socket identity {peer_id!r}")
        if problem := register_problem(msg):
            # Fatal for the actor (a config or a hostile peer: retrying cannot help).
            self.counters.registers_refused += 1
            return self._unexpected(peer_id, REJECT_PROTOCOL, f"register refused: {problem}")
        if self._keyring is not None and not self._still_authorized(msg.node_id):
            return self._unexpected(peer_id, REJECT_IDENTITY, f"key {msg.node_id!r} is no longer authorized")
        old = self._peers.get(peer_id)
        # A node's new incarnation (actor restart) replaces its older entries,
        # so the table stays one row per node.
        for other in [p for p in self._peers.values() if p.node_id == msg.node_id and p.peer_id != peer_id]:
            if other.connected:
                self._leave(other, "replaced")
            del self._peers[other.peer_id]
            self._seen.pop(other.peer_id, None)
            self.credits.forget(other.peer_id)  # its credits died with that process
        peer = PeerInfo(peer_id, msg.node_id, msg.incarnation, msg.engines, time.time(),
                        old.version if old else 0, True, old.stats if old else {},
                        old.groups if old else 0, key_name)
        self._peers[peer_id] = peer
        self._seen[peer_id] = time.monotonic()
        self.counters.registrations += 1
        self._send(peer_id, Welcome(self.incarnation, self.version))
        self.credits.peer_joined(peer_id)  # zero credits until it reports what it wants
        if old is None or not old.connected:
            self.counters.peers_joined += 1
            self.events.put_nowait(PeerEvent("joined", peer_id, msg.node_id, msg.incarnation))
            log.info("link.peer.joined", peer=peer_id, engines=[(e.engine_id, e.num_workers) for e in msg.engines],
                     key=key_name or None)

    def _connected(self) -> list[PeerInfo]:
        return [p for p in self._peers.values() if p.connected]

    def _leave(self, peer: PeerInfo, reason: str) -> None:
        peer.connected = False
        self.credits.peer_left(peer.peer_id)
        self.counters.peers_left += 1
        self.events.put_nowait(PeerEvent("left", peer.peer_id, peer.node_id, peer.incarnation, reason))
        log.info("link.peer.left", peer=peer.peer_id, reason=reason)
        for rid, (pid, fut) in list(self._requests.items()):
            if pid == peer.peer_id and not fut.done():
                fut.set_exception(PeerGone(f"peer {pid!r} left ({reason})"))

    async def _tick_loop(self) -> None:
        try:
            await self._ticks()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("link.trainer.tick_failed")
            self.deliveries.put_nowait(LinkError(f"trainer link heartbeat task failed: {e!r}"))
            raise

    async def _ticks(self) -> None:
        hb = self.link.heartbeat_s
        last = time.monotonic()
        while True:
            await asyncio.sleep(hb)
            now = time.monotonic()
            if now - last > 2 * hb:
                # Our own loop stalled (a long synchronous step): frames from
                # live peers are still queued unread, so do not blame them.
                for pid, seen in self._seen.items():
                    self._seen[pid] = max(seen, now - hb)
            last = now
            for p in self._connected():
                if now - self._seen.get(p.peer_id, now) > self.link.peer_timeout_s:
                    self._leave(p, "timeout")
            self._drop_revoked()
            self._watch_groups(now)
            stats = {"buffered": float(len(self._buffered)), "consumed": float(len(self._consumed))}
            self._grant(force=True)
            for p in self._connected():
                self._send(p.peer_id, Heartbeat("trainer", self.version, stats))
                pc = self.credits.peers.get(p.peer_id)
                if pc is not None and pc.granted:  # heals a lost grant
                    self._send(p.peer_id, CreditGrant(self.incarnation, pc.granted))

    def _still_authorized(self, node_id: str) -> bool:
        if node_id not in self._authorized:  # added since the last scan?
            self._authorized = set(self._keyring.names().values())
        return node_id in self._authorized

    def _drop_revoked(self) -> None:
        """A key deleted from authorized/ ends its node's session now, not
        at its next reconnect: it must register again, which is refused."""
        if self._keyring is None:
            return
        self._authorized = set(self._keyring.names().values())
        for p in self._connected():
            if p.node_id not in self._authorized:
                self.counters.revoked += 1
                log.warning("link.peer.revoked", peer=p.peer_id)
                self._leave(p, "revoked")
                self._send(p.peer_id, Reject(REJECT_IDENTITY, f"key {p.node_id!r} was revoked"))
