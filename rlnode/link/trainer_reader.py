"""The socket reader of ``TrainerLink`` (a part of it: ``trainer_link``
says how the parts fit): one task reads the ROUTER, checks each frame
(frame count, size, the CURVE key's node, a typed decode) and dispatches
it by message type to the other parts' handlers. Owns the containment of
what a peer may send: a malformed frame, an impostor, a message out of
turn, a handler that raises. Each is counted, answered with a ``Reject``
and logged without flooding the log. Must not decide anything about a
group, a peer or a credit itself: the handlers do.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import msgspec
import zmq

from rlnode.link.base import LinkError
from rlnode.link.zap import user_id
from rlnode.log import get_logger, log_throttled
from rlnode.wire import (
    REJECT_IDENTITY, REJECT_MALFORMED, REJECT_REGISTER_FIRST, Commit, CommitQuery, ControlReply,
    CreditReport, EvalReport, GroupDelivery, Heartbeat, Register, Reject,
)

log = get_logger("rlnode.link.trainer")


class FrameReader:
    """``TrainerLink``'s reader task and frame dispatch (state: the link's)."""

    async def _read_loop(self) -> None:
        try:
            for n in itertools.count(1):
                frames = await self._sock.recv_multipart(copy=False)
                try:
                    self._on_frames(frames)
                except Exception as e:  # a bug in a handler: contained, so no peer can kill the reader
                    self._handler_failed(frames, e)
                if n % 64 == 0:
                    # A recv with a backlog completes without yielding: a peer's
                    # flood must not starve the train loop and heartbeats.
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a dead context: the consumer must hear of it
            log.exception("link.trainer.reader_failed")
            self.deliveries.put_nowait(LinkError(f"trainer link reader failed: {e!r}"))
            raise

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.counters.frames_in += 1
        peer_id = frames[0].bytes.decode("utf-8", "replace")
        if len(frames) != 2:
            return self._malformed(peer_id, "frame_count", f"{len(frames) - 1} frames, expected 1")
        body = frames[1]
        if self._keyring is not None and (key := user_id(body)) != peer_id.split("/", 1)[0]:
            return self._impostor(peer_id, key)
        if len(body) > self.max_frame_bytes:
            return self._malformed(peer_id, "oversize", f"{len(body)} bytes > {self.max_frame_bytes}")
        try:
            msg = self._decoder.decode(body.buffer)
        except msgspec.DecodeError as e:  # ValidationError included: wrong types, unknown tag
            return self._malformed(peer_id, "decode", str(e))
        except Exception as e:  # msgspec raises others too (invalid UTF-8 in a str: UnicodeDecodeError)
            return self._malformed(peer_id, "decode", f"{type(e).__name__}: {e}")
        peer = self._peers.get(peer_id)
        if isinstance(msg, Register):
            return self._on_register(peer_id, msg, user_id(body))
        if peer is None or not peer.connected:
            return self._unexpected(peer_id, REJECT_REGISTER_FIRST, type(msg).__name__,
                                    [msg.group_id] if isinstance(msg, GroupDelivery) else [])
        self._seen[peer_id] = time.monotonic()
        peer.last_seen = time.time()
        match msg:
            case GroupDelivery():
                self._on_group(peer, msg)
            case Heartbeat(version=version, stats=stats):
                peer.version, peer.stats = version, stats
            case CommitQuery(group_ids=ids):
                self._on_commit_query(peer, ids)
            case ControlReply():
                self._on_reply(peer, msg)
            case EvalReport():
                self.counters.eval_reports += 1
                self.evals.put_nowait((peer_id, msg))
            case CreditReport():
                if self.credits.on_report(peer_id, msg):
                    self._settle(peer, msg)
                    self._grant()

    def _malformed(self, peer_id: str, reason: str, detail: str) -> None:
        c = self.counters
        c.malformed_frames += 1
        c.malformed_by_reason[reason] = c.malformed_by_reason.get(reason, 0) + 1
        log_throttled(log.warning, "link.trainer.malformed_frame", c.malformed_frames, peer=peer_id, reason=reason,
                      detail=detail[:200])
        self._send(peer_id, Reject(REJECT_MALFORMED, f"{reason}: {detail[:200]}"))

    def _impostor(self, peer_id: str, key: str) -> None:
        """A frame whose routing id claims a node other than the one its
        CURVE key is bound to: nothing in it is read."""
        c = self.counters
        c.identity_mismatch += 1
        log_throttled(log.warning, "link.trainer.identity_mismatch", c.identity_mismatch, peer=peer_id, key=key)
        self._send(peer_id, Reject(REJECT_IDENTITY, f"key {key!r} may only speak for node id {key!r}"))

    def _unexpected(self, peer_id: str, reason: str, detail: str, group_ids: list[str] = ()) -> None:
        self.counters.unexpected_frames += 1
        log.info("link.trainer.rejected", peer=peer_id, reason=reason, detail=detail)
        self._send(peer_id, Reject(reason, detail, list(group_ids)))

    def _handler_failed(self, frames: list[zmq.Frame], e: Exception) -> None:
        """A handler raised: a trainer bug, but one a peer may trigger at
        will, so it must not kill the reader. Counted and logged; a group
        that triggers it is rejected for good (a resend would hit it again)."""
        c = self.counters
        c.handler_errors += 1
        log_throttled(log.error, "link.trainer.handler_failed", c.handler_errors, error=repr(e)[:300], exc_info=e)
        try:
            peer_id = frames[0].bytes.decode("utf-8", "replace")
            msg = self._decoder.decode(frames[1].buffer)
            gid = msg.group_id if isinstance(msg, GroupDelivery) else ""
            if gid and gid in self._consumed:  # its resend: commit it, so the actor stops sending it
                self._send(peer_id, Commit([gid]))
            elif gid and gid not in self._buffered:
                # Refused for good, and the actor forgets it: its credit is spent.
                self.credits.on_delivered(peer_id, msg.credit_session, gid, accepted=False)
                self._invalid(peer_id, gid, "handler_error", repr(e))
            else:
                self._send(peer_id, Reject(REJECT_MALFORMED, f"handler_error: {e!r}"[:200]))
        except Exception:  # the frame that broke a handler may break this too: counted above
            pass
