"""Group intake of ``TrainerLink`` (a part of it: ``trainer_link`` says how
the parts fit): a delivered group is checked (its sender may deliver its
id, ``validate.validate_group``, room in the buffer, a credit), then
acked and put in ``deliveries`` at most once per group id; duplicates are
acked again, groups that can never be valid are refused for good. Owns
the ids of groups buffered or consumed (``consumed.ConsumedIds``) and the
``Commit``s that let an actor forget a group. Must not touch the training
buffer: the daemon reads ``deliveries`` and reports back with
``mark_consumed``.
"""

from __future__ import annotations

import time
from typing import Iterable

from rlnode.link.consumed import ConsumedIds
from rlnode.link.peers import PeerInfo, foreign_group_id
from rlnode.link.validate import validate_group
from rlnode.log import get_logger, log_throttled
from rlnode.wire import (
    REJECT_BUSY, REJECT_INVALID_GROUP, REJECT_UNKNOWN_GROUP, Ack, Commit, CreditReport, GroupDelivery, Reject,
)

log = get_logger("rlnode.link.trainer")


class GroupIntake:
    """``TrainerLink``'s group intake and consumed-id memory (state: the
    link's)."""

    async def next_delivery(self) -> tuple[str, GroupDelivery]:
        item = await self.deliveries.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def mark_consumed(self, group_ids: Iterable[str]) -> None:
        """These groups are durably consumed (trained and checkpointed, or
        dropped and counted): remember them and ``Commit`` them to their
        actors. Call for every group taken from ``deliveries``."""
        by_peer: dict[str, list[str]] = {}
        for gid in group_ids:
            if gid in self._consumed:
                continue
            self._consumed.add(gid)
            peer_id = self._buffered.pop(gid, None)
            if peer_id is not None:
                by_peer.setdefault(peer_id, []).append(gid)
        for peer_id, gids in by_peer.items():
            p = self._peers.get(peer_id)
            # A gone peer asks again with CommitQuery once it is back.
            if p is not None and p.connected and self._send(peer_id, Commit(gids)):
                self.counters.commits_sent += len(gids)

    def consumed_state(self, extra: Iterable[str] = ()) -> dict:
        """Every group id consumed by this run (plus ``extra``), compacted
        (``rlnode.link.consumed``): persist it with checkpoints."""
        return self._consumed.to_state(extra)

    def load_consumed(self, state: dict | list, extra: Iterable[str] = ()) -> None:
        """Restore consumed ids from a checkpoint (``consumed_state()``, or
        the plain id list older checkpoints hold) plus ``extra`` ids:
        resends of them are dropped as duplicates (and committed)."""
        self._consumed = ConsumedIds.from_state(state)
        self._consumed.update(extra)

    def is_consumed(self, group_id: str) -> bool:
        return group_id in self._consumed

    def buffered_ids(self) -> list[str]:
        return list(self._buffered)

    def stop_taking_groups(self) -> list[GroupDelivery]:
        """The trainer is stopping: from now on a new group is answered busy
        (its actor keeps it and resends it to the next trainer), and the
        groups accepted but not yet read from ``deliveries`` are returned,
        for the final checkpoint. Without this a group acked after the
        daemon stopped reading was neither trained nor saved: lost for good
        where its actor stops too (``--role all``)."""
        self._stopping = True
        late = []
        while not self.deliveries.empty():
            item = self.deliveries.get_nowait()
            if not isinstance(item, BaseException):  # a link task's failure: the link is closing anyway
                late.append(item[1])
        return late

    def _on_group(self, peer: PeerInfo, g: GroupDelivery) -> None:
        c, gid = self.counters, g.group_id
        if g.node_id != peer.node_id or foreign_group_id(gid, peer.node_id, peer.incarnation):
            # Not marked consumed: the id may be another node's real group.
            reason = "node_id" if g.node_id != peer.node_id else "group_id"
            c.invalid_groups += 1
            c.invalid_by_reason[reason] = c.invalid_by_reason.get(reason, 0) + 1
            # The actor forgets a group it sees refused: its credit is spent.
            self.credits.on_delivered(peer.peer_id, g.credit_session, gid, accepted=False)
            return self._unexpected(peer.peer_id, REJECT_INVALID_GROUP, f"{reason} of another sender", [gid])
        if gid in self._consumed or gid in self._buffered:
            self._on_duplicate(peer, gid)
            return
        if self._stopping:  # the actor keeps it and resends it to the next trainer
            c.busy_rejects += 1
            self._send(peer.peer_id, Reject(REJECT_BUSY, "the trainer is stopping", [gid]))
            return
        problem = validate_group(g, self.limits, self.version)
        if problem is not None:
            self.credits.on_delivered(peer.peer_id, g.credit_session, gid, accepted=False)
            self._invalid(peer.peer_id, gid, *problem)
            return
        if self.max_buffered_groups and len(self._buffered) >= self.max_buffered_groups:
            c.busy_rejects += 1
            self._send(peer.peer_id, Reject(REJECT_BUSY, f"{len(self._buffered)} groups buffered", [gid]))
            return
        if not self.credits.admits(peer.peer_id, g.credit_session):
            c.busy_rejects += 1
            self._send(peer.peer_id, Reject(REJECT_BUSY, f"over this node's share ({self.credits.share()}) of "
                                            "groups waiting without a credit", [gid]))
            return
        self._buffered[gid] = peer.peer_id
        self.last_group_at = time.monotonic()
        self.credits.on_delivered(peer.peer_id, g.credit_session, gid, accepted=True)
        c.groups_accepted += 1
        c.samples_accepted += len(g.samples)
        peer.groups += 1
        self.deliveries.put_nowait((peer.peer_id, g))
        if self._send(peer.peer_id, Ack([gid])):
            c.acks_sent += 1

    def _invalid(self, peer_id: str, gid: str, reason: str, detail: str) -> None:
        """Reject a group for good: counted by reason and remembered as
        consumed, so a resend is acked as a duplicate and committed, never
        retried (it could never become valid)."""
        c = self.counters
        c.invalid_groups += 1
        c.invalid_by_reason[reason] = c.invalid_by_reason.get(reason, 0) + 1
        if gid:  # bounded memory: a hostile peer may send endless fresh ids
            self._consumed.add_loose(gid)
        log_throttled(log.warning, "link.trainer.invalid_group", c.invalid_groups, peer=peer_id, group=gid,
                      reason=reason, detail=detail[:200])
        self._send(peer_id, Reject(REJECT_INVALID_GROUP, f"{reason}: {detail[:200]}", [gid]))

    def _on_duplicate(self, peer: PeerInfo, gid: str) -> None:
        c = self.counters
        c.duplicates += 1
        origin = self._buffered.get(gid)
        if origin is not None and origin != peer.peer_id:
            if origin.split("/", 1)[0] != peer.node_id:
                c.id_collisions += 1
                log.warning("link.trainer.group_id_collision", group=gid, first=origin, second=peer.peer_id)
            else:  # the same node under a new identity: commit to where it lives now
                self._buffered[gid] = peer.peer_id
        if self._send(peer.peer_id, Ack([], duplicate=[gid])):
            c.acks_sent += 1
        if gid in self._consumed and self._send(peer.peer_id, Commit([gid])):
            c.commits_sent += 1

    def _on_commit_query(self, peer: PeerInfo, ids: list[str]) -> None:
        consumed = [g for g in ids if g in self._consumed]
        unknown = [g for g in ids if g not in self._consumed and g not in self._buffered]
        if consumed and self._send(peer.peer_id, Commit(consumed)):
            self.counters.commits_sent += len(consumed)
        if unknown:
            self._unexpected(peer.peer_id, REJECT_UNKNOWN_GROUP, f"{len(unknown)} ids", unknown)

    def _settle(self, peer: PeerInfo, r: CreditReport) -> None:
        """The actor holds no group below ``settled_below`` any more: the
        consumed-id memory for its incarnation can be compacted up to there.
        Only for its own ids (the prefix names its node and incarnation)."""
        if r.id_prefix and r.settled_below > 0 and r.id_prefix.startswith(f"{peer.node_id}-{peer.incarnation}-"):
            self._consumed.settle(r.id_prefix, r.settled_below)
