"""Control requests of ``TrainerLink`` (a part of it: ``trainer_link`` says
how the parts fit): what the trainer tells its actors outside group
delivery. ``set_version`` announces a new policy version (lost: healed by
the next heartbeat); ``request`` sends one weight command
(``weights.protocol``) and waits for its ``ControlReply``, failing with
``PeerGone`` when the peer leaves, the link closes or the send fails.
Must not know what a command means: the weight pusher does.
"""

from __future__ import annotations

import asyncio

from rlnode.link.base import PeerGone
from rlnode.link.peers import PeerInfo
from rlnode.log import get_logger
from rlnode.weights.protocol import WeightCommand
from rlnode.wire import ControlReply, ControlRequest, VersionUpdate

log = get_logger("rlnode.link.trainer")


class ControlChannel:
    """``TrainerLink``'s version updates and control requests (state: the
    link's)."""

    def set_version(self, version: int) -> None:
        """The policy version moved: tell every connected actor."""
        self.version = version
        for p in self._connected():
            self._send(p.peer_id, VersionUpdate(version))

    async def request(self, peer_id: str, command: WeightCommand, timeout_s: float = 30.0) -> ControlReply:
        """Send a ``ControlRequest`` and wait for its ``ControlReply``.
        Raises PeerGone (peer unknown, gone, or its queue full) or TimeoutError."""
        p = self._peers.get(peer_id)
        if p is None or not p.connected:
            raise PeerGone(f"peer {peer_id!r} is not connected")
        rid = next(self._request_ids)
        fut = asyncio.get_running_loop().create_future()
        self._requests[rid] = (peer_id, fut)
        try:
            if not self._send(peer_id, ControlRequest(rid, command)):
                raise PeerGone(f"cannot send to peer {peer_id!r}")
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._requests.pop(rid, None)

    def _on_reply(self, peer: PeerInfo, r: ControlReply) -> None:
        pending = self._requests.get(r.request_id)
        if pending is None or pending[0] != peer.peer_id:
            # Late (timed out) or foreign reply: counted, not an error worth a Reject.
            self.counters.unexpected_frames += 1
            log.info("link.trainer.stray_reply", peer=peer.peer_id, request=r.request_id)
            return
        if not pending[1].done():
            pending[1].set_result(r)
