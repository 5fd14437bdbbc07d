"""What both ends of the link share: errors, the non-blocking send and the
frame-size default. Below both ends (they import it; it imports neither)."""

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
