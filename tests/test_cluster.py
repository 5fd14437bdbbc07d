"""A trainer and two actor hosts, each in its own network namespace with its
own address (tests/cluster.py), CurveZMQ on, the real daemons on the tiny
model: the multi-host run users start, and the faults they report most.

The scenarios share one cluster and run in this file's order, each leaving
it training for the next (a fresh cluster per scenario would cost minutes
of engine starts on 2 cores):

    test_no_fault             every push reaches both hosts, no 0-sample step
    test_actor_partition      1: an actor cut off for 30 s mid-episode
    test_half_open            5: frames one way only; heartbeats notice
    test_trainer_partition    2: the trainer cut off during a weight push
    test_actor_new_address    4: an actor restarts on a new address
    test_trainer_kill_resume  3: trainer kill -9, restart with --resume
    test_engine_frozen        6: one actor's engine core frozen (SIGSTOP)
                                 while its daemon heartbeats
    test_weight_thread_wedged 7: one actor's weight-receive thread stopped
                                 after it joined, its engine core generating

Each prints what it measured (time to detect, to recover, groups lost and
duplicated). Groups are accounted for through the trainer's metrics.jsonl
(every step names the groups it consumed), /status and the logs."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime, timezone

import pytest

from cluster import HTTP_PORT, LINK_PORT, Cluster, ThreadFreeze, netns_supported
from daemons import ROOT

pytestmark = [pytest.mark.engine, pytest.mark.cluster]

_why_not = netns_supported()
if _why_not:
    pytestmark.append(pytest.mark.skip(reason=f"cluster tests need network namespaces: {_why_not}"))

GROUPS_PER_STEP = 2
MAX_LAG = 1  # conf/demo.toml
BUDGET_STEPS = MAX_LAG + 1  # groups admitted and not consumed <= (max_lag + 1) * groups_per_step
WEIGHTS_TIMEOUT_S = 15
PEER_TIMEOUT_S = 6
COMMON = [
    "--config", str(ROOT / "conf/demo.toml"),
    "--set", "run.progress=false", "--set", "trainer.sync=false",
    "--set", f"actor.scheduler.groups_per_step={GROUPS_PER_STEP}", "--set", "actor.scheduler.attempts=4",
    "--set", "actor.scheduler.eval_every=0", "--set", "trainer.checkpoint_every=2",
    "--set", "actor.router.llm_max_rollouts=8", "--set", "actor.scheduler.max_groups_in_flight=2",
    "--set", f"http.trainer_port={HTTP_PORT}", "--set", f"http.actor_port={HTTP_PORT}",
    "--set", "link.heartbeat_s=1", "--set", f"link.peer_timeout_s={PEER_TIMEOUT_S}",
    "--set", f"trainer.weights.timeout_s={WEIGHTS_TIMEOUT_S}", "--set", "trainer.weights.max_failures=3",
    "--set", "trainer.cpu_threads=1",
    # Every 4th task fails in reset on every attempt (a test cube:
    # tests/plugins/rlnode_test_cubes.py): its groups are dropped on the
    # actor after a retry, and their credits must come back.
    "--set", 'actor.cubes=[{id = "guess5", kind = "faulty-guessing", weight = 1.0, options = {max_number = 5, '
             'max_turns = 3, feedback = "range", fail_reset_every = 4}}]',
    "--set", "actor.scheduler.max_retries=1", "--set", "actor.scheduler.retry_backoff_s=0.05",
]


def trainer_args(cluster: Cluster, model, run_dir, keys, resume=False) -> list[str]:
    t = cluster.trainer
    return ["--role", "trainer", *COMMON, "--set", f"model.path={model}", "--set", f"run.run_dir={run_dir}",
            "--set", f'trainer.bind_host="{t.addr}"', "--set", f"trainer.port={LINK_PORT}",
            "--set", f'link.curve_dir="{keys}"', *(["--resume"] if resume else [])]


def actor_args(cluster: Cluster, name: str, model, run_dir, keys) -> list[str]:
    return ["--role", "actor", *COMMON, "--set", f"model.path={model}", "--set", f"run.run_dir={run_dir}/{name}",
            "--set", f'actor.node_id="{name}"', "--set", f'link.curve_dir="{keys}"',
            "--peers", f"{cluster.trainer.addr}:{LINK_PORT}"]


def trainer_version(st) -> int:
    return st["roles"]["trainer"]["version"]


def actor_version(st) -> int:
    return st["roles"]["actor"]["version"]


def steps_of(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "step" in r]


def lineage(run_dir) -> list[dict]:
    """The steps that made the current weights: a restart from a checkpoint
    at step s writes steps s+1... again; the later record of a step number
    replaces the earlier one (that step's update was lost with the crash)."""
    by_step: dict[int, dict] = {}
    for r in steps_of(run_dir):
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def duplicated_groups(run_dir) -> list[str]:
    seen, dup = set(), []
    for r in lineage(run_dir):
        for g in r["group_ids"]:
            if g in seen:
                dup.append(g)
            seen.add(g)
    return dup


class Run:
    """The shared cluster and what the scenarios need to drive it."""

    def __init__(self, cluster: Cluster, model, work):
        self.cluster, self.model, self.work = cluster, model, work
        self.run_dir = work / "run"
        self.keys = work / "keys"

    def start_trainer(self, resume=False):
        self.cluster.trainer.start(trainer_args(self.cluster, self.model, self.run_dir, self.keys, resume))

    def start_actor(self, node):
        node.start(actor_args(self.cluster, node.name, self.model, self.run_dir, self.keys))

    def version(self) -> int:
        return self.cluster.trainer.wait(lambda st: trainer_version(st) + 1, 60, "the trainer's status") - 1

    def steps_after(self, v: int, n: int, timeout: float, what: str) -> int:
        return self.cluster.trainer.wait(lambda st: trainer_version(st) >= v + n and trainer_version(st), timeout,
                                         what)

    def all_actors_at(self, v: int, timeout: float) -> None:
        for a in self.cluster.actors():
            a.wait(lambda st: actor_version(st) >= v, timeout, f"{a.name} at version >= {v}")


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    from rlnode.link import keygen

    work = tmp_path_factory.mktemp("cluster")
    cluster = Cluster(work)
    with cluster:
        r = Run(cluster, tiny_model_dir, work)
        keygen(r.keys, [a.name for a in cluster.actors()])
        r.start_trainer()
        for a in cluster.actors():
            r.start_actor(a)
        yield r
        # The actors stop side by side (each shuts its engine down: 8-12 s
        # on 2 cores), and before the trainer, whose last step they may
        # still be sending groups for.
        actors = [a for a in cluster.actors() if a.alive()]
        for a in actors:
            a.request_stop()
        codes = {a.name: a.terminate() for a in actors}
        if cluster.trainer.alive():
            codes[cluster.trainer.name] = cluster.trainer.terminate()
        assert all(c == 0 for c in codes.values()), (codes, {
            name: cluster.nodes[name].log_path.read_text().splitlines()[-12:]
            for name, c in codes.items() if c != 0})
        # SIGTERM checkpoints the trainer's last step: a graceful restart
        # (--resume, as after kill -9 in test_trainer_kill_resume) loses none.
        last = max(x["step"] for x in steps_of(r.run_dir))
        latest = (r.run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest.startswith(f"step-{last:07d}-"), (latest, last)


def report(name: str, **figures) -> None:
    print(f"\n[cluster] {name}: " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def _when(event: dict) -> datetime:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))


def test_no_fault(run):
    """Both hosts join every push; no step trains on nothing."""
    t = run.cluster.trainer
    t0 = time.monotonic()
    # Both hosts first: on a loaded machine one engine can take a minute
    # longer to start, and the trainer trains on with the other meanwhile.
    # In the weight group, not only connected: a host whose engine joins
    # too slowly on a loaded start is benched (issue 36) and readmitted by
    # a probe, and the trainer steps on with the other meanwhile.
    t.wait(lambda st: all(peer_connected(st, a.name) for a in run.cluster.actors())
           and len(st["roles"]["trainer"]["weights"]["members"]) == len(run.cluster.actors()), 300,
           "both actor hosts in the weight group")
    run.steps_after(run.version(), 4, 600, "4 versions with two actor hosts")
    v = run.version()
    run.all_actors_at(v - 1, 120)
    pushed = t.events("weights.pushed")
    assert pushed and all(e["peers"] == 2 for e in pushed[-3:]), pushed[-3:]
    # From the first push that reached both hosts on, none failed. Before it
    # one may time out and be retried: with the suite's two workers another
    # file starts engines beside this cluster's start (seen once: version 0,
    # retried after 1 s), which is the loaded start the note above allows.
    both = min(_when(e) for e in pushed if e["peers"] == 2)
    failed = [e for e in t.events("weights.push_failed") if _when(e) > both]
    assert not failed, failed[:2]
    steps = steps_of(run.run_dir)
    assert steps and all(r["samples"] > 0 for r in steps), [r["samples"] for r in steps]
    # Steps push from then on too: the first step's push may be the one the
    # note above allows to time out (seen: [False, True, True, True]).
    pushes = [r["weights_pushed"] for r in steps]
    first = pushes.index(True) if True in pushes else len(pushes)
    assert first <= 1 and all(pushes[first:]), pushes
    assert t.healthy() and all(a.healthy() for a in run.cluster.actors())
    assert not duplicated_groups(run.run_dir)
    budget = (MAX_LAG + 1) * GROUPS_PER_STEP
    for r in steps:  # the credit budget holds across hosts, and so does the staleness bound
        assert r["credit_budget"] == budget and r["credits_outstanding_max"] <= budget, r
        assert r["lag_max"] <= MAX_LAG and r["groups"] == GROUPS_PER_STEP, r
    # The failing tasks' groups were dropped on the actors and gave their credits back.
    dropped = sum(a.must_status()["roles"]["actor"]["cubes"].get("guess5", {}).get("groups_dropped", 0)
                  for a in run.cluster.actors())
    assert dropped > 0
    t.wait(lambda st: st["roles"]["trainer"]["credits"]["returned"] > 0, 30, "dropped groups' credits back")
    report("no_fault", versions=v, pushes=len(pushed), groups_dropped_on_actors=dropped,
           wall_s=round(time.monotonic() - t0))


# ---- helpers for the fault scenarios ---------------------------------------------


def peer_connected(st, node_id: str) -> bool:
    return any(p["node_id"] == node_id and p["connected"] for p in st["roles"]["trainer"]["peers"])


def poll(cond, timeout: float, what: str, every: float = 0.25) -> float:
    """Seconds until ``cond()`` held; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return time.monotonic() - t0


def actor_link(node) -> dict:
    return node.must_status()["roles"]["actor"]["link"]


def lost_groups(run) -> int:
    """Groups an actor took and neither delivered (committed by the trainer,
    or still held to be resent) nor had refused: must be 0 at all times."""
    lost = 0
    for a in run.cluster.actors():
        if not a.alive():
            continue
        c = actor_link(a)
        lost += c["submitted"] - c["committed"] - c["uncommitted"] - c["rejected"] - c["dropped_oversize"]
    return lost


def healthy_again(run, timeout: float = 180) -> None:
    """Every node answers /healthz 200 and every actor is connected."""
    for n in run.cluster.nodes.values():
        poll(lambda n=n: n.healthy(), timeout, f"{n.name} healthy")
    for a in run.cluster.actors():
        run.cluster.trainer.wait(lambda st, a=a: peer_connected(st, a.name), timeout, f"{a.name} connected")


# ---- the scenarios -------------------------------------------------------------------


def test_actor_partition(run):
    """1. An actor cut off for 30 s mid-episode, then healed: training goes
    on without it, its /healthz is red while cut off and green after, its
    groups are delivered once (none lost, none trained twice)."""
    c, t = run.cluster, run.cluster.trainer
    a1 = c.nodes["a1"]
    healthy_again(run)
    a1.wait(lambda st: st["roles"]["actor"]["router"]["in_flight"] and sum(st["roles"]["actor"]["router"]["in_flight"]),
            60, "a1 mid-episode")
    v_cut = run.version()
    t_cut = time.monotonic()
    c.cut(a1)
    try:
        trainer_detect = poll(lambda: not peer_connected(t.must_status(), "a1"), 60, "the trainer to see a1 gone")
        actor_detect = poll(lambda: a1.healthy() is False, 60, "a1's /healthz to turn red")
        why = json.loads(a1.get("/healthz")[1])
        assert "trainer" in json.dumps(why), why
        # Training goes on with a2 alone.
        run.steps_after(v_cut, 2, 120, "training on without a1")
        assert peer_connected(t.must_status(), "a2")
        time.sleep(max(0.0, 30 - (time.monotonic() - t_cut)))
    finally:
        c.heal(a1)
    t_heal = time.monotonic()
    poll(lambda: a1.healthy(), 120, "a1's /healthz to turn green")
    t.wait(lambda st: peer_connected(st, "a1"), 60, "a1 back")
    v = run.version()
    a1.wait(lambda st: actor_version(st) >= v, 120, "a1 to receive the current weights")
    recovered = time.monotonic() - t_heal
    run.steps_after(v, 2, 120, "training with a1 back")
    dup, lost = duplicated_groups(run.run_dir), lost_groups(run)
    report("actor_partition", cut_s=30, trainer_detect_s=round(trainer_detect, 1),
           actor_detect_s=round(actor_detect, 1), recover_s=round(recovered, 1), groups_lost=lost,
           groups_duplicated=len(dup))
    assert not dup and lost == 0


def test_half_open(run):
    """5. The trainer's frames to a1 vanish while a1's still arrive (a
    half-open link): both ends notice within the configured heartbeat
    timeout (link.peer_timeout_s) and recover when the path heals."""
    c, t = run.cluster, run.cluster.trainer
    a1 = c.nodes["a1"]
    healthy_again(run)
    c.drop_to(t, a1)
    try:
        actor_detect = poll(lambda: a1.healthy() is False, 60, "a1 to notice the trainer is silent")
        trainer_detect = poll(lambda: not peer_connected(t.must_status(), "a1"), 60, "the trainer to drop a1")
    finally:
        c.undrop(t, a1)
    t_heal = time.monotonic()
    healthy_again(run)
    v = run.version()
    a1.wait(lambda st: actor_version(st) >= v, 120, "a1 to receive the current weights")
    recovered = time.monotonic() - t_heal
    report("half_open", actor_detect_s=round(actor_detect, 1), trainer_detect_s=round(trainer_detect, 1),
           recover_s=round(recovered, 1), groups_lost=lost_groups(run),
           groups_duplicated=len(duplicated_groups(run.run_dir)))
    # Detected by heartbeats, within the timeout plus the heartbeat period
    # and the probe's own polling, not by a TCP timeout (minutes).
    assert actor_detect < PEER_TIMEOUT_S + 5, actor_detect
    assert trainer_detect < 2 * PEER_TIMEOUT_S + 5, trainer_detect  # the actor stops talking once it gave up
    lost, dup = lost_groups(run), duplicated_groups(run.run_dir)
    assert lost == 0 and not dup, (lost, dup, [actor_link(a) for a in c.actors()])


def test_trainer_partition(run):
    """2. The trainer cut off from every actor during a weight push: the push
    fails or times out, is retried, and every engine ends on the same
    version; nothing hangs past the configured timeouts, and the trainer
    never steps more than max_lag ahead of what its engines hold."""
    c, t = run.cluster, run.cluster.trainer
    healthy_again(run)
    pushes = len(t.events("weights.broadcast"))
    poll(lambda: len(t.events("weights.broadcast")) > pushes, 60, "a push to start", every=0.05)
    c.cut(t)
    t_cut = time.monotonic()
    try:
        detect = poll(lambda: all(not peer_connected(t.must_status(), a.name) for a in c.actors()), 60,
                      "the trainer to see every actor gone")
        poll(lambda: all(a.healthy() is False for a in c.actors()), 60, "the actors to turn red")
        time.sleep(max(0.0, 20 - (time.monotonic() - t_cut)))
        st = t.must_status()["roles"]["trainer"]
        held = max(actor_version(a.must_status()) for a in c.actors())
        # Ahead of what the engines hold by at most max_lag, plus the steps the
        # credit budget lets it take on groups it already holds (nobody to push to).
        assert st["version"] - held <= MAX_LAG + BUDGET_STEPS, (st["version"], held)
    finally:
        c.heal(t)
    t_heal = time.monotonic()
    healthy_again(run)
    v = run.version()

    def same_version():
        vs = {actor_version(a.must_status()) for a in c.actors()}
        return len(vs) == 1 and vs.pop() >= v

    poll(same_version, WEIGHTS_TIMEOUT_S * 4, "every engine on one version >= the trainer's")
    recovered = time.monotonic() - t_heal
    run.steps_after(run.version(), 2, 120, "training after the partition")
    failed = t.events("weights.push_failed")
    report("trainer_partition", detect_s=round(detect, 1), recover_s=round(recovered, 1),
           push_failures=len(failed), groups_lost=lost_groups(run), groups_duplicated=len(duplicated_groups(run.run_dir)))
    assert recovered < WEIGHTS_TIMEOUT_S * 4
    assert lost_groups(run) == 0 and not duplicated_groups(run.run_dir)


def test_actor_new_address(run):
    """4. An actor killed -9 comes back on a new address with its node id: it
    rejoins the link and the weight group (gloo dials its new address), what
    it delivered before is trained once, and the credits its old
    incarnation held (groups running or unsent died with it) are returned
    to the pool and counted."""
    c, t = run.cluster, run.cluster.trainer
    a2 = c.nodes["a2"]
    healthy_again(run)
    old = a2.must_status()["roles"]["actor"]["incarnation"]

    def a2_held(st) -> int:
        peers = st["roles"]["trainer"].get("credits", {}).get("peers", {})
        return sum(v["in_hands"] for p, v in peers.items() if p.startswith("a2/") and old in p)

    # Killed while it holds credits (a group running): on a loaded machine
    # the trainer can hold the whole budget in groups waiting for a step,
    # and an actor killed then holds nothing to give back. Frozen first, so
    # what it holds cannot change between the look and the kill (CI at
    # 9d5ec0e: it delivered its group in between, and held nothing).
    for _ in range(20):
        t.wait(lambda st: a2_held(st) > 0, 180, "a2 to hold a credit")
        a2.freeze()
        time.sleep(1.0)  # what it sent before the freeze reaches the trainer
        if (held := a2_held(t.must_status())) > 0:
            break
        a2.freeze(False)
    assert held > 0, "a2 never held a credit when frozen"
    a2.kill()  # kill -9: whatever it held dies with it
    c.readdress(a2, 20)
    t_start = time.monotonic()
    run.start_actor(a2)
    a2.wait(lambda st: st["roles"]["actor"]["incarnation"] != old and st["roles"]["actor"].get("link", {}).get("connected"),
            300, "a2 to come back on its new address")
    v = run.version()
    a2.wait(lambda st: actor_version(st) >= v, 120, "a2 to receive the current weights")
    rejoined = time.monotonic() - t_start
    run.steps_after(run.version(), 2, 180, "training with a2 on its new address")
    epoch = t.events("weights.epoch")[-1]
    assert len(epoch["peers"]) == 2, epoch
    credits = t.must_status()["roles"]["trainer"]["credits"]
    # The old incarnation's account is gone (its credits back in the pool).
    assert not [p for p in credits["peers"] if p.startswith("a2/") and old in p], credits["peers"]
    assert credits["outstanding"] <= credits["budget"]
    assert credits["reclaimed"] >= held > 0  # it died holding credits (groups running): back in the pool
    report("actor_new_address", rejoin_s=round(rejoined, 1), credits_reclaimed=credits["reclaimed"],
           groups_lost=lost_groups(run),
           groups_duplicated=len(duplicated_groups(run.run_dir)))
    assert lost_groups(run) == 0 and not duplicated_groups(run.run_dir)


def test_trainer_kill_resume(run):
    """3. The trainer killed -9 and restarted with --resume while the actors
    keep generating: groups already trained and checkpointed are not
    trained again (the actors resend what was not committed; the trainer
    drops the ones its checkpoint consumed), the rest are delivered."""
    c, t = run.cluster, run.cluster.trainer
    healthy_again(run)
    v_kill = run.version()
    t.kill()
    t_kill = time.monotonic()
    poll(lambda: all(a.healthy() is False for a in c.actors()), 60, "the actors to notice")
    time.sleep(5)  # the actors keep generating into their outboxes
    run.start_trainer(resume=True)
    t.wait(lambda st: trainer_version(st) > 0 and all(peer_connected(st, a.name) for a in c.actors()), 300,
           "the trainer back with both actors")
    resumed_at = t.events("trainer.resumed")[-1]["version"]
    run.steps_after(resumed_at, 3, 300, "training after the restart")
    back = time.monotonic() - t_kill
    v = run.version()
    run.all_actors_at(v - 1, 120)
    dup = duplicated_groups(run.run_dir)
    link = t.must_status()["roles"]["trainer"]["link"]
    report("trainer_kill_resume", version_at_kill=v_kill, resumed_at=resumed_at, back_training_s=round(back, 1),
           resent_duplicates_dropped=link["duplicates"], groups_lost=lost_groups(run), groups_duplicated=len(dup))
    assert resumed_at <= v_kill and not dup and lost_groups(run) == 0
    # Versions name weights (issue 36): the killed trainer's versions after
    # its last checkpoint (the lost branch) are never trained as on-policy
    # nor served from the prefix cache.
    st = t.must_status()["roles"]["trainer"]
    started = t.events("link.trainer.started")
    assert st["incarnation"] == started[-1]["incarnation"] != started[-2]["incarnation"], started[-2:]
    since = _when(t.events("trainer.resumed")[-1]).timestamp()
    after = [r for r in steps_of(run.run_dir) if r["time"] > since]
    # A lost-branch token trained as if current would show a negative token
    # lag (its version number is ahead of the resumed trainer's); such
    # samples are dropped as foreign instead.
    assert after and all(int(k) >= 0 for r in after for k in r["token_lag_hist"]), \
        [r["token_lag_hist"] for r in after]
    # Every engine serves (and salts its prefix cache with) the new incarnation's weights.
    for a in c.actors():
        engines = a.must_status()["roles"]["actor"]["engines"]
        assert all(e["weights"].endswith("@" + st["incarnation"]) for e in engines), engines
    report("trainer_kill_resume_lineage", lost_versions=v_kill - resumed_at,
           foreign_samples_dropped=st["samples_dropped"]["foreign"])


def engine_cores(node) -> list[int]:
    """Pids of the vLLM engine-core processes under ``node``'s daemon."""
    import psutil

    return [p.pid for p in psutil.Process(node.proc.pid).children(recursive=True) if "EngineCor" in p.name()]


def benched(st) -> list[str]:
    return [b["node_id"] for b in st["roles"]["trainer"]["weights"]["benched"]]


def trains_on_without_a1(run, st, since: datetime) -> list[dict]:
    """With a1 benched (``st``): 3 more steps with a2 alone, each within
    max_lag, a2 keeping up, the trainer healthy (a1's failures are not its
    own: no reason for its watchdog). The steps that began once a1 was out."""
    t, a2 = run.cluster.trainer, run.cluster.nodes["a2"]
    v_bench = trainer_version(st)
    run.steps_after(v_bench, 3, 300, "training on with a2 while a1 is benched")
    st = t.must_status()
    w = st["roles"]["trainer"]["weights"]
    assert benched(st) == ["a1"] and [m.split("/")[0] for m in w["members"]] == ["a2"], w
    a2.wait(lambda s: actor_version(s) >= trainer_version(st) - MAX_LAG, 60, "a2 within max_lag")
    assert t.healthy(), t.get("/healthz")
    # The push that benched a1 may have been a step's: only those after it.
    while_benched = [r for r in steps_of(run.run_dir) if r["time"] > since.timestamp() and r["version"] > v_bench]
    assert while_benched and all(r["weights_pushed"] and r["lag_max"] <= MAX_LAG for r in while_benched), \
        [(r["weights_pushed"], r["lag_max"]) for r in while_benched]
    return while_benched


def a1_back(run, since: float) -> tuple[float, float]:
    """a1 answers a probe and rejoins, catches up, and contributes again: a
    step trains a group of a1's with none of its samples dropped as stale
    (those it generated while out are). Seconds from ``since`` to the
    readmission and to the catch-up."""
    t, a1 = run.cluster.trainer, run.cluster.nodes["a1"]
    t.wait(lambda st: not benched(st) and st["roles"]["trainer"]["weights"]["readmissions"] > 0, 300,
           "a1 to answer a probe and rejoin")
    readmitted = time.monotonic() - since
    v = run.version()
    a1.wait(lambda st: actor_version(st) >= v, 300, "a1 to catch up")
    caught_up = time.monotonic() - since
    steps_back = len(steps_of(run.run_dir))
    poll(lambda: any(r["dropped_stale"] == 0 and any(g.startswith("a1-") for g in r["group_ids"])
                     for r in steps_of(run.run_dir)[steps_back:]), 300, "a step that trains a group from a1")
    return readmitted, caught_up


def test_engine_frozen(run):
    """6. a1's vLLM engine core frozen (SIGSTOP) while its daemon keeps
    heartbeating: a1 is benched after trainer.weights.bench_after failed
    weight conversations, the trainer keeps stepping with a2 within
    max_lag and stays healthy (the failures are a1's, not its own); after
    SIGCONT a probe is answered, a1 rejoins, catches up and contributes
    again. No group is lost or trained twice. Before: every push failed
    (a1's rank never joined), a2 got no weights either and the trainer
    held its steps until SIGCONT."""
    c, t = run.cluster, run.cluster.trainer
    a1, a2 = c.nodes["a1"], c.nodes["a2"]
    healthy_again(run)
    cores = engine_cores(a1)
    assert cores, "a1 runs no engine core"
    t_freeze, frozen_at = time.monotonic(), datetime.now(timezone.utc)
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    try:
        st = t.wait(lambda st: "a1" in benched(st) and st, 300, "the trainer to bench a1")
        detect = time.monotonic() - t_freeze
        assert peer_connected(st, "a1"), "a1's daemon heartbeats: still connected, only benched"
        while_benched = trains_on_without_a1(run, st, frozen_at)
    finally:
        for pid in cores:
            os.kill(pid, signal.SIGCONT)
    readmitted, caught_up = a1_back(run, time.monotonic())
    epoch = t.events("weights.epoch")[-1]
    assert len(epoch["peers"]) == 2, epoch
    dup, lost = duplicated_groups(run.run_dir), lost_groups(run)
    probes = [e for e in t.events("weights.probe_unanswered") if _when(e) > frozen_at]
    failed = [e for e in t.events("weights.push_failed") if _when(e) > frozen_at]
    report("engine_frozen", detect_s=round(detect, 1), steps_while_benched=len(while_benched),
           probes_unanswered=len(probes), readmit_s=round(readmitted, 1), catch_up_s=round(caught_up, 1),
           push_failures=len(failed), groups_lost=lost, groups_duplicated=len(dup))
    assert not dup and lost == 0


def test_weight_thread_wedged(run):
    """7. a1's weight-receive thread (``rlnode-weights`` in its engine core)
    stopped after a1 joined the epoch, the rest of its engine core and its
    daemon running on: the next push's collective times out at the
    trainer, a2 answers and a1 does not, so a1 is named
    (``SilentMembers``) and benched after trainer.weights.bench_after such
    conversations; the trainer keeps stepping with a2 within max_lag and
    stays healthy (none of it is the trainer's own failure); once the
    thread runs again a1 answers a probe, rejoins in a fresh epoch,
    catches up and contributes. No group is lost or trained twice. Before:
    a failure that named nobody counted as the trainer's own, and the same
    members were re-formed at every push."""
    c, t = run.cluster, run.cluster.trainer
    a1, a2 = c.nodes["a1"], c.nodes["a2"]
    healthy_again(run)
    # Both in the weight group: with a1 its only member, a stalled push
    # could name no one (one member is the whole group).
    t.wait(lambda st: sorted(m.split("/")[0] for m in st["roles"]["trainer"]["weights"]["members"]) == ["a1", "a2"],
           300, "a weight group of a1 and a2")
    tids = poll_value(lambda: a1.threads_named("rlnode-weights"), 60, "a1's weight job thread")
    freeze, wedged_at, t_wedge = ThreadFreeze(), datetime.now(timezone.utc), time.monotonic()
    try:
        assert sum(freeze.freeze(tid) for tid in tids) >= 1, tids
        st = t.wait(lambda st: "a1" in benched(st) and st, 300, "the trainer to bench a1")
        detect = time.monotonic() - t_wedge
        assert peer_connected(st, "a1"), "a1's daemon heartbeats: still connected, only benched"
        failed = [e for e in t.events("weights.push_failed") if _when(e) > wedged_at]
        silent = [e for e in failed if "no answer from" in e["error"] and e["blamed"]]
        seen = [(e["error"][:400], e["blamed"], e["own_in_a_row"]) for e in failed]
        assert silent and all(b.startswith("a1/") for e in silent for b in e["blamed"]), seen
        assert all(e["own_in_a_row"] == 0 for e in failed), seen
        while_benched = trains_on_without_a1(run, st, wedged_at)
        assert a1.healthy() is not None, "a1's daemon answers"
    finally:
        freeze.thaw()
    readmitted, caught_up = a1_back(run, time.monotonic())
    dup, lost = duplicated_groups(run.run_dir), lost_groups(run)
    report("weight_thread_wedged", detect_s=round(detect, 1), steps_while_benched=len(while_benched),
           push_failures=len(failed), named_silent=len(silent), readmit_s=round(readmitted, 1),
           catch_up_s=round(caught_up, 1), groups_lost=lost, groups_duplicated=len(dup))
    assert not dup and lost == 0


def poll_value(fn, timeout: float, what: str, every: float = 0.25):
    """``fn()``'s first truthy value; AssertionError after ``timeout``."""
    found = []
    poll(lambda: found.append(fn()) or found[-1], timeout, what, every)
    return found[-1]
