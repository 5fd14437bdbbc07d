"""One trainer and two actor daemons (each its own engine) on loopback:
both get every update; one is killed -9 and training goes on; restarted, it
rejoins and receives the current weights."""

import pytest

from daemons import Daemon, daemon_args, free_port

pytestmark = pytest.mark.engine

SMALL = ["--set", "actor.scheduler.groups_per_step=2", "--set", "actor.scheduler.attempts=4",
         "--set", "actor.scheduler.eval_every=0", "--set", "trainer.checkpoint_every=0",
         "--set", "actor.router.llm_max_rollouts=8"]


def actor_version(st):
    return st["roles"]["actor"]["version"]


def trainer_version(st):
    return st["roles"]["trainer"]["version"]


def test_two_actors_kill_and_rejoin(tiny_model_dir, tmp_path):
    tport = free_port()
    ports = {n: free_port() for n in ("trainer", "a", "b", "b2")}
    trainer = Daemon("trainer", daemon_args("trainer", tiny_model_dir, tmp_path / "run", tport, ports["trainer"], SMALL),
                     tmp_path, ports["trainer"])
    actors = {n: Daemon(n, daemon_args("actor", tiny_model_dir, tmp_path / "run", tport, ports[n],
                                       SMALL + ["--set", f"actor.node_id={n}"]), tmp_path, ports[n])
              for n in ("a", "b")}
    daemons = [trainer, *actors.values()]
    try:
        trainer.wait(lambda st: trainer_version(st) >= 3, 400, "3 versions with two actors")
        # Both actors hold the trainer's weights (every update reached both).
        v = trainer_version(trainer.status())
        for a in actors.values():
            a.wait(lambda st: actor_version(st) >= v - 1, 60, f"actor at version >= {v - 1}")
        pushes = [e for e in trainer.events("weights.pushed") if e["peers"] == 2]
        assert pushes, "no weight update reached both actors"

        actors["b"].proc.kill()  # kill -9: no goodbye
        actors["b"].proc.wait()
        v_kill = trainer_version(trainer.status())
        trainer.wait(lambda st: trainer_version(st) >= v_kill + 3, 300, "training to go on without b")
        st = trainer.status()["roles"]["trainer"]
        assert [p["connected"] for p in st["peers"] if p["node_id"] == "b"] == [False]

        b2 = Daemon("b2", daemon_args("actor", tiny_model_dir, tmp_path / "run", tport, ports["b2"],
                                      SMALL + ["--set", "actor.node_id=b"]), tmp_path, ports["b2"])
        daemons.append(b2)
        # Rejoined: a new epoch with it, and it receives the current weights
        # (the push on join), then keeps up.
        b2.wait(lambda st: actor_version(st) > 0, 300, "the restarted actor to receive weights")
        v_now = trainer_version(trainer.status())
        b2.wait(lambda st: actor_version(st) >= v_now, 200, "the restarted actor to catch up")
        epochs = trainer.events("weights.epoch")
        assert len(epochs) >= 3  # a+b, a alone, a+b again
        assert any(len(e["peers"]) == 1 for e in epochs)  # trained on with a alone
        assert len(epochs[-1]["peers"]) == 2  # b is back in the group
    finally:
        codes = {d.name: d.terminate() for d in reversed(daemons) if d.proc.poll() is None}
    assert all(c == 0 for c in codes.values()), codes
