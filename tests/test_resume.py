"""Trainer restart with --resume: the version continues, no acknowledged
group is trained twice, and the actor reconnects without being restarted."""

import json

import pytest

from daemons import Daemon, daemon_args, free_port

pytestmark = pytest.mark.engine

SMALL = ["--set", "actor.scheduler.groups_per_step=2", "--set", "actor.scheduler.attempts=4",
         "--set", "actor.scheduler.eval_every=0", "--set", "trainer.checkpoint_every=2",
         "--set", "actor.router.llm_max_rollouts=8", "--set", "actor.node_id=solo"]


def test_trainer_restart_resumes(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    tport, thttp, ahttp = free_port(), free_port(), free_port()
    trainer = Daemon("trainer", daemon_args("trainer", tiny_model_dir, run, tport, thttp, SMALL), tmp_path, thttp)
    actor = Daemon("actor", daemon_args("actor", tiny_model_dir, run, tport, ahttp, SMALL), tmp_path, ahttp)
    daemons = [trainer, actor]
    try:
        trainer.wait(lambda st: st["roles"]["trainer"]["version"] >= 5, 400, "5 versions")
        assert trainer.terminate() == 0  # SIGTERM: final checkpoint, exit 0
        steps_before = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        last = max(r["step"] for r in steps_before if "step" in r)
        assert (run / "checkpoints" / "latest").read_text().strip().startswith(f"step-{last:07d}-")

        trainer2 = Daemon("trainer2", daemon_args("trainer", tiny_model_dir, run, tport, thttp, SMALL) + ["--resume"],
                          tmp_path, thttp)
        daemons.append(trainer2)
        trainer2.wait(lambda st: st["roles"]["trainer"]["version"] >= last + 3, 400, "3 more versions after resume")
        # The actor process was never restarted, and holds the new weights.
        assert actor.proc.poll() is None
        actor.wait(lambda st: st["roles"]["actor"]["version"] > last, 120, "actor to follow the resumed trainer")
        assert trainer2.events("trainer.resumed")[0]["version"] == last
    finally:
        codes = {d.name: d.terminate() for d in reversed(daemons) if d.proc.poll() is None}
    assert all(c == 0 for c in codes.values()), codes
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    # The version continues: steps strictly increase across the restart.
    assert [r["step"] for r in steps] == sorted(r["step"] for r in steps)
    assert len({r["step"] for r in steps}) == len(steps)
    # No group is trained twice, across both trainer processes.
    trained = [g for r in steps for g in r["group_ids"]]
    assert len(trained) == len(set(trained))
    # Both trainer processes trained: the second one's steps come after the first's.
    assert any(r["step"] > last for r in steps) and any(r["step"] <= last for r in steps)
