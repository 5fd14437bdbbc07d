"""``verifiers``: a cube whose tasks come from a verifiers environment, played
by that environment's own agent against the gateway.

verifiers (PyPI ``verifiers`` 0.4, the optional extra ``rlnode[verifiers]``)
splits an environment into a *taskset* (the rows), an *env* (how one task
becomes one episode: who plays, who answers) and a *harness* (the agent
program). A rollout runs the harness against a local *interception* server
that records every model call on a ``Trace`` and forwards it to the model
endpoint; the task's ``@vf.reward`` methods (the rubric) then score the
trace. Here the model endpoint is the episode's gateway URL, so every call
the environment makes becomes a training sample, and the rubric's reward is
the episode's reward.

Token parity needs nothing from this module: the interception relays the
harness's chat request as it is (model and sampling overridden), and a chat
harness re-sends the assistant messages it got back, which the gateway
extends token for token (``rlnode/actor/gateway/``).

Loading. ``env`` is a taskset id, as ``vf-eval`` takes it: an installed
package (``wordle``, ``owner/name@1.0``, a built-in such as ``textarena``)
or a module path (``rlnode.cubes.vf_guess``). verifiers resolves ids to
importable top-level names, so a module path is imported here and
registered under an alias (dots -> ``__``) that its loader can import.

Splits: train tasks are the first ``num_train`` of the taskset configured by
``env_args``; test tasks come from ``env_args`` merged with
``test_env_args`` (e.g. ``{taskset = {split = "eval"}}``), or, when
``test_env_args`` is empty, are held out of the train stream (its first
``num_test`` rows; train then starts after them).

Start refuses what cannot run here, each as a one-line ``ConfigError`` naming
the cube and the key: an environment that cannot be imported, sampling_args
the gateway would not honour, a seat whose runtime is a remote sandbox
(verifiers' default, ``prime``: it needs network, credentials and a public
tunnel to reach the gateway on this host), verifiers' own retries.

Containment. Every episode of every verifiers cube plays on one event loop,
in one thread, for the life of the process (``ForeignLoop``,
``cubes/foreign_loop.py``). One loop, because verifiers shares asyncio
locks and semaphores between episodes (``SubprocessRuntime._locks`` is a
class attribute) and a lock fails on any loop but the one it bound to. Not
the actor's loop, because asyncio re-raises ``SystemExit`` and
``KeyboardInterrupt`` from *any* task straight out of the loop, so a
``sys.exit`` anywhere in a foreign environment (its rubric runs under
``gather``) would otherwise stop the actor. There it stops only the foreign
loop's current turn, which runs on, and becomes a ``CubeError`` for its
episode. The rubric, when rlnode asks for it, runs there too, under the
cube's ``timeout_s``.

Owns: the verifiers import, config and task lists, one verifiers episode per
rlnode episode. Must not touch tokens or samples (the gateway does). The
verifiers import is lazy: rlnode runs without the extra.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import os
import secrets
import sys
import time
from typing import Annotated, Any, Awaitable, Callable, Iterator, Literal, TypeVar

import msgspec
from msgspec import Meta

from rlnode.config import ConfigError
from rlnode.cubes.base import (
    Action, AgentEndpoint, AgentTask, Cube, CubeError, CubeTaskRef, Evaluation, Reset, Split, StepResult, ToolSpec,
    run_blocking,
)
from rlnode.cubes.wall import agent_sandbox, vf_runtime
from rlnode.cubes.wall.agent_sandbox import AgentLimits
from rlnode.cubes.vf_scripts import cache_root
from rlnode.cubes.foreign_loop import ForeignLoop
from rlnode.cubes.tasks import split_index
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.verifiers")
T = TypeVar("T")

EXTRA_HINT = "pip install 'rlnode[verifiers]'"


class VerifiersOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # The environment: a verifiers taskset id ("wordle", "owner/name@1.0")
    # or a module path exporting one ("rlnode.cubes.vf_guess").
    env: str
    # The verifiers [env] table (what `vf-eval --env.*` sets): "taskset"
    # knobs, the seats ("agent", or the env's own role names) with their
    # harness / runtime / max_turns, "id" to pair another Env, "timeout",
    # "retries". taskset.id is `env`.
    env_args: dict[str, Any] = {}
    # Deep-merged over env_args for the test split. Empty: the test split
    # is held out of the train stream (its first num_test tasks).
    test_env_args: dict[str, Any] = {}
    # Tasks per split (ids train-N / test-N).
    num_train: Annotated[int, Meta(ge=1)] = 10_000
    num_test: Annotated[int, Meta(ge=0)] = 64
    # verifiers sampling knobs imposed on every model call: the keys of
    # GatewaySampling (what the gateway honours); the gateway caps them at
    # the run's actor.sampling.
    sampling_args: dict[str, Any] = {}
    # Seconds for one whole episode, the environment's agent included.
    timeout_s: Annotated[float, Meta(gt=0)] = 600.0
    # Where the programs a harness runs through verifiers' subprocess
    # runtime run: "bwrap" (one sandbox per runtime, as agents have it:
    # own pid and network namespaces, an unprivileged uid, the runtime's
    # working directory, no run dir or keys, only the loopback ports
    # verifiers hands them: rlnode/cubes/wall/vf_runtime.py) or "none" (as the
    # daemon's user; logged as an error). Process-wide: the first verifiers
    # cube that starts decides for all.
    isolation: Literal["bwrap", "none"] = "bwrap"
    # Under isolation = "bwrap": where the harnesses' PEP 723 scripts, their
    # uv environments and the runtimes' working directories live (written
    # by the daemon, read-only in the boxes: rlnode/cubes/vf_scripts.py).
    # Empty: $CACHE_DIRECTORY (systemd CacheDirectory=), else
    # $XDG_CACHE_HOME, else ~/.cache; then rlnode/verifiers. Process-wide
    # like isolation.
    cache_dir: str = ""
    # What one runtime's sandbox may take (agent_sandbox.AgentLimits).
    limits: AgentLimits = AgentLimits()


class GatewaySampling(msgspec.Struct, forbid_unknown_fields=True):
    """The sampling knobs the gateway's ``ChatRequest`` honours. verifiers
    passes any other key through to the endpoint, where the gateway ignores
    it, so a typo (``temprature``) would silently not apply: refused at start."""

    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None


def check_sampling(sampling_args: dict[str, Any]) -> None:
    """``sampling_args`` as the gateway takes them, or a ValueError naming
    the key (``sampling_args.max_tokens``)."""
    try:
        msgspec.convert(sampling_args, GatewaySampling, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(f"sampling_args: {str(e).replace('`$', '`sampling_args')}") from None


# -- verifiers plumbing (import-free until called) ------------------------------


def import_verifiers():
    """``verifiers.v1``, or an error naming the extra."""
    try:
        return importlib.import_module("verifiers.v1")
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] != "verifiers":
            raise
        raise ModuleNotFoundError(f"the verifiers cube needs the verifiers extra: {EXTRA_HINT}") from e


def taskset_id(env: str) -> str:
    """The id verifiers' loader can import ``env`` by. A dotted module path
    (which the loader cannot import: it looks ids up as top-level names) is
    imported and registered under an alias; other ids pass through."""
    if "." not in env or "/" in env or "@" in env:
        return env
    alias = env.replace(".", "__")
    module = importlib.import_module(env)
    known = sys.modules.setdefault(alias, module)
    if known is not module:
        raise ValueError(f"verifiers env {env!r}: the alias {alias!r} is taken by another module")
    return alias


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` deep-merged onto ``base`` (tables merge, values replace)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def env_config(env: str, env_args: dict[str, Any]):
    """The verifiers ``EnvConfig`` for ``env`` (id or module path) and an
    ``[env]`` table."""
    vf = import_verifiers()
    args = merged(env_args, {"taskset": {"id": taskset_id(env)}})
    return vf.resolve_env_config(args)


# Episode keys by variable name, read by verifiers as if from os.environ
# (_KeyedEnviron), never written there.
_EPISODE_KEYS: dict[str, str] = {}


class _KeyedEnviron:
    """The ``os`` that verifiers' ``configs/client.py`` sees: the real module,
    but ``environ`` also holds the open episodes' gateway keys.

    Why: verifiers 0.4 takes an endpoint's key only from
    ``os.environ[client.api_key_var]`` (``resolve_api_key``, read when the
    interception builds its client and again on every ``/v1/models`` relay);
    its client config has no key field, and a key in ``headers`` is
    overwritten by the dialect's ``Bearer EMPTY``. Writing the key into the
    process's environment would hand it to every process any thread starts
    meanwhile (and mutate environ under a concurrent fork). This view makes
    the key readable by that one module and nobody else."""

    def __getattr__(self, name: str):
        return getattr(os, name)

    @property
    def environ(self) -> collections.ChainMap:
        return collections.ChainMap(_EPISODE_KEYS, os.environ)


def _install_keyed_environ() -> None:
    module = importlib.import_module("verifiers.v1.configs.client")
    current = getattr(module, "os", None)
    if isinstance(current, _KeyedEnviron):
        return
    if current is not os or not callable(getattr(module, "resolve_api_key", None)):
        raise CubeError("this verifiers release does not read endpoint keys as rlnode expects "
                        "(verifiers.v1.configs.client.resolve_api_key over os.environ)")
    module.os = _KeyedEnviron()


@contextlib.contextmanager
def api_key_var(key: str) -> Iterator[str]:
    """The episode's gateway key under a variable name of its own (concurrent
    episodes never share or overwrite one), readable by verifiers'
    ``resolve_api_key`` alone (``_KeyedEnviron``) for the episode's lifetime.
    The key is the gateway's for this one episode: it opens nothing once the
    episode ends."""
    _install_keyed_environ()
    var = f"RLNODE_VF_API_KEY_{secrets.token_hex(8)}"
    _EPISODE_KEYS[var] = key
    try:
        yield var
    finally:
        _EPISODE_KEYS.pop(var, None)


def _load(env: str, env_args: dict[str, Any], count: int):
    """The verifiers ``EnvConfig`` and the first ``count`` tasks of its
    taskset (blocking: a taskset may read files or build a dataset)."""
    vf = import_verifiers()
    config = env_config(env, env_args)
    return config, list(vf.load_environment(config).taskset.take(count)) if count else []


def _check(config, key: str) -> None:
    """What rlnode needs of a verifiers config, checked once at start; ``key``
    is the options table it came from (env_args, test_env_args)."""
    vf = import_verifiers()
    from verifiers.v1.runtimes import runtime_is_local

    for name, seat in config:
        if not isinstance(seat, vf.AgentConfig):
            continue
        if seat.retries.max_retries or any(r.max_retries for r in seat.retries.rules):
            # A retried run re-plays the task inside one rlnode episode: the
            # failed attempt's calls would stay in it as samples.
            raise ValueError(f"{key}.{name}.retries: leave verifiers' retries off; rlnode retries whole "
                             "episodes (actor.scheduler.max_retries)")
        if not runtime_is_local(seat.runtime):
            # prime / modal / e2b: a paid remote box, an API key, and a public
            # tunnel back to the gateway, which listens on this host. Without
            # the key verifiers raises SystemExit mid-episode. Local container
            # runtimes (docker, podman, apptainer) pass: their user chose them.
            raise ValueError(f'{key}.{name}.runtime.type = "{seat.runtime.type}" needs network and credentials '
                             f'(a remote sandbox); set {key}.{name}.runtime.type = "subprocess"')


def _not_found(e: ModuleNotFoundError) -> str:
    """The innermost "No module named ..." under verifiers' own wording."""
    while isinstance(e.__cause__, ModuleNotFoundError):
        e = e.__cause__
    return str(e)


async def contained(what: str, fn: Callable[[], Awaitable[T]], cancel_grace_s: float = 10.0) -> T:
    """``await fn()`` on the process's one foreign loop (``ForeignLoop``):
    every verifiers episode and rubric of every cube shares it, so objects
    verifiers shares between episodes stay on the loop they were bound to,
    and a SystemExit in one episode fails only that episode."""
    return await ForeignLoop.shared().run(what, fn, cancel_grace_s)


def _trained(traces: list) -> list:
    """The traces of the seats being trained (all of them when none is)."""
    return [t for t in traces if t.agent is None or t.agent.trainable] or list(traces)


# -- the cube ------------------------------------------------------------------


class VerifiersTask(AgentTask):
    """One verifiers task; ``run_agent`` plays one verifiers episode of it.

    Each episode builds its own verifiers ``Env`` (a tenth of a millisecond):
    ``Env.serving()`` keeps the interception and shared tools on the Env
    object, so concurrent episodes must not share one."""

    # The reward is the rubric's, returned by run_agent. The evaluator is
    # asked only when the gateway ended the episode (actor.episode.max_turns,
    # a full context) and the environment failed on the refusal: it scores
    # the transcript so far, as verifiers scores a run its own limits stopped.
    has_evaluator = True

    def __init__(self, ref: CubeTaskRef, config, task, opts: VerifiersOptions):
        self.ref, self.config, self.task, self.opts = ref, config, task, opts
        self.timeout_s = opts.timeout_s
        self.reward: float | None = None
        self.traces: list = []
        self._all_traces: list = []  # every seat's, for phases()
        self._wall = [0.0, 0.0]  # time.time() at the start and end of the last episode

    async def reset(self) -> Reset:
        data = self.task.data
        return Reset(observation=data.prompt_text, system=data.system_prompt,
                     info={"verifiers_task": self.task.key, "verifiers_idx": data.idx})

    def tools(self) -> list[ToolSpec]:
        return []  # the environment's harness brings its own

    async def step(self, action: Action) -> StepResult:
        raise NotImplementedError("a verifiers environment plays its own turns; it has no env_url steps")

    async def run_agent(self, endpoint: AgentEndpoint, task: dict[str, Any]) -> float:
        vf = import_verifiers()

        async def play():
            self._wall = [time.time(), 0.0]
            try:
                env = vf.load_environment(self.config)
                async with env.serving():
                    episode = await env.run_episode(self.task, ctx)
                    self._all_traces = list(episode.traces)
                    return episode
            finally:
                self._wall[1] = time.time()  # after the interception and the runtimes are down

        with api_key_var(endpoint.api_key) as var:
            ctx = vf.ModelContext(
                model=endpoint.model,
                client=vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=var),
                sampling=vf.SamplingConfig(**self.opts.sampling_args),
            )
            episode = await contained("verifiers episode", play)
        self.traces = _trained(episode.traces)
        if not episode.ok:
            err = episode.last_error or next((t.last_error for t in episode.traces if t.last_error), None)
            raise CubeError(f"verifiers episode failed: {err.type}: {err.message}" if err else
                            "verifiers episode failed")
        self.reward = sum(t.reward for t in self.traces) / len(self.traces)
        return self.reward

    def phases(self) -> dict[str, float]:
        """Where the last verifiers episode's time went, from verifiers' own
        trace timing (wall clock) and this task's start and end of it:
        ``serving_s`` (the interception server up, until the first trace
        starts), ``harness_start_s`` (the runtime started and the harness
        set up: scripts prepared), ``harness_s`` (the agent's run less its
        model calls: the harness program's start, its work), ``model_s``
        (the model calls as verifiers saw them), ``rubric_s`` (scoring) and
        ``teardown_s`` (from the last trace's end until runtimes and
        servers are down). Summed over the episode's traces."""
        start, end = self._wall
        if not end or not self._all_traces:
            return {}
        out = dict.fromkeys(("harness_start_s", "harness_s", "model_s", "rubric_s"), 0.0)
        first, last = end, start
        for t in self._all_traces:
            tm = t.timing
            spans = [s for s in (tm.boot, tm.setup, tm.agent, tm.finalize, tm.scoring) if s.start]
            if spans:
                first = min(first, *(s.start for s in spans))
                last = max(last, *(s.end or s.start for s in spans))
            model = min(sum(c.time.duration for c in t.calls), tm.agent.duration)
            out["harness_start_s"] += tm.boot.duration + tm.setup.duration
            out["harness_s"] += tm.agent.duration - model
            out["model_s"] += model
            out["rubric_s"] += tm.scoring.duration
        out["serving_s"] = max(0.0, min(first, end) - start)
        out["teardown_s"] = max(0.0, end - max(last, start))
        return out

    async def evaluate(self) -> Evaluation:
        if self.reward is None:
            if not self.traces:
                raise CubeError("no rubric reward: the verifiers episode recorded no run")
            for t in self.traces:
                if not t.rewards:  # the run failed before its scoring stage
                    # Under the cube's deadline: a rubric (an LLM judge) that
                    # hangs would hold its group and its credit forever.
                    try:
                        await asyncio.wait_for(contained("verifiers rubric", lambda t=t: self.task.score(t)),
                                               self.timeout_s)
                    except TimeoutError:
                        raise CubeError(f"verifiers rubric: no score within timeout_s = {self.timeout_s:g} s") from None
            self.reward = sum(t.reward for t in self.traces) / len(self.traces)
        info = {"stop": [t.stop_condition for t in self.traces],
                "rewards": [{k: (r.value if r else None) for k, r in t.rewards.items()} for t in self.traces],
                "metrics": [dict(t.metrics) for t in self.traces]}
        return Evaluation(reward=self.reward, success=self.reward > 0, info=info)


class VerifiersCube(Cube):
    kind = "verifiers"
    Options = VerifiersOptions

    def __init__(self, cube_id: str, options: VerifiersOptions, seed: int):
        self.cube_id = cube_id
        self.opts = options
        self.seed = seed
        self.configs: dict[Split, Any] = {}  # verifiers EnvConfig per split
        self.tasks: dict[Split, list[Any]] = {}  # verifiers Tasks per split

    async def start(self) -> None:
        """Load the task lists; what cannot run is a one-line ConfigError
        naming this cube (``rlnode eval`` prints it without a traceback)."""
        o = self.opts
        try:
            check_sampling(o.sampling_args)
            await run_blocking(import_verifiers)
            try:
                await self._load_splits()
            except ModuleNotFoundError as e:
                raise ValueError(f"verifiers environment {o.env!r} cannot be imported: {_not_found(e)}") from e
            _check(self.configs["train"], "env_args")
            if o.test_env_args:
                _check(self.configs["test"], "test_env_args")
        except (ValueError, ModuleNotFoundError) as e:  # pydantic's ValidationError is a ValueError
            raise ConfigError(f"cube {self.cube_id!r}: {e}") from e
        await agent_sandbox.check(o.isolation, self.cube_id)
        if o.isolation == "bwrap":
            from rlnode.cubes.openai_agent import inherited_env

            agent_sandbox.check_shown(self.cube_id, [
                ("options.cache_dir (verifiers' scripts, uv cache and runtime folders)", str(cache_root(o.cache_dir))),
                *agent_sandbox.shown_paths([], inherited_env(), "", [])])

            vf_runtime.install(o.limits, inherited_env(), o.cache_dir)
        if not self.tasks["train"]:
            raise CubeError(f"verifiers env {o.env!r} yielded no train tasks")

    async def _load_splits(self) -> None:
        o = self.opts
        if o.test_env_args:
            self.configs["train"], self.tasks["train"] = await run_blocking(_load, o.env, o.env_args, o.num_train)
            test_args = merged(o.env_args, o.test_env_args)
            self.configs["test"], self.tasks["test"] = await run_blocking(_load, o.env, test_args, o.num_test)
        else:
            config, rows = await run_blocking(_load, o.env, o.env_args, o.num_test + o.num_train)
            self.configs = {"train": config, "test": config}
            self.tasks = {"test": rows[:o.num_test], "train": rows[o.num_test:]}

    async def task_ids(self, split: Split) -> list[str]:
        return [f"{split}-{i:05d}" for i in range(len(self.tasks.get(split, [])))]

    async def open_task(self, task_id: str) -> VerifiersTask:
        split, idx = split_index(task_id)
        if idx >= len(self.tasks.get(split, [])):
            raise KeyError(f"unknown task {task_id!r} in cube {self.cube_id!r}")
        task = self.tasks[split][idx]
        return VerifiersTask(CubeTaskRef(self.cube_id, task_id), self.configs[split], task, self.opts)
