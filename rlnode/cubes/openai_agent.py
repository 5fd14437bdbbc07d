"""``openai-agent``: train an agent you wrote against the OpenAI API.

Each episode runs your agent once, pointed at the actor's gateway (an
OpenAI-compatible base URL valid for that episode only); every chat
completion it asks for is a training sample. Two ways to run it:

* ``agent = "my_pkg.agents:play"``: an async (or plain; it then runs in a
  thread) function ``play(task, base_url, api_key) -> reward | None``, run
  in ``workers`` worker processes (``agent_workers.py``): never on the
  daemon's event loop, and killed with its worker when a cancelled episode
  does not end.
* ``command = ["python", "my_agent.py"]``: a process per episode, with
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``,
  ``ANTHROPIC_API_KEY``, ``RLNODE_ENV_URL`` and ``RLNODE_MODEL`` in its
  environment (the gateway speaks OpenAI's and Anthropic's APIs) and the task as JSON on stdin. A
  non-zero exit fails the episode. The process runs in its own process group
  and the whole group is killed at the timeout or when the episode is
  cancelled. Its environment is an allowlist: ``PATH``, locale, ``HOME``,
  ``TMPDIR``, ``VIRTUAL_ENV``/``PYTHONPATH``, the names in ``pass_env`` and
  ``env_vars``; nothing else of the daemon's (no ``HF_TOKEN``, cloud keys,
  ``RLNODE_*``). The agent is your code, but the tool calls it runs are the
  policy's: see ``reward_source``.

Reward (``reward_source``). ``"evaluator"`` (the default): the environment
cube's evaluator decides; what the agent returns is ignored and a POST to
``env/reward`` is refused. ``"agent"``: the agent's posted reward (with the
``reward_key`` of its task JSON, which is never in its environment), else
its returned one, else the evaluator. Without ``env`` the agent is the only
source, so ``reward_source = "agent"`` must be said.

Tasks and rewards come from an environment cube (``env = {kind = "guessing",
options = {...}}``): its train/test tasks, its tools (advertised in the task
JSON and callable at ``RLNODE_ENV_URL``: ``POST step`` with ``{"tool", "arguments"}``
or ``{"text"}``) and its evaluator. Without one, tasks are the lines of
``tasks`` (JSONL: ``{"id", "prompt", ...}``) and the reward must come from
the agent (return value or ``POST {RLNODE_ENV_URL}/reward``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rlnode.cubes.wall import agent_sandbox, isolation
from rlnode.cubes.wall.agent_sandbox import AgentLimits
from rlnode.cubes.wall.agent_workers import AgentWorkers, absolute_ref, ref_files
from rlnode.cubes.base import (Action, AgentEndpoint, AgentTask, Cube, CubeError, CubeTask, CubeTaskRef,
                               Evaluation, Reset, Split, StepResult, ToolSpec)
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.openai_agent")

STDERR_TAIL = 2000  # bytes of a failed command's stderr kept in the error


class EnvSpec(msgspec.Struct, forbid_unknown_fields=True):
    kind: str
    options: dict[str, Any] = {}


class OpenAIAgentOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # "module:function" run in `workers` worker processes (agent_workers.py):
    # fn(task: dict, base_url: str, api_key: str) -> float | None.
    agent: str = ""
    # Or a command run per episode (argv list; no shell).
    command: list[str] = []
    # Working directory of the command ("" = the daemon's).
    cwd: str = ""
    # Extra environment variables for the command.
    env_vars: dict[str, str] = {}
    # The environment cube: tasks, tools and evaluator.
    env: EnvSpec | None = None
    # Without `env`: a JSONL file of tasks ({"id", "prompt", ...}); reward from the agent.
    tasks: str = ""
    # Share of `tasks` held out for test (by a hash of each id).
    test_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.1
    # Seconds one episode (the whole agent run) may take.
    timeout_s: Annotated[float, Meta(gt=0)] = 300.0
    # Worker processes running a function agent (each runs many episodes at
    # once on its own event loop): the agent's SDK work stays off the
    # daemon's loop, which carries the engine's outputs and the gateway.
    workers: Annotated[int, Meta(ge=1, le=256)] = 2
    # Who decides the reward: "evaluator" (the env cube's; the agent's
    # returned or posted reward is ignored) or "agent" (its posted, else
    # returned reward counts: the policy can then write its own reward
    # through the tools it gets the agent to run).
    reward_source: Literal["evaluator", "agent"] = "evaluator"
    # Names of daemon environment variables a command agent may see beyond
    # the allowlist (PATH, HOME, locale, TMPDIR, VIRTUAL_ENV, PYTHONPATH).
    pass_env: list[str] = []
    # How the agent is isolated, a command's process or a function's
    # workers alike: "bwrap" (its own pid and network namespaces, an
    # unprivileged uid, a read-only view of the system, the Python
    # installation and its own files, `limits`; its ways out are the
    # gateway's episode routes, through a relay, and a function agent's
    # worker channel to the daemon: rlnode/cubes/wall/agent_sandbox.py)
    # or "none" (as the daemon's user, with its files, keys and network;
    # logged as an error).
    isolation: Literal["bwrap", "none"] = "bwrap"
    # Extra paths a sandboxed agent may read (its package, data files).
    # The files a command's argv names, a function agent's file, `cwd` and
    # PYTHONPATH are shown already.
    ro_paths: list[str] = []
    # What one sandbox may take: processes, memory, open files, CPU seconds,
    # gateway connections, /tmp size (agent_sandbox.AgentLimits).
    limits: AgentLimits = AgentLimits()


class OpenAIAgentCube(Cube):
    kind = "openai-agent"
    Options = OpenAIAgentOptions

    def __init__(self, cube_id: str, options: OpenAIAgentOptions, seed: int):
        if bool(options.agent) == bool(options.command):
            raise ValueError(f"cube {cube_id!r}: set exactly one of options.agent (module:function) "
                             "and options.command (argv list)")
        if bool(options.env) == bool(options.tasks):
            raise ValueError(f"cube {cube_id!r}: set exactly one of options.env (an environment cube) "
                             "and options.tasks (a JSONL file)")
        if options.tasks and options.reward_source != "agent":
            raise ValueError(f"cube {cube_id!r}: options.tasks has no evaluator, so the agent's reward is the only "
                             'one: set options.reward_source = "agent"')
        self.cube_id, self.opts, self.seed = cube_id, options, seed
        self.inner: Cube | None = None
        self.workers: AgentWorkers | None = None
        self._rows: dict[str, dict[str, Any]] = {}
        self._split: dict[str, list[str]] = {"train": [], "test": []}

    async def start(self) -> None:
        from rlnode.cubes.registry import make_cube

        await agent_sandbox.check(self.opts.isolation, self.cube_id)
        if self.opts.isolation == "bwrap":
            o = self.opts
            shown = agent_sandbox.shown_paths(o.command, allowed_env(o), o.cwd, o.ro_paths)
            shown += [("options.agent", path) for path in ref_files(absolute_ref(o.agent))] if o.agent else []
            agent_sandbox.check_shown(self.cube_id, shown)
        if self.opts.agent:
            o = self.opts
            self.workers = AgentWorkers(o.agent, o.workers, o.isolation, allowed_env(o), o.ro_paths, o.limits, o.cwd)
            try:
                await self.workers.start()
            except BaseException:
                await self.workers.close()
                raise
        if self.opts.env is not None:
            self.inner = make_cube(f"{self.cube_id}.env", self.opts.env.kind, self.opts.env.options, self.seed)
            await self.inner.start()
        else:
            self._load_tasks(Path(self.opts.tasks))

    def _load_tasks(self, path: Path) -> None:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise ValueError('expected an object with a string "prompt"')
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from e
            tid = str(row.get("id", n))
            if tid in self._rows:
                raise ValueError(f"{path}:{n}: duplicate task id {tid!r}")
            self._rows[tid] = row
            h = int.from_bytes(hashlib.sha256(f"{self.seed}/{tid}".encode()).digest()[:8], "big") / 2**64
            self._split["test" if h < self.opts.test_fraction else "train"].append(tid)

    async def task_ids(self, split: Split) -> list[str]:
        if self.inner is not None:
            return await self.inner.task_ids(split)
        return list(self._split[split])

    async def open_task(self, task_id: str) -> CubeTask:
        ref = CubeTaskRef(self.cube_id, task_id)
        inner = await self.inner.open_task(task_id) if self.inner is not None else None
        return OpenAIAgentTask(ref, self, inner, self._rows.get(task_id))

    async def close(self) -> None:
        if self.workers is not None:
            await self.workers.close()
        if self.inner is not None:
            await self.inner.close()

    def reference_scores(self) -> dict[str, float]:
        return self.inner.reference_scores() if self.inner is not None else {}


class OpenAIAgentTask(AgentTask):
    def __init__(self, ref: CubeTaskRef, cube: OpenAIAgentCube, inner: CubeTask | None,
                 row: dict[str, Any] | None):
        self.ref, self.cube, self.inner, self.row = ref, cube, inner, row
        self.has_evaluator = self.has_environment = inner is not None
        self.reward_source = cube.opts.reward_source
        self.timeout_s = cube.opts.timeout_s

    async def reset(self) -> Reset:
        if self.inner is not None:
            return await self.inner.reset()
        row = self.row or {}
        return Reset(observation=row["prompt"], system=row.get("system"),
                     info={k: v for k, v in row.items() if k not in ("prompt", "system")})

    def tools(self) -> list[ToolSpec]:
        return self.inner.tools() if self.inner is not None else []

    async def step(self, action: Action) -> StepResult:
        if self.inner is None:
            raise CubeError("this task has no environment")
        return await self.inner.step(action)

    async def evaluate(self) -> Evaluation:
        if self.inner is None:
            raise CubeError("this task has no evaluator")
        return await self.inner.evaluate()

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()

    async def run_agent(self, endpoint: AgentEndpoint, task: dict[str, Any]) -> float | None:
        if self.cube.workers is not None:
            return _reward(await self.cube.workers.run(task, endpoint))
        return await run_command(self.cube.opts, task, endpoint)


def _reward(out: Any) -> float | None:
    if out is None:
        return None
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise CubeError(f"the agent returned {type(out).__name__}, expected a number or None")
    return float(out)


# What a command agent inherits from the daemon's environment: enough to find
# programs, speak a locale and use a virtualenv. An allowlist, not a denylist:
# the daemon's environment holds credentials (HF_TOKEN, AWS_*, WANDB_API_KEY,
# RLNODE_HTTP_TOKEN) that the tools an agent runs must never read.
AGENT_ENV_ALLOW = ("PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "VIRTUAL_ENV", "PYTHONPATH",
                   "PYTHONHASHSEED", "SSL_CERT_FILE", "SSL_CERT_DIR")


def inherited_env(extra: list[str] | tuple[str, ...] = (), environ: dict[str, str] | None = None) -> dict[str, str]:
    """The daemon's variables any sandboxed process may inherit: the
    allowlist, locale (LC_*) and the names in ``extra``."""
    environ = os.environ if environ is None else environ
    allowed = set(AGENT_ENV_ALLOW) | set(extra)
    return {k: v for k, v in environ.items() if k in allowed or k.startswith("LC_")}


def allowed_env(opts: OpenAIAgentOptions, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What any agent (a command, a function's worker) gets of the daemon's
    environment: the allowlist, ``pass_env`` and ``env_vars``."""
    return {**inherited_env(opts.pass_env, environ), **opts.env_vars}


def agent_env(opts: OpenAIAgentOptions, endpoint: AgentEndpoint, environ: dict[str, str] | None = None) -> dict[str, str]:
    """A command agent's environment (the reward key is not in it: it goes on
    stdin, which the agent's tools do not inherit)."""
    return {**allowed_env(opts, environ), "OPENAI_BASE_URL": endpoint.base_url, "OPENAI_API_KEY": endpoint.api_key,
            # The same episode's routes for the anthropic SDK (its base URL
            # has no /v1: it appends /v1/messages itself).
            "ANTHROPIC_BASE_URL": anthropic_base(endpoint.base_url), "ANTHROPIC_API_KEY": endpoint.api_key,
            "RLNODE_ENV_URL": endpoint.env_url, "RLNODE_MODEL": endpoint.model}


def anthropic_base(base_url: str) -> str:
    """The anthropic SDK's base URL for an episode's OpenAI base URL."""
    return base_url.removesuffix("/").removesuffix("/v1")


async def run_command(opts: OpenAIAgentOptions, task: dict[str, Any], endpoint: AgentEndpoint) -> None:
    env = agent_env(opts, endpoint)
    if opts.isolation == "none":
        return await _run(opts.command, env, opts.cwd or None, task)
    inside = agent_sandbox.inside_url(endpoint.base_url)
    env.update(OPENAI_BASE_URL=inside, ANTHROPIC_BASE_URL=anthropic_base(inside),
               RLNODE_ENV_URL=agent_sandbox.inside_url(endpoint.env_url))
    async with agent_sandbox.GatewayRelay(endpoint.agent_socket, opts.limits.connections) as relay:
        argv = agent_sandbox.sandboxed_argv(opts.command, env, relay, opts.cwd, opts.ro_paths, opts.limits)
        group = await agent_sandbox.box_cgroup(opts.limits)
        try:
            return await _run(group.enter(argv) if group else argv, agent_sandbox.inside_env(env), "/", task)
        except CubeError as e:
            message = agent_sandbox.with_verdict(str(e), group)
            if relay.refused:
                message += (f" (and it opened more than {opts.limits.connections} gateway connections at once: "
                            "limits.connections)")
            raise CubeError(message) from e
        finally:
            if group is not None:
                await group.close()


async def _run(argv: list[str], env: dict[str, str], cwd: str | None, task: dict[str, Any]) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd,
        start_new_session=True,  # its own process group: killed whole, children included
    )
    # stderr is read as it comes and only its tail kept: an agent that
    # prints a gigabyte costs the daemon STDERR_TAIL bytes.
    err = isolation.OutputTail(STDERR_TAIL)
    try:
        await asyncio.gather(_feed(proc.stdin, json.dumps(task).encode()), err.drain(proc.stderr), proc.wait())
    finally:
        if proc.returncode is None:  # timeout or cancellation
            _kill_group(proc.pid)
            await proc.wait()
        else:
            _kill_group(proc.pid)  # children it left behind
    if proc.returncode != 0:
        raise CubeError(f"agent command exited with {proc.returncode}: {err.text()}")
    return None


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """The task on the agent's stdin; an agent that does not read it all
    (or exits first) is no error here: its exit status says."""
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stdin.close()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
