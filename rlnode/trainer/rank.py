"""What every FSDP2 rank of the trainer runs (``rlnode.trainer.parallel``
has the whole picture): the commands rank 0 broadcasts and the control
channel that carries them (msgspec over a gloo group; no pickle), the split
of a step's samples across ranks, the sharding, and ``RankLearner``, the
``Learner`` of one rank. Ranks 1..N-1 are this module's processes
(``python -m rlnode.trainer.rank``); rank 0's ``RankLearner`` lives in the
daemon, behind ``parallel.RankGroup``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import msgspec
import torch
import torch.distributed as dist

from rlnode.config import Config
from rlnode.log import get_logger
from rlnode.trainer.metrics import combine
from rlnode.wire import TrainingSample

log = get_logger("rlnode.trainer.rank")

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
    entropy_coef: float | None = None  # Batch.entropy_coef


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
                      norm_tokens=cmd.norm_tokens, norm_samples=cmd.norm_samples, version=cmd.version,
                      entropy_coef=cmd.entropy_coef)
        self.sync.active = True
        try:
            m = self.learner.train_step(batch)
        finally:
            self.sync.active = False
        return self._reduce(m)

    def _reduce(self, m):
        """Every rank's metrics, combined as one step's (rank 0's result):
        each figure by metrics.REDUCE, the function that merges a rank's
        micro-batches (grad_norm and lr are the step's already)."""
        from rlnode.trainer.learner import StepMetrics

        # StepMetrics is a dataclass: msgspec encodes and decodes it as is.
        mine = _encoder.encode(m)
        all_ = [msgspec.msgpack.decode(b, type=StepMetrics) for b in all_gather_bytes(mine, self.ctl)]
        top = combine([_fields(r) for r in all_])
        m.loss, m.samples, m.tokens, m.step_s = top["loss"], int(top["samples"]), int(top["tokens"]), top["step_s"]
        m.logprob_diff_mean = top["logprob_diff_mean"]
        m.on_policy_diff_max = top.get("on_policy_diff_max")
        m.extra = combine([r.extra for r in all_])
        m.mismatch = combine([r.mismatch for r in all_])
        hist: dict[int, int] = {}
        for r in all_:
            for lag, n in r.token_lag_hist.items():
                hist[lag] = hist.get(lag, 0) + n
        m.token_lag_hist = hist
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


def _fields(m) -> dict[str, float]:
    """A rank's StepMetrics fields that combine across ranks, by name."""
    out = {"loss": m.loss, "samples": m.samples, "tokens": m.tokens, "logprob_diff_mean": m.logprob_diff_mean,
           "step_s": m.step_s}
    if m.on_policy_diff_max is not None:  # a rank without lag-0 samples has none
        out["on_policy_diff_max"] = m.on_policy_diff_max
    return out


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


def init_rank(rank: int, world: int, port: int, cfg: Config):
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
# Ranks 1..N-1: python -m rlnode.trainer.rank RANK WORLD PORT PARENT_PID


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
    ctl = init_rank(rank, world, port, cfg)
    try:
        RankLearner(cfg, ctl).serve()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
