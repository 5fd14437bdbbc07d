"""The actor <-> trainer link: ZeroMQ ROUTER (trainer) / DEALER (actors),
msgspec messages from ``rlnode.wire``, acknowledged group delivery,
heartbeats, optional CurveZMQ authentication.

    trainer_link.TrainerLink   the trainer's end: peer table, dedup, acks, commits;
                               its parts in trainer_reader, trainer_peers,
                               trainer_groups, trainer_credits, trainer_control
    peers                      what a node may register as; the peer table's records
    zap                        the trainer's CurveZMQ handler: which key connects as which node
    actor_link.ActorLink       an actor's end: outbox kept until commit, resends
    curve                      key files (``rlnode keygen DIR``) and socket options

    base                       what both ends share: errors, the non-blocking
                               send, the frame-size default

This package's names are re-exported for callers; the ends import ``base``,
never the package, so nothing here imports back what imports it.
"""

from __future__ import annotations

from rlnode.link.actor_link import ActorLink, ActorLinkCounters
from rlnode.link.base import DEFAULT_MAX_FRAME_BYTES, LinkError, LinkFatalError, PeerGone, send_nowait
from rlnode.link.curve import keygen
from rlnode.link.peers import PeerEvent, PeerInfo, TrainerLinkCounters
from rlnode.link.trainer_link import TrainerLink

__all__ = [
    "ActorLink", "ActorLinkCounters", "DEFAULT_MAX_FRAME_BYTES", "LinkError", "LinkFatalError", "PeerEvent",
    "PeerGone", "PeerInfo", "TrainerLink", "TrainerLinkCounters", "keygen", "send_nowait",
]
