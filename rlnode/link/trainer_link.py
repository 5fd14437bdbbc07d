"""TrainerLink: the trainer's end of the actor <-> trainer link.

Owns the ROUTER socket, the ZAP authenticator (when ``curve_dir`` is set:
each authorized key is bound to one node id, ``rlnode.link.curve``), the
refusal of an unauthenticated non-loopback bind, the peer table, the ids of groups this trainer holds or has consumed, and
the link counters. Must not touch the training buffer, the optimizer or
checkpoints: accepted groups leave through ``deliveries``, and the daemon
reports back with ``mark_consumed`` and persists ``consumed_state()``.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import secrets
import time
from typing import Iterable

import msgspec
import zmq
import zmq.asyncio

from rlnode.config import LinkConfig
from rlnode.link import curve
from rlnode.link.base import LinkError, PeerGone, send_nowait
from rlnode.link.peers import PeerEvent, PeerInfo, TrainerLinkCounters, foreign_group_id, register_problem
from rlnode.link.validate import GroupLimits, validate_group
from rlnode.link.zap import NodeAuthenticator, user_id
from rlnode.log import get_logger
from rlnode.weights.protocol import WeightCommand
from rlnode.wire import (
    PROTOCOL_VERSION, REJECT_BUSY, REJECT_IDENTITY, REJECT_INVALID_GROUP, REJECT_MALFORMED,
    REJECT_PROTOCOL, REJECT_REGISTER_FIRST, REJECT_UNKNOWN_GROUP, Ack, Commit, CommitQuery,
    ControlReply, ControlRequest, CreditGrant, CreditReport, EvalReport, GroupDelivery,
    Heartbeat, Register, Reject, ToActor, ToTrainer, VersionUpdate, Welcome,
)
from rlnode.link.consumed import ConsumedIds
from rlnode.link.credits import CreditLedger

log = get_logger("rlnode.link.trainer")

class TrainerLink:
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

    # ---- public API for the trainer daemon --------------------------------

    async def next_delivery(self) -> tuple[str, GroupDelivery]:
        item = await self.deliveries.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def peers(self) -> dict[str, PeerInfo]:
        return {pid: copy.copy(p) for pid, p in self._peers.items()}

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

    def hold_credits(self, group_ids: Iterable[str]) -> None:
        """Groups the trainer holds that did not arrive through this link
        (restored from a checkpoint): they count against the credit budget
        until released."""
        self.credits.hold(group_ids)

    def release_credits(self, group_ids: Iterable[str]) -> None:
        """These groups left the trainer's buffer for good (a step consumed
        them and its weights are out, or they were dropped): their credits
        are free again and go to the actors that want them."""
        self.credits.release(group_ids)
        self._grant()

    def starved(self) -> str:
        """'' unless actors are connected and none delivered a group for
        link.no_group_alarm_s (leaked credits, every group lost, a stuck
        actor): the trainer's /healthz should report it."""
        limit = self.link.no_group_alarm_s
        idle = time.monotonic() - self.last_group_at
        if not limit or idle < limit or not self._connected():
            return ""
        return (f"no group accepted for {idle:.0f} s (link.no_group_alarm_s = {limit:g}) from "
                f"{len(self._connected())} connected actors; credits: {self.credits.outstanding()} outstanding "
                f"of {self.credits.budget}, {len(self.credits.waiting)} waiting")

    def _watch_groups(self, now: float) -> None:
        if not self._connected():
            self.last_group_at = now  # the clock starts when an actor is there to deliver
        why = self.starved()
        if why and not self._alarmed:
            log.error("link.trainer.no_group_alarm", detail=why)
        elif self._alarmed and not why:
            log.info("link.trainer.no_group_alarm_cleared", groups=self.counters.groups_accepted)
        self._alarmed = bool(why)

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

    # ---- socket reader ---------------------------------------------------

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
        # A flood of garbage must not become a flood of log lines.
        if c.malformed_frames <= 10 or c.malformed_frames % 1000 == 0:
            log.warning("link.trainer.malformed_frame", peer=peer_id, reason=reason, detail=detail[:200],
                        total=c.malformed_frames)
        self._send(peer_id, Reject(REJECT_MALFORMED, f"{reason}: {detail[:200]}"))

    def _impostor(self, peer_id: str, key: str) -> None:
        """A frame whose routing id claims a node other than the one its
        CURVE key is bound to: nothing in it is read."""
        c = self.counters
        c.identity_mismatch += 1
        if c.identity_mismatch <= 10 or c.identity_mismatch % 1000 == 0:
            log.warning("link.trainer.identity_mismatch", peer=peer_id, key=key, total=c.identity_mismatch)
        self._send(peer_id, Reject(REJECT_IDENTITY, f"key {key!r} may only speak for node id {key!r}"))

    def _unexpected(self, peer_id: str, reason: str, detail: str, group_ids: list[str] = ()) -> None:
        self.counters.unexpected_frames += 1
        log.info("link.trainer.rejected", peer=peer_id, reason=reason, detail=detail)
        self._send(peer_id, Reject(reason, detail, list(group_ids)))

    # ---- message handlers --------------------------------------------------

    def _on_register(self, peer_id: str, msg: Register, key_name: str) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            return self._unexpected(peer_id, REJECT_PROTOCOL,
                                    f"actor speaks {msg.protocol_version}, trainer {PROTOCOL_VERSION}")
        if not msg.node_id or peer_id != f"{msg.node_id}/{msg.incarnation}":
            return self._unexpected(peer_id, REJECT_IDENTITY, f"socket identity {peer_id!r}")
        if problem := register_problem(msg):
            # Fatal for the actor (a config or a hostile peer: retrying cannot help).
            self.counters.registers_refused += 1
            return self._unexpected(peer_id, REJECT_PROTOCOL, f"register refused: {problem}")
        if self._keyring is not None and not self._still_authorized(msg.node_id):
            return self._unexpected(peer_id, REJECT_IDENTITY, f"key {msg.node_id!r} is no longer authorized")
        old = self._peers.get(peer_id)
        # A node's new incarnation (actor restart) replaces its older entries,
        # so the table stays one row per node.
        for other in [p for p in self._peers.values() if p.node_id == msg.node_id and p.peer_id != peer_id]:
            if other.connected:
                self._leave(other, "replaced")
            del self._peers[other.peer_id]
            self._seen.pop(other.peer_id, None)
            self.credits.forget(other.peer_id)  # its credits died with that process
        peer = PeerInfo(peer_id, msg.node_id, msg.incarnation, msg.engines, time.time(),
                        old.version if old else 0, True, old.stats if old else {},
                        old.groups if old else 0, key_name)
        self._peers[peer_id] = peer
        self._seen[peer_id] = time.monotonic()
        self.counters.registrations += 1
        self._send(peer_id, Welcome(self.incarnation, self.version))
        self.credits.peer_joined(peer_id)  # zero credits until it reports what it wants
        if old is None or not old.connected:
            self.counters.peers_joined += 1
            self.events.put_nowait(PeerEvent("joined", peer_id, msg.node_id, msg.incarnation))
            log.info("link.peer.joined", peer=peer_id, engines=[(e.engine_id, e.num_workers) for e in msg.engines],
                     key=key_name or None)

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
        if c.invalid_groups <= 10 or c.invalid_groups % 1000 == 0:
            log.warning("link.trainer.invalid_group", peer=peer_id, group=gid, reason=reason, detail=detail[:200],
                        total=c.invalid_groups)
        self._send(peer_id, Reject(REJECT_INVALID_GROUP, f"{reason}: {detail[:200]}", [gid]))

    def _handler_failed(self, frames: list[zmq.Frame], e: Exception) -> None:
        """A handler raised: a trainer bug, but one a peer may trigger at
        will, so it must not kill the reader. Counted and logged; a group
        that triggers it is rejected for good (a resend would hit it again)."""
        c = self.counters
        c.handler_errors += 1
        if c.handler_errors <= 10 or c.handler_errors % 1000 == 0:
            log.error("link.trainer.handler_failed", error=repr(e)[:300], total=c.handler_errors, exc_info=e)
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

    def _on_reply(self, peer: PeerInfo, r: ControlReply) -> None:
        pending = self._requests.get(r.request_id)
        if pending is None or pending[0] != peer.peer_id:
            # Late (timed out) or foreign reply: counted, not an error worth a Reject.
            self.counters.unexpected_frames += 1
            log.info("link.trainer.stray_reply", peer=peer.peer_id, request=r.request_id)
            return
        if not pending[1].done():
            pending[1].set_result(r)

    # ---- liveness ------------------------------------------------------------

    async def _tick_loop(self) -> None:
        try:
            await self._ticks()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("link.trainer.tick_failed")
            self.deliveries.put_nowait(LinkError(f"trainer link heartbeat task failed: {e!r}"))
            raise

    async def _ticks(self) -> None:
        hb = self.link.heartbeat_s
        last = time.monotonic()
        while True:
            await asyncio.sleep(hb)
            now = time.monotonic()
            if now - last > 2 * hb:
                # Our own loop stalled (a long synchronous step): frames from
                # live peers are still queued unread, so do not blame them.
                for pid, seen in self._seen.items():
                    self._seen[pid] = max(seen, now - hb)
            last = now
            for p in self._connected():
                if now - self._seen.get(p.peer_id, now) > self.link.peer_timeout_s:
                    self._leave(p, "timeout")
            self._drop_revoked()
            self._watch_groups(now)
            stats = {"buffered": float(len(self._buffered)), "consumed": float(len(self._consumed))}
            self._grant(force=True)
            for p in self._connected():
                self._send(p.peer_id, Heartbeat("trainer", self.version, stats))
                pc = self.credits.peers.get(p.peer_id)
                if pc is not None and pc.granted:  # heals a lost grant
                    self._send(p.peer_id, CreditGrant(self.incarnation, pc.granted))

    def _still_authorized(self, node_id: str) -> bool:
        if node_id not in self._authorized:  # added since the last scan?
            self._authorized = set(self._keyring.names().values())
        return node_id in self._authorized

    def _drop_revoked(self) -> None:
        """A key deleted from authorized/ ends its node's session now, not
        at its next reconnect: it must register again, which is refused."""
        if self._keyring is None:
            return
        self._authorized = set(self._keyring.names().values())
        for p in self._connected():
            if p.node_id not in self._authorized:
                self.counters.revoked += 1
                log.warning("link.peer.revoked", peer=p.peer_id)
                self._leave(p, "revoked")
                self._send(p.peer_id, Reject(REJECT_IDENTITY, f"key {p.node_id!r} was revoked"))

    def _connected(self) -> list[PeerInfo]:
        return [p for p in self._peers.values() if p.connected]

    def _leave(self, peer: PeerInfo, reason: str) -> None:
        peer.connected = False
        self.credits.peer_left(peer.peer_id)
        self.counters.peers_left += 1
        self.events.put_nowait(PeerEvent("left", peer.peer_id, peer.node_id, peer.incarnation, reason))
        log.info("link.peer.left", peer=peer.peer_id, reason=reason)
        for rid, (pid, fut) in list(self._requests.items()):
            if pid == peer.peer_id and not fut.done():
                fut.set_exception(PeerGone(f"peer {pid!r} left ({reason})"))

    # ---- sending ---------------------------------------------------------

    def _grant(self, force: bool = False) -> None:
        for pc in self.credits.grant(force):
            if pc.peer_id in self._peers and self._peers[pc.peer_id].connected:
                self._send(pc.peer_id, CreditGrant(self.incarnation, pc.granted))

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
