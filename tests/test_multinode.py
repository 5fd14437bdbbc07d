"""One trainer and three actor daemons (each its own engine) on loopback,
training in sync mode on a cube where every 4th task always fails (its
groups are dropped after retries): the trainer's credits keep the global
budget, dropped groups never stall the run. The async pipeline across
hosts (the same failing cube, a kill -9 and a rejoin on a new address,
partitions) is tests/test_cluster.py."""

import json

import pytest

from daemons import Daemon, daemon_args, free_port

pytestmark = pytest.mark.engine

GROUPS_PER_STEP = 2
# Every 4th train task fails in reset on every attempt (fault injection).
FAILING_CUBE = ('actor.cubes=[{id = "guess5", kind = "guessing", weight = 1.0, '
                'options = {max_number = 5, max_turns = 3, feedback = "range", fail_reset_every = 4}}]')
SMALL = ["--set", f"actor.scheduler.groups_per_step={GROUPS_PER_STEP}", "--set", "actor.scheduler.attempts=4",
         "--set", "actor.scheduler.eval_every=0", "--set", "trainer.checkpoint_every=0",
         "--set", "actor.router.llm_max_rollouts=8", "--set", "actor.scheduler.max_retries=1",
         "--set", "actor.scheduler.retry_backoff_s=0.05", "--set", "actor.scheduler.max_groups_in_flight=2",
         "--set", FAILING_CUBE,
         # Four daemons and three engines share 2 cores here: a loop can
         # stall for seconds; do not take that for a dead peer.
         "--set", "link.peer_timeout_s=10"]


def trainer_version(st):
    return st["roles"]["trainer"]["version"]


def steps_of(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step" in r]


def check_budget(steps, max_lag):
    budget = (max_lag + 1) * GROUPS_PER_STEP
    assert steps
    for r in steps:
        assert r["credit_budget"] == budget
        # Admitted and not yet consumed, over all actors, at every moment.
        assert r["credits_outstanding_max"] <= budget, r
        assert r["lag_max"] <= max_lag, r
        assert r["groups"] == GROUPS_PER_STEP


def start(name, role, model, tmp_path, tport, extra=()):
    port = free_port()
    return Daemon(name, daemon_args(role, model, tmp_path / "run", tport, port, SMALL + list(extra)), tmp_path, port)


def dropped_groups(daemon) -> int:
    st = daemon.status()
    # An actor still starting (its engine, under load) has no cube stats yet.
    return st["roles"]["actor"]["cubes"].get("guess5", {}).get("groups_dropped", 0) if st else 0


def test_three_actors_sync_failing_tasks(tiny_model_dir, tmp_path):
    """Sync mode is the same credits with max_lag 0: each step's groups start
    on the weights of the step before, and dropped groups do not stall it
    (before credits: 1 of 12 steps, then idle until killed)."""
    tport = free_port()
    sync = ["--set", "trainer.sync=true"]
    trainer = start("trainer", "trainer", tiny_model_dir, tmp_path, tport, sync)
    actors = [start(n, "actor", tiny_model_dir, tmp_path, tport, sync + ["--set", f"actor.node_id={n}"])
              for n in ("a", "b", "c")]
    daemons = [trainer, *actors]
    try:
        v_end = trainer.wait(lambda st: trainer_version(st) >= 6 and trainer_version(st), 500,
                             "6 sync steps with failing tasks")
        assert sum(dropped_groups(a) for a in actors) > 0
    finally:
        codes = {d.name: d.terminate() for d in reversed(daemons) if d.proc.poll() is None}
    assert all(c == 0 for c in codes.values()), codes
    steps = steps_of(tmp_path / "run")
    check_budget(steps, max_lag=0)
    # Nothing was generated on old weights (until the shutdown below began:
    # an actor stopping mid-push makes the next groups start on old ones).
    assert all(r["dropped_stale"] == 0 for r in steps if r["version"] <= v_end)
