"""AdmissionRouter as a state machine, without an engine."""

import asyncio

import pytest

from rlnode.actor.router import AdmissionRouter


async def test_never_exceeds_capacity_and_releases_all():
    router = AdmissionRouter(num_engines=2, llm_max_rollouts=3)
    peak = [0, 0]

    async def call(i):
        async with router.lease() as lease:
            peak[lease.engine_id] = max(peak[lease.engine_id], router.in_flight[lease.engine_id])
            await asyncio.sleep(0.001 * (i % 5))

    await asyncio.gather(*(call(i) for i in range(200)))
    assert peak == [3, 3]
    assert router.in_flight == [0, 0]
    s = router.stats()
    assert s.max_in_flight == [3, 3]
    assert s.leases_granted == s.leases_released == 200
    assert s.waiting == 0


async def test_least_loaded_first():
    router = AdmissionRouter(num_engines=3, llm_max_rollouts=10)
    leases = [await router.acquire() for _ in range(6)]
    assert sorted(l.engine_id for l in leases) == [0, 0, 1, 1, 2, 2]
    router.release(leases[0])
    router.release(leases[2])  # engines of leases[0] and [2] now have 1 each... pick the min
    nxt = await router.acquire()
    assert router.in_flight[nxt.engine_id] - 1 == min(
        c - (1 if e == nxt.engine_id else 0) for e, c in enumerate(router.in_flight)
    )


async def test_affinity_prefers_previous_engine_while_it_has_room():
    router = AdmissionRouter(num_engines=2, llm_max_rollouts=2)
    a = await router.acquire(affinity=1)
    b = await router.acquire(affinity=1)
    assert (a.engine_id, b.engine_id) == (1, 1)
    c = await router.acquire(affinity=1)  # engine 1 full: falls back to least-loaded
    assert c.engine_id == 0
    off = AdmissionRouter(num_engines=2, llm_max_rollouts=2, affinity=False)
    x = await off.acquire(affinity=1)
    assert x.engine_id == 0  # affinity disabled: least-loaded (ties -> lowest id)


async def test_fifo_handoff_when_full():
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=1)
    first = await router.acquire()
    order = []

    async def waiter(i):
        lease = await router.acquire()
        order.append(i)
        router.release(lease)

    tasks = [asyncio.create_task(waiter(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert router.waiting == 5
    router.release(first)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert router.in_flight == [0]


async def test_cancelled_waiter_leaves_queue_and_frees_nothing_twice():
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=1)
    held = await router.acquire()
    t = asyncio.create_task(router.acquire())
    await asyncio.sleep(0.01)
    assert router.waiting == 1
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert router.waiting == 0
    router.release(held)
    assert router.in_flight == [0]
    again = await asyncio.wait_for(router.acquire(), 1)
    assert again.engine_id == 0


async def test_granted_then_cancelled_in_same_tick_returns_permit():
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=1)
    held = await router.acquire()
    t = asyncio.create_task(router.acquire())
    await asyncio.sleep(0.01)
    router.release(held)  # hands the permit to t's future...
    t.cancel()  # ...but t is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await t
    assert router.in_flight == [0]
    assert router.stats().leases_granted == router.stats().leases_released == 2


async def test_release_on_error_and_cancellation_in_body():
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=2)
    with pytest.raises(RuntimeError):
        async with router.lease():
            raise RuntimeError("tool failed")
    assert router.in_flight == [0]

    async def slow():
        async with router.lease():
            await asyncio.sleep(10)

    t = asyncio.create_task(slow())
    await asyncio.sleep(0.01)
    assert router.in_flight == [1]
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert router.in_flight == [0]


async def test_release_is_idempotent_and_metadata_sane():
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=1)
    lease = await router.acquire()
    lease.record(prompt_tokens=10, completion_tokens=4)
    await asyncio.sleep(0.02)
    m1 = router.release(lease)
    m2 = router.release(lease)
    assert m1 is m2
    assert router.in_flight == [0]
    assert (m1.prompt_tokens, m1.completion_tokens) == (10, 4)
    assert m1.llm_latency_s >= 0.02
    assert m1.finished_at - m1.started_at == pytest.approx(m1.llm_latency_s, abs=1e-5)
    assert m1.lease_wait_s >= 0


async def test_wait_time_stats_reflect_queueing():
    router = AdmissionRouter(num_engines=1, llm_max_rollouts=1)
    held = await router.acquire()
    t = asyncio.create_task(router.acquire())
    await asyncio.sleep(0.05)
    router.release(held)
    lease = await t
    router.release(lease)
    s = router.stats()
    assert s.wait_s_max >= 0.05
    assert lease.metadata.lease_wait_s >= 0.05
    assert s.wait_s_sum >= 0.05


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        AdmissionRouter(num_engines=0, llm_max_rollouts=1)
    with pytest.raises(ValueError):
        AdmissionRouter(num_engines=1, llm_max_rollouts=0)
