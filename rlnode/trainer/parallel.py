"""FSDP2 data parallelism under the one trainer daemon.

Owns: the trainer's ranks on this node. Rank 0 is the daemon (link, weight
push, checkpoints); ranks 1..N-1 are child processes it starts
(``python -m rlnode.trainer.rank``, which holds what every rank runs), each holding a shard of the
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
from rlnode.trainer.rank import (
    Gather, GatherState, LoadModel, LoadOptimizer, LoadScheduler, RankLearner, Step, StepPart, Stop, init_rank,
    send_command, split_samples,
)

log = get_logger("rlnode.trainer.parallel")

STOP_SEND_S = 10.0  # how long close() waits to hand the children a Stop
STOP_WAIT_S = 20.0  # how long close() waits for children to exit before SIGKILL

def resolve_ranks(cfg: Config) -> int:
    n = cfg.trainer.parallel.ranks
    if n == 0:
        n = torch.cuda.device_count() if torch.cuda.is_available() and cfg.trainer.device != "cpu" else 1
    return max(1, n)


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
                p = subprocess.Popen([sys.executable, "-m", "rlnode.trainer.rank", str(r), str(ranks), str(port),
                                      str(os.getpid())], stdin=subprocess.PIPE)
                p.stdin.write(blob)
                p.stdin.close()
                g.procs.append(p)
            ctl = init_rank(0, ranks, port, cfg)
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
            cmd = Step(parts, batch.norm_tokens, batch.norm_samples, batch.version, batch.entropy_coef)
            send_command(cmd, self.rank0.ctl)
            return self.rank0.step(cmd)

    def tensor_metas(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor of the full shape) per parameter, each once, in
        the model's order: what ``WeightBroadcaster.plan`` needs."""
        from rlnode.weights.broadcast import WRAPPER_PREFIXES

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


