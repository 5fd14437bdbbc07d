"""The actor <-> trainer link: ZeroMQ ROUTER (trainer) / DEALER (actors),
msgspec messages from ``rlnode.wire``, acknowledged group delivery,
heartbeats, optional CurveZMQ authentication.

    trainer_link.TrainerLink   the trainer's end: peer table, dedup, acks, commits
    actor_link.ActorLink       an actor's end: outbox kept until commit, resends
    curve                      key files (``rlnode keygen DIR``) and socket options

This module holds only the plumbing both ends share (errors, the
non-blocking send, frame-size limits); it imports the two ends last so they
can import it back while it is being initialised.
"""

from __future__ import annotations

import zmq

# Largest message a link accepts or sends (bytes). A group of 8 episodes x
# 10 turns x 8k tokens is ~6 MB; 64 MiB leaves room without letting one
# frame exhaust memory. Missing from LinkConfig: a constructor argument.
DEFAULT_MAX_FRAME_BYTES = 64 << 20


class LinkError(RuntimeError):
    """The link stopped working (its socket task died). Travels through the
    link's output queue and is re-raised where the queue is read."""


class LinkFatalError(LinkError):
    """The peer refuses us for good (protocol version, identity): retrying
    cannot help; the daemon should exit and be fixed."""


class PeerGone(LinkError):
    """A request's peer is not (or no longer) connected."""


def send_nowait(sock, frames: list) -> str | None:
    """Send without ever waiting: None when ZeroMQ took the message, else a
    short reason ("hwm": the peer's queue is full or not connected yet;
    "unreachable": ROUTER has no such peer; otherwise the errno name).

    With DONTWAIT, pyzmq's asyncio socket resolves the future immediately,
    and going through it (not a shadow socket) keeps its edge-triggered
    read wake-ups correct."""
    fut = sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
    if not fut.done():  # only if a blocking send were pending, which we never start
        fut.cancel()
        return "busy"
    try:
        fut.result()
    except zmq.Again:
        return "hwm"
    except zmq.ZMQError as e:
        return "unreachable" if e.errno == zmq.EHOSTUNREACH else zmq.strerror(e.errno)
    return None


from rlnode.link.actor_link import ActorLink, ActorLinkCounters  # noqa: E402
from rlnode.link.curve import keygen  # noqa: E402
from rlnode.link.trainer_link import PeerEvent, PeerInfo, TrainerLink, TrainerLinkCounters  # noqa: E402

__all__ = [
    "ActorLink", "ActorLinkCounters", "DEFAULT_MAX_FRAME_BYTES", "LinkError", "LinkFatalError", "PeerEvent",
    "PeerGone", "PeerInfo", "TrainerLink", "TrainerLinkCounters", "keygen", "send_nowait",
]
