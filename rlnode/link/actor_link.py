"""ActorLink: one actor's end of the actor <-> trainer link.

Owns the DEALER socket, the outbox of submitted groups (encoded once, kept
until the trainer commits them), registration, heartbeats, resends and the
link counters. Must not touch engines, weights or the scheduler: requests
from the trainer (``Welcome``, ``VersionUpdate``, ``ControlRequest``) leave
through ``controls`` and the daemon answers with ``reply``.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import msgspec
import zmq
import zmq.asyncio

from rlnode.config import LinkConfig
from rlnode.link import curve
from rlnode.link.base import LinkError, LinkFatalError, send_nowait
from rlnode.log import get_logger
from rlnode import wire
from rlnode.wire import (
    PROTOCOL_VERSION, Ack, Commit, CommitQuery, ControlReply,
    ControlRequest, CreditGrant, EngineInfo, EvalReport, GroupDelivery, Heartbeat, Register, Reject, ToActor,
    VersionUpdate, Welcome,
)
from rlnode.link.credits import ActorCredits

log = get_logger("rlnode.link.actor")

ControlItem = Welcome | VersionUpdate | ControlRequest
MAX_PENDING_EVALS = 64


class ActorLinkCounters(msgspec.Struct):
    submitted: int = 0  # groups accepted by submit()
    sent: int = 0  # GroupDelivery frames handed to ZeroMQ, resends included
    resent: int = 0  # of those, repeats (ack timeout, Reject, trainer restart)
    acked: int = 0  # groups acked (once per trainer incarnation)
    committed: int = 0  # groups committed and forgotten
    unacked: int = 0  # held, not acked by the current trainer incarnation
    uncommitted: int = 0  # held (everything submitted and not committed)
    rejected: int = 0  # groups the trainer refused as invalid: dropped
    dropped_oversize: int = 0  # groups larger than max_frame_bytes: dropped at submit
    duplicate_submits: int = 0  # submit() of a group id already held: ignored
    send_blocked: int = 0  # sends deferred because the socket was at its HWM
    registrations: int = 0  # Welcomes acted on
    trainer_restarts: int = 0  # Welcomes from a new trainer incarnation
    disconnects: int = 0  # trainer silent for peer_timeout_s
    commit_queries: int = 0  # group ids asked about with CommitQuery
    evals_sent: int = 0
    evals_dropped: int = 0  # eval reports pushed out of the pending list while disconnected
    malformed_frames: int = 0
    unexpected_frames: int = 0


@dataclass(slots=True, eq=False)
class _Held:
    group_id: str
    payload: bytes  # the encoded GroupDelivery: resends cost no encoding
    acked: bool = False  # by the current trainer incarnation
    queued: bool = False  # waiting in the send queue
    sends: int = 0
    sent_at: float | None = None  # monotonic time of the last send to this incarnation
    acked_at: float = 0.0
    queried_at: float = 0.0


class ActorLink:
    """An actor's DEALER (identity ``node_id/incarnation``) to the trainer.

    Guarantees:
    * ``submit`` never blocks. Every submitted group is kept until the trainer
      ``Commit``s it (durably consumed), across disconnects and trainer
      restarts; it is lost only if this process dies (groups live in memory).
    * ``Ack`` = in this trainer incarnation's buffer: no more resends to it.
      Unacked groups are resent after ``ack_timeout_s`` (lost frames), after a
      ``Reject("register first")`` + re-registration, and every uncommitted
      group is resent when a Welcome shows a new trainer incarnation (the
      trainer drops the ones it already consumed as duplicates). Acked groups
      still uncommitted after ``commit_query_s`` are asked about
      (``CommitQuery``), which repairs a lost Commit without resending data.
    * Order of delivery follows submit order, except for resends.
    * Nothing is dropped silently: oversize groups, groups the trainer
      rejects as invalid, malformed frames from the trainer are counted.
    * At the high-water mark (``sndhwm`` messages queued in ZeroMQ, or no
      connection: IMMEDIATE is set) sends are deferred, not dropped: the
      group stays queued and goes out when the socket drains. Memory is
      bounded by what the scheduler admits, not by the link: watch
      ``counters().uncommitted``.
    * Liveness: a Heartbeat every ``heartbeat_s``; a trainer silent for
      ``peer_timeout_s`` is marked disconnected, the socket is rebuilt and
      the actor registers again until the trainer answers.
    * Flow control (``credit_want`` > 0): ``credits`` (an ``ActorCredits``)
      holds what the trainer granted; the scheduler spends one per group and
      gives back those of dropped groups. The link reports the counts to the
      trainer when they change and with every heartbeat
      (``rlnode.link.credits`` states the protocol).

    Call all methods from the event loop's thread. ``next_control()``
    returns trainer requests and raises ``LinkFatalError`` when the trainer
    refuses this actor for good.
    """

    def __init__(self, trainer: str, node_id: str, engines: Iterable[EngineInfo | tuple[int, int]] = (),
                 link: LinkConfig | None = None, *, incarnation: str | None = None, curve_key: str | None = None,
                 ack_timeout_s: float | None = None, commit_query_s: float = 30.0,
                 max_frame_bytes: int | None = None, sndhwm: int = 256, rcvhwm: int = 1024,
                 stats: Callable[[], dict[str, float]] | None = None, credit_want: int = 0,
                 settled: Callable[[], tuple[str, int]] | None = None):
        if not node_id or "/" in node_id:
            raise ValueError(f"node_id must be non-empty and without '/': {node_id!r}")
        self.trainer = trainer
        self.node_id = node_id
        self.incarnation = incarnation or secrets.token_hex(8)
        if not re.fullmatch(r"[0-9A-Za-z]{1,64}", self.incarnation):
            # The trainer refuses it (rlnode.link.peers.INCARNATION): a '-'
            # would let group-id prefixes of two nodes collide.
            raise ValueError(f"incarnation must be 1-64 letters and digits: {self.incarnation!r}")
        self.identity = f"{node_id}/{self.incarnation}".encode()
        if len(self.identity) > 255:  # ZeroMQ routing ids are at most 255 bytes
            raise ValueError("node_id + incarnation longer than 255 bytes")
        self.engines = [e if isinstance(e, EngineInfo) else EngineInfo(*e) for e in engines]
        self.link = link or LinkConfig()
        # This node's own key pair: the trainer accepts a key only from the
        # node id it is named after (rlnode.link.curve). ``curve_key`` is for
        # tools and tests; a config names it with link.key_name.
        self.curve_key = curve_key or self.link.key_name or node_id
        if self.link.curve_dir and curve_key is None and self.curve_key != node_id:
            raise ValueError(f"link.key_name = {self.link.key_name!r} but this node's id is {node_id!r}: the trainer "
                             f"accepts key {self.link.key_name!r} only from node id {self.link.key_name!r}; set "
                             f"actor.node_id = {self.link.key_name!r} or leave link.key_name empty")
        # Default: a trainer that has not acked within a peer timeout most
        # likely lost the frame (a reconnect); earlier would resend under load.
        self.ack_timeout_s = ack_timeout_s or self.link.peer_timeout_s
        self.commit_query_s = commit_query_s
        # None = link.max_frame_bytes (the config checks that a group fits).
        self.max_frame_bytes = max_frame_bytes or self.link.max_frame_bytes
        self._hwm = (sndhwm, rcvhwm)
        self._stats_fn = stats
        self.version = 0  # policy version this node's engines hold (set_version)
        self.trainer_incarnation: str | None = None
        self.trainer_version: int | None = None
        self.controls: asyncio.Queue[ControlItem | LinkError] = asyncio.Queue()
        # Groups this actor can run at once (0 = it starts no groups: tools, tests).
        self.credits = ActorCredits(credit_want, settled) if credit_want > 0 else None
        self._c = ActorLinkCounters()
        self._outbox: dict[str, _Held] = {}
        self._n_acked = 0  # held groups acked by the current trainer incarnation
        self._send_queue: deque[_Held] = deque()
        self._evals: deque[EvalReport] = deque()  # waiting for a connection
        self._connected = False
        self._fatal: LinkError | None = None
        self._last_heard = 0.0
        self._last_hb = 0.0
        self._last_register = float("-inf")
        self._socket_since = 0.0
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._decoder = msgspec.msgpack.Decoder(ToActor)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._socket_tasks: list[asyncio.Task] = []
        self._tick_task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        await self._new_socket()
        self._tick_task = asyncio.create_task(self._tick_loop(), name="actor-link-tick")
        log.info("link.actor.started", trainer=self.trainer, node=self.node_id, incarnation=self.incarnation,
                 curve=bool(self.link.curve_dir), key=self.curve_key if self.link.curve_dir else None)

    async def close(self) -> None:
        tasks = [*self._socket_tasks, *([self._tick_task] if self._tick_task else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._socket_tasks, self._tick_task = [], None
        if self._sock is not None:
            self._sock.close(linger=0)  # held groups live in the outbox, not in ZeroMQ
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._connected = False
        c = self.counters()
        log.info("link.actor.stopped", node=self.node_id, submitted=c.submitted, committed=c.committed,
                 uncommitted=c.uncommitted, resent=c.resent)

    async def __aenter__(self) -> ActorLink:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- public API for the actor daemon ---------------------------------

    @property
    def connected(self) -> bool:
        """Registered with a trainer that was heard from within peer_timeout_s."""
        return self._connected

    def submit(self, delivery: GroupDelivery) -> bool:
        """Hand a group to the link (never blocks). False if it was not
        taken: its id is already held, or it is larger than max_frame_bytes
        (counted, logged: resending could never succeed)."""
        gid = delivery.group_id
        if gid in self._outbox:
            self._c.duplicate_submits += 1
            log.warning("link.actor.duplicate_submit", group=gid)
            return False
        payload = self._encoder.encode(delivery)
        if len(payload) > self.max_frame_bytes:
            self._c.dropped_oversize += 1
            log.error("link.actor.group_too_large", group=gid, bytes=len(payload), limit=self.max_frame_bytes)
            return False
        held = _Held(gid, payload)
        self._outbox[gid] = held
        self._c.submitted += 1
        self._enqueue(held)
        return True

    def reply(self, r: ControlReply) -> bool:
        """Answer a ControlRequest. False if it could not be sent (not
        connected, queue full): the trainer's request then times out."""
        return self._connected and self._send(r)

    def report_eval(self, version: int, cubes: dict[str, dict[str, float | int]]) -> None:
        """Send evaluation results (best effort, at most once). While
        disconnected the newest MAX_PENDING_EVALS wait for the next Welcome."""
        self._evals.append(EvalReport(self.node_id, version, cubes))
        while len(self._evals) > MAX_PENDING_EVALS:
            self._evals.popleft()
            self._c.evals_dropped += 1
        self._send_evals()

    def _send_evals(self) -> None:
        while self._connected and self._evals and self._send(self._evals[0]):
            self._evals.popleft()
            self._c.evals_sent += 1

    def send_credit_report(self, force: bool = False) -> None:
        """Tell the trainer this actor's credit counts (when they changed, or
        ``force``: the heartbeat repeat that heals a lost report)."""
        c = self.credits
        if c is None or not self._connected or c.session is None or not (c.report_due or force):
            return
        if not self._send(c.report()):
            c.report_due = True  # retried on the next tick

    def set_version(self, version: int) -> None:
        """The policy version this node's engines now hold (sent in heartbeats)."""
        self.version = version

    async def next_control(self) -> ControlItem:
        item = await self.controls.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def counters(self) -> ActorLinkCounters:
        c = msgspec.structs.replace(self._c)
        c.uncommitted = len(self._outbox)
        c.unacked = len(self._outbox) - self._n_acked
        return c

    def held_ids(self) -> list[str]:
        return list(self._outbox)

    async def wait_connected(self, timeout_s: float) -> bool:
        return await self._wait(lambda: self._connected, timeout_s)

    async def flush(self, timeout_s: float, committed: bool = False) -> bool:
        """Wait until every held group is acked (or committed): True if so
        before the deadline. For graceful shutdown and benchmarks."""
        if committed:
            return await self._wait(lambda: not self._outbox, timeout_s)
        return await self._wait(lambda: self._n_acked == len(self._outbox), timeout_s)

    async def _wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self._fatal is not None:
                raise self._fatal
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return done()
        return True

    # ---- socket ------------------------------------------------------------

    async def _new_socket(self) -> None:
        """(Re)build the DEALER: a fresh TCP connection and CURVE handshake.
        Anything ZeroMQ still queued is dropped; the outbox has it all."""
        for t in self._socket_tasks:
            t.cancel()
        await asyncio.gather(*self._socket_tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        if self.link.curve_dir:
            curve.apply_client(sock, self.link.curve_dir, self.curve_key)
        sock.identity = self.identity
        sock.sndhwm, sock.rcvhwm = self._hwm
        sock.linger = 0
        # Queue only to a live, handshaken connection: while the trainer is
        # away sends fail at once instead of piling Registers into a pipe.
        sock.immediate = True
        sock.reconnect_ivl = 100
        sock.reconnect_ivl_max = int(max(1000, self.link.heartbeat_s * 1000))
        sock.maxmsgsize = 2 * self.max_frame_bytes
        sock.connect(self.trainer)
        self._sock = sock
        self._socket_since = time.monotonic()
        for h in self._outbox.values():  # whatever was in flight on the old socket is gone
            if not h.acked:
                self._enqueue(h)
        self._socket_tasks = [asyncio.create_task(self._read_loop(sock), name="actor-link-read"),
                              asyncio.create_task(self._send_loop(sock), name="actor-link-send")]

    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sock.recv_multipart(copy=False)
                self._on_frames(frames)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("link.actor.reader_failed")
            self._fail(LinkError(f"actor link reader failed: {e!r}"))

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 1 or len(frames[0]) > self.max_frame_bytes:
            self._c.malformed_frames += 1
            return
        try:
            msg = self._decoder.decode(frames[0].buffer)
        except msgspec.DecodeError as e:
            self._c.malformed_frames += 1
            log.warning("link.actor.malformed_frame", error=str(e)[:200])
            return
        self._last_heard = time.monotonic()
        match msg:
            case Welcome():
                self._on_welcome(msg)
            case Ack(group_ids=ids, duplicate=dups):
                self._on_ack(ids + dups)
            case Commit(group_ids=ids):
                self._on_commit(ids)
            case Reject():
                self._on_reject(msg)
            case Heartbeat(version=v) | VersionUpdate(version=v):
                self._learn_version(v)
            case ControlRequest():
                self.controls.put_nowait(msg)
            case CreditGrant(session=session, granted=granted):
                if self.credits is not None:
                    self.credits.on_grant(session, granted)

    # ---- message handlers --------------------------------------------------

    def _on_welcome(self, w: Welcome) -> None:
        if self._connected and w.trainer_incarnation == self.trainer_incarnation:
            return  # an answer to a repeated Register: nothing new
        new = w.trainer_incarnation != self.trainer_incarnation
        if new and self.trainer_incarnation is not None:
            self._c.trainer_restarts += 1
        self.trainer_incarnation = w.trainer_incarnation
        self._connected = True
        if self.credits is not None:
            self.credits.new_session(w.trainer_incarnation)
            self.credits.report_due = True  # tell it what this actor wants
        self._c.registrations += 1
        for h in self._outbox.values():
            if new:
                self._set_acked(h, False)  # a new trainer has an empty buffer
            if not h.acked:
                h.sent_at = None
                self._enqueue(h)
        self._wake.set()
        log.info("link.actor.registered", trainer=w.trainer_incarnation, version=w.version, new_trainer=new,
                 resending=sum(h.queued for h in self._outbox.values()))
        self.controls.put_nowait(w)
        if new:
            self.trainer_version = None  # a restarted trainer may be at an older checkpoint
        self._learn_version(w.version)
        self._send_evals()
        self.send_credit_report()
        self._progress.set()

    def _on_ack(self, ids: list[str]) -> None:
        if not self._connected:
            self._c.unexpected_frames += 1  # which incarnation acked? unknown: keep resending
            return
        now = time.monotonic()
        for gid in ids:
            h = self._outbox.get(gid)
            if h is not None and not h.acked:
                self._set_acked(h, True)
                h.acked_at = h.queried_at = now
                self._c.acked += 1
        self._progress.set()

    def _on_commit(self, ids: list[str]) -> None:
        # Always honoured: a commit means durably consumed, whoever says it.
        for gid in ids:
            if self._forget(gid):
                self._c.committed += 1
        self._progress.set()

    def _on_reject(self, r: Reject) -> None:
        held = [h for h in map(self._outbox.get, r.group_ids) if h is not None]
        match r.reason:
            case wire.REJECT_REGISTER_FIRST if self._connected:
                log.info("link.actor.reregister", detail=r.detail)
                self._connected = False
                self._last_register = float("-inf")  # register on the next tick
                self._register()
            case wire.REJECT_REGISTER_FIRST:
                pass  # already registering; more Rejects for frames sent before
            case wire.REJECT_BUSY:
                for h in held:  # the ack-timeout scan resends them
                    h.sent_at = time.monotonic()
            case wire.REJECT_UNKNOWN_GROUP:
                for h in held:
                    self._set_acked(h, False)
                    h.sent_at = None
                    self._enqueue(h)
            case wire.REJECT_INVALID_GROUP:
                for h in held:
                    self._forget(h.group_id)
                self._c.rejected += len(held)
                log.error("link.actor.group_rejected", groups=r.group_ids, detail=r.detail)
            case wire.REJECT_PROTOCOL | wire.REJECT_IDENTITY:
                self._fail(LinkFatalError(f"trainer refused this actor: {r.reason}: {r.detail}"))
            case _:
                self._c.unexpected_frames += 1
                log.warning("link.actor.trainer_reject", reason=r.reason, detail=r.detail)
        self._progress.set()

    def _set_acked(self, h: _Held, acked: bool) -> None:
        if h.acked != acked:
            h.acked = acked
            self._n_acked += 1 if acked else -1

    def _forget(self, group_id: str) -> bool:
        h = self._outbox.pop(group_id, None)
        if h is not None and h.acked:
            self._n_acked -= 1
        return h is not None

    def _learn_version(self, version: int) -> None:
        if self.trainer_version is None or version > self.trainer_version:
            self.trainer_version = version
            self.controls.put_nowait(VersionUpdate(version))

    def _fail(self, err: LinkError) -> None:
        if self._fatal is None:
            self._fatal = err
            self._connected = False
            log.error("link.actor.failed", error=str(err))
            self.controls.put_nowait(err)
            self._progress.set()

    # ---- sending ---------------------------------------------------------

    def _enqueue(self, h: _Held) -> None:
        if not h.queued:
            h.queued = True
            self._send_queue.append(h)
            self._wake.set()

    async def _send_loop(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._connected and self._flush() == "hwm":
                    # Wait for room rather than spin; the timeout re-checks state.
                    await sock.poll(100, zmq.POLLOUT)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("link.actor.sender_failed")
            self._fail(LinkError(f"actor link sender failed: {e!r}"))

    def _flush(self) -> str | None:
        """Send queued groups in order until the queue is empty or ZeroMQ
        pushes back; returns the push-back reason, if any."""
        q = self._send_queue
        while q:
            h = q[0]
            if self._outbox.get(h.group_id) is not h or h.acked:
                q.popleft()  # committed or acked while queued
                h.queued = False
                continue
            err = send_nowait(self._sock, [h.payload])
            if err is not None:
                self._c.send_blocked += 1
                return err
            q.popleft()
            h.queued = False
            self._c.sent += 1
            self._c.resent += h.sends > 0
            h.sends += 1
            h.sent_at = time.monotonic()
        return None

    def _send(self, msg) -> bool:
        return self._sock is not None and send_nowait(self._sock, [self._encoder.encode(msg)]) is None

    def _register(self) -> None:
        now = time.monotonic()
        if now - self._last_register < self.link.heartbeat_s:
            return
        if self._send(Register(self.node_id, self.incarnation, self.engines, PROTOCOL_VERSION)):
            self._last_register = now

    # ---- periodic duties -------------------------------------------------

    async def _tick_loop(self) -> None:
        try:
            await self._ticks()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # e.g. key files gone when the socket is rebuilt
            log.exception("link.actor.tick_failed")
            self._fail(LinkError(f"actor link failed: {e!r}"))

    async def _ticks(self) -> None:
        tick = min(0.25, self.link.heartbeat_s / 2)
        last = time.monotonic()
        while self._fatal is None:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last > 4 * tick + self.link.heartbeat_s:
                # Our loop stalled: the trainer's frames wait unread; not its fault.
                self._last_heard = max(self._last_heard, now - self.link.heartbeat_s)
            last = now
            if self._connected:
                self._tick_connected(now)
            else:
                await self._tick_registering(now)

    def _tick_connected(self, now: float) -> None:
        if now - self._last_heard > self.link.peer_timeout_s:
            self._connected = False
            self._c.disconnects += 1
            log.warning("link.actor.trainer_silent", seconds=round(now - self._last_heard, 1))
            return
        if now - self._last_hb >= self.link.heartbeat_s:
            c = self.counters()
            stats = {"uncommitted": float(c.uncommitted), "unacked": float(c.unacked), "sent": float(c.sent),
                     **(self._stats_fn() if self._stats_fn else {})}
            if self._send(Heartbeat(self.node_id, self.version, stats)):
                self._last_hb = now
                self.send_credit_report(force=True)
        self.send_credit_report()
        self._resend_and_query(now)
        if self._send_queue:
            self._wake.set()  # the send loop gave up on an error other than HWM

    async def _tick_registering(self, now: float) -> None:
        # A half-open connection never answers: rebuild it now and then.
        if now - self._socket_since > self.link.peer_timeout_s and now - self._last_heard > self.link.peer_timeout_s:
            await self._new_socket()
        self._register()

    def _resend_and_query(self, now: float) -> None:
        query: list[str] = []
        for h in self._outbox.values():
            if not h.acked:
                if not h.queued and h.sent_at is not None and now - h.sent_at > self.ack_timeout_s:
                    self._enqueue(h)
            elif now - h.queried_at > self.commit_query_s and len(query) < 4096:
                query.append(h.group_id)
        if query and self._send(CommitQuery(query)):
            for gid in query:
                self._outbox[gid].queried_at = now
            self._c.commit_queries += len(query)
