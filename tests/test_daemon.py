"""`rlnode --role ...` as a real process refusing a bad config before
anything starts. Its clean stops are checked where a daemon already runs:
SIGTERM of `--role all` mid-run (exit 0, a checkpoint, no group lost,
nothing left in its session: the actor's engine included) in
test_ops.test_notify_order_and_sigterm_midrun, SIGTERM during the engine
start in test_engine_lifetime, and SIGTERM of every cluster node (exit 0)
at the end of test_cluster."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bad_config_exits_2_naming_the_key(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "rlnode", "--role", "actor", "--config", str(ROOT / "conf/demo.toml"),
         "--set", "actor.router.llm_max_rollouts=-3"],
        capture_output=True, text=True,
    )
    assert r.returncode == 2
    assert "actor.router.llm_max_rollouts" in r.stderr and "expected `int` >= 1" in r.stderr
