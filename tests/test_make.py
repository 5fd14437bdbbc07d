"""What `make test` (and so CI's `.ci/run`) hands the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from daemons import ROOT

XDG = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")


def test_make_test_runs_the_suite_in_an_empty_home_it_removes_afterwards(tmp_path):
    """The suite's HOME and XDG directories are a folder made empty for the
    run (so no test passes on a warm ~/.cache) and removed after it. Runs
    `make test`'s own pytest line, with pytest swapped for a probe."""
    dry = subprocess.run(["make", "-s", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "MAKEFLAGS": ""}).stdout
    start = dry.index("home=$(mktemp")
    line = dry[start:].replace("\\\n", " ").splitlines()[0]  # the recipe's one logical line
    head, sep, _ = line.partition(" -m pytest ")
    assert sep, line
    python = head.rsplit(" ", 1)[1]
    assert python.endswith("python")
    probe = ("import json, os; h = os.environ['HOME']; "
             f"print(json.dumps({{'home': h, 'entries': os.listdir(h), 'xdg': {{k: os.environ[k] for k in {XDG!r}}}}}))")
    script = head.rsplit(" ", 1)[0] + f" {sys.executable} -c {json.dumps(probe)}"
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    home = seen["home"]
    assert home.startswith(str(tmp_path) + "/") and home != os.path.expanduser("~")
    assert seen["entries"] == []
    assert all(v.startswith(home + "/") for v in seen["xdg"].values()), seen["xdg"]
    assert not os.path.exists(home)  # removed once the suite has run
