"""Credit-based flow control: the trainer decides how many groups run.

Owns: the credit ledger of both ends. ``CreditLedger`` lives in the
trainer's link, ``ActorCredits`` in each actor's link; the actor's
``RolloutScheduler`` spends a credit to start a group. Must not touch
sockets (the links send the messages) nor the training buffer (the trainer
daemon reports consumption with ``release``).

Why the trainer: it is the only place that knows what it will consume. A
budget counted in each actor lets N actors start N times what the trainer
trains, lets a restarted actor start a burst, and stalls when dropped
groups are counted as started (all measured before this module existed).

The protocol (messages in ``rlnode.wire``):

* A *credit* is the right to start one group. The trainer grants credits
  to each actor incarnation, per trainer incarnation (the *session*), as a
  cumulative count: ``CreditGrant(session, granted)``. The actor reports its
  side, also cumulative: ``CreditReport(session, want, started, returned)``.
  Cumulative counts make every message idempotent: a lost one is healed by
  the next (grants are re-sent with every trainer heartbeat, reports with
  every actor heartbeat). Counts of another session are ignored.
* Budget, over all actors: ``outstanding <= (max_lag + 1) * groups_per_step``
  where ``outstanding`` = credits in actors' hands (granted, neither
  delivered nor returned: unused, or a group running or in transit) +
  groups delivered and not yet released by the trainer. Each optimizer step
  consumes ``groups_per_step`` groups and releases them once the new weights
  are pushed, so over a run at most ``(version + max_lag + 1) *
  groups_per_step`` groups are admitted net of drops: a group started at
  version v is trained by about version v + max_lag. Sync mode is the same
  with ``max_lag = 0``: the next groups start on the new weights.
* A credit comes back when its group is dropped on the actor (episodes
  failed past their retries: ``returned``), rejected by the trainer as
  invalid, consumed by a step (trained, skipped or dropped as stale), or
  when its actor is gone: replaced by a new incarnation of its node (the
  credits in its hands died with that process) or silent for ``reclaim_s``
  after it timed out. Until then a timed-out actor's credits still count:
  an actor that was only slow (a stalled loop, a network blip) comes back
  and delivers what it started without pushing the total over the budget.
  A new or restarted actor starts with zero credits: it is granted what the
  budget has free, never a burst.
* Sharing by demand: each actor asks for ``want`` (how many groups it can
  run at once); free credits go one at a time to the connected actor with
  the lowest ``in_hands / want``. A fast actor returns its credits (as
  delivered groups) sooner and so is topped up more often; a slow one keeps
  what it holds but cannot take more than its ``want``.
* What a peer may claim (an authenticated actor is still not trusted with
  the budget): ``want`` is capped at the budget (``MAX_WANT`` without one),
  ``started`` at what it was granted, and ``returned`` at the credits it
  holds (granted - delivered): a peer cannot report back credits it never
  had to make the ledger think its hands are empty. A delivery of this
  session counts against its credits only while it has one; more are
  counted as ``uncredited`` (they still wait in ``waiting``). Each clamp an
  honest actor never causes is counted (``clamped_reports``) and logged;
  a want above the budget is normal (the actor has room for more) and is
  capped quietly. So no peer ever holds more than
  its capped ``want`` credits, whatever it reports.
* Limits, stated: groups started under an older session (a trainer
  restart), or by an actor that comes back after its credits were
  reclaimed, count only once delivered, so ``outstanding`` can exceed the
  budget for a moment then; no credit is granted until it is back under.
  The trainer drops and counts
  samples older than ``max_lag`` whatever happens.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable

import msgspec

from rlnode.log import get_logger, log_throttled
from rlnode.wire import CreditReport

log = get_logger("rlnode.link.credits")

# Largest ``want`` a peer may claim when the ledger has no budget (bare
# links in tools and tests): ``grant`` loops once per credit it hands out,
# so an unbounded claim would spin the trainer's event loop for ever.
MAX_WANT = 4096


class PeerCredits(msgspec.Struct):
    """One actor incarnation's account in the trainer's ledger."""

    peer_id: str
    connected: bool = True
    left_at: float = 0.0  # monotonic time it timed out (while not connected)
    want: int = 0  # from its last report
    granted: int = 0  # cumulative, this session
    started: int = 0  # from its reports (informational)
    returned: int = 0  # from its reports: groups it dropped
    delivered: int = 0  # groups of this session it delivered (accepted or rejected)

    @property
    def in_hands(self) -> int:
        """Credits it holds: unused, or spent on a group not yet delivered."""
        return max(0, self.granted - self.returned - self.delivered)


class CreditLedger:
    """The trainer's side. ``budget`` None = no global limit (each actor is
    topped up to its ``want``): for tools and tests that run a bare link.
    ``reclaim_s``: how long a timed-out actor's credits keep counting."""

    def __init__(self, session: str, budget: int | None, reclaim_s: float = 0.0):
        self.session = session
        self.budget = budget
        self.reclaim_s = reclaim_s
        self.peers: dict[str, PeerCredits] = {}
        self.waiting: set[str] = set()  # delivered groups the trainer has not released
        self.peak = 0  # highest outstanding since reset_peak()
        self.granted_total = 0
        self.returned_total = 0
        self.foreign_reports = 0  # reports for another session (stale), ignored
        self.clamped_reports = 0  # reports that claimed more than the rules allow (see the module doc)
        self.uncredited = 0  # deliveries of this session by a peer that held no credit
        # Uncredited groups waiting for a step (resent from before a trainer
        # restart, or a peer past its grant), by peer: each peer may hold at
        # most its fair share of the budget this way (``admits``), so no
        # peer can fill the trainer with groups no credit paid for.
        self._uncredited_waiting: dict[str, str] = {}  # group id -> peer id
        self._uncredited_by_peer: dict[str, int] = {}
        self.uncredited_refused = 0  # uncredited deliveries refused (busy) for being over that share
        # Credits in the hands of incarnations that died (replaced by a new
        # one of their node): groups running or unsent died with them; the
        # credits went back to the pool.
        self.reclaimed = 0
        # Something grant() reads changed since it last ran. An actor repeats
        # its report every heartbeat; re-running grant (a walk over every
        # peer) for each unchanged one cost the trainer O(N^2) per heartbeat
        # period: a full core at 1,024 actors (rlnode bench link).
        self._dirty = True

    def _counts(self, p: PeerCredits, now: float) -> bool:
        return p.connected or now - p.left_at < self.reclaim_s

    def outstanding(self) -> int:
        now = time.monotonic()
        return len(self.waiting) + sum(p.in_hands for p in self.peers.values() if self._counts(p, now))

    def reset_peak(self) -> int:
        """The peak since the last call; starts a new window at the current value."""
        peak, self.peak = self.peak, self.outstanding()
        return max(peak, self.peak)

    def _note(self) -> None:
        self.peak = max(self.peak, self.outstanding())

    # ---- peers ---------------------------------------------------------------

    def peer_joined(self, peer_id: str) -> None:
        """Registered (new, or the same incarnation back after a timeout)."""
        self.peers.setdefault(peer_id, PeerCredits(peer_id)).connected = True
        self._dirty = True
        self._note()

    def peer_left(self, peer_id: str) -> None:
        """Timed out: it gets no new credits; the ones it holds count for
        ``reclaim_s`` more (it may only be slow), then return to the pool.
        Kept in case the same incarnation comes back."""
        p = self.peers.get(peer_id)
        if p is not None and p.connected:
            p.connected, p.left_at = False, time.monotonic()
            self._dirty = True

    def forget(self, peer_id: str) -> None:
        """Replaced by a new incarnation of its node: that process is gone,
        and the groups it was running or had not sent with it. Its credits
        return to the pool (counted in ``reclaimed``)."""
        p = self.peers.pop(peer_id, None)
        if p is not None:
            self._dirty = True
            if p.in_hands:
                self.reclaimed += p.in_hands
                log.info("credits.reclaimed", peer=peer_id, credits=p.in_hands, total=self.reclaimed)

    def on_report(self, peer_id: str, r: CreditReport) -> bool:
        """Apply an actor's report; False if it was for another session."""
        p = self.peers.get(peer_id)
        if p is None or r.session != self.session:
            self.foreign_reports += 1
            return False
        # What an honest actor reports never exceeds these: the trainer
        # counts a grant before sending it and a delivery only once it came.
        want = min(max(0, r.want), self.max_want)
        started = min(r.started, p.granted)
        returned = min(r.returned, p.granted - p.delivered)
        # An actor that can run more groups than the budget wants more: its
        # want is capped without a word. Only what no honest actor reports
        # (a want past MAX_WANT or below 0, more started or returned than
        # it holds) is an anomaly worth counting and logging.
        if not 0 <= r.want <= MAX_WANT or (started, returned) != (r.started, r.returned):
            self.clamped_reports += 1
            log_throttled(log.warning, "credits.report_clamped", self.clamped_reports, peer=peer_id, want=r.want,
                          started=r.started, returned=r.returned, granted=p.granted, delivered=p.delivered,
                          max_want=self.max_want)
        if want != p.want or returned > p.returned:
            self._dirty = True
        p.want = want
        p.started = max(p.started, started)
        if returned > p.returned:
            self.returned_total += returned - p.returned
            p.returned = returned
        return True

    @property
    def max_want(self) -> int:
        """No peer can use more than the whole budget."""
        return self.budget if self.budget is not None else MAX_WANT

    # ---- groups ----------------------------------------------------------------

    def _credited(self, peer_id: str, session: str) -> bool:
        p = self.peers.get(peer_id)
        return p is not None and session == self.session and p.delivered + p.returned < p.granted

    def share(self) -> int:
        """Uncredited groups one peer may have waiting: the budget split
        over the connected peers (no limit without a budget)."""
        if self.budget is None:
            return MAX_WANT
        live = sum(1 for p in self.peers.values() if p.connected)
        return max(1, -(-self.budget // max(1, live)))

    def admits(self, peer_id: str, session: str) -> bool:
        """Whether a delivery by ``peer_id`` under ``session`` may wait for
        a step: always with a credit to spend; without one (an older
        session's group, or past the grant), only within the peer's share.
        A refusal is a busy reject: the actor keeps the group and resends
        it once the trainer consumed some of its others."""
        if self._credited(peer_id, session) or self._uncredited_by_peer.get(peer_id, 0) < self.share():
            return True
        self.uncredited_refused += 1
        return False

    def on_delivered(self, peer_id: str, session: str, group_id: str, accepted: bool) -> None:
        """A group arrived (first time for its id): ``accepted`` groups wait
        for a step; rejected ones give their credit back at once."""
        credited = self._credited(peer_id, session)
        if credited:
            self.peers[peer_id].delivered += 1
        elif session == self.session and peer_id in self.peers:  # no credit of this session left to spend on it
            self.uncredited += 1
        if accepted:
            self.waiting.add(group_id)
            if not credited:
                self._uncredited_waiting[group_id] = peer_id
                self._uncredited_by_peer[peer_id] = self._uncredited_by_peer.get(peer_id, 0) + 1
        self._dirty = True
        self._note()

    def hold(self, group_ids: Iterable[str]) -> None:
        """Groups the trainer holds that came another way (restored from a
        checkpoint): they count until released."""
        self.waiting.update(group_ids)
        self._dirty = True
        self._note()

    def release(self, group_ids: Iterable[str]) -> None:
        """Consumed by a step (trained, skipped or stale) or dropped: free."""
        for gid in group_ids:
            self.waiting.discard(gid)
            peer_id = self._uncredited_waiting.pop(gid, None)
            if peer_id is not None:
                left = self._uncredited_by_peer[peer_id] - 1
                if left:
                    self._uncredited_by_peer[peer_id] = left
                else:
                    del self._uncredited_by_peer[peer_id]
        self._dirty = True

    # ---- granting ----------------------------------------------------------

    def grant(self, force: bool = False) -> list[PeerCredits]:
        """Hand out what the budget has free, by demand; returns the peers
        whose grant grew (the link sends them ``CreditGrant``). Without
        ``force``, nothing is done unless an event changed the ledger since
        the last grant; ``force`` (the link's heartbeat tick) also catches
        credits freed by time alone (a timed-out peer's ``reclaim_s``)."""
        if not (force or self._dirty):
            return []
        self._dirty = False
        live = [p for p in self.peers.values() if p.connected and p.want > 0]
        free = (self.budget - self.outstanding()) if self.budget is not None else sum(p.want for p in live)
        changed: dict[str, PeerCredits] = {}
        while free > 0:
            needy = [p for p in live if p.in_hands < p.want]
            if not needy:
                break
            p = min(needy, key=lambda p: (p.in_hands / p.want, p.granted))
            p.granted += 1
            self.granted_total += 1
            free -= 1
            changed[p.peer_id] = p
        self._note()
        return list(changed.values())

    def summary(self) -> dict:
        return {"budget": self.budget if self.budget is not None else -1, "outstanding": self.outstanding(),
                "waiting": len(self.waiting), "granted": self.granted_total, "returned": self.returned_total,
                "foreign_reports": self.foreign_reports, "clamped_reports": self.clamped_reports,
                "uncredited": self.uncredited, "uncredited_refused": self.uncredited_refused,
                "reclaimed": self.reclaimed,
                "peers": {pid: {"connected": p.connected, "want": p.want, "granted": p.granted,
                                "in_hands": p.in_hands, "delivered": p.delivered, "returned": p.returned}
                          for pid, p in self.peers.items()}}


class ActorCredits:
    """An actor's side: how many groups the trainer lets it start now.

    ``acquire`` waits for a credit and returns the session it belongs to
    (stamped on the group); ``give_back`` returns the credit of a group
    dropped on this actor. ``report_due`` is set whenever the trainer should
    hear the new counts (the link sends a ``CreditReport``)."""

    def __init__(self, want: int, settled: Callable[[], tuple[str, int]] | None = None):
        if want < 1:
            raise ValueError(f"want must be >= 1, got {want}")
        self.want = want
        # (id prefix, index below which this actor holds no group): reported
        # so the trainer can compact its consumed-id memory.
        self.settled = settled
        self.session: str | None = None
        self.granted = 0
        self.started = 0
        self.returned = 0
        self.report_due = False
        self._changed = asyncio.Event()

    @property
    def available(self) -> int:
        return self.granted - self.started if self.session is not None else 0

    def new_session(self, session: str) -> None:
        """Welcomed by a new trainer incarnation: credits of the old one are void."""
        if session != self.session:
            self.session, self.granted, self.started, self.returned = session, 0, 0, 0
            self.report_due = True

    def on_grant(self, session: str, granted: int) -> bool:
        if session != self.session or granted <= self.granted:
            return False
        self.granted = granted
        self._changed.set()
        return True

    async def acquire(self) -> str:
        while self.available <= 0:
            self._changed.clear()
            await self._changed.wait()
        self.started += 1
        self.report_due = True
        return self.session

    def give_back(self, session: str) -> None:
        # Never more than started: a report beyond it is clamped by the trainer.
        if session and session == self.session and self.returned < self.started:
            self.returned += 1
            self.report_due = True

    def report(self) -> CreditReport:
        self.report_due = False
        prefix, below = self.settled() if self.settled else ("", 0)
        return CreditReport(self.session or "", self.want, self.started, self.returned, prefix, below)
