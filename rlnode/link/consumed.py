"""ConsumedIds: which groups a trainer has consumed, in bounded memory.

Owns: the dedup memory behind "a group is trained at most once", which the
trainer keeps across restarts in every checkpoint. A plain set of ids grows
with the run (and with it every checkpoint); this one is compacted per actor
incarnation.

Group ids are ``f"{prefix}g{index:07d}"`` with one prefix per actor
incarnation (``node-incarnation-``) and indices counting up from 0. Per
prefix we keep a *watermark* W (every index below W is settled: consumed,
or will never be sent) and the consumed indices at or above W. W moves:
* when the index at W is consumed (the contiguous run extends), and
* when the actor reports ``settled_below`` (``CreditReport``): it holds no
  group below that index any more (each was committed or dropped), so none
  can be resent. Dropped groups leave holes that only this report closes.
Ids of another shape, and groups rejected as invalid (they need no exact
memory: a resend is rejected again), go to a bounded LRU of loose ids.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Iterable

GROUP_ID = re.compile(r"^(.+-)g(\d+)$")  # RolloutScheduler: f"{id_prefix}g{index:07d}"
MAX_LOOSE_IDS = 100_000


def split_group_id(group_id: str) -> tuple[str, int] | None:
    m = GROUP_ID.match(group_id)
    return (m.group(1), int(m.group(2))) if m else None


class ConsumedIds:
    def __init__(self, max_loose: int = MAX_LOOSE_IDS):
        self.max_loose = max_loose
        self._marks: dict[str, int] = {}  # prefix -> watermark W
        self._above: dict[str, set[int]] = {}  # prefix -> consumed indices >= W
        self._loose: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, group_id: str) -> bool:
        parsed = split_group_id(group_id)
        if parsed is not None:
            prefix, idx = parsed
            if idx < self._marks.get(prefix, 0) or idx in self._above.get(prefix, ()):
                return True
        return group_id in self._loose

    def add(self, group_id: str) -> None:
        """A group trained (or otherwise durably consumed)."""
        parsed = split_group_id(group_id)
        if parsed is None:
            return self.add_loose(group_id)
        prefix, idx = parsed
        mark = self._marks.setdefault(prefix, 0)
        if idx < mark:
            return
        above = self._above.setdefault(prefix, set())
        above.add(idx)
        while mark in above:  # the contiguous run grows
            above.discard(mark)
            mark += 1
        self._marks[prefix] = mark

    def add_loose(self, group_id: str) -> None:
        """Remembered as long as room allows (rejected groups, foreign ids)."""
        self._loose[group_id] = None
        self._loose.move_to_end(group_id)
        while len(self._loose) > self.max_loose:
            self._loose.popitem(last=False)

    def update(self, group_ids: Iterable[str]) -> None:
        for g in group_ids:
            self.add(g)

    def settle(self, prefix: str, below: int) -> None:
        """The actor of ``prefix`` will never send an index below ``below``."""
        mark = self._marks.get(prefix, 0)
        if below <= mark:
            return
        above = {i for i in self._above.get(prefix, ()) if i >= below}
        while below in above:
            above.discard(below)
            below += 1
        self._marks[prefix], self._above[prefix] = below, above

    def __len__(self) -> int:
        """Entries held (not ids covered): what memory and checkpoints grow with."""
        return len(self._marks) + sum(map(len, self._above.values())) + len(self._loose)

    # ---- checkpoints -------------------------------------------------------

    def to_state(self, extra: Iterable[str] = ()) -> dict:
        """JSON-ready; ``extra`` ids are included as if added."""
        snap = ConsumedIds(self.max_loose)
        snap._marks, snap._loose = dict(self._marks), OrderedDict(self._loose)
        snap._above = {p: set(s) for p, s in self._above.items()}
        snap.update(extra)
        return {"watermarks": snap._marks, "above": {p: sorted(s) for p, s in snap._above.items() if s},
                "loose": list(snap._loose)}

    @classmethod
    def from_state(cls, state: dict | list) -> ConsumedIds:
        """Also reads the list of ids older checkpoints stored."""
        out = cls()
        if isinstance(state, list):
            out.update(state)
            return out
        out._marks = {p: int(w) for p, w in state.get("watermarks", {}).items()}
        out._above = {p: {int(i) for i in idx} for p, idx in state.get("above", {}).items()}
        for g in state.get("loose", []):
            out.add_loose(g)
        return out
