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


async def test_a_role_whose_cube_refuses_its_options_exits_2_with_one_line():
    """A ConfigError at a role's start (a cube that cannot run its options:
    an agent that cannot be loaded, isolation that cannot run, a verifiers
    runtime that needs credentials) is a usage error: exit 2 and one log line
    naming the key, not a "fatal" traceback; roles already started are shut
    down."""
    import structlog

    from rlnode.config import ConfigError
    from rlnode.daemon import EXIT_USAGE, Lifecycle

    class Role:
        def __init__(self, name, fail=False):
            self.name, self.fail, self.shut = name, fail, False

        async def start(self):
            if self.fail:
                raise ConfigError("cube 'agent': options.isolation = \"bwrap\" cannot run agents here")

        async def run(self, stop):
            await stop.wait()

        async def shutdown(self):
            self.shut = True

    first, second = Role("trainer"), Role("actor", fail=True)
    with structlog.testing.capture_logs() as logs:
        code = await Lifecycle([first, second]).main()
    assert code == EXIT_USAGE and first.shut
    (entry,) = [e for e in logs if e["event"] == "config_error"]
    assert "options.isolation" in entry["error"] and "exc_info" not in entry
    assert not [e for e in logs if e["event"] == "fatal"]
