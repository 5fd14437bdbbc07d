"""``rlnode bench transport``: what moving training samples actor -> trainer
costs, against the transport PipelineRL uses by default.

  (a) rlnode: groups through ``ActorLink`` -> ``TrainerLink`` over loopback
      TCP, acknowledged. The clock runs from the first ``submit`` until every
      group is acked; the trainer acks a group only after decoding it into
      ``TrainingSample`` objects, so the time covers encode, send, decode and
      the ack round trip. Optionally again with CurveZMQ encryption.
  (b) baseline: a JSONL file stream (PipelineRL's ``FileStreamWriter`` /
      ``read_jsonl_stream``): the writer appends one JSON line per sample
      (token ids and logprobs as JSON lists) and flushes; a reader process
      tails the file and ``json.loads`` each line into a dict. The clock runs
      from the first write until the reader has decoded every line.
      PipelineRL writes with orjson; without it here, msgspec.json stands in
      (same speed class). Its reader polls every 0.1 s; we poll every
      ``poll_s`` (default 5 ms), in the baseline's favour.

Same samples in both (random token ids, float32 logprobs, lease metadata);
the receiving side always runs in a separate process, as a trainer would.
Modes alternate round by round so drift on a shared host hits both alike.
Must not touch anything outside a temporary directory and loopback ports.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Callable

import msgspec
import numpy as np

from rlnode.wire import LeaseMetadata
from rlnode.config import LinkConfig
from rlnode.wire import EpisodeSummary, GroupDelivery, TrainingSample

try:  # PipelineRL's writer
    import orjson

    def _json_line(obj) -> bytes:
        return orjson.dumps(obj)

    JSON_WRITER = "orjson"
except ImportError:  # pragma: no cover - depends on the environment
    _enc = msgspec.json.Encoder()

    def _json_line(obj) -> bytes:
        return _enc.encode(obj)

    JSON_WRITER = "msgspec.json (orjson stand-in)"


class TransportBenchResult(msgspec.Struct):
    samples_per_s: float  # rlnode link, acked
    baseline_samples_per_s: float  # JSONL file stream
    ratio: float  # samples_per_s / baseline_samples_per_s
    samples: int
    tokens_per_sample: int
    group_size: int
    rounds: int
    details: dict[str, float | int | str]


def make_samples(n: int, tokens: int, group_size: int, seed: int = 0, turns: int = 1) -> list[GroupDelivery]:
    """``n`` episodes of ``turns`` LLM calls (samples) each, ``tokens`` tokens
    per sample (3/4 prompt, 1/4 completion, as in multi-turn agent calls), in
    groups of ``group_size`` episodes."""
    rng = np.random.default_rng(seed)
    n_completion = max(1, tokens // 4)
    n_prompt = tokens - n_completion
    groups: list[GroupDelivery] = []
    for g in range(0, n, group_size):
        gid = f"bench-g{g // group_size:06d}"
        episodes = [f"{gid}/e{i}" for i in range(min(group_size, n - g))]
        samples = []
        for i, eid in enumerate(episodes):
            for t in range(turns):
                samples.append(TrainingSample(
                    sample_id=f"{eid}/{t}", group_id=gid, episode_id=eid, cube_id="bench",
                    task_id=f"t{g}", step_index=t,
                    prompt_ids=rng.integers(0, 151_000, n_prompt, dtype="<i4").tobytes(),
                    completion_ids=rng.integers(0, 151_000, n_completion, dtype="<i4").tobytes(),
                    logprobs=(-rng.exponential(1.0, n_completion)).astype("<f4").tobytes(),
                    loss_mask=b"\x01" * n_completion, reward=float(i % 2), finish_reason="stop",
                    termination_reason="done", policy_version=3, temperature=1.0,
                    lease=LeaseMetadata(route_id=(g + i) * turns + t, engine_id=i % 2, lease_wait_s=0.002,
                                        llm_latency_s=0.8, prompt_tokens=n_prompt, completion_tokens=n_completion,
                                        started_at=1.7e9, finished_at=1.7e9 + 0.8),
                    weight_versions=[("3", 0, n_completion)], num_turns=turns,
                ))
        groups.append(GroupDelivery(gid, "bench", "bench", f"t{g}", 3,
                                    [EpisodeSummary(eid, float(i % 2), bool(i % 2), turns, "done")
                                     for i, eid in enumerate(episodes)], samples))
    return groups


def as_json_dict(s: TrainingSample) -> dict:
    """The baseline's native form: what PipelineRL streams, lists not bytes."""
    return {
        "sample_id": s.sample_id, "group_id": s.group_id, "episode_id": s.episode_id, "cube_id": s.cube_id,
        "task_id": s.task_id, "step_index": s.step_index,
        "prompt_ids": s.prompt_token_ids.tolist(), "completion_ids": s.completion_token_ids.tolist(),
        "logprobs": s.completion_logprobs.tolist(), "loss_mask": s.completion_mask.tolist(),
        "reward": s.reward, "finish_reason": s.finish_reason, "termination_reason": s.termination_reason,
        "policy_version": s.policy_version, "temperature": s.temperature,
        "lease": msgspec.to_builtins(msgspec.structs.asdict(s.lease)),
        "weight_versions": [list(w) for w in s.weight_versions], "num_turns": s.num_turns,
    }


# ---- (a) rlnode link -------------------------------------------------------

def _trainer_proc(conn, link: LinkConfig) -> None:
    """Child process: a TrainerLink that counts decoded samples per round."""
    from rlnode.link import TrainerLink
    from rlnode.log import setup_logging

    setup_logging("warning")  # stdout belongs to the parent's table / JSON

    async def main() -> None:
        trainer = TrainerLink("tcp://127.0.0.1:*", link)
        await trainer.start()
        conn.send(trainer.endpoint)
        loop = asyncio.get_running_loop()
        try:
            while (expected := await loop.run_in_executor(None, conn.recv)) is not None:
                got = 0
                while got < expected:
                    _, g = await trainer.next_delivery()
                    got += sum(isinstance(s, TrainingSample) for s in g.samples)
                    trainer.mark_consumed([g.group_id])
                conn.send(got)
        finally:
            await trainer.close()

    asyncio.run(main())


async def _rlnode_round(groups: list[GroupDelivery], link: LinkConfig, conn, endpoint: str, tag: str) -> float:
    from rlnode.link import ActorLink

    # Fresh group ids per round (the trainer would drop repeats as
    # duplicates), in the scheduler's shape for this sender: the trainer
    # refuses an id that names another node or incarnation.
    def own(i: int) -> str:
        return f"bench-{tag}-g{i:07d}"

    groups = [msgspec.structs.replace(g, group_id=own(i), node_id="bench",
                                      samples=[msgspec.structs.replace(s, group_id=own(i)) for s in g.samples])
              for i, g in enumerate(groups)]
    n = sum(len(g.samples) for g in groups)
    async with ActorLink(endpoint, "bench", [(0, 1)], link, incarnation=tag) as actor:
        if not await actor.wait_connected(30):
            raise RuntimeError("benchmark actor could not register with its trainer")
        conn.send(n)
        t0 = time.perf_counter()
        for g in groups:
            actor.submit(g)
        if not await actor.flush(600):
            raise RuntimeError("benchmark groups were not acked in 600 s")
        wall = time.perf_counter() - t0
        got = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    if got != n:
        raise RuntimeError(f"trainer decoded {got} samples, expected {n}")
    return wall


# ---- (b) JSONL file stream ---------------------------------------------------

def _tail_proc(conn, path: str, poll_s: float) -> None:
    """Child process: PipelineRL's read_jsonl_stream, counting decoded lines."""
    while (expected := conn.recv()) is not None:
        while not os.path.exists(path):
            time.sleep(poll_s)
        with open(path) as f:
            got, pos = 0, 0
            while got < expected:
                line = f.readline()
                if line.endswith("\n"):
                    json.loads(line)
                    got += 1
                    pos = f.tell()
                else:  # a partial line: rewind and wait for the writer
                    f.seek(pos)
                    time.sleep(poll_s)
        conn.send(got)


def _jsonl_round(dicts: list[dict], path: str, conn) -> tuple[float, int]:
    if os.path.exists(path):
        os.remove(path)
    conn.send(len(dicts))
    t0 = time.perf_counter()
    size = 0
    with open(path, "a") as f:
        for d in dicts:
            line = _json_line(d).decode()
            f.write(line)
            f.write("\n")
            f.flush()
            size += len(line) + 1
    got = conn.recv()
    wall = time.perf_counter() - t0
    if got != len(dicts):
        raise RuntimeError(f"reader decoded {got} lines, expected {len(dicts)}")
    return wall, size


# ---- driver ------------------------------------------------------------------

def _start_receivers(links: dict[str, LinkConfig], stream: str, poll_s: float):
    """One trainer process per link flavour, one JSONL tail process."""
    spawn = mp.get_context("spawn")  # never fork a process that holds an event loop and ZeroMQ
    procs, conns, endpoints = [], {}, {}
    jobs = [(name, _trainer_proc, (link,)) for name, link in links.items()] + [("jsonl", _tail_proc, (stream, poll_s))]
    for name, target, args in jobs:
        parent, child = spawn.Pipe()
        p = spawn.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        procs.append(p)
        conns[name] = parent
        if name != "jsonl":
            endpoints[name] = parent.recv()
    return procs, conns, endpoints


def _stop_receivers(procs, conns) -> None:
    for c in conns.values():
        c.send(None)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


async def bench_transport(samples: int, tokens: int = 1024, group_size: int = 16, rounds: int = 3,
                          curve: bool = True, poll_s: float = 0.005,
                          log: Callable[[str], None] = lambda m: None) -> TransportBenchResult:
    groups = make_samples(samples, tokens, group_size)
    dicts = [as_json_dict(s) for g in groups for s in g.samples]
    wire_bytes = sum(len(msgspec.msgpack.encode(g)) for g in groups)
    with tempfile.TemporaryDirectory(prefix="rlnode-bench-") as tmp:
        links = {"rlnode": LinkConfig()}
        if curve:
            from rlnode.link.curve import keygen

            keygen(os.path.join(tmp, "keys"), ["bench"])  # the key of node id "bench"
            links["rlnode+curve"] = LinkConfig(curve_dir=os.path.join(tmp, "keys"))
        stream = os.path.join(tmp, "stream.jsonl")
        walls: dict[str, list[float]] = {name: [] for name in [*links, "jsonl"]}
        procs, conns, endpoints = _start_receivers(links, stream, poll_s)
        try:
            for r in range(rounds):
                for name, link in links.items():
                    walls[name].append(await _rlnode_round(groups, link, conns[name], endpoints[name], f"r{r}"))
                    log(f"round {r + 1}/{rounds} {name}: {samples / walls[name][-1]:,.0f} samples/s")
                wall, jsonl_bytes = await asyncio.to_thread(_jsonl_round, dicts, stream, conns["jsonl"])
                walls["jsonl"].append(wall)
                log(f"round {r + 1}/{rounds} jsonl: {samples / wall:,.0f} samples/s")
        finally:
            _stop_receivers(procs, conns)
    rate = {name: samples / statistics.median(w) for name, w in walls.items()}
    details: dict[str, float | int | str] = {
        "rlnode_wire_bytes_per_sample": round(wire_bytes / samples, 1),
        "jsonl_bytes_per_sample": round(jsonl_bytes / samples, 1),
        "rlnode_wall_s_median": round(statistics.median(walls["rlnode"]), 4),
        "jsonl_wall_s_median": round(statistics.median(walls["jsonl"]), 4),
        "jsonl_writer": JSON_WRITER, "jsonl_poll_s": poll_s, "cpu_count": os.cpu_count() or 0,
    }
    if curve:
        details["curve_samples_per_s"] = round(rate["rlnode+curve"], 1)
        details["curve_ratio"] = round(rate["rlnode+curve"] / rate["jsonl"], 2)
    return TransportBenchResult(round(rate["rlnode"], 1), round(rate["jsonl"], 1),
                                round(rate["rlnode"] / rate["jsonl"], 2), samples, tokens, group_size, rounds, details)


def print_table(r: TransportBenchResult) -> None:
    d = r.details
    rows = [("rlnode link (acked)", r.samples_per_s, d["rlnode_wire_bytes_per_sample"])]
    if "curve_samples_per_s" in d:
        rows.append(("rlnode link + CurveZMQ", d["curve_samples_per_s"], d["rlnode_wire_bytes_per_sample"]))
    rows.append(("JSONL file stream", r.baseline_samples_per_s, d["jsonl_bytes_per_sample"]))
    print(f"transport: {r.samples} samples x {r.tokens_per_sample} tokens, groups of {r.group_size}, "
          f"median of {r.rounds} rounds")
    print(f"{'path':<26}{'samples/s':>12}{'MB/s':>10}{'bytes/sample':>14}{'vs JSONL':>10}")
    for name, rate, size in rows:
        print(f"{name:<26}{rate:>12,.0f}{rate * size / 1e6:>10,.1f}{size:>14,.0f}"
              f"{rate / r.baseline_samples_per_s:>9.2f}x")
    print(f"baseline writer: {d['jsonl_writer']}; reader: json.loads, polls every {d['jsonl_poll_s']} s")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-curve", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from rlnode.log import setup_logging

    setup_logging("warning")
    res = asyncio.run(bench_transport(a.samples, a.tokens, a.group_size, a.rounds, not a.no_curve,
                                      log=lambda m: print(m, flush=True) if not a.json else None))
    print(msgspec.json.encode(res).decode()) if a.json else print_table(res)
