"""The trainer's view of its actors: what a node may announce when it
registers (``register_problem``), whose group ids it may deliver
(``foreign_group_id``), and the records the peer table and the link's
counters keep (``PeerInfo``, ``PeerEvent``, ``TrainerLinkCounters``).
``TrainerLink`` applies them; nothing here touches a socket.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from rlnode.wire import EngineInfo, Register

# What one node may announce in its Register. The weight epoch's world size
# is 1 + every connected engine's workers, and the trainer waits for that
# many ranks: an authenticated node that claims thousands of workers would
# make every epoch time out. The bounds sit far above any real node (a GPU
# node holds up to 16 GPUs: engines x tensor_parallel_size <= 16).
MAX_ENGINES_PER_NODE = 64
MAX_WORKERS_PER_ENGINE = 64  # an engine's tensor-parallel ranks
MAX_RANKS_PER_NODE = 64  # summed over a node's engines
MAX_GPUS_PER_ENGINE = 64  # EngineInfo.gpus entries
# An actor incarnation is a token (ActorLink: hex). Without '-' a group id
# f"{node}-{incarnation}-g{index}" names exactly one (node, incarnation):
# a free-form incarnation "x-y" would make node "n" collide with node "n-x".
INCARNATION = re.compile(r"[0-9A-Za-z]{1,64}")
# The scheduler's group ids (rlnode.actor.scheduler: f"{prefix}g{index:07d}",
# prefix f"{node}-{incarnation}-"): the trainer accepts one only from the
# incarnation it names, so no peer can deliver (and so void) another's ids.
SCHEDULER_GROUP_ID = re.compile(r"^(.+)-([0-9A-Za-z]{1,64})-g(\d+)$")


def register_problem(msg: Register) -> str:
    """What in an actor's Register breaks the trainer's rules ("" = none)."""
    if "/" in msg.node_id:
        return f"node_id {msg.node_id[:80]!r} contains '/'"
    if not INCARNATION.fullmatch(msg.incarnation):
        return f"incarnation {msg.incarnation[:80]!r} is not 1-64 letters and digits"
    engines = msg.engines
    if len(engines) > MAX_ENGINES_PER_NODE:
        return f"{len(engines)} engines > {MAX_ENGINES_PER_NODE}"
    if len({e.engine_id for e in engines}) != len(engines) or any(e.engine_id < 0 for e in engines):
        return "engine ids must be distinct and >= 0"
    if any(not 1 <= e.num_workers <= MAX_WORKERS_PER_ENGINE for e in engines):
        return f"an engine's num_workers outside 1..{MAX_WORKERS_PER_ENGINE}"
    if (ranks := sum(e.num_workers for e in engines)) > MAX_RANKS_PER_NODE:
        return f"{ranks} worker ranks > {MAX_RANKS_PER_NODE}"
    if any(len(e.gpus) > MAX_GPUS_PER_ENGINE for e in engines):
        return f"an engine lists more than {MAX_GPUS_PER_ENGINE} GPUs"
    return ""


def foreign_group_id(group_id: str, node_id: str, incarnation: str) -> bool:
    """A scheduler-shaped id that names another node or incarnation."""
    m = SCHEDULER_GROUP_ID.match(group_id)
    return m is not None and (m.group(1), m.group(2)) != (node_id, incarnation)


class PeerInfo(msgspec.Struct):
    """One actor link as the trainer sees it (``peers()`` returns copies)."""

    peer_id: str  # "node_id/incarnation", the actor's ZeroMQ identity
    node_id: str
    incarnation: str
    engines: list[EngineInfo]
    last_seen: float  # wall clock (time.time()) of its last valid frame
    version: int  # policy version its engines hold (from its heartbeats)
    connected: bool  # registered and heard from within peer_timeout_s
    stats: dict[str, float] = {}  # its last heartbeat's stats
    groups: int = 0  # groups accepted from it
    user_id: str = ""  # name of the authorized key it authenticated with (= node_id); "" without curve


class PeerEvent(msgspec.Struct):
    kind: Literal["joined", "left"]
    peer_id: str
    node_id: str
    incarnation: str
    reason: str = ""  # left: "timeout" | "replaced" (same node, new incarnation) | "closed" | "revoked"


class TrainerLinkCounters(msgspec.Struct):
    frames_in: int = 0
    malformed_frames: int = 0  # undecodable, wrong frame count or oversize
    unexpected_frames: int = 0  # valid, but not in this peer's state (answered with Reject)
    registrations: int = 0
    groups_accepted: int = 0
    samples_accepted: int = 0
    duplicates: int = 0  # group ids already buffered or consumed: dropped, still acked
    id_collisions: int = 0  # duplicates from a node other than the first sender (group ids not unique!)
    invalid_groups: int = 0  # well-formed deliveries with inconsistent content: rejected
    busy_rejects: int = 0  # deliveries refused while max_buffered_groups were buffered
    acks_sent: int = 0
    eval_reports: int = 0
    commits_sent: int = 0  # group ids committed to their actor
    send_failures: int = 0  # messages ZeroMQ did not take (peer queue at HWM, peer gone)
    auth_denied: int = 0  # CURVE handshakes with a key not in authorized/ (ZAP denials)
    identity_mismatch: int = 0  # frames claiming a node id other than their key's name: rejected
    revoked: int = 0  # connected peers dropped because their key left authorized/
    peers_joined: int = 0
    peers_left: int = 0
    malformed_by_reason: dict[str, int] = {}
    invalid_by_reason: dict[str, int] = {}  # rlnode.link.validate reason names, "node_id" and "group_id"
    registers_refused: int = 0  # Registers that break register_problem's rules (answered with Reject)
    handler_errors: int = 0  # a message handler raised (a trainer bug): contained, counted, logged
