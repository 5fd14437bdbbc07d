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

Each prints what it measured (time to detect, to recover, groups lost and
duplicated). Groups are accounted for through the trainer's metrics.jsonl
(every step names the groups it consumed), /status and the logs."""

from __future__ import annotations

import json
import time

import pytest

from cluster import HTTP_PORT, LINK_PORT, Cluster, netns_supported
from daemons import ROOT

pytestmark = [pytest.mark.engine, pytest.mark.cluster]

_why_not = netns_supported()
if _why_not:
    pytestmark.append(pytest.mark.skip(reason=f"cluster tests need network namespaces: {_why_not}"))

GROUPS_PER_STEP = 2
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
        return trainer_version(self.cluster.trainer.status())

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
        codes = {n.name: n.terminate() for n in reversed(list(cluster.nodes.values())) if n.alive()}
        assert all(c == 0 for c in codes.values()), codes


def report(name: str, **figures) -> None:
    print(f"\n[cluster] {name}: " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def test_no_fault(run):
    """Both hosts join every push; no step trains on nothing."""
    t = run.cluster.trainer
    t0 = time.monotonic()
    run.steps_after(0, 6, 600, "6 versions with two actor hosts")
    v = run.version()
    run.all_actors_at(v - 1, 120)
    pushed = t.events("weights.pushed")
    assert pushed and all(e["peers"] == 2 for e in pushed[-3:]), pushed[-3:]
    assert not t.events("weights.push_failed"), t.events("weights.push_failed")[:2]
    steps = steps_of(run.run_dir)
    assert steps and all(r["samples"] > 0 for r in steps), [r["samples"] for r in steps]
    assert all(r["weights_pushed"] for r in steps), [r["weights_pushed"] for r in steps]
    assert t.healthy() and all(a.healthy() for a in run.cluster.actors())
    assert not duplicated_groups(run.run_dir)
    report("no_fault", versions=v, pushes=len(pushed), wall_s=round(time.monotonic() - t0))
