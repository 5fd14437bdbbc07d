"""Flow control of ``TrainerLink`` (a part of it: ``trainer_link`` says
how the parts fit): the daemon's holds and releases on the trainer's
``CreditLedger`` (``credits`` states the protocol), the grants that go
out when credits free up, and the no-group alarm (``starved``) that
reports credits leaked or groups lost. Must not touch the ledger's
arithmetic: ``credits.CreditLedger`` owns it.
"""

from __future__ import annotations

import time
from typing import Iterable

from rlnode.log import get_logger
from rlnode.wire import CreditGrant

log = get_logger("rlnode.link.trainer")


class CreditFlow:
    """``TrainerLink``'s grants, holds, releases and no-group alarm (state:
    the link's)."""

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

    def _grant(self, force: bool = False) -> None:
        for pc in self.credits.grant(force):
            if pc.peer_id in self._peers and self._peers[pc.peer_id].connected:
                self._send(pc.peer_id, CreditGrant(self.incarnation, pc.granted))

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
