"""``cube-protocol``: any benchmark served by a cube-standard JSON-RPC 2.0 server.

cube-standard (PyPI, Python >= 3.12) serves a benchmark on one ``POST /``
endpoint. Benchmark methods: ``cube/info``, ``cube/tasks`` (task metadata,
each with ``id`` and ``split``), ``cube/task_configs`` (``{task_id}`` -> the
serialized configs ``cube/spawn`` takes), ``cube/spawn`` (``{task_config,
host?}`` -> the URL of a new task server), ``cube/shutdown``. Task methods,
POSTed to that URL: ``tools/list``, ``cube/reset`` (-> ``{obs, info}``),
``cube/step`` (``{name, arguments}`` -> ``{obs, reward, done, truncated,
info, error}``), ``cube/evaluate`` (-> ``{reward, info}``), ``cube/close``.

Owns: the HTTP client side of that protocol (one aiohttp session per cube,
JSON-RPC ids, response validation, retries of transient failures), the
optional server process it starts (``command``) and kills on ``close``, the
train/test split of the server's tasks, and the per-cube counters. Must not
touch engines, tokens or the scheduler, and must not import cube-standard:
the server runs in its own interpreter (``scripts/cube_server_venv.sh``,
launcher ``scripts/serve_cube.py``).

Errors: transport failures, JSON-RPC error objects and malformed responses
raise ``CubeError`` (the scheduler retries the episode). Mistakes of the
agent (no tool call, an unknown tool, invalid params on ``cube/step``) and a
step's own ``error`` field become ``StepResult.error``, which the agent sees.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import signal
import socket
import weakref
from typing import Annotated, Any, Literal

import aiohttp
import msgspec
from msgspec import Meta

from rlnode.cubes.base import (
    Action,
    Cube,
    CubeError,
    CubeTask,
    CubeTaskRef,
    Evaluation,
    Reset,
    Split,
    StepResult,
    ToolSpec,
)
from rlnode.log import get_logger

log = get_logger("rlnode.cubes.protocol")

Seconds = Annotated[float, Meta(gt=0, le=3600)]

# Methods that may be sent twice without harm: a timeout or a 5xx after the
# server got the request is retried only for these. ``cube/step`` and
# ``cube/spawn`` are retried only when the connection could not be opened
# (the request never left), so an action is never applied twice and a task
# server never spawned twice.
_REPEATABLE = frozenset({
    "cube/info", "cube/tasks", "cube/task_configs", "tools/list",
    "cube/reset", "cube/evaluate", "cube/close", "cube/status", "cube/shutdown",
})
# JSON-RPC "invalid params" on cube/step is about the agent's arguments.
_INVALID_PARAMS = -32602


class ProtocolOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Benchmark server URL. With `command`, "{port}" in it is replaced by the
    # port picked for the server; empty with `command` = http://127.0.0.1:{port}.
    url: str = ""
    # argv that starts the benchmark server in the foreground, e.g.
    # [".venv-cube/bin/python", "scripts/serve_cube.py", "--benchmark",
    #  "arithmetic-cube", "--port", "{port}"]. "{port}" is replaced by a free
    # port. Started in its own process session by start(); its whole process
    # group (task servers included) is killed by close().
    command: list[str] = []
    # Working directory for `command`; empty = the daemon's.
    cwd: str = ""
    # File the server's stdout/stderr are appended to; empty = inherit ours.
    log_file: str = ""
    # How long start() waits for the started server to answer.
    startup_timeout_s: Seconds = 60.0
    # How long open_task() waits for a spawned task server to answer.
    spawn_timeout_s: Seconds = 30.0
    # Per HTTP request (one JSON-RPC call attempt).
    request_timeout_s: Seconds = 60.0
    # Re-sends of a call after a transient failure (connection error,
    # timeout, HTTP 5xx/429). JSON-RPC error objects are never retried.
    max_retries: Annotated[int, Meta(ge=0, le=20)] = 3
    # Retry backoff: retry_backoff_s * 2**attempt seconds.
    retry_backoff_s: Annotated[float, Meta(ge=0, le=60)] = 0.5
    # Host task servers bind to (cube/spawn's `host`); empty = the server's
    # default (127.0.0.1). Set a routable address for a remote server.
    spawn_host: str = ""
    # Train/test split. "server": the tasks' own `split` field ("val" counts
    # as test); "hash": a stable hash of the task id holds out
    # `test_fraction`; "auto": "server" when the server has train tasks,
    # else "hash". A non-empty `test_task_ids` overrides all three.
    split: Literal["auto", "server", "hash"] = "auto"
    # Share of tasks held out as test by the "hash" split, (0, 1).
    test_fraction: Annotated[float, Meta(gt=0, lt=1)] = 0.2
    # Explicit test tasks; every other task is train.
    test_task_ids: list[str] = []
    # An evaluation succeeds when the server's reward >= this.
    success_threshold: float = 1.0
    # Concurrent HTTP connections of this cube's client.
    max_connections: Annotated[int, Meta(ge=1, le=65536)] = 256

    def __post_init__(self):
        if not self.url and not self.command:
            raise ValueError("cube-protocol: set `url` (a running server) or `command` (one to start)")
        if self.url and "{port}" in self.url and not self.command:
            raise ValueError("cube-protocol: `url` has {port} but there is no `command` to start")


class ProtocolCounters(msgspec.Struct):
    rpc_calls: int = 0  # JSON-RPC calls made (a retried call counts once)
    rpc_errors: int = 0  # calls that returned no result (any reason)
    retries: int = 0  # re-sent attempts after a transient failure
    timeouts: int = 0  # attempts that ran past request_timeout_s
    tasks_spawned: int = 0
    tasks_closed: int = 0  # cube/close answered
    close_errors: int = 0  # cube/close failed (the task server may be left)
    agent_errors: int = 0  # StepResults carrying an agent-visible error


class _Transient(Exception):
    """An attempt failed in a way a re-send may fix."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent  # whether the server may have received the request


class RpcError(CubeError):
    """The server answered with a JSON-RPC error object."""

    def __init__(self, url: str, method: str, code: int, message: str, data: Any = None):
        super().__init__(f"{method} at {url}: JSON-RPC error {code}: {message}")
        self.code, self.rpc_message, self.data = code, message, data


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def render_observation(obs: Any) -> str:
    """A cube Observation (``{"contents": [...]}``) as the text an LLM reads.
    Text stays text, structured data becomes JSON, media become placeholders
    (the agent is text-only). Anything else is rendered as JSON."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, dict) and isinstance(obs.get("contents"), list):
        return "\n\n".join(_render_content(c) for c in obs["contents"])
    return json.dumps(obs, ensure_ascii=False)


def _render_content(content: Any) -> str:
    if not isinstance(content, dict):
        return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    kind = str(content.get("_type", "")).rpartition(".")[2]
    data = content.get("data")
    if kind in ("ImageContent", "AudioContent", "VideoContent") or (
            isinstance(data, str) and data.startswith("data:image/")):
        text = f"[{kind.removesuffix('Content').lower() or 'image'} omitted]"
    elif isinstance(data, str):
        text = data
    else:
        text = json.dumps(data, ensure_ascii=False)
    name = content.get("name")
    return f"## {name}\n{text}" if name else text


def _tool_spec(raw: Any) -> ToolSpec:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise CubeError(f"tools/list: malformed tool {raw!r}")
    params = raw.get("parameters") if isinstance(raw.get("parameters"), dict) else {}
    return ToolSpec(name=raw["name"], description=str(raw.get("description") or ""), parameters=params)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CubeError(f"{what}: expected a number, got {value!r}")
    return float(value)


def _as_dict(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CubeError(f"{what}: expected an object, got {type(value).__name__}")
    return value


def _step_error_text(error: Any) -> str | None:
    if error is None:
        return None
    if isinstance(error, dict):
        kind, text = error.get("error_type"), error.get("exception_str")
        if kind or text:
            return f"{kind or 'Error'}: {text or ''}".rstrip(": ")
    return str(error)


def split_tasks(tasks: list[dict[str, Any]], opts: ProtocolOptions) -> dict[str, list[str]]:
    """Disjoint train/test task ids, each in the server's order."""
    ids = [t["id"] for t in tasks]
    if opts.test_task_ids:
        unknown = sorted(set(opts.test_task_ids) - set(ids))
        if unknown:
            raise CubeError(f"test_task_ids not served by the benchmark: {unknown[:5]}")
        test = set(opts.test_task_ids)
    elif opts.split == "server" or (opts.split == "auto" and any(t.get("split") == "train" for t in tasks)):
        test = {t["id"] for t in tasks if t.get("split") != "train"}
    else:
        # Stable across runs and seeds, so test scores stay comparable.
        ranked = sorted(ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())
        n_test = round(len(ids) * opts.test_fraction)
        n_test = min(max(n_test, 1), len(ids) - 1) if len(ids) > 1 else len(ids)
        test = set(ranked[:n_test])
    return {"train": [i for i in ids if i not in test], "test": [i for i in ids if i in test]}


class ProtocolCube(Cube):
    runs_agents = False  # the actor plays every episode itself (rlnode/actor/episode.py)

    kind = "cube-protocol"
    Options = ProtocolOptions

    def __init__(self, cube_id: str, options: ProtocolOptions, seed: int):
        self.cube_id = cube_id
        self.opts = options
        self.seed = seed  # unused: the server owns its tasks' randomness
        self.counters = ProtocolCounters()
        self.url = options.url.rstrip("/")
        self._ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._reaper: weakref.finalize | None = None
        self._start_lock = asyncio.Lock()
        self._splits: dict[str, list[str]] | None = None
        self._configs: dict[str, dict[str, Any]] = {}
        self._open: set[ProtocolTask] = set()
        self._closing: set[asyncio.Task] = set()
        self._closed = False

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise CubeError(f"cube-protocol {self.cube_id}: used after close()")
            if self._session is not None:
                return
            connector = aiohttp.TCPConnector(limit=self.opts.max_connections, keepalive_timeout=2.0)
            self._session = aiohttp.ClientSession(connector=connector)
            if self.opts.command:
                try:
                    await self._start_server()
                except BaseException:
                    await self._stop_server()
                    await self._session.close()
                    self._session = None
                    raise

    async def _start_server(self) -> None:
        port = _free_port()
        argv = [a.replace("{port}", str(port)) for a in self.opts.command]
        self.url = (self.opts.url or "http://127.0.0.1:{port}").replace("{port}", str(port)).rstrip("/")
        out = open(self.opts.log_file, "ab") if self.opts.log_file else None
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv, cwd=self.opts.cwd or None, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=out, start_new_session=True)
        except OSError as e:
            raise CubeError(f"cube-protocol {self.cube_id}: cannot start {argv[0]!r}: {e}") from e
        finally:
            if out is not None:
                out.close()
        # Kills the server group if this cube is dropped or the interpreter
        # exits without close().
        self._reaper = weakref.finalize(self, _kill_group, self._proc.pid)
        log.info("cube_server_started", cube=self.cube_id, pid=self._proc.pid, url=self.url)
        await self._wait_ready(self.url, self.opts.startup_timeout_s, self._proc)

    async def _wait_ready(self, url: str, timeout_s: float, proc=None) -> None:
        """Poll until ``url`` answers HTTP at all. An empty JSON object is not a
        valid request, so a cube server answers -32600: proof it is up."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        probe = aiohttp.ClientTimeout(total=min(5.0, timeout_s))
        while True:
            if proc is not None and proc.returncode is not None:
                raise CubeError(f"cube-protocol {self.cube_id}: server exited with {proc.returncode} while starting")
            try:
                async with self._session.post(url, json={}, timeout=probe) as resp:
                    await resp.read()
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise CubeError(f"cube-protocol {self.cube_id}: {url} did not answer within {timeout_s:g}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        # Tasks the episodes left open (they should not) and closes in flight.
        for task in list(self._open):
            await task.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._proc is not None and self._session is not None:
            try:  # let the benchmark release its infrastructure first
                await self._call(self.url, "cube/shutdown", None, retries=0, timeout_s=5.0)
            except CubeError as e:
                log.warning("cube_shutdown_failed", cube=self.cube_id, error=str(e))
        await self._stop_server()
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _stop_server(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # The whole group: the server and every task server it forked.
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except asyncio.TimeoutError:
            pass
        _kill_group(proc.pid, signal.SIGKILL)  # stragglers, even if the leader exited
        await proc.wait()
        if self._reaper is not None:
            self._reaper.detach()
        log.info("cube_server_stopped", cube=self.cube_id, returncode=proc.returncode)

    def stats(self) -> ProtocolCounters:
        return msgspec.structs.replace(self.counters)

    # -- JSON-RPC ------------------------------------------------------------

    async def _call(self, url: str, method: str, params: dict[str, Any] | None = None, *,
                    retries: int | None = None, timeout_s: float | None = None) -> Any:
        """One JSON-RPC call: the ``result``, or CubeError. Transient failures
        are re-sent with backoff (see ``_REPEATABLE``)."""
        if self._session is None:
            await self.start()
        self.counters.rpc_calls += 1
        retries = self.opts.max_retries if retries is None else retries
        body = {"jsonrpc": "2.0", "method": method, "id": next(self._ids)}
        if params is not None:
            body["params"] = params
        try:
            for attempt in itertools.count():
                try:
                    return await self._attempt(url, body, timeout_s or self.opts.request_timeout_s)
                except _Transient as e:
                    if attempt >= retries or (e.sent and method not in _REPEATABLE):
                        raise CubeError(f"{method} at {url}: {e} (after {attempt + 1} attempts)") from e
                    self.counters.retries += 1
                    log.warning("cube_rpc_retry", cube=self.cube_id, method=method, error=str(e), attempt=attempt + 1)
                    await asyncio.sleep(self.opts.retry_backoff_s * 2**attempt)
        except CubeError:
            self.counters.rpc_errors += 1
            raise

    async def _attempt(self, url: str, body: dict[str, Any], timeout_s: float) -> Any:
        try:
            async with self._session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            self.counters.timeouts += 1
            raise _Transient(f"no answer within {timeout_s:g}s", sent=True) from None
        except aiohttp.ClientConnectorError as e:
            raise _Transient(f"cannot connect: {e}", sent=False) from e
        except aiohttp.ClientError as e:
            raise _Transient(f"{type(e).__name__}: {e}", sent=True) from e
        if status >= 500 or status == 429:
            raise _Transient(f"HTTP {status}", sent=True)
        return self._result(url, body, status, raw)

    @staticmethod
    def _result(url: str, body: dict[str, Any], status: int, raw: bytes) -> Any:
        method = body["method"]
        try:
            msg = json.loads(raw)
        except ValueError:
            raise CubeError(f"{method} at {url}: malformed response (HTTP {status}, not JSON): {raw[:200]!r}") from None
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0" or ("result" in msg) == ("error" in msg):
            raise CubeError(f"{method} at {url}: malformed JSON-RPC response (HTTP {status}): {raw[:200]!r}")
        if "error" in msg:
            err = msg["error"]
            if not isinstance(err, dict) or not isinstance(err.get("code"), int):
                raise CubeError(f"{method} at {url}: malformed JSON-RPC error object: {err!r}")
            raise RpcError(url, method, err["code"], str(err.get("message", "")), err.get("data"))
        if msg.get("id") != body["id"]:
            raise CubeError(f"{method} at {url}: response id {msg.get('id')!r} != request id {body['id']}")
        if status != 200:
            raise CubeError(f"{method} at {url}: HTTP {status} with a result")
        return msg["result"]

    # -- tasks ---------------------------------------------------------------

    async def _load_tasks(self) -> dict[str, list[str]]:
        if self._splits is None:
            tasks = await self._call(self.url, "cube/tasks", {})
            if not isinstance(tasks, list) or not all(
                    isinstance(t, dict) and isinstance(t.get("id"), str) for t in tasks):
                raise CubeError(f"cube/tasks at {self.url}: expected a list of {{id, ...}}, got {str(tasks)[:200]}")
            self._splits = split_tasks(tasks, self.opts)
        return self._splits

    async def task_ids(self, split: Split) -> list[str]:
        return list((await self._load_tasks())[split])

    async def _task_config(self, task_id: str) -> dict[str, Any]:
        if task_id not in self._configs:
            configs = await self._call(self.url, "cube/task_configs", {"task_id": task_id})
            if not isinstance(configs, list):
                raise CubeError(f"cube/task_configs at {self.url}: expected a list, got {str(configs)[:200]}")
            if not configs or not isinstance(configs[0], dict):
                raise CubeError(f"cube-protocol {self.cube_id}: the server has no task {task_id!r}")
            self._configs[task_id] = configs[0]
        return self._configs[task_id]

    async def open_task(self, task_id: str) -> ProtocolTask:
        params: dict[str, Any] = {"task_config": await self._task_config(task_id)}
        if self.opts.spawn_host:
            params["host"] = self.opts.spawn_host
        url = await self._call(self.url, "cube/spawn", params)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise CubeError(f"cube/spawn at {self.url}: expected a task URL, got {url!r}")
        self.counters.tasks_spawned += 1
        task = ProtocolTask(self, CubeTaskRef(self.cube_id, task_id), url.rstrip("/"))
        self._open.add(task)
        try:
            # cube/spawn answers before the task server has bound its port.
            await self._wait_ready(task.url, self.opts.spawn_timeout_s)
        except BaseException:
            # Not handed to the caller, so nobody else would close it.
            await asyncio.shield(task.close())
            raise
        return task

    def _close_task(self, task: ProtocolTask) -> asyncio.Task:
        """Start ``cube/close`` in a task of its own, so a cancelled caller
        cannot interrupt it and ``close()`` can wait for it."""
        self._open.discard(task)
        closing = asyncio.get_running_loop().create_task(self._do_close(task))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        return closing

    async def _do_close(self, task: ProtocolTask) -> None:
        try:
            await self._call(task.url, "cube/close")
            self.counters.tasks_closed += 1
        except CubeError as e:
            # Raising here would mask the episode's own outcome.
            self.counters.close_errors += 1
            log.warning("cube_task_close_failed", cube=self.cube_id, task=task.ref.task_id, error=str(e))


class ProtocolTask(CubeTask):
    """One spawned task server; used by one episode coroutine."""

    def __init__(self, cube: ProtocolCube, ref: CubeTaskRef, url: str):
        self.cube = cube
        self.ref = ref
        self.url = url
        self._tools: list[ToolSpec] = []
        self._closing: asyncio.Task | None = None

    async def reset(self) -> Reset:
        out = _as_dict(await self.cube._call(self.url, "cube/reset"), "cube/reset")
        if "obs" not in out:
            raise CubeError(f"cube/reset at {self.url}: no `obs` in {str(out)[:200]}")
        tools = await self.cube._call(self.url, "tools/list")
        if not isinstance(tools, list):
            raise CubeError(f"tools/list at {self.url}: expected a list, got {str(tools)[:200]}")
        self._tools = [_tool_spec(t) for t in tools]
        return Reset(observation=render_observation(out["obs"]), info=_as_dict(out.get("info"), "cube/reset info"))

    def tools(self) -> list[ToolSpec]:
        return list(self._tools)

    def _agent_error(self, text: str, error: str, role: Literal["tool", "user"]) -> StepResult:
        self.cube.counters.agent_errors += 1
        return StepResult(text, error=error, role=role)

    async def step(self, action: Action) -> StepResult:
        names = [t.name for t in self._tools]
        if action.parse_error:
            return self._agent_error(f"Your tool call could not be parsed: {action.parse_error}",
                                     action.parse_error, "user")
        # cube/step takes only tool calls: a text-only turn cannot be sent.
        if not action.tool_calls:
            return self._agent_error(f"Please act by calling one of the tools: {', '.join(names)}.",
                                     "no tool call", "user")
        call = action.tool_calls[0]
        # cube-standard answers an unknown tool with a generic internal error
        # (-32603), indistinguishable from a crash, so it is caught here.
        if names and call.name not in names:
            return self._agent_error(f"Unknown tool {call.name!r}. Available: {', '.join(names)}.",
                                     f"unknown tool {call.name}", "tool")
        try:
            out = await self.cube._call(self.url, "cube/step", {"name": call.name, "arguments": call.arguments})
        except RpcError as e:
            if e.code != _INVALID_PARAMS:
                raise
            return self._agent_error(f"Invalid tool call: {e.rpc_message}", e.rpc_message, "tool")
        return self._step_result(out, extra_calls=len(action.tool_calls) - 1)

    def _step_result(self, out: Any, extra_calls: int) -> StepResult:
        out = _as_dict(out, "cube/step")
        if "obs" not in out:
            raise CubeError(f"cube/step at {self.url}: no `obs` in {str(out)[:200]}")
        info = dict(_as_dict(out.get("info"), "cube/step info"))
        truncated = bool(out.get("truncated", False))
        if truncated:
            info["truncated"] = True
        if extra_calls:
            info["ignored_tool_calls"] = extra_calls  # cube/step runs one action
        error = _step_error_text(out.get("error"))
        self.cube.counters.agent_errors += error is not None
        return StepResult(
            observation=render_observation(out["obs"]),
            reward=_number(out.get("reward", 0.0), "cube/step reward"),
            done=bool(out.get("done", False)) or truncated,
            info=info, error=error, role="tool",
        )

    async def evaluate(self) -> Evaluation:
        out = _as_dict(await self.cube._call(self.url, "cube/evaluate"), "cube/evaluate")
        reward = _number(out.get("reward"), "cube/evaluate reward")
        return Evaluation(reward=reward, success=reward >= self.cube.opts.success_threshold,
                          info=_as_dict(out.get("info"), "cube/evaluate info"))

    async def close(self) -> None:
        # Exactly one cube/close however often (and however cancelled) this is
        # awaited; the shield keeps a caller's cancellation from cutting it.
        if self._closing is None:
            self._closing = self.cube._close_task(self)
        await asyncio.shield(self._closing)
