"""FSDP2 data parallelism under the one trainer daemon.

Owns: the trainer's ranks on this node. Rank 0 is the daemon (link, weight
push, checkpoints); ranks 1..N-1 are child processes it starts
(``python -m rlnode.trainer.parallel``), each holding a shard of the
weights, gradients and AdamW state, all running the same ``Learner``. Rank 0
drives them with commands (``Command``: msgspec, broadcast as bytes over a
gloo group; no pickle). Must not touch sockets, engines or the run directory.

How a step stays equal to the 1-rank step:
  * the step's samples are split across ranks by forward tokens, an episode
    on one rank (``split_samples``); ``norm_tokens/norm_samples`` stay the
    step's, so the per-rank losses SUM to the step's loss, and FSDP2's
    gradient reduction is a plain sum (divide factor 1, not the mean);
  * ranks run different numbers of forward/backward passes (micro-batches)
    and of head calls (chunks): FSDP2's collectives would pair up wrong. So
    (a) the head group (``base_model`` root params + the head, tied or not)
    is gathered once per step and reduced once per step (no collective per
    chunk), and (b) before each pass every rank votes "one more pass"
    (``_PassSync``): a rank that is out of passes runs a zero-gradient dummy
    pass instead, until no rank has one; then one final zero pass reduces
    the head group's gradients on every rank;
  * clipping uses DTensor norms (global), and the non-finite skip is voted
    (a rank skips only when every rank skips).

Weight pushes gather one full tensor at a time (``DTensor.full_tensor``) on
every rank, in the plan's order (``gathering``); checkpoints gather full
state dicts to rank 0 and load by broadcasting from rank 0, so the files are
the same as a 1-rank run's.

Children die with the daemon: each watches its parent pid, and a collective
whose peer is gone fails.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import threading
import time

import msgspec
import torch
import torch.distributed as dist

from rlnode.config import Config
from rlnode.log import get_logger
from rlnode.wire import TrainingSample

log = get_logger("rlnode.trainer.parallel")

STOP_SEND_S = 10.0  # how long close() waits to hand the children a Stop
STOP_WAIT_S = 20.0  # how long close() waits for children to exit before SIGKILL
PARENT_POLL_S = 0.5  # children check that the daemon still lives this often

# ---------------------------------------------------------------------------
# Wire: rank 0 -> ranks 1..N-1 (broadcast on the control group)


class StepPart(msgspec.Struct, array_like=True, omit_defaults=True):
    """One rank's share of a step."""

    samples: list[TrainingSample]
    advantages: list[float]
    lags: list[int]


class Step(msgspec.Struct, tag="step", array_like=True):
    """Train one optimizer step; rank r trains ``parts[r]``."""

    parts: list[StepPart]
    norm_tokens: int  # the whole step's loss normalizers (every rank's)
    norm_samples: int
    version: int = 0  # the trainer's version: token lags count from it


class Gather(msgspec.Struct, tag="gather", array_like=True):
    """Gather these parameters (or their gradients) one by one, in order."""

    names: list[str]
    grads: bool = False


class GatherState(msgspec.Struct, tag="gather_state", array_like=True):
    """Gather the full model (``what`` = "model") or optimizer state to rank 0."""

    what: str


class LoadModel(msgspec.Struct, tag="load_model", array_like=True):
    """Load the full model state rank 0 holds (broadcast from rank 0)."""


class LoadOptimizer(msgspec.Struct, tag="load_optimizer", array_like=True):
    """Load the full optimizer state rank 0 holds (broadcast from rank 0)."""


SchedulerState = dict[str, int | float | bool | None | list[float | None]]


class LoadScheduler(msgspec.Struct, tag="load_scheduler", array_like=True):
    state: SchedulerState  # torch LRScheduler.state_dict() (plain numbers)


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


Command = Step | Gather | GatherState | LoadModel | LoadOptimizer | LoadScheduler | Stop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


# ---------------------------------------------------------------------------
# Splitting a step across ranks


def split_samples(samples: list, ranks: int, packed: bool = True) -> list[list[int]]:
    """Sample indices per rank: whole episodes, balanced by forward tokens
    (greedy, largest first). An episode's cost is its longest sequence when
    its calls are packed into one row, else the sum of its sequences."""
    episodes: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        episodes.setdefault(s.episode_id, []).append(i)

    def cost(idx: list[int]) -> int:
        lens = [len(samples[i].prompt_ids) // 4 + len(samples[i].completion_ids) // 4 for i in idx]
        return max(lens) if packed else sum(lens)

    load, out = [0] * ranks, [[] for _ in range(ranks)]
    for eid, idx in sorted(episodes.items(), key=lambda kv: (-cost(kv[1]), kv[0])):
        r = min(range(ranks), key=lambda k: (load[k], k))
        load[r] += cost(idx)
        out[r] += idx
    return [sorted(o) for o in out]


# ---------------------------------------------------------------------------
# Sharding


def resolve_ranks(cfg: Config) -> int:
    n = cfg.trainer.parallel.ranks
    if n == 0:
        n = torch.cuda.device_count() if torch.cuda.is_available() and cfg.trainer.device != "cpu" else 1
    return max(1, n)


def shard_model(model, precision: str) -> list:
    """FSDP2 in place: each decoder layer its own unit (bf16 compute under
    "bf16-mixed", fp32 reduction); the decoder (``model.base_model``: the
    embedding and final norm) the root unit; an untied head a unit of its
    own; both in their parameters' dtype (the Learner runs the head in fp32
    under bf16-mixed). A tied head reads the embedding's Parameter from the
    root unit, which stays gathered for the whole step (``_head_collect``).
    Gradients are summed over ranks, never averaged. Returns the FSDP
    units: [layers..., root, head (untied)]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16-mixed" else MixedPrecisionPolicy()
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    tied = head.weight is emb.weight
    units = [fully_shard(layer, mesh=mesh, mp_policy=mixed) for layer in model.base_model.layers]
    units.append(fully_shard(model.base_model, mesh=mesh, reshard_after_forward=False))
    if tied:
        # FSDP2 swaps the embedding's registered Parameter (sharded DTensor
        # <-> gathered tensor) on its own module only: the head reads it
        # from there at call time, and keeps the Parameter object for its
        # dtype and so parameters() lists it once.
        head.weight = emb.weight
        head.forward = lambda x: torch.nn.functional.linear(x, emb.weight)
    else:
        units.append(fully_shard(head, mesh=mesh, reshard_after_forward=False))
    for u in units:
        # Each rank's loss is its share of the step's sum: sum the gradients.
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)
    for u in units[len(model.base_model.layers):]:
        _head_collect(u, False)
    return units


def _head_collect(head, reduce: bool) -> None:
    """Between steps' final passes the head group stays gathered and keeps
    its gradient unsharded (no collective per head call); ``reduce`` = the
    final pass: reduce-scatter and reshard."""
    head.set_requires_gradient_sync(reduce, recurse=False)
    head.set_reshard_after_backward(reduce, recurse=False)


# ---------------------------------------------------------------------------
# One rank: the Learner, the pass vote, and the command handlers


class _PassSync:
    """Makes every rank run the same number of forward/backward passes:
    each real pass of the policy (``token_logprobs`` with grad) is preceded
    by a vote; a rank that has finished its passes answers votes with dummy
    passes until none votes "more"."""

    def __init__(self, rank: RankLearner):
        self.r = rank
        L = rank.learner
        self._score, self._clip = L.token_logprobs, L._clip_and_step
        L.token_logprobs, L._clip_and_step = self.token_logprobs, self.clip_and_step
        self.active = False

    def _vote(self, more: bool) -> bool:
        t = torch.tensor([1 if more else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.r.ctl)
        return bool(t.item())

    def token_logprobs(self, model, samples, *args, **kwargs):
        if self.active and model is self.r.learner.model and torch.is_grad_enabled():
            self._vote(True)
        return self._score(model, samples, *args, **kwargs)

    def dummy_pass(self) -> None:
        """A 1-token forward/backward through every unit: zero gradient."""
        L = self.r.learner
        s = self.r.dummy_sample
        logp = self._score(L.model, [s]).logprobs
        (logp.sum() * 0.0).backward()

    def clip_and_step(self, loss_finite: bool):
        if self.active:
            while self._vote(False):
                self.dummy_pass()
            for u in self.r.held:
                _head_collect(u, True)
            try:
                self.dummy_pass()
            finally:
                for u in self.r.held:
                    _head_collect(u, False)
            t = torch.tensor([1 if loss_finite else 0], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.r.ctl)
            loss_finite = bool(t.item())
        return self._clip(loss_finite)


class RankLearner:
    """One rank's Learner (sharded) and the handlers of each command."""

    def __init__(self, cfg: Config, ctl):
        from rlnode.trainer.learner import Learner

        self.cfg, self.ctl = cfg, ctl
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.units: list = []
        self.learner = Learner(cfg, shard=self._shard)
        # The units gathered for a whole step: the root and an untied head.
        self.held = self.units[len(self.learner.model.base_model.layers):]
        self.params = dict(self.learner.model.named_parameters())
        self.sync = _PassSync(self)
        from rlnode.wire import pack_f32, pack_i32
        from rlnode.wire import LeaseMetadata

        self.dummy_sample = TrainingSample(
            "dummy/0", "dummy", "dummy/e", "-", "-", 0, pack_i32([0]), pack_i32([0]), pack_f32([0.0]),
            bytes([0]), 0.0, "stop", "done", 0, 1.0, LeaseMetadata(0, 0, 0.0, 0.0))

    def _shard(self, model) -> None:
        self.units = shard_model(model, self.cfg.trainer.precision)

    # -- a step --------------------------------------------------------------

    def step(self, cmd: Step):
        from rlnode.trainer.buffer import Batch, token_versions

        part = cmd.parts[self.rank]
        batch = Batch(part.samples, part.advantages, [], [], [], part.lags,
                      token_lags=[cmd.version - token_versions(s) for s in part.samples],
                      norm_tokens=cmd.norm_tokens, norm_samples=cmd.norm_samples, version=cmd.version)
        self.sync.active = True
        try:
            m = self.learner.train_step(batch)
        finally:
            self.sync.active = False
        return self._reduce(m)

    def _reduce(self, m):
        """Every rank's metrics, combined as one step's (rank 0's result)."""
        from rlnode.trainer.learner import StepMetrics

        # StepMetrics is a dataclass: msgspec encodes and decodes it as is.
        mine = _encoder.encode(m)
        all_ = [msgspec.msgpack.decode(b, type=StepMetrics) for b in all_gather_bytes(mine, self.ctl)]
        tokens = sum(r.tokens for r in all_)
        onp = [r.on_policy_diff_max for r in all_ if r.on_policy_diff_max is not None]
        extra: dict[str, float] = {}
        for k in {k for r in all_ for k in r.extra}:
            if k in ("micro_batches", "forward_tokens", "pad_tokens"):
                extra[k] = sum(r.extra.get(k, 0.0) for r in all_)
            elif k.startswith("nonfinite"):
                extra[k] = max(r.extra.get(k, 0.0) for r in all_)
            else:  # means over tokens
                w = sum(r.tokens for r in all_ if k in r.extra)
                extra[k] = sum(r.extra[k] * r.tokens for r in all_ if k in r.extra) / max(1, w)
        if "pad_tokens" in extra:  # a ratio of the sums, not a mean of ratios
            extra["pad_fraction"] = extra["pad_tokens"] / max(1.0, extra["forward_tokens"])
        # Mismatch figures: counts add, maxima take the max, means weigh by
        # each rank's tokens in that lag group; a p99 takes the ranks' max (an
        # upper bound: the exact one needs every rank's tokens in one place).
        mismatch: dict[str, float] = {}
        for k in {k for r in all_ for k in r.mismatch}:
            group = k.rpartition("/")[0] + "/" if "/" in k else ""
            have = [r for r in all_ if k in r.mismatch]
            if k.endswith("tokens"):
                mismatch[k] = sum(r.mismatch[k] for r in have)
            elif k.endswith("_max") or k.endswith("_p99"):
                mismatch[k] = max(r.mismatch[k] for r in have)
            else:
                w = [r.mismatch.get(group + "tokens", r.tokens) for r in have]
                mismatch[k] = sum(r.mismatch[k] * x for r, x in zip(have, w)) / max(1.0, sum(w))
        hist: dict[int, int] = {}
        for r in all_:
            for lag, n in r.token_lag_hist.items():
                hist[lag] = hist.get(lag, 0) + n
        m.mismatch, m.token_lag_hist = mismatch, hist
        m.loss = sum(r.loss for r in all_)
        m.samples = sum(r.samples for r in all_)
        m.tokens = tokens
        m.logprob_diff_mean = sum(r.logprob_diff_mean * r.tokens for r in all_) / max(1, tokens)
        m.on_policy_diff_max = max(onp) if onp else None
        m.extra = extra
        m.step_s = max(r.step_s for r in all_)
        return m

    # -- gathers ---------------------------------------------------------------

    def full(self, name: str, grads: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
        p = self.params[name]
        t = p.grad if grads else p.detach()
        if t is None:
            t = torch.zeros_like(p.detach())
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        return t if dtype is None else t.to(dtype)

    def gather_state(self, what: str):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        L = self.learner
        if what == "model":
            return get_model_state_dict(L.model, options=opts)
        return get_optimizer_state_dict(L.model, L.optimizer, options=opts)

    def load_model(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.learner.model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=False))

    def load_optimizer(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.learner.model, self.learner.optimizer, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

    # -- the children's loop ----------------------------------------------------

    def serve(self) -> None:
        """Ranks 1..N-1: run commands until Stop."""
        while True:
            cmd = recv_command(self.ctl)
            match cmd:
                case Step():
                    self.step(cmd)
                case Gather(names=names, grads=grads):
                    for n in names:
                        self.full(n, grads)
                case GatherState(what=what):
                    self.gather_state(what)
                case LoadModel():
                    self.load_model({})
                case LoadOptimizer():
                    self.load_optimizer({})
                case LoadScheduler(state=state):
                    self.learner.scheduler.load_state_dict(dict(state))
                case Stop():
                    return


# ---------------------------------------------------------------------------
# The control channel


def send_command(cmd, group) -> None:
    data = _encoder.encode(cmd)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)


def recv_command(group):
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, src=0, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return _decoder.decode(buf.numpy().tobytes())


def all_gather_bytes(data: bytes, group) -> list[bytes]:
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    top = max(int(s.item()) for s in sizes)
    buf = torch.zeros(top, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    out = [torch.zeros(top, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, buf, group=group)
    return [o[: int(s.item())].numpy().tobytes() for o, s in zip(out, sizes)]


def _init(rank: int, world: int, port: int, cfg: Config):
    p = cfg.trainer.parallel
    backend = p.backend
    if backend == "auto":
        backend = "nccl" if cfg.trainer.device != "cpu" and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # Commands and votes: always gloo (CPU tensors), whatever FSDP uses.
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


# ---------------------------------------------------------------------------
# Rank 0: the daemon's handle on every rank


class RankGroup:
    """Rank 0's side: starts the children, and turns each operation (step,
    gather, state) into one command that every rank runs. One operation at
    a time (a lock): the push thread and the step thread never interleave
    collectives. Blocking: call from worker threads."""

    def __init__(self, cfg: Config, ranks: int):
        self.cfg, self.world = cfg, ranks
        self.procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self.rank0: RankLearner | None = None
        self.closed = False

    @classmethod
    def start(cls, cfg: Config, ranks: int) -> RankGroup:
        """Blocking: spawn ranks 1..N-1, rendezvous, build every rank's
        Learner (each loads the policy from model.path and keeps its shard)."""
        import socket

        g = cls(cfg, ranks)
        port = cfg.trainer.parallel.port
        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        blob = msgspec.json.encode(cfg)
        try:
            for r in range(1, ranks):
                p = subprocess.Popen([sys.executable, "-m", "rlnode.trainer.parallel", str(r), str(ranks), str(port),
                                      str(os.getpid())], stdin=subprocess.PIPE)
                p.stdin.write(blob)
                p.stdin.close()
                g.procs.append(p)
            ctl = _init(0, ranks, port, cfg)
            g.rank0 = RankLearner(cfg, ctl)
        except BaseException:
            g.close()
            raise
        log.info("trainer.ranks_started", ranks=ranks, port=port, pids=[p.pid for p in g.procs])
        return g

    @property
    def learner(self):
        return self.rank0.learner

    @property
    def model(self):
        return self.rank0.learner.model

    def train_step(self, batch):
        """One optimizer step of ``batch`` over every rank; the combined metrics."""
        idx = split_samples(batch.samples, self.world, self.cfg.trainer.pack_episodes)
        parts = [StepPart([batch.samples[i] for i in ix], [batch.advantages[i] for i in ix],
                          [batch.lags[i] for i in ix]) for ix in idx]
        with self._lock:
            cmd = Step(parts, batch.norm_tokens, batch.norm_samples, batch.version)
            send_command(cmd, self.rank0.ctl)
            return self.rank0.step(cmd)

    def tensor_metas(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor of the full shape) per parameter, each once, in
        the model's order: what ``WeightBroadcaster.plan`` needs."""
        from rlnode.trainer.weights import WRAPPER_PREFIXES

        out = []
        for name, p in self.model.named_parameters():
            for prefix in WRAPPER_PREFIXES:
                name = name.removeprefix(prefix)
            out.append((name, torch.empty(p.shape, dtype=dtype or p.dtype, device="meta")))
        return out

    @contextlib.contextmanager
    def gathering(self, names: list[str], dtypes: list[torch.dtype] | None = None, grads: bool = False):
        """Yields an iterator of (name, full tensor) in ``names`` order,
        gathered one tensor at a time on every rank. Leaving the block
        gathers whatever was not consumed (the other ranks wait for every
        gather): a failed broadcast does not hang them."""
        with self._lock:
            send_command(Gather(list(names), grads), self.rank0.ctl)
            done = [0]

            def gen():
                for i, n in enumerate(names):
                    t = self.rank0.full(n, grads, dtypes[i] if dtypes else None)
                    done[0] = i + 1
                    yield n, t

            try:
                yield gen()
            finally:
                for i in range(done[0], len(names)):
                    self.rank0.full(names[i], grads)

    def push(self, broadcaster, version: int, on_plan) -> object:
        """Blocking, under the caller's WeightGuard: plan the update from
        the full shapes (in the engine's dtype under bf16-mixed: fp32 master
        weights, cast per tensor), hand the plan to ``on_plan``, and
        broadcast it while every rank gathers one full tensor at a time in
        the plan's order."""
        from rlnode.weights.plan import torch_dtype

        engine = self.cfg.model.dtype
        mixed = self.cfg.trainer.precision == "bf16-mixed" and engine != "auto"
        dtype = torch_dtype(engine) if mixed else None
        plan = broadcaster.plan(self.tensor_metas(dtype), version)
        on_plan(plan)
        order = [t for b in plan.buckets for t in b.tensors]
        with self.gathering([t.name for t in order], [torch_dtype(t.dtype) for t in order]) as tensors:
            return broadcaster.broadcast(plan, tensors)

    # -- checkpoints: full state dicts on rank 0 ------------------------------

    def full_model_state(self) -> dict[str, torch.Tensor]:
        with self._lock:
            send_command(GatherState("model"), self.rank0.ctl)
            return self.rank0.gather_state("model")

    def full_optimizer_state(self) -> dict:
        """In ``optimizer.state_dict()``'s format (parameters numbered in
        the model's order), so 1-rank and N-rank checkpoints are one format."""
        with self._lock:
            send_command(GatherState("optimizer"), self.rank0.ctl)
            sd = self.rank0.gather_state("optimizer")
        ids = self._param_ids()
        groups = []
        for g in sd["param_groups"]:
            groups.append({**g, "params": [ids[n] for n in g["params"]]})
        return {"state": {ids[n]: v for n, v in sd["state"].items()}, "param_groups": groups}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            send_command(LoadModel(), self.rank0.ctl)
            self.rank0.load_model(state)

    def load_optimizer_state(self, sd: dict) -> None:
        # A tied Parameter under its first name, as parameters() lists it.
        names = dict(enumerate(n for n, _ in self.model.named_parameters()))
        fqn = {"state": {names[int(i)]: v for i, v in sd["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in sd["param_groups"]]}
        with self._lock:
            send_command(LoadOptimizer(), self.rank0.ctl)
            self.rank0.load_optimizer(fqn)

    def load_scheduler_state(self, sd: dict) -> None:
        with self._lock:  # (a LambdaLR's lr_lambdas are None: its lambdas are functions)
            send_command(LoadScheduler(dict(sd)), self.rank0.ctl)
        self.learner.scheduler.load_state_dict(sd)

    def _param_ids(self) -> dict[str, int]:
        """Parameter name -> its number in ``optimizer.state_dict()`` (every
        alias of a tied parameter maps to the one number)."""
        order = {id(p): i for i, p in enumerate(self.model.parameters())}
        return {n: order[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False)}

    def checkpoint_views(self):
        """(model, optimizer, scheduler) stand-ins for CheckpointManager and
        save_hf_policy: they read and write full state through every rank."""
        return _ModelView(self), _OptimizerView(self), _SchedulerView(self)

    # -- shutdown ---------------------------------------------------------------

    def _send_stop(self) -> None:
        try:
            with self._lock:
                send_command(Stop(), self.rank0.ctl)
        except Exception as e:  # a child died: the kill in close() ends the rest
            log.warning("trainer.ranks_stop_failed", error=repr(e))

    def close(self) -> None:
        """Stop the children (a Stop command, then SIGKILL after
        STOP_WAIT_S) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self.rank0 is not None and all(p.poll() is None for p in self.procs):
            # In a thread: after a failed operation the children may sit in
            # a collective rank 0 left; the kill below ends that, and them.
            stopper = threading.Thread(target=self._send_stop, daemon=True, name="ranks-stop")
            stopper.start()
            stopper.join(STOP_SEND_S)
            stuck = stopper.is_alive()
        else:
            stuck = True  # a child is gone: the others cannot finish a command
        deadline = time.monotonic() + (0.0 if stuck else STOP_WAIT_S)
        killed = 0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                killed += 1
        if dist.is_initialized():
            dist.destroy_process_group()
        log.info("trainer.ranks_stopped", ranks=self.world, killed=killed)


class _ModelView:
    """The sharded policy as CheckpointManager sees a model."""

    def __init__(self, g: RankGroup):
        self.g = g
        self.config = g.model.config

    def save_pretrained(self, out, **kw) -> None:
        self.g.model.save_pretrained(out, state_dict=self.g.full_model_state(), **kw)

    def load_state_dict(self, weights: dict, strict: bool = True):
        want = {n for n, _ in self.g.model.named_parameters(remove_duplicate=False)}
        want |= {n for n, _ in self.g.model.named_buffers() if n in weights}
        missing = sorted(want - set(weights))
        unexpected = sorted(set(weights) - want)
        # A tied head is the embedding's Parameter: loaded under its name.
        state = {k: v for k, v in weights.items() if k in want}
        self.g.load_model_state(state)
        return missing, unexpected


class _OptimizerView:
    def __init__(self, g: RankGroup):
        self.g = g

    def state_dict(self) -> dict:
        return self.g.full_optimizer_state()

    def load_state_dict(self, sd: dict) -> None:
        self.g.load_optimizer_state(sd)


class _SchedulerView:
    def __init__(self, g: RankGroup):
        self.g = g

    def state_dict(self) -> dict:
        return self.g.learner.scheduler.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.g.load_scheduler_state(sd)


# ---------------------------------------------------------------------------
# Ranks 1..N-1: python -m rlnode.trainer.parallel RANK WORLD PORT PARENT_PID


def _watch_parent(parent: int) -> None:
    """Exit at once when the daemon is gone (reparented): no orphan rank
    holds a GPU's memory. PR_SET_PDEATHSIG would fire when the daemon's
    spawning *thread* ends, so the pid is polled instead."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(PARENT_POLL_S)


def main() -> None:
    rank, world, port, parent = (int(a) for a in sys.argv[1:5])
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=Config)
    ctl = _init(rank, world, port, cfg)
    try:
        RankLearner(cfg, ctl).serve()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
