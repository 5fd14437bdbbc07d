"""Length-prefixed msgpack frames over a stream socket: how rlnode's local
channels between processes carry msgspec messages (the gateway host's,
``rlnode/actor/gateway/protocol.py``; a function agent's worker's,
``rlnode/cubes/wall/agent_workers.py``).

Frame: ``u32 big-endian length | msgpack body``. Never pickle: the peer may
be a process that runs the policy's output (an agent's worker), and
decoding its bytes must not run its code.

``FrameProtocol`` is one end, an ``asyncio.Protocol``: reading never blocks
(half a frame waits for its rest), a frame over ``max_frame_bytes`` or one
that does not decode into the expected type is a broken or hostile peer:
the transport is aborted and ``on_lost`` says why, once.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Callable

import msgspec

LEN = struct.Struct(">I")


class FrameProtocol(asyncio.Protocol):
    """One end of a framed channel. ``on_decoded`` gets each frame's body
    decoded as ``decode_type``, in order, on the loop; ``on_lost`` the
    reason once, when the peer is gone (EOF, error) or broke the framing.
    ``name`` words the reason ("<name> closed")."""

    def __init__(self, decode_type: Any, on_decoded: Callable[[Any], None], on_lost: Callable[[str], None],
                 max_frame_bytes: int, name: str = "channel"):
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self.on_decoded, self.on_lost = on_decoded, on_lost
        self.max_frame_bytes, self.name = max_frame_bytes, name
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._lost = False
        self.frames_in = self.frames_out = 0

    @property
    def lost(self) -> bool:
        return self._lost

    def connection_made(self, transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self._buf:  # the rest of a frame that began in an earlier read
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        view, pos, end = memoryview(data), 0, len(data)
        while end - pos >= 4:
            (n,) = LEN.unpack_from(data, pos)
            if n > self.max_frame_bytes:
                self._fail(f"frame of {n} bytes (at most {self.max_frame_bytes})")
                return
            if end - pos - 4 < n:
                break
            try:
                decoded = self._decoder.decode(view[pos + 4:pos + 4 + n])
            except msgspec.DecodeError as e:  # ValidationError included
                self._fail(f"undecodable frame: {e}")
                return
            pos += 4 + n
            self.frames_in += 1
            self.on_decoded(decoded)
            if self._lost:
                return
        if pos < end:
            self._buf += view[pos:]

    def connection_lost(self, exc) -> None:
        if not self._lost:
            self._lost = True
            self.on_lost(f"{self.name} closed ({exc!r})" if exc else f"{self.name} closed")

    def write_frame(self, body: bytes) -> None:
        """One frame out (dropped once the channel is lost or closing)."""
        if self._lost or self._transport is None or self._transport.is_closing():
            return
        self._transport.write(LEN.pack(len(body)) + body)
        self.frames_out += 1

    def _fail(self, why: str) -> None:
        if self._transport is not None:
            self._transport.abort()
        if not self._lost:
            self._lost = True
            self.on_lost(why)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
