"""The trainer's ZAP handler for CurveZMQ: which actor key may connect,
and under which node id (``rlnode.link.curve`` reads the keys)."""

from __future__ import annotations

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from rlnode.link import curve
from rlnode.link.peers import TrainerLinkCounters
from rlnode.log import get_logger, log_throttled

log = get_logger("rlnode.link.trainer")


def user_id(frame: zmq.Frame) -> str:
    """The node id (authorized key name) the ZAP handler bound this
    connection to; "" without CURVE."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, AttributeError):
        return ""


class NodeAuthenticator(AsyncioAuthenticator):
    """ZAP handler: accepts a CURVE key iff ``authorized/NAME.key`` holds it
    at handshake time (the folder is read for every handshake) and gives the
    connection User-Id NAME, which every frame from it then carries."""

    def __init__(self, ctx: zmq.asyncio.Context, keyring: curve.KeyRing, counters: TrainerLinkCounters):
        super().__init__(ctx, log=ZapLog(counters))
        self.keyring = keyring
        self._names: dict[bytes, str] = {}
        self.configure_curve_callback("*", self)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        self._names = self.keyring.names()
        return z85_key in self._names

    def curve_user_id(self, client_public_key: bytes) -> str:
        # Called right after callback() accepted this key, same handshake.
        return self._names[z85.encode(client_public_key)]


class ZapLog:
    """pyzmq's authenticator reports through a stdlib-style logger; count
    its denials and turn them into structured events (rate-limited: a
    rejected actor retries every second or so)."""

    def __init__(self, counters: TrainerLinkCounters):
        self.counters = counters

    def debug(self, msg: str, *args) -> None:
        # Every ZAP answer passes through "ZAP reply code=%s text=%s".
        if msg.startswith("ZAP reply") and args and args[0] != b"200":
            n = self.counters.auth_denied = self.counters.auth_denied + 1
            reason = args[1].decode("utf-8", "replace") if len(args) > 1 else ""
            log_throttled(log.warning, "link.trainer.auth_denied", n, every=100, reason=reason)

    def error(self, msg: str, *args) -> None:
        log.error("link.trainer.zap_error", detail=(msg % args)[:200])
