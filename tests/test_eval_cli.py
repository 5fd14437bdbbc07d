"""`rlnode eval` end to end: real engine, tiny model, the demo's cubes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine


def test_eval_json_per_cube(tiny_model_dir, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "rlnode", "eval", "--config", str(ROOT / "conf/demo.toml"),
         "--model", str(tiny_model_dir), "--set", f"run.run_dir={tmp_path}", "--episodes", "6", "--json",
         "--set", 'actor.cubes=[{id="guess5", kind="guessing", options={max_number=5, max_turns=3}},'
                  ' {id="arith", kind="arithmetic", weight=0.0, options={max_operand=9}}]'],
        capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert set(out) == {"guess5", "arith"}
    for cube_id, stats in out.items():
        assert stats["episodes"] == 6
        assert stats["errors"] == 0
        assert 0.0 <= stats["success_rate"] <= 1.0
        assert stats["reward_mean"] == pytest.approx(stats["success_rate"])  # 0/1 rewards
    assert out["guess5"]["turns_mean"] <= 3  # the cube's turn limit


def test_eval_unknown_cube_is_a_clear_error(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "rlnode", "eval", "--config", str(ROOT / "conf/demo.toml"), "--cube", "nope"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode != 0 and "no cube with id nope" in r.stderr
