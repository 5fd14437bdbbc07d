"""``rlnode bench link``: one real trainer link against N simulated actors.

What is real: the trainer's ``TrainerLink`` (ROUTER, decoding, the group
validation the daemon runs with its ``GroupLimits``, acks, commits,
heartbeats) and its ``CreditLedger`` with the daemon's budget
``(max_lag + 1) * groups_per_step``; each actor's ``ActorLink`` (its own
DEALER, outbox, heartbeats, credit reports) and ``ActorCredits``. What is
fake: the actor's scheduler spends a credit and submits at once a group
of realistic size (``attempts`` episodes x ``turns`` LLM calls x
``tokens`` tokens, the real wire structs, so encoding and decoding cost
what they cost), and the trainer's step is free: it takes
``groups_per_step`` groups, then releases their credits and commits them
(a checkpoint every step). So the figures are the link's ceiling, not a
training run's rate.

The trainer runs in its own process (spawn) so its CPU time
(``time.process_time``, its ZeroMQ I/O thread included) is its alone; the
N actors share the parent process and one event loop. Per N, in order:
connect every actor and let registration settle (two heartbeats); an idle
window of ``idle_s`` (connected, holding credits, starting nothing: the
heartbeat and credit-report load alone); a warm-up of ``idle_s`` (the
first actors to register hold the whole budget: their burst goes first);
the timed window of ``seconds`` (groups/s, CPU per group, submit -> ack
of the groups submitted in it, fairness); a drain (producers stopped,
every group acked) for the loss count. Must not touch anything
but loopback ports and the two processes it starts.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import resource
import time
from typing import Callable

import msgspec
import numpy as np

from rlnode.bench.transport import make_samples
from rlnode.config import Config, LinkConfig
from rlnode.link import ActorLink
from rlnode.link.validate import GroupLimits
from rlnode.wire import GroupDelivery

VOCAB = 151_936  # Qwen's vocabulary: token ids are validated against it
DRAIN_S = 60.0  # longest wait for the last groups' acks after a window


class LinkScaleRow(msgspec.Struct):
    actors: int
    groups_per_s: float  # accepted by the trainer in the timed window
    trainer_cpu_ms_per_group: float  # trainer process CPU in the window / groups accepted
    trainer_cpu_pct: float  # of one core, timed window
    trainer_idle_cpu_pct: float  # of one core, N actors connected, no groups: heartbeats + reports
    sim_cpu_pct: float  # the N simulated actors' process (shares the host with the trainer)
    ack_p50_ms: float  # submit() -> Ack at the actor, groups submitted in the timed window
    ack_p99_ms: float
    acked_in_window: int  # groups the latencies are over (0: none started in the window; latencies 0)
    jain_delivered: float  # Jain's index over groups delivered per actor in the window, (0, 1]
    jain_granted: float  # ... over credits granted per actor in the window
    outstanding_max: int  # the ledger's peak over the whole run
    budget: int
    delivered: int  # groups accepted in the timed window
    submitted: int  # groups submitted over the run (window + drain)
    lost: int  # submitted and never accepted (must be 0)
    duplicates: int  # resends the trainer dropped as already held
    connect_s: float  # until every actor was registered
    window_s: float


class LinkScaleResult(msgspec.Struct):
    rows: list[LinkScaleRow]
    seconds: float
    groups_per_step: int
    max_lag: int
    credit_want: int  # groups each actor asks credits for
    attempts: int
    turns: int
    tokens: int
    group_bytes: int  # one encoded GroupDelivery
    heartbeat_s: float
    details: dict[str, float | int | str]


def jain(values: list[int] | list[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 = all equal, 1/n =
    one actor got everything; 0 when nothing was counted."""
    x = np.asarray(values, dtype=np.float64)
    sq = float((x * x).sum())
    return float(x.sum() ** 2 / (len(x) * sq)) if sq > 0 else 0.0


# ---- the trainer process -------------------------------------------------------

def _trainer_proc(conn, link: LinkConfig, budget: int, groups_per_step: int, limits: GroupLimits) -> None:
    """Child process: a TrainerLink whose fake train loop takes
    ``groups_per_step`` groups per step, then releases and commits them (as
    the daemon does after a step's push and checkpoint). Answers each pipe
    message with a snapshot; None ends it."""
    from rlnode.link import TrainerLink
    from rlnode.log import setup_logging

    setup_logging("warning")  # stdout belongs to the parent's table / JSON

    async def steps(trainer: TrainerLink) -> None:
        taken: list[str] = []
        while True:
            _peer, g = await trainer.next_delivery()
            taken.append(g.group_id)
            if len(taken) >= groups_per_step:
                trainer.release_credits(taken)
                trainer.mark_consumed(taken)
                taken = []

    async def main() -> None:
        trainer = TrainerLink("tcp://127.0.0.1:*", link, credit_budget=budget, limits=limits)
        await trainer.start()
        conn.send(trainer.endpoint)
        task = asyncio.create_task(steps(trainer))
        loop = asyncio.get_running_loop()
        try:
            while await loop.run_in_executor(None, conn.recv) is not None:
                if task.done():  # a dead link re-raises here and ends the run
                    task.result()
                conn.send(_snapshot(trainer))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await trainer.close()

    asyncio.run(main())


def _snapshot(trainer) -> dict:
    c, led = trainer.counters, trainer.credits
    return {"t": time.monotonic(), "cpu": time.process_time(), "accepted": c.groups_accepted,
            "duplicates": c.duplicates, "invalid": c.invalid_groups, "busy": c.busy_rejects,
            "send_failures": c.send_failures, "malformed": c.malformed_frames,
            "connected": sum(p.connected for p in trainer.peers().values()),
            "peak": led.reset_peak(), "budget": led.budget,
            "delivered": {p.peer_id: p.delivered for p in led.peers.values()},
            "granted": {p.peer_id: p.granted for p in led.peers.values()}}


class _Trainer:
    """The parent's handle on the trainer process."""

    def __init__(self, link: LinkConfig, budget: int, groups_per_step: int, limits: GroupLimits):
        ctx = mp.get_context("spawn")  # never fork a process that holds an event loop and ZeroMQ
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_trainer_proc, args=(child, link, budget, groups_per_step, limits),
                                daemon=True)
        self.proc.start()
        child.close()
        self.endpoint = self._recv(60)

    def _recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"benchmark trainer process did not answer in {timeout_s:.0f} s "
                               f"(alive: {self.proc.is_alive()})")
        return self.conn.recv()

    async def snapshot(self) -> dict:
        self.conn.send(True)
        return await asyncio.to_thread(self._recv, 30)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:  # already gone
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


# ---- the simulated actors --------------------------------------------------------

class _TimedActorLink(ActorLink):
    """An ActorLink that records submit -> Ack time per group. ActorLink has
    no per-group ack hook, so this wraps its private ``_on_ack``: a rename
    there shows up here as a failing ``tests/test_bench_link.py``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.submitted_at: dict[str, float] = {}
        self.acks: list[tuple[float, float]] = []  # (submitted at, seconds to its Ack)

    def submit(self, delivery: GroupDelivery) -> bool:
        self.submitted_at[delivery.group_id] = time.perf_counter()
        return super().submit(delivery)

    def _on_ack(self, ids: list[str]) -> None:
        super()._on_ack(ids)
        now = time.perf_counter()
        for gid in ids:
            t = self.submitted_at.pop(gid, None)
            if t is not None:
                self.acks.append((t, now - t))


def _stamp(template: GroupDelivery, group_id: str, node_id: str, session: str) -> GroupDelivery:
    """The template group under a fresh id, sent by ``node_id`` on ``session``'s credit."""
    return msgspec.structs.replace(
        template, group_id=group_id, node_id=node_id, credit_session=session,
        samples=[msgspec.structs.replace(s, group_id=group_id) for s in template.samples])


async def _produce(actor: _TimedActorLink, template: GroupDelivery) -> None:
    """The fake scheduler: spend a credit, submit a group, at once."""
    for i in itertools.count():
        session = await actor.credits.acquire()
        actor.submit(_stamp(template, f"{actor.node_id}-{actor.incarnation}-g{i:07d}", actor.node_id, session))
        await asyncio.sleep(0)  # a credit at hand completes acquire() without yielding


async def _connect(trainer: _Trainer, n: int, link: LinkConfig, want: int) -> list[_TimedActorLink]:
    actors = [_TimedActorLink(trainer.endpoint, f"sim{i:04d}", [(0, 1)], link, credit_want=want)
              for i in range(n)]
    for a in actors:
        await a.start()
    ok = await asyncio.gather(*(a.wait_connected(30 + n / 10) for a in actors))
    if not all(ok):
        raise RuntimeError(f"{n - sum(ok)} of {n} simulated actors could not register")
    return actors


def _per_actor(a: dict, b: dict, key: str, actors: list[_TimedActorLink]) -> list[int]:
    """Per actor (zero for one the ledger never saw), the growth of ``key`` from snapshot a to b."""
    ids = [a_.identity.decode() for a_ in actors]
    return [b[key].get(pid, 0) - a[key].get(pid, 0) for pid in ids]


async def _run_n(n: int, template: GroupDelivery, link: LinkConfig, budget: int, groups_per_step: int,
                 want: int, limits: GroupLimits, seconds: float, idle_s: float,
                 log: Callable[[str], None]) -> LinkScaleRow:
    """One actor count: connect, settle, idle window, warm-up, timed window, drain."""
    trainer = _Trainer(link, budget, groups_per_step, limits)
    actors: list[_TimedActorLink] = []
    producers: list[asyncio.Task] = []
    snap: dict[str, dict] = {}
    try:
        t0 = time.perf_counter()
        actors = await _connect(trainer, n, link, want)
        connect_s = time.perf_counter() - t0
        # Registration's first reports and grants are over after a heartbeat or two.
        await asyncio.sleep(2 * link.heartbeat_s)
        snap["idle"] = await trainer.snapshot()
        await asyncio.sleep(idle_s)
        snap["warm"] = await trainer.snapshot()
        producers = [asyncio.create_task(_produce(a, template)) for a in actors]
        # The first actors to register took the whole budget while idle: let
        # that burst through before the window opens.
        await asyncio.sleep(idle_s)
        snap["window"] = await trainer.snapshot()
        w0, sim0 = time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        snap["end"] = await trainer.snapshot()
        w1, sim_cpu = time.perf_counter(), time.process_time() - sim0
        for p in producers:
            p.cancel()
        await asyncio.gather(*producers, return_exceptions=True)
        drained = await asyncio.gather(*(a.flush(DRAIN_S) for a in actors))
        snap["drained"] = await trainer.snapshot()
    finally:
        for p in producers:
            p.cancel()
        for a in actors:
            await a.close()
        trainer.stop()
    if not all(drained):
        log(f"link n={n}: {n - sum(drained)} actors still had unacked groups after {DRAIN_S:.0f} s")
    row = _row(n, actors, snap, budget, (w0, w1), sim_cpu, connect_s)
    bad = {k: snap["drained"][k] for k in ("invalid", "busy", "malformed") if snap["drained"][k]}
    if bad:
        log(f"link n={n}: trainer refused frames: {bad}")
    log(f"link n={n}: {row.groups_per_s:,.0f} groups/s, trainer {row.trainer_cpu_ms_per_group} ms CPU/group "
        f"({row.trainer_cpu_pct}% busy, {row.trainer_idle_cpu_pct}% idle), ack p99 {row.ack_p99_ms} ms, "
        f"jain {row.jain_delivered}, lost {row.lost}")
    return row


def _row(n: int, actors: list[_TimedActorLink], snap: dict[str, dict], budget: int, window: tuple[float, float],
         sim_cpu: float, connect_s: float) -> LinkScaleRow:
    idle, s1, s2, end = snap["idle"], snap["window"], snap["end"], snap["drained"]
    wall = s2["t"] - s1["t"]
    delivered = s2["accepted"] - s1["accepted"]
    cpu = s2["cpu"] - s1["cpu"]
    # Latency of the groups submitted inside the window (not the warm-up burst, not the drain).
    acks = np.asarray([dt for a in actors for t, dt in a.acks if window[0] <= t < window[1]]) * 1e3
    submitted = sum(a.counters().submitted for a in actors)
    return LinkScaleRow(
        actors=n, groups_per_s=round(delivered / wall, 1),
        trainer_cpu_ms_per_group=round(1e3 * cpu / delivered, 3) if delivered else 0.0,
        trainer_cpu_pct=round(100 * cpu / wall, 1),
        trainer_idle_cpu_pct=round(100 * (snap["warm"]["cpu"] - idle["cpu"]) / (snap["warm"]["t"] - idle["t"]), 1),
        sim_cpu_pct=round(100 * sim_cpu / wall, 1),
        ack_p50_ms=round(float(np.percentile(acks, 50)), 2) if len(acks) else 0.0,
        ack_p99_ms=round(float(np.percentile(acks, 99)), 2) if len(acks) else 0.0, acked_in_window=len(acks),
        jain_delivered=round(jain(_per_actor(s1, s2, "delivered", actors)), 4),
        jain_granted=round(jain(_per_actor(s1, s2, "granted", actors)), 4),
        outstanding_max=max(s["peak"] for s in snap.values()), budget=budget,
        delivered=delivered, submitted=submitted, lost=submitted - end["accepted"],
        duplicates=end["duplicates"], connect_s=round(connect_s, 2), window_s=round(wall, 2))


def _raise_fd_limit(n_max: int) -> int:
    """Each simulated actor holds a ZeroMQ context (a few fds) and a TCP
    connection on each side: raise the soft fd limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    need = 12 * n_max + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        raise RuntimeError(f"{n_max} simulated actors need about {need} file descriptors; the hard limit is {soft}")
    return soft


async def bench_link(cfg: Config, actors: list[int], seconds: float = 5.0, groups_per_step: int = 64,
                     max_lag: int = 1, credit_want: int = 32, turns: int = 3, tokens: int = 512,
                     idle_s: float = 1.0, log: Callable[[str], None] = lambda m: None,
                     curve: bool = False) -> LinkScaleResult:
    """``credit_want``: groups each actor asks for (the actor default,
    max_concurrent_episodes 256 / attempts 8). ``cfg`` supplies the link
    timing (heartbeat_s, peer_timeout_s), attempts and the validation
    limits; never its keys or addresses: everything stays on loopback.
    ``curve``: CurveZMQ on, one key pair per simulated actor (made in a
    temporary directory), so every handshake and revocation scan consults
    the trainer's keyring as a production trainer's does."""
    import tempfile

    from rlnode.link.curve import keygen

    fds = _raise_fd_limit(max(actors))
    attempts = cfg.actor.scheduler.attempts
    template = make_samples(attempts, tokens, attempts, turns=turns)[0]
    limits = GroupLimits.from_config(cfg, VOCAB)
    budget = (max_lag + 1) * groups_per_step
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlnode-bench-keys-") as keys:
        if curve:
            await asyncio.to_thread(keygen, keys, [f"sim{i:04d}" for i in range(max(actors))])
        link = LinkConfig(heartbeat_s=cfg.link.heartbeat_s, peer_timeout_s=cfg.link.peer_timeout_s,
                          curve_dir=keys if curve else "")
        for n in actors:
            rows.append(await _run_n(n, template, link, budget, groups_per_step, credit_want, limits, seconds,
                                     idle_s, log))
    load = os.getloadavg()
    return LinkScaleResult(rows, seconds, groups_per_step, max_lag, credit_want, attempts, turns, tokens,
                           len(msgspec.msgpack.encode(template)), link.heartbeat_s,
                           {"curve": int(curve), "cpu_count": os.cpu_count() or 0, "loadavg_1m": round(load[0], 2),
                            "fd_limit": int(fds) if fds != resource.RLIM_INFINITY else -1})


def print_table(r: LinkScaleResult) -> None:
    print(f"link: one trainer, N simulated actors; groups of {r.attempts} episodes x {r.turns} turns x "
          f"{r.tokens} tokens ({r.group_bytes / 1e3:,.0f} kB); groups_per_step {r.groups_per_step}, "
          f"max_lag {r.max_lag}, want {r.credit_want}/actor, heartbeat {r.heartbeat_s:g} s, "
          f"CURVE {'on' if r.details.get('curve') else 'off'}; "
          f"{r.seconds:g} s per N")
    print(f"{'actors':>6}{'groups/s':>10}{'trainer':>10}{'trainer':>9}{'idle':>7}{'sim':>7}"
          f"{'ack p50':>9}{'ack p99':>9}{'Jain':>7}{'Jain':>7}{'outstanding':>13}{'lost':>6}")
    print(f"{'':>6}{'':>10}{'ms/group':>10}{'CPU %':>9}{'CPU %':>7}{'CPU %':>7}"
          f"{'ms':>9}{'ms':>9}{'groups':>7}{'grants':>7}{'max/budget':>13}{'':>6}")
    for w in r.rows:
        p50, p99 = (f"{w.ack_p50_ms:.1f}", f"{w.ack_p99_ms:.1f}") if w.acked_in_window else ("-", "-")
        print(f"{w.actors:>6}{w.groups_per_s:>10,.0f}{w.trainer_cpu_ms_per_group:>10.3f}{w.trainer_cpu_pct:>9.1f}"
              f"{w.trainer_idle_cpu_pct:>7.1f}{w.sim_cpu_pct:>7.1f}{p50:>9}{p99:>9}"
              f"{w.jain_delivered:>7.3f}{w.jain_granted:>7.3f}{f'{w.outstanding_max}/{w.budget}':>13}{w.lost:>6}")
    d = r.details
    print(f"host: {d['cpu_count']} CPUs, load {d['loadavg_1m']} (trainer and simulated actors share them)")
