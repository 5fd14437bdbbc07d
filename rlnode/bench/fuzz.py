"""``rlnode bench fuzz``: hostile frames at a live trainer while it trains.

A real ``rlnode --role trainer`` process (tiny model, no engine) and, on the
other side, a ZeroMQ DEALER that registers like an actor and then sends
random bytes, truncated and byte-mutated encodings, invalid UTF-8, extra
frames and decodable-but-inconsistent groups (one per rule of
``rlnode.link.validate``), interleaved with valid synthetic groups. Reports
the frames per second the trainer rejects while it keeps training, its
crashes (must be 0), the counts by reason next to what the sender expected,
and the steps trained.

The pieces (``FrameMaker``, ``Oracle``, ``FuzzPeer``, ``fuzz``) are also
what tests/test_fuzz.py drives an in-process trainer with.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import random
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from rlnode.wire import LeaseMetadata
from rlnode.link import validate as V
from rlnode.link.validate import GroupLimits, validate_group
from rlnode.wire import (
    Commit, EpisodeSummary, GroupDelivery, Heartbeat, Register, Reject, ToActor, ToTrainer, TrainingSample,
    VersionUpdate, Welcome, pack_f32, pack_i32,
)

ENC = msgspec.msgpack.Encoder()
CATEGORIES = ("random", "truncated", "mutated", "bad_utf8", "frame_count", "inconsistent", "resend_invalid")
_PLACEHOLDER = "\x01" * 8  # cube_id of bad_utf8 groups: one byte of it is replaced by 0xff


class FrameMaker:
    """Builds frames for one sender (``node_id``): valid groups with token
    ids and finite logprobs a real engine could have produced, and every
    kind of bad frame."""

    def __init__(self, limits: GroupLimits, node_id: str, seed: int = 0):
        self.limits, self.node_id = limits, node_id
        self.rng = random.Random(seed)
        self._ids = 0
        self.invalid_sent: list[str] = []  # ids of groups rejected for content (resend_invalid reuses them)

    def _gid(self, kind: str) -> str:
        self._ids += 1
        return f"{self.node_id}/{kind}/{self._ids}"

    def valid_group(self, version: int, kind: str = "valid") -> GroupDelivery:
        r, lim = self.rng, self.limits
        gid = self._gid(kind)
        episodes, samples = [], []
        for e in range(lim.attempts):
            eid = f"{gid}/e{e}"
            reward = float(e % 2) if e < 2 else r.random()  # two differing rewards: the group has signal
            episodes.append(EpisodeSummary(eid, reward, reward > 0.5, 1, "done"))
            prompt = [r.randrange(lim.vocab_size) for _ in range(r.randint(2, 8))]
            completion = [r.randrange(lim.vocab_size) for _ in range(r.randint(1, 4))]
            samples.append(TrainingSample(
                sample_id=f"{eid}/0", group_id=gid, episode_id=eid, cube_id="fuzz", task_id="t", step_index=0,
                prompt_ids=pack_i32(prompt), completion_ids=pack_i32(completion),
                logprobs=pack_f32([-r.uniform(0.5, 8.0) for _ in completion]), loss_mask=b"\x01" * len(completion),
                reward=reward, finish_reason="stop", termination_reason="done", policy_version=version,
                temperature=1.0, lease=LeaseMetadata(route_id=e, engine_id=0, lease_wait_s=0.0, llm_latency_s=0.0),
                num_turns=1))
        return GroupDelivery(gid, self.node_id, "fuzz", "t", version, episodes, samples)

    # -- bad frames: each returns the frames of one multipart message ------------

    def random_bytes(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randint(0, 300))]

    def truncated(self, version: int) -> list[bytes]:
        body = ENC.encode(self.valid_group(version, "trunc"))
        return [body[: self.rng.randrange(len(body))]]

    def mutated(self, version: int) -> list[bytes]:
        body = bytearray(ENC.encode(self.valid_group(version, "mut")))
        for _ in range(self.rng.randint(1, 4)):
            body[self.rng.randrange(len(body))] = self.rng.randrange(256)
        return [bytes(body)]

    def bad_utf8(self, version: int) -> list[bytes]:
        g = self.valid_group(version, "utf8")
        g.cube_id = _PLACEHOLDER
        body = ENC.encode(g)
        i = body.index(_PLACEHOLDER.encode())
        return [body[:i] + b"\xff" + body[i + 1:]]

    def frame_count(self, version: int) -> list[bytes]:
        return [ENC.encode(Heartbeat(self.node_id, version)), b"extra"]

    def inconsistent(self, version: int, reason: str) -> list[bytes]:
        """A decodable group that breaks exactly the rule named ``reason``
        (or "node_id": another node's name in it)."""
        g = self.valid_group(version, reason)
        s0, r, lim = g.samples[0], self.rng, self.limits
        match reason:
            case V.R_EMPTY:
                g.samples = []
            case V.R_EPISODE_COUNT:
                g.episodes, g.samples = g.episodes[:-1], g.samples[:-1]
            case V.R_DUPLICATE_EPISODE:
                g.episodes[1].episode_id = g.episodes[0].episode_id
            case V.R_EPISODE_WITHOUT_SAMPLES:
                g.samples = g.samples[1:]
            case V.R_FOREIGN_SAMPLE:
                s0.group_id = "someone/else"
            case V.R_UNKNOWN_EPISODE:
                s0.episode_id = "no/such/episode"
            case V.R_DUPLICATE_SAMPLE:
                g.samples.append(msgspec.structs.replace(s0))
            case V.R_TOO_MANY_SAMPLES:
                g.samples += [msgspec.structs.replace(s0, sample_id=f"{s0.sample_id}+{k}", step_index=k + 1)
                              for k in range(lim.max_samples)]
            case V.R_REWARD:
                bad = r.choice([math.nan, math.inf, -math.inf])
                if r.random() < 0.5:
                    g.episodes[0].reward = bad
                else:  # a sample's reward differs from its episode's
                    s0.reward = s0.reward + 0.5 if r.random() < 0.5 else bad
            case V.R_REWARD_BOUND:  # finite, beyond the actors' actor.episode.max_abs_reward
                bound = lim.max_abs_reward
                huge = max(1e30, 2 * bound)
                bad = r.choice([huge, -huge, math.nextafter(bound, math.inf), -math.nextafter(bound, math.inf)])
                if r.random() < 0.5:
                    g.episodes[0].reward = bad
                else:
                    s0.reward = bad
            case V.R_ARRAY_LENGTH:
                which = r.randrange(3)
                if which == 0:
                    s0.logprobs = s0.logprobs[:-2]
                elif which == 1:
                    s0.prompt_ids += b"\x00"
                else:
                    s0.loss_mask += b"\x01"
            case V.R_EMPTY_SEQUENCE:
                if r.random() < 0.5:
                    s0.prompt_ids = b""
                else:
                    s0.completion_ids, s0.logprobs, s0.loss_mask = b"", b"", b""
            case V.R_TOO_LONG:
                s0.prompt_ids = pack_i32([1] * lim.max_model_len)
            case V.R_TOKEN_ID:
                bad = r.choice([-1, lim.vocab_size, lim.vocab_size + 1000, 2**31 - 1])
                s0.completion_ids = pack_i32([bad] + list(s0.completion_token_ids[1:]))
            case V.R_LOGPROB:
                bad = r.choice([math.nan, math.inf, -math.inf, 1.0])
                s0.logprobs = pack_f32([bad] + list(s0.completion_logprobs[1:]))
            case V.R_MASK:
                s0.loss_mask = b"\x02" + s0.loss_mask[1:]
            case V.R_TEMPERATURE:
                s0.temperature = r.choice([0.0, -1.0, math.nan, math.inf, 1e-9])
            case V.R_VERSION:
                if r.random() < 0.5:
                    s0.policy_version = -1
                else:
                    g.start_version = 10**12  # far beyond any max_version_ahead
            case "node_id":
                g.node_id = "not-" + self.node_id
            case _:
                raise ValueError(f"no generator for {reason!r}")
        return [ENC.encode(g)]


class Oracle:
    """What the trainer should make of each frame, computed on the sender's
    side with the same decoder and rules (and the same duplicate memory):
    "malformed/<reason>", "invalid/<reason>", "accepted", "duplicate" or
    "other/<message type>"."""

    def __init__(self, node_id: str, limits: GroupLimits):
        self.node_id, self.limits = node_id, limits
        self.decoder = msgspec.msgpack.Decoder(ToTrainer)
        self.seen: set[str] = set()  # accepted or rejected-for-good group ids
        self.counts: collections.Counter[str] = collections.Counter()
        self.accepted: list[str] = []

    def classify(self, frames: list[bytes], version: int) -> str:
        out = self._classify(frames, version)
        self.counts[out] += 1
        return out

    def _classify(self, frames: list[bytes], version: int) -> str:
        if len(frames) != 1:
            return "malformed/frame_count"
        try:
            msg = self.decoder.decode(frames[0])
        except Exception:
            return "malformed/decode"
        if not isinstance(msg, GroupDelivery):
            return f"other/{type(msg).__name__}"
        if msg.node_id != self.node_id:
            return "invalid/node_id"
        if msg.group_id in self.seen:
            return "duplicate"
        bad = validate_group(msg, self.limits, version)
        if bad is not None:
            if msg.group_id:
                self.seen.add(msg.group_id)
            return f"invalid/{bad[0]}"
        self.seen.add(msg.group_id)
        self.accepted.append(msg.group_id)
        return "accepted"


class FuzzPeer:
    """A DEALER that registers like an actor (no engines, so the trainer
    pushes it no weights) and reads what the trainer answers."""

    def __init__(self, endpoint: str, node_id: str = "fuzz"):
        self.endpoint, self.node_id = endpoint, node_id
        self.incarnation = secrets.token_hex(4)
        self.version = 0
        self.replies: collections.Counter[str] = collections.Counter()
        self.committed: set[str] = set()
        self.rejected: dict[str, str] = {}  # group id -> reject reason
        self.welcomes = 0
        self.sent = 0  # messages sent, heartbeats and registrations included
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.identity = f"{node_id}/{self.incarnation}".encode()
        self.sock.linger, self.sock.rcvhwm, self.sock.sndhwm = 0, 100_000, 100_000
        self._reader: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        self.sock.connect(self.endpoint)
        self._reader = asyncio.create_task(self._read())
        deadline = time.monotonic() + timeout_s
        while not self.welcomes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Welcome from {self.endpoint}")
            await self.send([ENC.encode(Register(self.node_id, self.incarnation, []))])
            await asyncio.sleep(0.2)

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)
        self.sent += 1

    async def heartbeat(self) -> None:
        await self.send([ENC.encode(Heartbeat(self.node_id, self.version))])

    async def _read(self) -> None:
        dec = msgspec.msgpack.Decoder(ToActor)
        while True:
            msg = dec.decode(await self.sock.recv())
            self.replies[type(msg).__name__] += 1
            match msg:
                case Welcome(version=v) | VersionUpdate(version=v) | Heartbeat(version=v):
                    self.version = max(self.version, v)
                    self.welcomes += isinstance(msg, Welcome)
                case Commit(group_ids=ids):
                    self.committed.update(ids)
                case Reject(reason=reason, group_ids=ids):
                    self.replies[f"Reject/{reason}"] += 1
                    for g in ids:
                        self.rejected[g] = reason

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close(0)
        self._ctx.term()


class FuzzRun(msgspec.Struct):
    frames: int
    send_s: float
    by_category: dict[str, int]
    expected: dict[str, int]  # oracle outcome -> count
    valid_sent: list[str]  # ids of the valid groups (all expected "accepted")
    accepted: list[str]  # every id the oracle expects accepted (valid ones and lucky mutations)
    resent_invalid: list[str]


def plan_frames(maker: FrameMaker, oracle: Oracle, frames: int, valid_every: int = 10, seed: int = 0,
                version: int = 0) -> tuple[list[list[bytes]], FuzzRun]:
    """``frames`` messages, built (and classified by ``oracle``) before any
    is sent, so sending measures the trainer, not this generator: every
    ``valid_every``-th a valid group at ``version``, the rest drawn from
    ``CATEGORIES`` (inconsistent groups cycle through every rule)."""
    rng = random.Random(seed)
    rules = list(V.REASONS) + ["node_id"]
    by_cat: collections.Counter[str] = collections.Counter()
    valid, resent, messages = [], [], []
    for i in range(frames):
        v = version
        if i % valid_every == 0:
            cat, g = "valid", maker.valid_group(v)
            out = [ENC.encode(g)]
            valid.append(g.group_id)
        else:
            cat = rng.choice(CATEGORIES)
            if cat == "resend_invalid" and not maker.invalid_sent:
                cat = "inconsistent"
            match cat:
                case "random":
                    out = maker.random_bytes()
                case "truncated":
                    out = maker.truncated(v)
                case "mutated":
                    out = maker.mutated(v)
                case "bad_utf8":
                    out = maker.bad_utf8(v)
                case "frame_count":
                    out = maker.frame_count(v)
                case "inconsistent":
                    rule = rules[by_cat["inconsistent"] % len(rules)]
                    out = maker.inconsistent(v, rule)
                case "resend_invalid":
                    gid = rng.choice(maker.invalid_sent)
                    out = maker.inconsistent(v, V.R_LOGPROB)
                    g = msgspec.msgpack.decode(out[0], type=GroupDelivery)
                    g.group_id = gid
                    for s in g.samples:
                        s.group_id = gid
                    out = [ENC.encode(g)]
                    resent.append(gid)
        outcome = oracle.classify(out, v)
        if cat == "inconsistent" and outcome.startswith("invalid/") and outcome != "invalid/node_id":
            maker.invalid_sent.append(msgspec.msgpack.decode(out[0], type=GroupDelivery).group_id)
        by_cat[cat] += 1
        messages.append(out)
    run = FuzzRun(frames, 0.0, dict(by_cat), dict(oracle.counts), valid, list(oracle.accepted), resent)
    return messages, run


async def send_frames(peer: FuzzPeer, messages: list[list[bytes]], log=lambda msg: None) -> float:
    """Send them all; returns the seconds it took. Heartbeats go in between
    (a peer sending only garbage is silent to the trainer's liveness
    check); they are not counted as frames."""
    t0 = last_hb = time.perf_counter()
    for i, out in enumerate(messages):
        await peer.send(out)
        if i % 32 == 0:
            await asyncio.sleep(0)  # let the trainer's side run when it shares this loop
        if time.perf_counter() - last_hb > 0.3:
            await peer.heartbeat()
            last_hb = time.perf_counter()
        if i and i % 1000 == 0:
            log(f"fuzz: {i}/{len(messages)} frames")
    return time.perf_counter() - t0


async def fuzz(peer: FuzzPeer, maker: FrameMaker, oracle: Oracle, frames: int, valid_every: int = 10,
               seed: int = 0, log=lambda msg: None) -> FuzzRun:
    """``plan_frames`` at the peer's current version, then ``send_frames``."""
    messages, run = plan_frames(maker, oracle, frames, valid_every, seed, peer.version)
    run.send_s = await send_frames(peer, messages, log)
    return run


def expected_counters(run: FuzzRun) -> dict[str, dict[str, int] | int]:
    """The trainer link counters the run must have produced."""
    malformed, invalid = {}, {}
    for k, n in run.expected.items():
        kind, _, reason = k.partition("/")
        if kind == "malformed":
            malformed[reason] = n
        elif kind == "invalid":
            invalid[reason] = n
    return {"malformed_by_reason": malformed, "invalid_by_reason": invalid,
            "groups_accepted": run.expected.get("accepted", 0), "duplicates": run.expected.get("duplicate", 0)}


# -- the benchmark: a real trainer process ---------------------------------------


def _trainer_status(url: str) -> dict | None:
    """The trainer role's ``status()`` from the daemon's /status."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read()).get("roles", {}).get("trainer")
    except OSError:
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_fuzz(cfg, frames: int, log) -> dict:
    from rlnode.bench.weights import build_bench_model
    from rlnode.config import load_config

    run_dir = Path(cfg.run.run_dir) / "bench-fuzz"
    model = cfg.model.path if (Path(cfg.model.path) / "config.json").exists() else \
        build_bench_model("tiny", f"{cfg.run.run_dir}/bench-models/tiny")
    port, http_port = _free_port(), _free_port()
    sets = [f"model.path={model}", f"run.run_dir={run_dir}", f"trainer.port={port}", "trainer.bind_host=127.0.0.1",
            f"http.trainer_port={http_port}", "run.progress=false", "trainer.device=cpu", "trainer.sync=false",
            "trainer.cpu_threads=1", "trainer.checkpoint_every=0", "trainer.max_steps=0",
            "actor.scheduler.attempts=4", "actor.scheduler.groups_per_step=2", "actor.scheduler.max_lag=1000",
            "actor.episode.max_turns=2", "model.max_model_len=64", "actor.sampling.max_tokens=8",
            f"trainer.weights.base_port={_free_port()}"]
    tcfg = load_config(None, sets)  # what the trainer will run with: the sender's limits come from it
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    limits = GroupLimits.from_config(tcfg, vocab)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # the group ids repeat from run to run
    args = [sys.executable, "-m", "rlnode", "--role", "trainer", "--log-json"] + [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    err_path = run_dir / "trainer.log"
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(err_path, "w"), env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{http_port}/status"
    try:
        deadline = time.monotonic() + 180
        while (_trainer_status(url) or {}).get("link") in (None, {}):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trainer did not start (exit {proc.poll()}): {err_path}")
            time.sleep(0.5)
        log(f"fuzz: trainer up on port {port}; sending {frames} frames")
        st0 = _trainer_status(url)
        res = asyncio.run(_bench_send(f"tcp://127.0.0.1:{port}", limits, frames, log))
        run, sent_s = res
        steps_during = (_trainer_status(url) or {}).get("step", 0) - st0.get("step", 0)
        # Let the trainer answer the last frames and train what it accepted.
        exp = expected_counters(run)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            st = _trainer_status(url)
            c = (st or {}).get("link", {})
            if c.get("groups_accepted", 0) >= exp["groups_accepted"] and st["buffered_groups"] < 2:
                break
            time.sleep(0.5)
        st = _trainer_status(url) or {}
        alive = proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    log_text = err_path.read_text()
    # A crash: the process died under the fuzz, or a link task failed (the
    # daemon then stops on its own).
    crashes = int(not alive) + log_text.count("link.trainer.reader_failed") + log_text.count("link.trainer.tick_failed")
    trained: set[str] = set()
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        rec = json.loads(line)
        trained.update(rec.get("group_ids", []))
    c = st.get("link", {})
    rejected = sum(c.get("malformed_by_reason", {}).values()) + sum(c.get("invalid_by_reason", {}).values())
    return {
        "frames": run.frames, "wall_s": round(sent_s, 3), "frames_per_s": round(run.frames / sent_s, 1),
        "rejected": rejected, "rejected_per_s": round(rejected / sent_s, 1),
        "crashes": crashes, "exit_code": proc.returncode, "alive_at_end": alive,
        "steps": st.get("step", 0) - st0.get("step", 0), "steps_while_fuzzed": steps_during,
        "valid_sent": len(run.valid_sent), "valid_trained": len(trained & set(run.valid_sent)),
        "accepted_expected": exp["groups_accepted"], "accepted": c.get("groups_accepted", 0),
        "duplicates": c.get("duplicates", 0), "duplicates_expected": exp["duplicates"],
        "handler_errors": c.get("handler_errors", 0),
        "malformed_by_reason": c.get("malformed_by_reason", {}), "malformed_expected": exp["malformed_by_reason"],
        "invalid_by_reason": c.get("invalid_by_reason", {}), "invalid_expected": exp["invalid_by_reason"],
        "by_category": run.by_category, "counts_match": _matches(c, exp),
    }


def _matches(counters: dict, exp: dict) -> bool:
    return all(counters.get(k) == v for k, v in exp.items())


async def _bench_send(endpoint: str, limits: GroupLimits, frames: int, log) -> tuple[FuzzRun, float]:
    peer = FuzzPeer(endpoint)
    await peer.start()
    try:
        maker, oracle = FrameMaker(limits, peer.node_id, seed=1), Oracle(peer.node_id, limits)
        messages, run = plan_frames(maker, oracle, frames, seed=1, version=peer.version)
        log(f"fuzz: {frames} frames built; sending")
        t0 = time.perf_counter()
        run.send_s = await send_frames(peer, messages, log)
        # Sent is not handled: wait for the trainer's answers to the frames
        # (one Reject or Ack each, heartbeats aside) before stopping the clock.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answered = peer.replies["Reject"] + peer.replies["Ack"]
            if answered >= frames - sum(n for k, n in run.expected.items() if k.startswith("other/")):
                break
            await asyncio.sleep(0.05)
        return run, time.perf_counter() - t0
    finally:
        await peer.close()


def print_table(res: dict) -> None:
    print(f"fuzz: {res['frames']} frames at a live trainer in {res['wall_s']:.2f} s "
          f"({res['frames_per_s']:.0f} frames/s sent and answered)")
    print(f"  rejected {res['rejected']} ({res['rejected_per_s']:.0f}/s), accepted {res['accepted']} "
          f"(expected {res['accepted_expected']}), duplicates {res['duplicates']} "
          f"(expected {res['duplicates_expected']})")
    print(f"  crashes {res['crashes']}  handler errors {res['handler_errors']}  steps trained {res['steps']} "
          f"({res['steps_while_fuzzed']} while the frames came in)  "
          f"valid groups trained {res['valid_trained']}/{res['valid_sent']}  counts match: {res['counts_match']}")
    print(f"\n  {'reason':<34} {'trainer':>8} {'expected':>9}")
    for kind in ("malformed", "invalid"):
        got, exp = res[f"{kind}_by_reason"], res[f"{kind}_expected"]
        for reason in sorted(set(got) | set(exp)):
            print(f"  {kind + '/' + reason:<34} {got.get(reason, 0):>8} {exp.get(reason, 0):>9}")
    print("\n  frames by category: " + ", ".join(f"{k}={v}" for k, v in sorted(res["by_category"].items())))
