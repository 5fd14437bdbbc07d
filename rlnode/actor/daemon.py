"""ActorDaemon: the actor role's lifecycle on one node.

Owns: this node's engines, its AdmissionRouter, the LLMClient episodes use,
the configured cubes, the RolloutScheduler and the link to the trainer.
Startup brings every engine and cube up (tearing down what was started if
one fails) and connects to the trainer; run() schedules episodes, hands
complete groups to the link, and obeys the trainer's control requests (join
a weight-broadcast group epoch, apply a weight update while generation goes
on); shutdown stops admitting, cancels episodes in flight, flushes
unacknowledged groups for a while, closes cubes and stops engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from pathlib import Path

import msgspec

from rlnode.actor.agent_starts import default_limit
from rlnode.actor.engine import Engine, SamplingSettings, fp32_lm_head_enabled
from rlnode.actor.episode import ChatRenderer, EpisodeSettings, check_tools_rendered, make_renderer
from rlnode.actor.gateway import Gateway, HostedGateway
from rlnode.actor.generation import LLMClient
from rlnode.actor.router import AdmissionRouter
from rlnode.actor.scheduler import Group, RolloutScheduler, VersionSource
from rlnode.addresses import is_loopback
from rlnode.config import Config, actor_node_id, effective_max_lag, engine_lora_rank, groups_in_flight
from rlnode.aio import run_until_stopped, spawn
from rlnode.cubes.base import Cube
from rlnode.log import get_logger, set_version
from rlnode.weights.protocol import WeightCommand, WeightResult

log = get_logger("rlnode.actor")

WORKER_EXTENSION = "rlnode.weights.worker.WeightReceiverExtension"
# How long shutdown waits for the trainer to acknowledge what was delivered.
FLUSH_TIMEOUT_S = 10.0


def trainer_endpoint(peer: str) -> str:
    return peer if "://" in peer else f"tcp://{peer}"


def episode_settings(cfg: Config) -> EpisodeSettings:
    s = cfg.actor.sampling
    return EpisodeSettings(
        sampling=SamplingSettings(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p),
        max_turns=cfg.actor.episode.max_turns,
        max_model_len=cfg.model.max_model_len,
        min_completion_tokens=cfg.actor.episode.min_completion_tokens,
        min_temperature=s.min_temperature,
        max_abs_reward=cfg.actor.episode.max_abs_reward,
    )


class TrainerGroupSink:
    """Where the scheduler puts complete groups when a trainer is connected:
    the link's outbox (``submit`` never blocks). Owns a group once ``put``
    returns: a group the link refuses (larger than link.max_frame_bytes, or
    an id it already holds) can never be delivered, so its credit goes back
    here and the loss is counted; otherwise the credit would stay "in hands"
    for the rest of the run and the actor would run one group fewer."""

    def __init__(self, link, node_id: str):
        self.link, self.node_id = link, node_id
        self.submitted = 0  # groups the link took
        self.lost = 0  # groups the link refused: dropped, credit given back
        self.last_at = time.monotonic()  # monotonic time the link last took a group (or start)

    async def put(self, group: Group) -> None:
        from rlnode.actor.scheduler import group_to_delivery

        if self.link.submit(group_to_delivery(group, self.node_id)):
            self.submitted += 1
            self.last_at = time.monotonic()
            return
        self.lost += 1
        if self.link.credits is not None:
            self.link.credits.give_back(group.credit_session)
        # The link logged why (link.actor.group_too_large / duplicate_submit).
        log.error("actor.group_lost", group=group.group_id, lost=self.lost, credit_returned=bool(group.credit_session))


def no_box_sees(cfg: Config) -> dict[str, str]:
    """The paths no agent box may be shown, by config key: the run dir (link
    keys, checkpoints), the key folder, the HTTP token file and the Hugging
    Face cache, where `huggingface-cli login` keeps its token."""
    from huggingface_hub import constants

    return {"run.run_dir": cfg.run.run_dir, "link.curve_dir": cfg.link.curve_dir,
            "http.token_file": cfg.http.token_file, "HF_HOME (the Hugging Face cache and token)": constants.HF_HOME,
            "HF_TOKEN_PATH": constants.HF_TOKEN_PATH}


def count_start(run_dir: str, node_id: str, incarnation: str) -> str:
    """Which start of this node in this run dir this is, for the scheduler's
    task draws: "" for the first (a fresh run with the same seed replays the
    same draws), "start{n}" after (a restarted, maybe crash-looping, actor
    must not replay its first tasks with the same seeds). The count lives in
    RUN_DIR/actor-starts/NODE_ID, written atomically. A run dir that cannot
    be written gets the incarnation (random): never a replay, at the cost of
    a reproducible first start."""
    path = Path(run_dir) / "actor-starts" / node_id.replace("/", "_")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        before = int(path.read_text()) if path.exists() else 0
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(str(before + 1))
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        log.warning("actor.start_count_unavailable", path=str(path), error=str(e))
        return incarnation
    return f"start{before}" if before else ""


def flat_summary(summary: dict) -> dict[str, float | int]:
    """A cube's summary as the wire's EvalReport carries it: numbers only,
    each phase's mean and p90 as ``<phase>_mean_s`` / ``<phase>_p90_s``."""
    out = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    for phase, d in summary.get("phases_s", {}).items():
        name = phase.removesuffix("_s")
        out[f"{name}_mean_s"], out[f"{name}_p90_s"] = d["mean"], d["p90"]
    return out


class ActorDaemon:
    name = "actor"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.peers = cfg.actor.peers
        self.node_id = actor_node_id(cfg)
        self.incarnation = secrets.token_hex(4)
        ecfg = cfg.actor.engine
        # The weight receiver runs inside each engine's worker processes; it
        # is only needed when a trainer will push weights (or for the fp32 head).
        ext = WORKER_EXTENSION if self.peers or fp32_lm_head_enabled(ecfg, cfg.model) else None
        self.engines = [Engine(i, cfg.model, ecfg, worker_extension_cls=ext, lora_rank=engine_lora_rank(cfg))
                        for i in range(ecfg.num_engines)]
        self.link = None
        self._background: set[asyncio.Task] = set()  # control-request handlers in flight
        # Errors a handler hit that the daemon must exit on (a failed weight
        # load): raised by run()'s "fatal" job.
        self._fatal: asyncio.Queue[BaseException] = asyncio.Queue()
        self._tok_mark = (time.monotonic(), 0)
        self.router = AdmissionRouter(
            ecfg.num_engines, cfg.actor.router.llm_max_rollouts, cfg.actor.router.affinity
        )
        self.client = LLMClient(self.engines, self.router)
        # External agents' OpenAI endpoint. Inline: served on the ops HTTP
        # endpoint (add_http_routes) or, without one, on a loopback port of
        # its own; its renderer is set at start (it needs the tokenizer).
        # In a host process (actor.gateway_host): on a loopback port of its own.
        model_name = os.path.basename(os.path.normpath(cfg.model.path)) or "rlnode"
        self.renderer: ChatRenderer | None = None
        self.gateway: Gateway | HostedGateway
        if cfg.actor.gateway_host == "process":
            self.gateway = HostedGateway(self.client, cfg.model, episode_settings(cfg), model_name=model_name,
                                         hosts=cfg.actor.gateway_hosts, history=cfg.actor.gateway_history)
        else:
            self.gateway = Gateway(self.client, None, episode_settings(cfg), model_name=model_name,
                                   history=cfg.actor.gateway_history)
        self._gateway_site = contextlib.AsyncExitStack()
        self.versions = VersionSource(0)
        self.cubes: dict[str, Cube] = {}
        self.scheduler: RolloutScheduler | None = None
        # Complete groups, for the trainer link. Bounded in effect by the
        # scheduler's staleness budget, not by the queue.
        self.groups: asyncio.Queue[Group] = asyncio.Queue()
        self.sink: TrainerGroupSink | None = None  # set by run() when a trainer takes the groups

    async def start(self) -> None:
        from rlnode.actor.weight_receiver import prepare_engine
        from rlnode.cubes.registry import close_cubes, open_cubes

        self.cubes = await open_cubes(self.cfg.actor.cubes, self.cfg.run.seed, no_box_sees(self.cfg))
        started: list[Engine] = []
        try:
            if self.cubes:
                # Before the engines: a parser name or a chat template that
                # cannot work is refused in seconds, not after their start.
                self.renderer = self.gateway.renderer = await self._make_renderer()
            # Sequential on purpose: concurrent engine starts on one host
            # race for memory and CPU and make start-up failures ambiguous.
            for engine in self.engines:
                await engine.start()
                started.append(engine)
                await prepare_engine(engine)
            if self.cubes:
                self.scheduler = await self._make_scheduler()
            # External agents' episodes only: native cubes alone start no
            # gateway host process and bind no agent socket.
            if self._gateway_needed:
                if self._hosted:  # a port of its own, as wide as the agents need (loopback by default)
                    bind = self.cfg.actor.gateway_bind
                    await self._gateway_site.enter_async_context(self.gateway.serve(bind, 0))
                    if is_loopback(bind):
                        log.info("gateway.serving", bind=bind, url=self.gateway.url)
                    else:
                        log.warning("gateway.exposed", bind=bind, url=self.gateway.url, key="actor.gateway_bind",
                                    effect="machines that reach this address reach the episode routes (each "
                                           "episode's own key still needed)")
                elif not self.gateway.url:  # no ops endpoint: the gateway listens on its own (loopback)
                    await self._gateway_site.enter_async_context(self.gateway.serve("127.0.0.1", 0))
                else:  # the ops endpoint serves the routes; sandboxed agents get the episode routes alone
                    await self._gateway_site.enter_async_context(self.gateway.serve_agents())
            if self.peers:
                await self._connect()
        except BaseException:
            await self._gateway_site.aclose()
            await asyncio.gather(*(e.shutdown() for e in started), return_exceptions=True)
            await close_cubes(self.cubes)
            raise
        log.info("actor.started", node=self.node_id, engines=len(self.engines), peers=self.peers,
                 llm_max_rollouts=self.router.capacity, cubes=list(self.cubes))

    async def _make_renderer(self) -> ChatRenderer:
        """The tokenizer, model.chat_template and the output parsers; refuses
        (ConfigError) an unknown parser, a missing template, or cubes with
        tools on a template that renders none."""
        from transformers import AutoTokenizer

        m = self.cfg.model
        tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, m.tokenizer or m.path)
        renderer = await asyncio.to_thread(make_renderer, tok, m)
        await check_tools_rendered(renderer, self.cubes, m.chat_template)
        return renderer

    async def _make_scheduler(self) -> RolloutScheduler:
        cfg = self.cfg
        start = await asyncio.to_thread(count_start, cfg.run.run_dir, self.node_id, self.incarnation)
        sched = RolloutScheduler(
            self.cubes, {c.id: c.weight for c in cfg.actor.cubes}, [c.id for c in cfg.actor.cubes if c.eval],
            self.client, self.renderer,
            msgspec.structs.replace(cfg.actor.scheduler, max_lag=effective_max_lag(cfg),
                                    max_starting_agents=cfg.actor.scheduler.max_starting_agents or default_limit(
                                        cfg.actor.engine.device, cfg.actor.engine.cpu_omp_threads_bind)),
            episode_settings(cfg), self.versions,
            seed=cfg.run.seed, on_eval=self._on_eval, id_prefix=f"{self.node_id}-{self.incarnation}-",
            gateway=self.gateway if self._gateway_needed else None, node_id=self.node_id, incarnation=start,
        )
        await sched.prepare()
        return sched

    async def _connect(self) -> None:
        from rlnode.link.actor_link import ActorLink

        from rlnode.weights.ipc import host_identity
        from rlnode.wire import EngineInfo

        tp = self.cfg.actor.engine.tensor_parallel_size
        engines = [EngineInfo(e.engine_id, tp, host_identity(), list(e.visible_gpus)) for e in self.engines]
        self.link = ActorLink(trainer_endpoint(self.peers[0]), self.node_id, engines, self.cfg.link,
                              incarnation=self.incarnation, stats=self._stats,
                              credit_want=groups_in_flight(self.cfg) if self.scheduler else 0,
                              settled=self._settled if self.scheduler else None)
        if self.scheduler is not None:
            # Under a trainer, groups start on its credits (its global budget),
            # not on the local version count.
            self.scheduler.gate = self.link.credits
        await self.link.start()

    def _settled(self) -> tuple[str, int]:
        """(group id prefix, lowest index this actor may still send): every
        group below it was committed or dropped (CreditReport.settled_below)."""
        from rlnode.link.consumed import split_group_id

        s = self.scheduler
        low = min(s.in_flight_indices, default=s.started_groups)
        for gid in self.link.held_ids():
            parsed = split_group_id(gid)
            if parsed is not None and parsed[0] == s.id_prefix:
                low = min(low, parsed[1])
        return s.id_prefix, low

    def _stats(self) -> dict[str, float]:
        r = self.router.stats()
        return {"in_flight": float(sum(r.in_flight)), "waiting": float(r.waiting),
                "leases": float(r.leases_granted)}

    def _on_eval(self, report) -> None:
        log.info("eval", version=report.version, cubes=report.cubes)
        if self.link is not None:
            self.link.report_eval(report.version, {c: flat_summary(s) for c, s in report.cubes.items()})

    async def run(self, stop: asyncio.Event) -> None:
        jobs = []
        if self.scheduler is not None:
            # With a trainer, complete groups go straight into the link's
            # outbox (no queue in between: what the actor holds is exactly
            # the scheduler's groups in flight plus the outbox).
            out = self.groups
            if self.link is not None:
                out = self.sink = TrainerGroupSink(self.link, self.node_id)
                if self.cfg.link.no_group_alarm_s:
                    jobs.append(asyncio.create_task(self._watch_groups(), name="no-group-alarm"))
            jobs.append(asyncio.create_task(self.scheduler.run(out), name="rollouts"))
        if self.link is not None:
            jobs.append(asyncio.create_task(self._control_loop(), name="control"))
            jobs.append(asyncio.create_task(self._raise_fatal(), name="fatal"))
        await run_until_stopped(jobs, stop)

    async def _watch_groups(self) -> None:
        """Log the no-group alarm when it trips and when it clears (/healthz
        reads the same condition, ``_starved``)."""
        limit = self.cfg.link.no_group_alarm_s
        raised = False
        while True:
            await asyncio.sleep(min(limit / 4, 30.0))
            why = self._starved()
            if why and not raised:
                log.error("actor.no_group_alarm", detail=why)
            elif raised and not why:
                log.info("actor.no_group_alarm_cleared", submitted=self.sink.submitted)
            raised = bool(why)

    def _starved(self) -> str:
        """'' unless no group reached the link for link.no_group_alarm_s:
        whatever the cause (no credits, groups lost, episodes failing), this
        actor is not feeding the trainer."""
        limit, sink = self.cfg.link.no_group_alarm_s, self.sink
        if not limit or sink is None:
            return ""
        idle = time.monotonic() - sink.last_at
        if idle < limit:
            return ""
        s, c = self.scheduler, self.link.credits
        credits = f", credits available {c.available} of {c.granted} granted" if c is not None else ""
        return (f"no group reached the trainer link for {idle:.0f} s (link.no_group_alarm_s = {limit:g}): "
                f"{s.in_flight_groups} groups in flight, waiting for a credit: {s.waiting_for_credit}{credits}, "
                f"groups lost {sink.lost}, failed {s.groups_failed}, connected: {self.link.connected}")

    async def _control_loop(self) -> None:
        from rlnode.wire import ControlReply, ControlRequest

        while True:
            item = await self.link.next_control()
            if isinstance(item, ControlRequest):
                # Run each request as its own task: a weight update must not
                # hold up the next request's reading (e.g. a new epoch).
                spawn(self._background, self._answer(item))

    async def _raise_fatal(self) -> None:
        raise await self._fatal.get()

    async def _answer(self, req) -> None:
        from rlnode.weights.plan import LoadError
        from rlnode.wire import ControlReply

        fatal = None
        try:
            result = await self._handle(req.command)
            reply = ControlReply(req.request_id, True, result=result)
        except Exception as e:  # reported to the trainer; fatal here only if an engine is half-loaded
            log.warning("control.failed", command=type(req.command).__name__, error=repr(e))
            reply = ControlReply(req.request_id, False, error=repr(e)[:500])
            fatal = e if isinstance(e, LoadError) else None
        self.link.reply(reply)
        if fatal is not None:
            # The engine holds partly updated weights (paused, never
            # resumed): exit non-zero so the supervisor restarts the node.
            self._fatal.put_nowait(fatal)

    async def _handle(self, command: WeightCommand) -> WeightResult:
        from rlnode.actor.weight_receiver import apply_weight_update, join_group, probe_engine
        from rlnode.weights.plan import LoadError
        from rlnode.weights.protocol import EpochJoined, JoinEpoch, LoadWeights, Probe, ProbeAnswered, WeightsLoaded

        if isinstance(command, JoinEpoch):
            spec = command.spec
            spec.validate()
            await asyncio.gather(*(join_group(e, spec, spec.member(f"{self.node_id}/{e.engine_id}").first_rank)
                                   for e in self.engines))
            return EpochJoined(spec.epoch)
        if isinstance(command, LoadWeights):
            plan = command.plan
            plan.validate()
            # The trainer's incarnation orders versions: the same trainer
            # never goes back; a restarted one may (its last checkpoint).
            source = self.link.trainer_incarnation or ""
            results = await asyncio.gather(*(apply_weight_update(e, plan, source=source) for e in self.engines),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:  # a failed load outranks the rest: it is fatal
                raise next((e for e in errors if isinstance(e, LoadError)), errors[0])
            timings = results
            self.versions.set(plan.version)
            self.link.set_version(plan.version)
            set_version(plan.version)
            return WeightsLoaded(plan.version, max(t.stalled_s for t in timings))
        if isinstance(command, Probe):  # benched by the trainer: may it rejoin?
            await asyncio.gather(*(probe_engine(e, command.timeout_s) for e in self.engines))
            return ProbeAnswered(len(self.engines))
        raise TypeError(f"no handler for {type(command).__name__}")  # a new command without its handler

    async def shutdown(self) -> None:
        from rlnode.cubes.registry import close_cubes

        await self._gateway_site.aclose()
        if self.link is not None:
            # Give the trainer a moment to acknowledge what it was sent;
            # anything unacknowledged is reported, not silently dropped.
            acked = await self.link.flush(FLUSH_TIMEOUT_S)
            c = self.link.counters()
            log.info("actor.link_flushed", all_acked=acked, unacked=c.unacked, uncommitted=c.uncommitted)
            await self.link.close()
        await close_cubes(self.cubes)
        results = await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)
        for e, r in zip(self.engines, results):
            if isinstance(r, BaseException):
                log.error("engine.shutdown_failed", engine=e.engine_id, error=repr(r))
        stats = {c: s.summary() for c, s in self.scheduler.stats.items()} if self.scheduler else {}
        log.info("actor.stopped", leases=self.router.stats().leases_granted, cubes=stats)

    # -- HTTP (rlnode.ops.http mounts these before it listens) ------------------------

    def add_http_routes(self, app) -> None:
        self.gateway.add_routes(app)

    def http_bound(self, url: str) -> None:
        if not self._hosted:  # a gateway host listens on its own port
            self.gateway.url = url

    @property
    def _gateway_needed(self) -> bool:
        """Some cube may hand episodes to external agents (Cube.runs_agents)."""
        return any(c.runs_agents for c in self.cubes.values())

    @property
    def _hosted(self) -> bool:
        return isinstance(self.gateway, HostedGateway)

    # -- observability (read by rlnode.ops.http; never changes state) ---------------

    def healthy(self) -> tuple[bool, str]:
        if why := self._local_fault():
            return False, why
        # Unreachable first: it explains a starved actor too.
        if why := self._trainer_unreachable() or self._starved():
            return False, why
        return True, ""

    def _local_fault(self) -> str:
        """'' unless this daemon's own engines are broken."""
        from rlnode.actor.weight_receiver import load_failure

        down = [e.engine_id for e in self.engines if e.llm is None]
        if down:
            return f"engines not serving: {down}"
        broken = {e.engine_id: why for e in self.engines if (why := load_failure(e))}
        if broken:
            return f"engines half-loaded by a failed weight update: {broken}"
        failing = {e.engine_id: why for e in self.engines if (why := e.failing())}
        if failing:
            return f"engines failing every request: {failing}"
        return ""

    def _trainer_unreachable(self) -> str:
        """'' unless this actor has a trainer and is not registered with it
        (silent for link.peer_timeout_s, or never reached): it generates, but
        nothing it makes is delivered until the link is back."""
        if self.link is None or self.link.connected:
            return ""
        c = self.link.counters()
        return (f"trainer {self.peers[0]} unreachable (nothing heard for link.peer_timeout_s = "
                f"{self.cfg.link.peer_timeout_s:g} s; {c.unacked} group(s) held for resend, "
                f"{c.disconnects} disconnect(s) so far)")

    def restart_would_help(self) -> bool:
        """For the systemd watchdog: true only for faults of this daemon
        (its engines; no group for no_group_alarm_s while the trainer is
        reachable). An unreachable trainer turns /healthz red too, but a
        restart cannot fix the network and would lose the groups held for
        resend."""
        return bool(self._local_fault()) or (not self._trainer_unreachable() and bool(self._starved()))

    def status(self) -> dict:
        r = self.router.stats()
        out = {
            "node_id": self.node_id, "incarnation": self.incarnation, "version": self.versions.version,
            "engines": [{"id": e.engine_id, "serving": e.llm is not None, "in_flight": e.in_flight,
                         "requests": e.requests_total, "failed": e.requests_failed,
                         "generated_tokens": e.generated_tokens,
                         # The weights it serves and salts its prefix cache with:
                         # "{version}@{trainer incarnation}" ("0": the model on disk).
                         "weights": e.weight_version} for e in self.engines],
            "router": msgspec.to_builtins(r),
            "cubes": {c: s.summary() for c, s in self.scheduler.stats.items()} if self.scheduler else {},
            "groups_started": self.scheduler.started_groups if self.scheduler else 0,
            "waiting_for_credit": self.scheduler.waiting_for_credit if self.scheduler else False,
            "groups_failed": self.scheduler.groups_failed if self.scheduler else 0,
            "groups_lost": self.sink.lost if self.sink else 0,
            "gateway": {"url": self.gateway.url, "open_episodes": len(self.gateway.sessions),
                        **msgspec.to_builtins(self.gateway.stats),
                        **({"host_pid": self.gateway.host_pid, "host_pids": self.gateway.host_pids,
                            "host_starts": self.gateway.host_starts} if self._hosted else {})},
        }
        if self.link is not None:
            out["link"] = {"trainer": self.peers[0], "connected": self.link.connected,
                           **msgspec.to_builtins(self.link.counters())}
            c = self.link.credits
            if c is not None:
                out["credits"] = {"session": c.session, "want": c.want, "granted": c.granted,
                                  "started": c.started, "returned": c.returned, "available": c.available}
        return out

    def prometheus(self) -> list:
        r = self.router.stats()
        out = [("rlnode_policy_version", "gauge", "policy version the engines hold", {}, self.versions.version),
               ("rlnode_router_waiting", "gauge", "generations waiting for a lease", {}, r.waiting),
               ("rlnode_router_leases", "counter", "leases granted", {}, r.leases_granted),
               ("rlnode_router_lease_wait_seconds_sum", "counter", "total lease wait", {}, r.wait_s_sum),
               ("rlnode_router_lease_wait_p50_seconds", "gauge", "median lease wait (recent)", {}, r.wait_s_p50),
               ("rlnode_router_lease_wait_p99_seconds", "gauge", "p99 lease wait (recent)", {}, r.wait_s_p99)]
        for e in self.engines:
            lab = {"engine": str(e.engine_id)}
            out += [("rlnode_router_in_flight", "gauge", "generations holding a lease", lab, r.in_flight[e.engine_id]),
                    ("rlnode_router_capacity", "gauge", "llm_max_rollouts", lab, self.router.capacity),
                    ("rlnode_generated_tokens", "counter", "tokens generated", lab, e.generated_tokens),
                    ("rlnode_generation_requests", "counter", "generation requests", lab, e.requests_total),
                    ("rlnode_generation_failures", "counter", "failed generation requests", lab, e.requests_failed),
                    ("rlnode_engine_serving", "gauge", "1 when the engine is up", lab, float(e.llm is not None))]
        if self.scheduler:
            a = self.scheduler.agent_starts
            out += [("rlnode_agents_starting", "gauge", "external agents holding a start slot "
                     "(actor.scheduler.max_starting_agents)", {}, a.starting),
                    ("rlnode_agents_start_waiting", "gauge", "external agents waiting for a start slot", {}, a.waiting)]
            for cube, s in self.scheduler.stats.items():
                lab = {"cube": cube}
                out += [("rlnode_episodes", "counter", "episodes completed", lab, s.episodes),
                        ("rlnode_episode_successes", "counter", "successful episodes", lab, s.successes),
                        ("rlnode_episode_errors", "counter", "episodes failed after retries", lab, s.errors),
                        ("rlnode_episode_retries", "counter", "episode retries", lab, s.retries),
                        ("rlnode_groups", "counter", "complete groups emitted", lab, s.groups),
                        ("rlnode_groups_dropped", "counter", "groups dropped (failed episode)", lab, s.groups_dropped),
                        ("rlnode_episode_reward_mean", "gauge", "mean episode reward", lab, s.reward_mean)]
                d = s.durations
                for phase in sorted(d.count):
                    plab = {"cube": cube, "phase": phase.removesuffix("_s")}
                    out += [("rlnode_episode_phase_seconds_sum", "counter",
                             "seconds spent in an episode phase (agent, evaluate, harness_start, rubric, teardown, "
                             "llm_call, llm_lease_wait, ...)", plab, d.sum_s[phase]),
                            ("rlnode_episode_phase_count", "counter", "times an episode phase was timed", plab,
                             d.count[phase])]
        g = self.gateway.stats
        out += [("rlnode_gateway_open_episodes", "gauge", "external-agent episodes open", {}, len(self.gateway.sessions)),
                ("rlnode_gateway_calls", "counter", "chat completions served", {}, g.calls),
                ("rlnode_gateway_history_resets", "counter", "calls that did not extend the episode's history", {},
                 g.history_resets),
                ("rlnode_gateway_errors", "counter", "gateway requests answered with an error", {}, g.errors),
                ("rlnode_gateway_unauthorized", "counter", "unknown episode or wrong key", {}, g.unauthorized),
                ("rlnode_gateway_temperature_floored", "counter",
                 "calls that asked below actor.sampling.min_temperature (sampled at it)", {}, g.temperature_floored)]
        if self._hosted:
            out.append(("rlnode_gateway_host_starts", "counter",
                        "gateway host processes started (more than 1: a host died and was replaced)", {},
                        self.gateway.host_starts))
        if self.link is not None:
            c = self.link.counters()
            lab = {"trainer": self.peers[0]}
            out += [("rlnode_link_connected", "gauge", "1 when registered with the trainer", lab,
                     float(self.link.connected))]
            for k, v in msgspec.structs.asdict(c).items():
                if isinstance(v, (int, float)):
                    kind = "gauge" if k in ("unacked", "uncommitted") else "counter"
                    out.append((f"rlnode_link_{k}", kind, f"actor link: {k}", lab, v))
        return out

    def gauges(self) -> dict[str, float]:
        r = self.router.stats()
        tokens = sum(e.generated_tokens for e in self.engines)
        now = time.monotonic()
        last_t, last_tok = self._tok_mark
        self._tok_mark = (now, tokens)
        rate = (tokens - last_tok) / (now - last_t) if now > last_t else 0.0
        return {"in_flight": float(sum(r.in_flight)), "waiting": float(r.waiting), "tokens_per_s": rate,
                "version": float(self.versions.version)}

    def history(self) -> dict:
        return {}
