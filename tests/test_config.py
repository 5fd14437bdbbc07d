from pathlib import Path

import pytest

from rlnode.config import Config, ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_load():
    demo = load_config(ROOT / "conf/demo.toml")
    assert demo.run.name == "demo"
    assert demo.actor.router.llm_max_rollouts == 32
    assert demo.actor.engine.device == "cpu"
    gpu = load_config(ROOT / "conf/qwen3-4b-2node.toml")
    assert gpu.actor.engine.num_engines == 8
    assert gpu.model.dtype == "bfloat16"


def test_defaults_without_file():
    cfg = load_config(None)
    assert cfg == Config(run=cfg.run)  # only the run name is derived
    assert cfg.run.name == "rlnode"


def test_unknown_key_names_dotted_path(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[actor.router]\nllm_max_rolouts = 8\n")
    with pytest.raises(ConfigError, match=r"^actor\.router\.llm_max_rolouts: unknown key"):
        load_config(f)


def test_wrong_type_names_key_and_expected_type(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[actor.sampling]\nmax_tokens = "many"\n')
    with pytest.raises(ConfigError, match=r"^actor\.sampling\.max_tokens: expected `int`, got `str`"):
        load_config(f)


def test_bound_violation_shows_value(tmp_path):
    with pytest.raises(ConfigError, match=r"^actor\.router\.llm_max_rollouts: expected `int` >= 1, got 0$"):
        load_config(None, ["actor.router.llm_max_rollouts=0"])


def test_bad_set_overrides():
    with pytest.raises(ConfigError, match=r"^actor\.engine\.gpu_memory_utilization: expected `float` <= 1"):
        load_config(None, ["actor.engine.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match=r"^model\.nonsense: unknown key"):
        load_config(None, ["model.nonsense=1"])
    with pytest.raises(ConfigError, match=r"expected KEY\.PATH=VALUE"):
        load_config(None, ["model.path"])
    with pytest.raises(ConfigError, match=r"^model\.path: is a value, not a section"):
        load_config(None, ["model.path=/a", "model.path.x=1"])


def test_set_overrides_are_typed():
    cfg = load_config(ROOT / "conf/demo.toml", [
        "actor.router.llm_max_rollouts=7", "actor.sampling.temperature=0.5",
        "model.path=/some/dir", "actor.peers=[\"h1:5555\", \"h2:5555\"]", "actor.router.affinity=false",
    ])
    assert cfg.actor.router.llm_max_rollouts == 7
    assert cfg.actor.sampling.temperature == 0.5
    assert cfg.model.path == "/some/dir"  # bare string: not TOML, taken as text
    assert cfg.actor.peers == ["h1:5555", "h2:5555"]
    assert cfg.actor.router.affinity is False


def test_cross_field_rules():
    with pytest.raises(ConfigError, match=r"^actor\.sampling\.max_tokens: must be < model\.max_model_len"):
        load_config(None, ["model.max_model_len=64", "actor.sampling.max_tokens=64"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: must be 1"):
        load_config(None, ["actor.engine.device=\"cpu\"", "actor.engine.tensor_parallel_size=2"])
    # A dual clip at or under 1 would cut the on-policy gradient itself.
    with pytest.raises(ConfigError, match=r"^trainer\.loss\.dual_clip: must be 0 \(off\) or > 1 \(got 1\.0\)"):
        load_config(None, ["trainer.loss.dual_clip=1.0"])
    assert load_config(None, ["trainer.loss.dual_clip=0"]).trainer.loss.dual_clip == 0


def test_truncated_sampling_is_refused():
    # The trainer scores tokens under softmax(logits / T): top-p sampling
    # would make every importance ratio silently wrong.
    with pytest.raises(ConfigError, match=r"^actor\.sampling\.top_p: must be 1\.0 for training \(got 0\.9\)"):
        load_config(None, ["actor.sampling.top_p=0.9"])
    assert load_config(None, ["actor.sampling.top_p=1.0"]).actor.sampling.top_p == 1.0


def test_groups_in_flight_default():
    from rlnode.config import groups_in_flight

    assert groups_in_flight(load_config(None, ["actor.scheduler.max_concurrent_episodes=20",
                                               "actor.scheduler.attempts=8"])) == 3
    assert groups_in_flight(load_config(None, ["actor.scheduler.max_groups_in_flight=5"])) == 5


def test_invalid_toml_and_missing_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[actor\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_parse_override_values():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=1e-3") == (["a"], 1e-3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=hello world") == (["a"], "hello world")


def test_config_module_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, rlnode.config, rlnode.cli; sys.exit(int('torch' in sys.modules or 'vllm' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_rlnode_never_asks_the_model_hub():
    """Models come from local paths: the CLI sets HF_HUB_OFFLINE (inherited
    by the engine's processes) so a wrong model.path fails at once instead
    of retrying the hub (it did: five retries of a relative path)."""
    import subprocess
    import sys

    code = ("import os, rlnode.cli as c\n"
            "os.environ.pop('HF_HUB_OFFLINE', None)\n"
            "try:\n    c.main(['keygen', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('OFFLINE=' + os.environ.get('HF_HUB_OFFLINE', ''))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "OFFLINE=1" in out
