"""``rlnode bench link`` at toy size: a real trainer link (its own process)
against 1 and 4 simulated actors over loopback. Asserts what the run must
show whatever the machine: groups flow, none is lost, the credit budget
holds, fairness is an index. No timing threshold: this host's timings say
nothing."""

import subprocess
import sys

import msgspec
import pytest

from rlnode.bench.link_scale import LinkScaleResult, jain, print_table


def test_jain_index():
    assert jain([3, 3, 3, 3]) == 1.0
    assert jain([8, 0, 0, 0]) == 0.25  # one actor got everything: 1/n
    assert jain([0, 0]) == 0.0  # nothing delivered: no index
    assert jain([2, 1]) == pytest.approx(9 / 10)


def test_bench_link_tiny(capsys):
    # In its own process, as users run it: the CLI sets up logging for the
    # whole process (in this one it would bind to pytest's captured stderr,
    # closed after the test, and break every later test's log lines).
    done = subprocess.run([sys.executable, "-m", "rlnode", "--log-level", "warning", "bench", "link",
                           "--actors", "1,4", "--seconds", "1", "--groups-per-step", "8", "--max-lag", "1",
                           "--json"], capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, done.stderr[-2000:]
    res = msgspec.json.decode(out, type=LinkScaleResult)  # stdout is exactly one JSON object
    assert [r.actors for r in res.rows] == [1, 4]
    assert (res.groups_per_step, res.max_lag, res.attempts, res.turns) == (8, 1, 8, 3)
    assert res.group_bytes > 8 * 3 * 512 * 4  # token ids alone; the real structs on the wire
    for r in res.rows:
        assert r.budget == 16
        assert r.delivered > 0 and r.groups_per_s > 0
        assert r.submitted >= r.delivered
        assert r.lost == 0 and r.duplicates == 0
        assert 0 < r.outstanding_max <= r.budget
        assert 0 < r.jain_delivered <= 1 and 0 < r.jain_granted <= 1
        assert r.trainer_cpu_ms_per_group > 0
        assert r.acked_in_window > 0 and 0 < r.ack_p50_ms <= r.ack_p99_ms
    # Four actors against a budget of 16 with want 32 each: the ledger
    # shares by demand, so every actor delivers in the window.
    assert res.rows[1].jain_delivered > 0.25

    print_table(res)
    table = capsys.readouterr().out
    assert "groups/s" in table and len([ln for ln in table.splitlines() if ln.split()[:1] in (["1"], ["4"])]) == 2
