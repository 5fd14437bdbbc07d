"""A LoRA run end to end (issue 38): `rlnode --role all` on the demo job
with ``trainer.lora.rank`` set. The trainer trains the adapter, every push
is an adapter the engine serves as a new vLLM adapter with no pause, the
samples of a sync run are on policy (the engine's adapter computes what the
trainer's peft model does), and final/ is the adapter in peft's format."""

import json

import pytest
from test_learning import _finish, _on_policy, _start

pytestmark = pytest.mark.engine


def test_a_lora_run_serves_every_version_as_an_adapter_on_policy(tmp_path):
    from rlnode.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0)
    steps, run_dir = 5, tmp_path / "run"
    proc = _start(run_dir, model, True, steps, "--set", "trainer.lora.rank=8",
                  "--set", "actor.scheduler.groups_per_step=2")
    # Exit 0, every step, pushes from the first that reached the engine.
    done = _finish(proc, run_dir, steps, final="adapter_config.json")
    first = [x["weights_pushed"] for x in done].index(True)
    log = open(f"{run_dir}.log").read()
    # Sync: every token at lag 0, and the engine's logprobs are the trainer's.
    on_policy = _on_policy(done)
    assert len(on_policy) >= steps // 2 and max(on_policy) < 1e-3, on_policy
    for x in done:
        assert x["lag_max"] == 0 and x["offpolicy/mismatch_kl"] < 1e-8, x
        assert x["offpolicy/logprob_absdiff_p99"] < 1e-4, x
    # Every update the engine took was an adapter, served without a pause.
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    updates = [e for e in events if e.get("event") == "weights.updated"]
    assert len(updates) >= steps - first and all(e["adapter"] and e["stalled_s"] == 0.0 for e in updates), updates
    assert {int(e["version"]) for e in updates} >= set(range(first + 1, steps + 1))
    # final/ is the adapter, as peft writes it.
    assert sorted(p.name for p in (run_dir / "final").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors"]
    assert json.loads((run_dir / "final" / "adapter_config.json").read_text())["r"] == 8
