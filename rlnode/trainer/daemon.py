"""TrainerDaemon: the trainer role's lifecycle and its optimizer loop.

Owns: the link's server side (groups in, acks and commits out), the group
buffer, the Learner (model + optimizer, in a worker thread), the weight
pushes to every actor after each step, checkpoints, metrics.jsonl and the
final policy. One per job.

The loop, per optimizer step (version v -> v + 1):
    wait for groups_per_step complete groups -> batch (stale samples dropped,
    zero-signal groups skipped) -> train_step (thread) -> version v + 1 ->
    push weights to every actor (in flight: engines pause only to load) ->
    metrics line -> every checkpoint_every steps: checkpoint, then commit
    the groups it covers to their actors (they stop keeping them).

``--resume`` loads the latest checkpoint: weights, optimizer, scheduler,
RNG, version, and the ids of consumed groups (a resent group that was
already trained is dropped as a duplicate).
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from pathlib import Path

import msgspec

from rlnode.config import Config, effective_max_lag
from rlnode.aio import run_until_stopped
from rlnode.log import get_logger, set_version
from rlnode.ops.netaddr import resolve_advertise_host
from rlnode.trainer.buffer import GroupBuffer
from rlnode.trainer.loss import next_entropy_coef

log = get_logger("rlnode.trainer")

HISTORY_STEPS = 2000  # step records kept in memory (the live page's window)
HISTORY_EVALS = 2000  # eval records kept in memory (cube x version)


class TrainerDaemon:
    name = "trainer"

    def __init__(self, cfg: Config, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.run_dir = Path(cfg.run.run_dir)
        self.version = 0
        self.step = 0
        self.learner = None
        self.ranks = None  # rlnode.trainer.parallel.RankGroup when trainer.parallel gives > 1 rank
        self.link = None
        self.pusher = None
        loss = cfg.trainer.loss
        self.buffer = GroupBuffer(cfg.actor.scheduler.groups_per_step, effective_max_lag(cfg), cfg.trainer.advantage,
                                  keep_zero_signal=loss.entropy_term or loss.entropy_target > 0 or loss.kl_coef > 0)
        # The entropy bonus's coefficient, moved after each step when
        # trainer.loss.entropy_target is set (loss.next_entropy_coef).
        self.entropy_coef = loss.entropy_coef
        self.pending_commit: list[str] = []  # consumed since the last checkpoint
        self.empty_batches = 0  # batches consumed without a step (nothing to train on)
        self.waiting_for_engines = False  # the train loop holds a step until a push lands
        self.last_checkpoint_step = 0
        self.last_metrics: dict = {}
        # What the live page and the final table show; metrics.jsonl has
        # everything. Bounded so a long run's memory does not grow with it.
        self.eval_history: collections.deque[dict] = collections.deque(maxlen=HISTORY_EVALS)
        self.step_history: collections.deque[dict] = collections.deque(maxlen=HISTORY_STEPS)
        # Groups admitted and not yet consumed, over all actors: the link's
        # credits enforce it (rlnode/link/credits.py).
        self.credit_budget = (effective_max_lag(cfg) + 1) * cfg.actor.scheduler.groups_per_step

    # -- startup -----------------------------------------------------------------

    async def start(self) -> None:
        from rlnode.link.trainer_link import TrainerLink
        from rlnode.link.validate import GroupLimits
        from rlnode.trainer.checkpoint import CheckpointManager, MetricsWriter
        from rlnode.trainer.learner import Learner
        from rlnode.trainer.parallel import RankGroup, resolve_ranks
        from rlnode.trainer.weight_push import WeightPusher
        from rlnode.trainer.trackers import open_sinks
        from rlnode.weights.broadcast import WeightBroadcaster, WeightGuard
        from rlnode.weights.lora import adapter_spec

        t = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if (ranks := resolve_ranks(self.cfg)) > 1:  # FSDP2: this process is rank 0
            self.ranks = await asyncio.to_thread(RankGroup.start, self.cfg, ranks)
            self.learner = self.ranks.learner
        else:
            self.learner = await asyncio.to_thread(Learner, self.cfg)
        self.checkpoints = CheckpointManager(self.run_dir, t.keep_checkpoints)
        consumed: dict | list = []  # rlnode.link.consumed state (a plain list in older checkpoints)
        restored_ids: list[str] = []
        if self.resume:
            consumed, restored_ids = await self._resume()
        self.metrics = MetricsWriter(self.run_dir, await asyncio.to_thread(open_sinks, self.cfg, self.run_dir))
        self.link = TrainerLink(f"tcp://{t.bind_host}:{t.port}", self.cfg.link, version=self.version,
                                credit_budget=self.credit_budget,
                                limits=GroupLimits.from_config(self.cfg, self.learner.vocab_size))
        # Restored groups count as consumed for the link: a resend of one is
        # a duplicate (it is already in the buffer).
        self.link.load_consumed(consumed, restored_ids)
        self.link.hold_credits(g.group_id for g in self.buffer.snapshot())  # restored: they count
        # Weights are named by version @ this incarnation (wire.weights_label):
        # samples of weights off this lineage (a lost branch) are foreign.
        self.buffer.lineage.own = self.link.incarnation
        await self.link.start()
        master = t.weights.master_host or resolve_advertise_host(self.cfg)
        broadcaster = WeightBroadcaster(t.weights, master_host=master, device=str(self.learner.device),
                                        timeout_s=t.weights.timeout_s, source=self.link.incarnation)
        self.pusher = WeightPusher(self.link, broadcaster, self.learner.model, WeightGuard(self.version),
                                   request_timeout_s=t.weights.timeout_s + 30, max_failures=t.weights.max_failures,
                                   ranks=self.ranks, bench_after=t.weights.bench_after,
                                   adapter=adapter_spec(t.lora) if t.lora.rank else None)
        set_version(self.version)
        log.info("trainer.started", bind=self.link.endpoint, version=self.version, run_dir=str(self.run_dir),
                 resumed=self.resume, device=str(self.learner.device), attention=self.learner.attn_impl)

    async def _resume(self) -> tuple[dict | list, list[str]]:
        """Load the latest checkpoint; returns its consumed-id state and the
        ids of the buffered groups it restored."""
        path = self.checkpoints.latest()
        if path is None:
            log.warning("trainer.resume_without_checkpoint", run_dir=str(self.run_dir))
            return [], []
        state = await asyncio.to_thread(self.checkpoints.load, path, *self._state_views())
        self.version, self.step = state["version"], state["step"]
        # Whose versions this checkpoint's weights descend from ({} in older ones).
        self.buffer.lineage.inherited = dict(state.get("weights_lineage") or {})
        if self.cfg.trainer.loss.entropy_target > 0:  # else the configured constant, whatever it was
            self.entropy_coef = max(self.cfg.trainer.loss.entropy_coef, state.get("entropy_coef", self.entropy_coef))
        restored = await asyncio.to_thread(self.checkpoints.load_buffer, path)
        for g in restored:
            self.buffer.put(g)
        self.last_checkpoint_step = self.step
        log.info("trainer.resumed", checkpoint=str(path), version=self.version, step=self.step,
                 restored_buffered_groups=len(restored))
        return state["consumed_group_ids"], [g.group_id for g in restored]

    # -- run -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(c, name=n) for n, c in (
            ("intake", self._intake()), ("peers", self._peer_events()), ("evals", self._evals()),
            ("pushes", self.pusher.run()),
            ("train", self._train_loop(stop)))]
        await run_until_stopped(tasks, stop)

    async def _intake(self) -> None:
        while True:
            _peer, group = await self.link.next_delivery()
            self.buffer.put(group)

    async def _evals(self) -> None:
        while True:
            _peer, report = await self.link.evals.get()
            for cube_id, stats in report.cubes.items():
                self.record_eval(report.version, cube_id, stats)

    async def _peer_events(self) -> None:
        while True:
            ev = await self.link.events.get()
            log.info("trainer.peer", kind=ev.kind, peer=ev.peer_id)
            self.pusher.membership_changed()
            if ev.kind == "joined":
                # A (re)joining actor gets the current weights right away
                # (pushed by the pusher's own task, serialized with the rest).
                self.pusher.request()

    async def _train_loop(self, stop: asyncio.Event) -> None:
        t = self.cfg.trainer
        max_lag = effective_max_lag(self.cfg)
        while not stop.is_set() and (t.max_steps == 0 or self.step < t.max_steps):
            await self._wait_for_engines(max_lag)
            await self.buffer.wait_ready()
            t_wait = time.perf_counter()
            batch = self.buffer.take_batch(self.version)
            if not batch.samples:
                self._consumed_without_step(batch)
                continue
            m = await self._train(batch)
            t_push, pushed = time.perf_counter(), False
            try:
                if not m.skipped:  # a skipped step left the weights (and the version) as they were
                    pushed = await self.pusher.push(self.version)
                    self.link.set_version(self.version)
            finally:  # also when stopped mid-push: the step happened, record it
                # Only now, with the new weights out, may new groups start
                # (in sync mode they must start on them).
                self.link.release_credits(batch.group_ids)
                self._write_step_metrics(batch, m, time.perf_counter() - t_push, pushed,
                                         time.perf_counter() - t_wait)
            if t.checkpoint_every and self.step - self.last_checkpoint_step >= t.checkpoint_every:
                await self.checkpoint()
        log.info("trainer.done", step=self.step, version=self.version)
        await self._wait_final_eval(stop)
        if self.cfg.run.progress:
            print_final_table(self)

    async def _wait_for_engines(self, max_lag: int) -> None:
        """Hold the next step while the group's engines are more than
        max_lag versions behind (their pushes fail): everything they
        generate would be dropped as stale, and each step would widen the
        gap. An actor that keeps failing is benched (the pusher) and no
        longer holds the others back. /healthz turns red through the
        pusher's own-failure count meanwhile."""
        if not self.pusher.engines_behind(self.version, max_lag):
            return
        self.waiting_for_engines = True
        log.warning("trainer.waiting_for_engines", version=self.version, engines_at=self.pusher.pushed_version,
                    max_lag=max_lag, push_error=self.pusher.last_error)
        try:
            waited = await self.pusher.wait_engines(self.version, max_lag)
        finally:
            self.waiting_for_engines = False
        log.info("trainer.engines_caught_up", version=self.version, engines_at=self.pusher.pushed_version,
                 waited_s=round(waited, 1))

    def _consumed_without_step(self, batch) -> None:
        """A batch with nothing to train on (every sample stale, every
        group without signal): no optimizer step and no new version (a
        version names weights that moved); the groups are consumed all the
        same, recorded where they died (metrics.jsonl) and their credits
        returned."""
        self.pending_commit += batch.group_ids
        self.link.release_credits(batch.group_ids)
        self.empty_batches += 1
        rec = {"no_step": True, "version": self.version, "time": time.time(), "group_ids": batch.group_ids,
               "groups": len(batch.group_ids), "dropped_stale": batch.dropped_stale,
               "dropped_foreign": batch.dropped_foreign,
               "zero_signal_groups": batch.zero_signal_groups, "empty_batches_total": self.empty_batches}
        self.metrics.write(rec)
        log.warning("trainer.no_step", reason="no sample to train on", version=self.version,
                    groups=len(batch.group_ids), dropped_stale=batch.dropped_stale,
                    dropped_foreign=batch.dropped_foreign, zero_signal_groups=batch.zero_signal_groups)

    async def _wait_final_eval(self, stop: asyncio.Event) -> None:
        sched = self.cfg.actor.scheduler
        if not (sched.eval_every and any(c.eval for c in self.cfg.actor.cubes)):
            return
        if self.version % sched.eval_every:
            return
        deadline = time.monotonic() + self.cfg.run.final_eval_wait_s
        while time.monotonic() < deadline and not stop.is_set():
            if any(r["version"] == self.version for r in self.eval_history):
                return
            await asyncio.sleep(0.5)

    async def _train(self, batch):
        """One optimizer step, and its bookkeeping, as one unit: a stop that
        arrives mid-step waits for it, so the model, the version and the set
        of consumed groups (saved in the checkpoint) always agree."""
        # Under the weight guard: no push reads the parameters mid-step.
        train = self.ranks.train_step if self.ranks is not None else self.learner.train_step
        batch.entropy_coef = self.entropy_coef
        step = asyncio.ensure_future(asyncio.to_thread(self.pusher.guard.step, train, batch))
        try:
            m = await asyncio.shield(step)
        except asyncio.CancelledError:
            m = await step
            self._stepped(batch, m)
            self._write_step_metrics(batch, m, 0.0, False, m.step_s)
            raise
        self._stepped(batch, m)
        return m

    def _stepped(self, batch, m) -> None:
        if m.skipped:  # non-finite loss or gradient: the weights did not move, so no new version
            self.pending_commit += batch.group_ids  # the groups are consumed all the same
            log.warning("trainer.step_skipped", reason="nonfinite", loss=m.loss, grad_norm=m.grad_norm,
                        groups=len(batch.group_ids), total=self.learner.skipped_steps)
            return
        self.step += 1
        self.version += 1
        self.pending_commit += batch.group_ids
        set_version(self.version)
        self.entropy_coef = next_entropy_coef(self.entropy_coef, m.extra.get("entropy"), self.cfg.trainer.loss,
                                              failing=batch.groups_all_failed > 0)

    def _write_step_metrics(self, batch, m, push_s: float, pushed: bool, step_s: float) -> None:
        rewards = batch.rewards
        rec = {
            "step": self.step, "version": self.version, "time": time.time(),
            "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "success_mean": statistics.fmean(batch.successes) if batch.successes else 0.0,
            "groups": len(batch.group_ids), "samples": m.samples, "tokens": m.tokens,
            # Replies max_tokens (or the context) cut short: trained as they
            # are, flagged per sample (finish_reason "length") and counted here.
            "length_cut_fraction": (sum(s.finish_reason == "length" for s in batch.samples) / len(batch.samples)
                                    if batch.samples else 0.0),
            "lag_mean": statistics.fmean(batch.lags) if batch.lags else 0.0,
            "lag_max": max(batch.lags, default=0),
            "dropped_stale": batch.dropped_stale, "zero_signal_groups": batch.zero_signal_groups,
            # Samples of weights off this trainer's lineage (trainer/buffer.py),
            # and the smallest lag trained: < 0 would be a lost branch's sample.
            "dropped_foreign": batch.dropped_foreign, "lag_min": min(batch.lags, default=0),
            "groups_all_failed": batch.groups_all_failed, "groups_all_solved": batch.groups_all_solved,
            **batch.turn_figures(),  # multi-turn episodes: how many calls extend the one before
            "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr,
            "logprob_diff_mean": m.logprob_diff_mean, "logprob_diff_on_policy_max": m.on_policy_diff_max,
            "train_s": m.step_s,
            "weight_push_s": push_s, "weights_pushed": pushed, "step_s": step_s,
            "buffered_groups": len(self.buffer),
            # Flow control: the most groups admitted and not yet consumed at
            # any moment since the previous step, and the budget it must respect.
            "credits_outstanding_max": self.link.credits.reset_peak() if self.link else 0,
            "credit_budget": self.credit_budget,
            # Where each group died: trained (or skipped) in this step.
            "group_ids": batch.group_ids,
            **{f"loss/{k}": v for k, v in m.extra.items() if k != "tokens"},
            "loss/entropy_coef": batch.entropy_coef,  # the coefficient this step trained with
            # Train/inference mismatch (loss.mismatch_figures): overall and
            # per token version lag; trained tokens per lag.
            **{f"offpolicy/{k}": v for k, v in m.mismatch.items()},
            "token_lag_hist": {str(k): n for k, n in sorted(m.token_lag_hist.items())},
        }
        if m.skipped:
            # The weights did not move: no optimizer step, so no step number
            # (it would repeat the previous step's); a record kind of its own.
            del rec["step"]
            rec["skipped_step"] = True
        self.last_metrics = rec
        self.step_history.append(rec)
        self.metrics.write(rec)
        log.info("step", step=self.step, reward=round(rec["reward_mean"], 3), loss=round(m.loss, 4),
                 samples=m.samples, lag_mean=round(rec["lag_mean"], 2), step_s=round(step_s, 2))
        if self.cfg.run.progress:
            evals = " ".join(f"{c}={r['eval_success']:.2f}@v{r['version']}" for c, r in self.latest_evals().items())
            print(f"step {self.step:4d}  v{self.version:<4d} reward {rec['reward_mean']:.3f}  "
                  f"success {rec['success_mean']:.3f}  loss {m.loss:+.4f}  lag {rec['lag_mean']:.2f}  "
                  f"samples {m.samples:4d}  {step_s:5.2f}s  eval {evals or '-'}", flush=True)

    def record_eval(self, version: int, cube_id: str, stats: dict) -> None:
        rec = {"eval": True, "version": version, "cube_id": cube_id, "time": time.time(),
               "eval_reward_mean": stats.get("reward_mean", 0.0), "eval_success": stats.get("success_rate", 0.0),
               "episodes": stats.get("episodes", 0), "turns_mean": stats.get("turns_mean", 0.0)}
        self.eval_history.append(rec)
        self.metrics.write(rec)

    # -- checkpoints and shutdown ---------------------------------------------------

    def _state_views(self) -> tuple:
        """(model, optimizer, scheduler) as checkpoints read and write them:
        with FSDP ranks, stand-ins that gather / broadcast full states."""
        if self.ranks is not None:
            return self.ranks.checkpoint_views()
        return self.learner.model, self.learner.optimizer, self.learner.scheduler

    async def checkpoint(self) -> None:
        model, optimizer, scheduler = self._state_views()
        consumed = self.link.consumed_state(self.pending_commit)
        buffered = self.buffer.snapshot()
        path = await asyncio.to_thread(
            self.checkpoints.save, self.step, self.version, model, optimizer, scheduler,
            self.cfg.model.path, consumed, {"run": self.cfg.run.name, "entropy_coef": self.entropy_coef,
                                            "weights_lineage": self.buffer.lineage.at(self.version)}, buffered)
        # Only now are these groups durable here (trained, or saved in the
        # checkpoint's buffer): their actors may forget them.
        self.link.mark_consumed(self.pending_commit + [g.group_id for g in buffered])
        self.pending_commit = []
        self.last_checkpoint_step = self.step
        log.info("trainer.checkpoint", path=str(path), step=self.step, version=self.version)

    def unsaved(self) -> bool:
        """Whether a checkpoint would save anything the last one lacks: a
        step, buffered groups, or groups consumed without a step (stale or
        skipped): those are committed to their actors only once a checkpoint
        holds them, so without one the next trainer would take them again."""
        return self.step > self.last_checkpoint_step or bool(len(self.buffer)) or bool(self.pending_commit)

    async def shutdown(self) -> None:
        from rlnode.trainer.checkpoint import save_hf_policy

        try:
            if self.link is not None:
                # Accepted after the intake stopped: into the buffer, so the
                # final checkpoint holds them.
                late = self.link.stop_taking_groups()
                for group in late:
                    self.buffer.put(group)
                if late:
                    log.info("trainer.late_groups", groups=len(late))
            if self.learner is not None and self.link is not None and self.unsaved():
                await self.checkpoint()
            if self.learner is not None and self.step > 0:
                final = self.run_dir / "final"
                await asyncio.to_thread(save_hf_policy, self._state_views()[0], self.cfg.model.path, final)
                log.info("trainer.final_policy", path=str(final), version=self.version)
        finally:
            if self.pusher is not None:
                await asyncio.to_thread(self.pusher.broadcaster.close_group)
            if self.link is not None:
                await self.link.close()
            if self.ranks is not None:
                await asyncio.to_thread(self.ranks.close)
            if hasattr(self, "metrics"):
                await asyncio.to_thread(self.metrics.close)
            log.info("trainer.stopped", step=self.step, version=self.version)

    # -- observability (read by rlnode.ops.http; never changes state) ---------------

    def healthy(self) -> tuple[bool, str]:
        if why := self._own_fault():
            return False, why
        if why := self.link.starved():  # connected actors, no group for link.no_group_alarm_s
            return False, why
        return True, ""

    def _own_fault(self) -> str:
        if self.learner is None or self.link is None or not self.link.endpoint or self.pusher is None:
            return "starting"
        return self.pusher.health() or self._stalled()

    def restart_would_help(self) -> bool:
        """For the systemd watchdog: the trainer's own faults (still
        starting, pushes that keep failing with no actor to blame, a stuck
        loop). Actors connected but delivering nothing turn /healthz red
        too, but a trainer restart does not make them deliver; nor does it
        fix an actor whose pushes fail (the pusher benches it)."""
        return bool(self._own_fault())

    def _stalled(self) -> str:
        """'' unless a batch's worth of groups is waiting and no optimizer
        step started or ended for trainer.stall_timeout_s (the loop is stuck
        in a push, a checkpoint or a step)."""
        limit = self.cfg.trainer.stall_timeout_s
        waiting = len(self.buffer)
        if not limit or waiting < self.buffer.groups_per_step:
            return ""
        idle = time.monotonic() - self.pusher.guard.progress_at
        if idle < limit:
            return ""
        return (f"stalled: {waiting} groups waiting, no optimizer step for {idle:.0f} s "
                f"(trainer.stall_timeout_s = {limit:g}) at step {self.step}")

    def status(self) -> dict:
        peers = self.link.peers() if self.link else {}
        benched = self.pusher.bench_status() if self.pusher else []
        return {
            "version": self.version, "step": self.step, "run_dir": str(self.run_dir),
            "buffered_groups": len(self.buffer), "max_steps": self.cfg.trainer.max_steps,
            "empty_batches": self.empty_batches, "waiting_for_engines": self.waiting_for_engines,
            "last_step": self.last_metrics,
            # Samples dropped since start, by reason (too old; made by weights
            # off this trainer's lineage, e.g. a lost branch after --resume).
            "samples_dropped": {"stale": self.buffer.counters.samples_dropped_stale,
                                "foreign": self.buffer.counters.samples_dropped_foreign},
            "incarnation": self.link.incarnation if self.link else "",
            "peers": [{"peer": pid, "node_id": p.node_id, "connected": p.connected, "version": p.version,
                       "groups": p.groups, "last_seen": p.last_seen,
                       "benched": any(b["peer"] == pid for b in benched)} for pid, p in peers.items()],
            "weights": {"pushes": self.pusher.pushes if self.pusher else 0,
                        "failures": self.pusher.failures if self.pusher else 0,
                        # Left out of the weight group after failed pushes, and probed
                        # (rlnode.trainer.weight_push); "members": the actors of the working
                        # epoch, all joined ([] while one forms or after one failed).
                        "benched": benched, "benches": self.pusher.benches if self.pusher else 0,
                        "readmissions": self.pusher.readmissions if self.pusher else 0,
                        "members": self.pusher.group_members() if self.pusher else [],
                        "last_push_s": self.pusher.last_push_s if self.pusher else 0.0,
                        # The current epoch's transport, and why (trainer.weights.backend "auto"
                        # picks cuda_ipc only for engines that can open the trainer's GPU memory).
                        "backend": self.pusher.broadcaster.spec.backend
                        if self.pusher and self.pusher.broadcaster.spec else "",
                        "backend_reason": self.pusher.broadcaster.backend_reason if self.pusher else ""},
            "link": msgspec.to_builtins(self.link.counters) if self.link else {},
            # insecure = true: a non-loopback bind without CurveZMQ (link.insecure).
            "security": self.link.security() if self.link else {},
            "credits": self.link.credits.summary() if self.link else {},
        }

    def prometheus(self) -> list:
        m = self.last_metrics
        b = self.buffer.counters
        out = [("rlnode_trainer_version", "gauge", "current policy version", {}, self.version),
               ("rlnode_trainer_steps", "counter", "optimizer steps", {}, self.step),
               ("rlnode_trainer_buffered_groups", "gauge", "complete groups waiting", {}, len(self.buffer)),
               ("rlnode_trainer_groups_received", "counter", "groups accepted", {}, b.groups_in),
               ("rlnode_trainer_samples_dropped_stale", "counter", "samples older than max_lag", {},
                b.samples_dropped_stale),
               ("rlnode_trainer_samples_dropped_foreign", "counter",
                "samples made by weights off this trainer's lineage (another incarnation's lost versions)", {},
                b.samples_dropped_foreign),
               ("rlnode_trainer_groups_zero_signal", "counter",
                "groups whose episodes all got one reward (no signal against their own mean)", {},
                b.groups_zero_signal)]
        for key, help_ in (("loss", "last step loss"), ("reward_mean", "last step mean episode reward"),
                           ("grad_norm", "last step gradient norm"), ("lag_mean", "last step mean lag"),
                           ("lag_max", "last step max lag"), ("step_s", "last step wall time"),
                           ("train_s", "last step compute time"), ("weight_push_s", "last weight update"),
                           ("logprob_diff_mean", "last step mean |engine - trainer| logprob"),
                           ("groups_all_failed", "last step groups in which every episode failed"),
                           ("length_cut_fraction",
                            "last step share of samples whose reply max_tokens cut (finish_reason length)"),
                           ("loss/entropy", "last step mean policy entropy per trained token (nats)"),
                           ("loss/entropy_coef",
                            "last step entropy bonus coefficient (trainer.loss.entropy_target moves it)"),
                           ("loss/entropy_below_floor",
                            "last step share of trained tokens below trainer.loss.entropy_floor"),
                           ("loss/dual_clip_fraction",
                            "last step share of trained tokens cut by trainer.loss.dual_clip")):
            if key in m:
                out.append((f"rlnode_trainer_{key.removeprefix('loss/')}", "gauge", help_, {}, float(m[key])))
        for key, help_ in OFFPOLICY_GAUGES:
            if f"offpolicy/{key}" in m:
                out.append((f"rlnode_trainer_{key}", "gauge", help_, {}, float(m[f"offpolicy/{key}"])))
        names = {g for g, _ in OFFPOLICY_GAUGES}
        for key, v in m.items():  # the same figures per token version lag
            lag, _, name = key.removeprefix("offpolicy/lag").partition("/")
            if key.startswith("offpolicy/lag") and lag.isdigit() and name in names:
                out.append((f"rlnode_trainer_{name}_by_lag", "gauge", f"last step, tokens at one version lag: {name}",
                            {"lag": lag}, float(v)))
        for lag, n in m.get("token_lag_hist", {}).items():
            out.append(("rlnode_trainer_tokens_by_lag", "gauge", "last step's trained tokens per version lag",
                        {"lag": lag}, float(n)))
        if self.link is not None:
            out += [("rlnode_credits_outstanding", "gauge", "groups admitted and not yet consumed (all actors)", {},
                     self.link.credits.outstanding()),
                    ("rlnode_credit_budget", "gauge", "(max_lag + 1) * groups_per_step", {}, self.credit_budget),
                    ("rlnode_credits_granted", "counter", "credits granted to actors", {},
                     self.link.credits.granted_total),
                    ("rlnode_credits_returned", "counter", "credits of groups dropped on actors", {},
                     self.link.credits.returned_total)]
        if self.pusher is not None:
            out += [("rlnode_weight_pushes", "counter", "weight updates pushed", {}, self.pusher.pushes),
                    ("rlnode_weight_push_failures", "counter", "failed weight pushes", {}, self.pusher.failures),
                    ("rlnode_weight_benched_peers", "gauge", "actors left out of the weight group after failed pushes",
                     {}, len(self.pusher.benched)),
                    ("rlnode_weight_benches", "counter", "actors benched after failed pushes", {},
                     self.pusher.benches)]
        if self.link is not None:
            for pid, p in self.link.peers().items():
                lab = {"peer": p.node_id}
                out += [("rlnode_peer_connected", "gauge", "1 when the actor is connected", lab, float(p.connected)),
                        ("rlnode_peer_version", "gauge", "policy version the actor holds", lab, p.version)]
            for k, v in msgspec.structs.asdict(self.link.counters).items():
                if isinstance(v, (int, float)):
                    out.append((f"rlnode_link_trainer_{k}", "counter", f"trainer link: {k}", {}, v))
        for rec in self.latest_evals().values():
            out.append(("rlnode_eval_success", "gauge", "last evaluation success rate", {"cube": rec["cube_id"]},
                        rec["eval_success"]))
        return out

    def latest_evals(self) -> dict[str, dict]:
        last: dict[str, dict] = {}
        for rec in self.eval_history:
            last[rec["cube_id"]] = rec
        return last

    def gauges(self) -> dict[str, float]:
        return {"version": float(self.version), "buffered_groups": float(len(self.buffer))}

    def history(self) -> dict:
        return {"steps": list(self.step_history), "evals": list(self.eval_history)}


# The train/inference mismatch gauges (last step), from metrics.jsonl's
# offpolicy/* figures (rlnode/trainer/loss.py: mismatch_figures).
OFFPOLICY_GAUGES = (
    ("mismatch_kl", "last step k3 KL(engine || trainer) over trained tokens"),
    ("logprob_absdiff_mean", "last step mean |engine - trainer| logprob"),
    ("logprob_absdiff_p99", "last step p99 |engine - trainer| logprob"),
    ("logprob_absdiff_max", "last step max |engine - trainer| logprob"),
    ("is_ess", "last step importance-sampling effective sample size / tokens"),
    ("truncated_fraction", "last step share of trained tokens whose IS weight was truncated or clipped"),
    ("masked_fraction", "last step share of completion tokens without gradient (loss mask, lag mask)"),
)


def print_final_table(trainer: TrainerDaemon) -> None:
    """Eval success over versions per cube, next to reference policies."""
    from rlnode.cubes.registry import make_cube

    cfg = trainer.cfg
    t = cfg.actor.scheduler.eval_temperature
    how = "greedy decoding" if t == 0 else f"sampled at temperature {t if t > 0 else cfg.actor.sampling.temperature}"
    print(f"\nevaluation (held-out test split, {how})")
    by_cube: dict[str, list[dict]] = {}
    for r in trainer.eval_history:
        by_cube.setdefault(r["cube_id"], []).append(r)
    for spec in cfg.actor.cubes:
        rows = by_cube.get(spec.id, [])
        if not rows:
            continue
        refs = make_cube(spec.id, spec.kind, spec.options, cfg.run.seed).reference_scores()
        print(f"\n  {spec.id} ({spec.kind}{', trained' if spec.weight > 0 else ', eval only'})")
        print(f"  {'version':>8} {'success':>8} {'reward':>8} {'episodes':>9}")
        for r in rows:
            print(f"  {r['version']:>8} {r['eval_success']:>8.3f} {r['eval_reward_mean']:>8.3f} {r['episodes']:>9}")
        for name, value in refs.items():
            print(f"  {'':>8} {value:>8.3f}  <- {name.replace('_', ' ')} policy")
        first, best, last = rows[0]["eval_success"], max(r["eval_success"] for r in rows), rows[-1]["eval_success"]
        print(f"  first {first:.3f} -> last {last:.3f} (best {best:.3f})")
    print(f"\nrun directory: {trainer.run_dir} (metrics.jsonl, checkpoints/, final/)", flush=True)
