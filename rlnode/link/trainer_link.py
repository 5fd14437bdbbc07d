"""TrainerLink: the trainer's end of the actor <-> trainer link.

Owns the ROUTER socket, the ZAP authenticator (when ``curve_dir`` is set:
each authorized key is bound to one node id, ``rlnode.link.curve``), the
refusal of an unauthenticated non-loopback bind, the peer table, the ids of groups this trainer holds or has consumed, and
the link counters. Must not touch the training buffer, the optimizer or
checkpoints: accepted groups leave through ``deliveries``, and the daemon
reports back with ``mark_consumed`` and persists ``consumed_state()``.

One object, its rooms in files of their own. This file holds its state,
its lifecycle (bind, close) and the one way out (``_send``). The rest are
the class's mixins, split by concern, with no state or use of their own:
every attribute they read is made in ``TrainerLink.__init__``.

    trainer_reader.FrameReader     the reader task: frame checks, decode, dispatch, containment
    trainer_peers.PeerTable        registration, heartbeats, timeouts, revoked keys
    trainer_groups.GroupIntake     group delivery: checks, acks, duplicates, commits, consumed ids
    trainer_credits.CreditFlow     credit grants, holds and releases; the no-group alarm
    trainer_control.ControlChannel version updates and control requests (weight commands)
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time

import msgspec
import zmq
import zmq.asyncio

from rlnode.config import LinkConfig
from rlnode.link import curve
from rlnode.link.base import LinkError, PeerGone, send_nowait
from rlnode.link.consumed import ConsumedIds
from rlnode.link.credits import CreditLedger
from rlnode.link.peers import PeerEvent, PeerInfo, TrainerLinkCounters
from rlnode.link.trainer_control import ControlChannel
from rlnode.link.trainer_credits import CreditFlow
from rlnode.link.trainer_groups import GroupIntake
from rlnode.link.trainer_peers import PeerTable
from rlnode.link.trainer_reader import FrameReader
from rlnode.link.validate import GroupLimits
from rlnode.link.zap import NodeAuthenticator
from rlnode.log import get_logger
from rlnode.wire import EvalReport, GroupDelivery, ToActor, ToTrainer

log = get_logger("rlnode.link.trainer")


class TrainerLink(FrameReader, PeerTable, GroupIntake, CreditFlow, ControlChannel):
    """The trainer's ROUTER. One per trainer process; actors connect to it.

    Guarantees:
    * A group reaches ``deliveries`` at most once per group id, across
      trainer restarts too as long as the daemon persists ``consumed_state()``
      and restores them with ``load_consumed`` (ids still only buffered at a
      crash are resent by their actor, which keeps them until ``Commit``).
    * Every delivery is answered: ``Ack`` once it is in ``deliveries`` (or
      was already buffered/consumed: counted as duplicate, still acked so the
      actor stops resending), ``Reject`` otherwise. ``mark_consumed`` sends
      ``Commit`` to the sender; a lost Commit is repaired by the actor's
      ``CommitQuery``.
    * Nothing is dropped silently: malformed frames, unexpected messages,
      duplicates, invalid or refused groups and failed sends are counted.
    * The trainer never waits on an actor. Inbound, each actor has a queue of
      ``rcvhwm`` messages; when it is full ZeroMQ stops reading that actor's
      TCP connection and the actor's own sends fail and are retried. Outbound,
      a send to an actor whose queue (``sndhwm``) is full, or that is gone,
      fails at once (ROUTER_MANDATORY + DONTWAIT): the message is dropped and
      counted in ``send_failures``. Each trainer->actor message heals: a lost
      Ack causes a resend (acked again as a duplicate), a lost Commit a
      CommitQuery, a lost VersionUpdate the next Heartbeat; ``request()``
      raises instead.
    * Liveness: heartbeats every ``heartbeat_s`` to each connected peer; a
      peer silent for ``peer_timeout_s`` is marked gone (``PeerEvent`` "left")
      and must register again before it may deliver.
    * Flow control: the link owns the trainer's ``CreditLedger``
      (``rlnode.link.credits`` states the protocol). Actors start a group
      only with a credit; at most ``credit_budget`` groups are outstanding
      (granted and not delivered or returned, or delivered and not yet
      ``release``d by the daemon). Grants go out when credits free up and
      are repeated with every heartbeat.

    Usage: ``await start()``; read ``deliveries`` (``(peer_id, GroupDelivery)``),
    ``events`` (``PeerEvent``) and ``evals`` (``(peer_id, EvalReport)``), or
    ``next_delivery()`` which re-raises a ``LinkError`` if a link task died;
    ``await close()``.
    """


    def __init__(self, bind: str, link: LinkConfig | None = None, *, version: int = 0,
                 incarnation: str | None = None, max_frame_bytes: int | None = None,
                 max_buffered_groups: int = 0, sndhwm: int = 1024, rcvhwm: int = 256,
                 credit_budget: int | None = None, limits: GroupLimits | None = None):
        self.bind = bind
        self.link = link or LinkConfig()
        self.incarnation = incarnation or secrets.token_hex(8)
        self.version = version
        # None = link.max_frame_bytes (the config checks that a group fits).
        self.max_frame_bytes = max_frame_bytes or self.link.max_frame_bytes
        self.max_buffered_groups = max_buffered_groups  # 0 = unbounded
        # What a delivered group may contain (rlnode.link.validate); None =
        # only the checks that need no model or config (bare links in tests).
        self.limits = limits
        self._hwm = (sndhwm, rcvhwm)
        self.endpoint = ""  # the bound address (resolved port), set by start()
        self.counters = TrainerLinkCounters()
        # None = no global limit (bare links in tools and tests); the trainer
        # daemon passes (max_lag + 1) * groups_per_step.
        # A timed-out actor's credits count for one more peer timeout before
        # they return: a slow actor that comes back cannot overshoot the budget.
        self.credits = CreditLedger(self.incarnation, credit_budget, reclaim_s=self.link.peer_timeout_s)
        self.deliveries: asyncio.Queue[tuple[str, GroupDelivery] | LinkError] = asyncio.Queue()
        self.events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        self.evals: asyncio.Queue[tuple[str, EvalReport]] = asyncio.Queue()
        self._peers: dict[str, PeerInfo] = {}
        self._seen: dict[str, float] = {}  # peer_id -> monotonic time of its last valid frame
        self._buffered: dict[str, str] = {}  # accepted, not yet consumed: group id -> peer_id
        self._consumed = ConsumedIds()  # compacted per actor incarnation
        self._requests: dict[int, tuple[str, asyncio.Future]] = {}
        self._request_ids = itertools.count(1)
        self._decoder = msgspec.msgpack.Decoder(ToTrainer)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._auth: NodeAuthenticator | None = None
        self._keyring: curve.KeyRing | None = None
        self._authorized: set[str] = set()  # node ids with a key in authorized/ at the last scan
        # Listening beyond loopback without authentication (link.insecure).
        self.insecure = False
        self._tasks: list[asyncio.Task] = []
        # The no-group alarm (link.no_group_alarm_s): monotonic time of the
        # last accepted group, or of the last tick with no actor connected.
        self.last_group_at = time.monotonic()
        self._alarmed = False
        self._stopping = False  # stop_taking_groups() was called

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Bind. Raises ``curve.InsecureBindError`` for a non-loopback bind
        without CurveZMQ unless ``link.insecure``, ``curve.CurveError`` for
        missing or unreadable keys."""
        self.insecure = curve.check_bind(_bind_host(self.bind), self.link.curve_dir, self.link.insecure)
        # A private context: the ZAP authenticator is per context, and tests
        # (or `--role all`) may run several links in one process.
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            if self.link.curve_dir:
                self._keyring = curve.KeyRing(self.link.curve_dir)
                self._authorized = set(self._keyring.names().values())
                self._auth = NodeAuthenticator(self._ctx, self._keyring, self.counters)
                self._auth.start()
                curve.apply_server(sock, self.link.curve_dir)
                # No handover with keys: a routing id (node/incarnation) stays
                # with the connection that holds it, so another node's key
                # cannot take a live node's pipe (and its replies) by claiming
                # its id. ZMTP heartbeats reap a dead actor's pipe instead, so
                # its reconnect gets the id back within peer_timeout_s.
                sock.heartbeat_ivl = int(self.link.heartbeat_s * 1000)
                sock.heartbeat_timeout = int(self.link.peer_timeout_s * 1000)
            else:
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an actor's reconnect takes over its half-dead pipe
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer / full queue -> error, not silent drop
            sock.sndhwm, sock.rcvhwm = self._hwm
            sock.linger = 0  # unsent acks are not worth waiting for: actors resend
            # Hard cap: bigger frames make ZeroMQ drop the connection before
            # we see them; frames between the two limits are counted below.
            sock.maxmsgsize = 2 * self.max_frame_bytes
            sock.bind(self.bind)
        except BaseException:
            sock.close(linger=0)
            self._stop_context()
            raise
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._read_loop(), name="trainer-link-read"),
                       asyncio.create_task(self._tick_loop(), name="trainer-link-tick")]
        log.info("link.trainer.started", endpoint=self.endpoint, incarnation=self.incarnation,
                 curve=bool(self.link.curve_dir), version=self.version)
        if self.insecure:
            log.warning("link.trainer.INSECURE", endpoint=self.endpoint,
                        detail="link.insecure = true: actors connect without CurveZMQ on a non-loopback bind; "
                               "anyone who reaches this port can register, deliver groups and join weight pushes "
                               "(set link.curve_dir, made by `rlnode keygen`)")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for _, fut in self._requests.values():
            if not fut.done():
                fut.set_exception(PeerGone("trainer link closed"))
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._stop_context()
        log.info("link.trainer.stopped", incarnation=self.incarnation, **self._summary())

    def security(self) -> dict:
        """How this link authenticates actors (for /status)."""
        return {"curve": bool(self.link.curve_dir), "insecure": self.insecure,
                "authorized_nodes": sorted(self._authorized)}

    def _stop_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._keyring = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> TrainerLink:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- sending ---------------------------------------------------------

    def _send(self, peer_id: str, msg: ToActor) -> bool:
        if self._sock is None:
            return False
        err = send_nowait(self._sock, [peer_id.encode(), self._encoder.encode(msg)])
        if err is not None:
            self.counters.send_failures += 1
            log.debug("link.trainer.send_failed", peer=peer_id, msg=type(msg).__name__, error=err)
            return False
        return True

    def _summary(self) -> dict:
        c = self.counters
        return {"groups": c.groups_accepted, "duplicates": c.duplicates, "malformed": c.malformed_frames,
                "unexpected": c.unexpected_frames, "send_failures": c.send_failures}


def _bind_host(endpoint: str) -> str:
    """"tcp://HOST:PORT" -> HOST ("[::1]" -> "::1"); other transports
    (ipc, inproc) never leave the machine: reported as loopback."""
    if not endpoint.startswith("tcp://"):
        return "127.0.0.1"
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
