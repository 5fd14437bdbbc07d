"""The trainer's memory of consumed group ids stays bounded: compacted per
actor incarnation (rlnode/link/consumed.py), in memory and in checkpoints."""

import json

from rlnode.link.consumed import ConsumedIds


def gid(prefix: str, i: int) -> str:
    return f"{prefix}g{i:07d}"


def test_contiguous_ids_compact_to_a_watermark():
    c = ConsumedIds()
    order = [3, 0, 2, 1, 5]  # out of order, as groups finish
    for i in order:
        c.add(gid("n1-abc-", i))
    assert all(gid("n1-abc-", i) in c for i in order)
    assert gid("n1-abc-", 4) not in c and gid("n1-abc-", 6) not in c and gid("n2-abc-", 0) not in c
    # 0..3 collapsed into the watermark 4; 5 is held above it.
    assert c.to_state() == {"watermarks": {"n1-abc-": 4}, "above": {"n1-abc-": [5]}, "loose": []}
    assert len(c) == 2


def test_a_long_run_stays_small_and_dropped_groups_are_settled():
    c = ConsumedIds()
    p = "node-7f3a-"
    for i in range(100_000):
        if i % 4:  # every 4th group was dropped on the actor: a hole the trainer never fills
            c.add(gid(p, i))
    assert len(c) > 70_000  # the holes keep the run from compacting ...
    c.settle(p, 99_990)  # ... until the actor reports it holds nothing below 99,990
    assert len(c) <= 10
    assert gid(p, 5) in c and gid(p, 99_993) in c and gid(p, 99_992) not in c
    state = c.to_state(extra=[gid(p, 99_992)])
    assert len(json.dumps(state)) < 200  # the checkpoint does not grow with the run
    back = ConsumedIds.from_state(json.loads(json.dumps(state)))
    assert gid(p, 99_992) in back and gid(p, 99_996) not in back and gid(p, 3) in back


def test_loose_ids_are_bounded_and_old_checkpoints_load():
    c = ConsumedIds(max_loose=3)
    for i in range(10):
        c.add_loose(f"hostile-{i}")
    assert len(c) == 3 and "hostile-9" in c and "hostile-0" not in c
    c.add("no-index-here")  # not of the scheduler's shape: kept loose
    assert "no-index-here" in c
    old = ConsumedIds.from_state(["a-x-g0000000", "a-x-g0000001", "custom"])  # pre-compaction list
    assert "a-x-g0000001" in old and "custom" in old and old.to_state()["watermarks"] == {"a-x-": 2}
