"""AdmissionRouter in front of the real engine: the permit limit holds as seen
from inside the engine wrapper, leases come back on cancel and error, and
the lease metadata describes what happened."""

import asyncio
import time

import pytest

from conftest import assert_engine_idle

from rlnode.actor.engine import EngineError, SamplingSettings
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter

pytestmark = pytest.mark.engine


def _reset_peak(engine):
    assert engine.in_flight == 0
    engine.max_in_flight = 0


async def test_engine_never_sees_more_than_llm_max_rollouts(engine):
    _reset_peak(engine)
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=6)
    client = LLMClient([engine], router)
    prompts = [[40 + (i % 50)] * (8 + i % 7) for i in range(120)]
    gens = await asyncio.gather(*(
        client.generate(p, SamplingSettings(max_tokens=6 + i % 5, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ))
    # The engine wrapper counts its own concurrent requests: the gate held,
    # and under 120 concurrent callers it was actually filled.
    assert engine.max_in_flight == 6
    assert router.in_flight == [0]
    stats = router.stats()
    assert stats.max_in_flight == [6]
    assert stats.leases_granted == stats.leases_released == 120
    assert stats.wait_s_max > 0  # most callers had to queue
    route_ids = [g.lease.route_id for g in gens]
    assert len(set(route_ids)) == 120
    for i, (p, g) in enumerate(zip(prompts, gens)):
        m = g.lease
        assert m.engine_id == 0
        assert m.prompt_tokens == len(p)
        assert m.completion_tokens == len(g.completion.token_ids) == 6 + i % 5
        assert m.lease_wait_s >= 0 and m.llm_latency_s > 0
        assert m.started_at <= m.finished_at <= time.time()
        assert m.finished_at - m.started_at == pytest.approx(m.llm_latency_s, abs=1e-3)


async def test_cancelled_callers_free_their_leases(engine):
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=3)
    client = LLMClient([engine], router)
    long = SamplingSettings(max_tokens=300, ignore_eos=True)
    tasks = [asyncio.create_task(client.generate([60] * 10, long)) for _ in range(8)]
    while router.in_flight != [3]:
        await asyncio.sleep(0.01)
    assert router.waiting == 5
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert router.in_flight == [0] and router.waiting == 0
    assert engine.in_flight == 0
    await assert_engine_idle(engine)
    # The gate is fully usable again.
    g = await asyncio.wait_for(client.generate([61] * 5, SamplingSettings(max_tokens=3)), 60)
    assert g.lease.completion_tokens == len(g.completion.token_ids)


async def test_engine_errors_free_their_leases(engine):
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=2)
    client = LLMClient([engine], router)
    too_long = [50] * 2100  # > max_model_len of the test engine
    results = await asyncio.gather(
        *(client.generate(too_long, SamplingSettings(max_tokens=4)) for _ in range(5)),
        return_exceptions=True,
    )
    assert all(isinstance(r, EngineError) for r in results)
    assert router.in_flight == [0]
    assert router.stats().leases_released == 5
