"""Daemon lifecycle shared by every role: startup -> run -> shutdown.

Owns: the event loop (uvloop), signal handling and the order in which roles
start and stop. Signal handlers only set state: the first SIGINT/SIGTERM asks
every role to stop (drain with a deadline), a second one exits at once with
code 130. Roles must not install signal handlers of their own.

Exit codes: 0 clean stop, 1 fatal error, 2 bad config/usage, 130 forced stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Protocol

from rlnode import aio
from rlnode.config import Config, ConfigError, actor_node_id
from rlnode.log import bind_context, get_logger
from rlnode.model_files import model_unreadable

log = get_logger("rlnode.daemon")

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_USAGE = 2
EXIT_FORCED = 130


class Role(Protocol):
    """What a role (actor, trainer) exposes to the lifecycle."""

    name: str

    async def start(self) -> None: ...  # bring up engines/sockets; raise to abort

    async def run(self, stop: asyncio.Event) -> None: ...  # serve until stop is set

    async def shutdown(self) -> None: ...  # release everything; must not raise


class Lifecycle:
    # Each role's shutdown (after the drain): above the engines' own
    # shutdown bound (rlnode/actor/engine.py: Engine.SHUTDOWN_TIMEOUT_S, 30 s) plus
    # what a role does before it (a final checkpoint, closing cubes and the
    # gateway host), which a loaded host needed (a daemon exited 1 with its
    # engine still closing at 30 s). Drain + two roles' shutdowns stay within
    # the units' TimeoutStopSec=120.
    SHUTDOWN_TIMEOUT_S = 45.0

    def __init__(self, roles: list[Role], drain_timeout_s: float = 30.0,
                 http: tuple[str, int] | tuple[str, int, str] | None = None):
        from rlnode.ops.notify import Notifier

        self.roles = roles
        self.drain_timeout_s = drain_timeout_s
        self.stop = asyncio.Event()
        self._signals = 0
        self.notifier = Notifier()
        self.http = http  # (host, port[, bearer token]) of the ops endpoint, or None
        self.ops = None

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals > 1:
            # Second signal: the operator means it. No cleanup.
            os.write(2, b'{"event": "forced exit on second signal"}\n')
            os._exit(EXIT_FORCED)
        log.info("signal", signal=signal.Signals(signum).name)
        self.notifier.stopping(f"stopping on {signal.Signals(signum).name}")
        self.stop.set()

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        started: list[Role] = []
        code = EXIT_OK
        status_task = None
        try:
            await self._start_ops()
            for role in self.roles:
                self.notifier.status(f"starting {role.name}")
                await _until_stopped(role.start(), self.stop)
                started.append(role)
                if self.stop.is_set():
                    break
            else:
                log.info("ready", roles=[r.name for r in self.roles])
                self.notifier.ready(f"serving: {' + '.join(r.name for r in self.roles)}")
                status_task = asyncio.create_task(self._report_status())
                runs = [asyncio.create_task(r.run(self.stop), name=f"run-{r.name}") for r in self.roles]
                code = await self._supervise(runs)
        except _Stopped:
            log.info("stopped during startup")
        except ConfigError as e:  # a cube refused its options at start: one line naming the key
            log.error("config_error", error=str(e))
            code = EXIT_USAGE
        except Exception:
            log.exception("fatal")
            code = EXIT_FATAL
        finally:
            self.notifier.stopping("draining")
            if status_task is not None:
                status_task.cancel()
            for role in reversed(started):
                try:
                    await asyncio.wait_for(role.shutdown(), self.SHUTDOWN_TIMEOUT_S)
                except Exception:
                    log.exception("shutdown failed", role=role.name)
                    code = code or EXIT_FATAL
            if self.ops is not None:
                await self.ops.close()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        log.info("exit", code=code)
        return code

    async def _start_ops(self) -> None:
        if self.http is None:
            return
        from rlnode.ops.http import OpsServer

        host, port, *token = self.http
        self.ops = OpsServer(self.roles, host, port, notifier=self.notifier, token=token[0] if token else "")
        await self.ops.start()

    async def _report_status(self) -> None:
        """systemd STATUS= line: what `systemctl status` shows."""
        while True:
            parts = []
            for r in self.roles:
                st = r.status()
                parts.append(f"{r.name} v{st.get('version', 0)}" + (f" step {st['step']}" if "step" in st else ""))
            self.notifier.status(", ".join(parts))
            await asyncio.sleep(5.0)

    async def _supervise(self, runs: list[asyncio.Task]) -> int:
        """Wait for a stop request or for a role to end; a role that ends on
        its own with an error is fatal for the daemon."""
        stop_wait = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait([stop_wait, *runs], return_when=asyncio.FIRST_COMPLETED)
        self.stop.set()
        code = EXIT_OK
        for t in runs:
            if t in done and not t.cancelled() and t.exception() is not None:
                log.error("role failed", task=t.get_name(), error=repr(t.exception()))
                code = EXIT_FATAL
        # Roles see stop and drain themselves; past the deadline they are cancelled.
        _, pending = await asyncio.wait(runs, timeout=self.drain_timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            log.warning("drain deadline passed, cancelled", tasks=len(pending))
            await asyncio.gather(*pending, return_exceptions=True)
        for t in runs:
            if t.done() and not t.cancelled() and t.exception() is not None and code == EXIT_OK:
                log.error("role failed while draining", task=t.get_name(), error=repr(t.exception()))
                code = EXIT_FATAL
        stop_wait.cancel()
        return code


class _Stopped(Exception):
    pass


async def _until_stopped(coro, stop: asyncio.Event):
    """Run a startup step, but give up as soon as a stop is requested."""
    task = asyncio.ensure_future(coro)
    stop_wait = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise _Stopped()
    finally:
        stop_wait.cancel()


def build_roles(cfg: Config, role: str, resume: bool = False) -> list[Role]:
    roles: list[Role] = []
    if role in ("trainer", "all"):
        from rlnode.trainer.daemon import TrainerDaemon

        roles.append(TrainerDaemon(cfg, resume=resume))
    if role in ("actor", "all"):
        from rlnode.actor.daemon import ActorDaemon

        if role == "all" and not cfg.actor.peers:
            # One machine: the actor talks to its own trainer over loopback,
            # through the same link as a remote actor would.
            cfg.actor.peers = [f"127.0.0.1:{cfg.trainer.port}"]

        roles.append(ActorDaemon(cfg))
    return roles


# Cube kinds that run code the policy steers (agents, their tools, verifiers
# runtimes) on the actor's node, outside any sandbox when in-process.
AGENT_CUBE_KINDS = frozenset({"openai-agent", "verifiers"})


def agent_link_keys(cfg: Config, role: str) -> str:
    """With agent cubes configured, a loopback link without CurveZMQ gets
    keys of its own (``curve.auto_keys`` under the run dir): loopback is no
    trust boundary while agents run on the node. Returns the curve dir
    chosen ('' when the config's own rules apply: curve_dir set, no agent
    cube, or a link beyond loopback, which needs CURVE or insecure anyway)."""
    from rlnode.addresses import is_loopback
    from rlnode.link.curve import auto_keys

    if cfg.link.curve_dir or not any(c.kind in AGENT_CUBE_KINDS for c in cfg.actor.cubes):
        return ""
    if role == "trainer" and not is_loopback(cfg.trainer.bind_host):
        return ""
    if role == "actor" and not all(is_loopback(p.rpartition(":")[0].split("://")[-1]) for p in cfg.actor.peers):
        return ""
    cfg.link.curve_dir = auto_keys(cfg.run.run_dir, cfg.link.key_name or actor_node_id(cfg))
    log.info("link.curve_auto", curve_dir=cfg.link.curve_dir, why="agent cubes run code on this node; "
             "loopback is no trust boundary", key="link.curve_dir")
    return cfg.link.curve_dir


def _exposure_checked(cfg: Config, role: str) -> tuple[str, int, str] | None:
    """Refuse, before anything heavy starts, a trainer link or an HTTP
    endpoint open beyond loopback without authentication (the link and the
    ops server check again when they start). Returns the ops endpoint
    (host, port, token), or None when it is disabled."""
    from rlnode.link.curve import check_bind

    if role in ("trainer", "all"):
        check_bind(cfg.trainer.bind_host, cfg.link.curve_dir, cfg.link.insecure)
    if not cfg.http.enabled:
        return None
    from rlnode.ops.http import check_exposure, resolve_token

    token = resolve_token(cfg.http)
    check_exposure(cfg.http.host, token)
    return cfg.http.host, cfg.http.actor_port if role == "actor" else cfg.http.trainer_port, token


def run_daemon(cfg: Config, role: str, resume: bool = False) -> int:
    bind_context(run=cfg.run.name, role=role, node=cfg.actor.node_id or os.uname().nodename)
    try:
        agent_link_keys(cfg, role)
        http = _exposure_checked(cfg, role)
        if unread := model_unreadable(cfg.model.path, cfg.model.tokenizer):
            raise ValueError("; ".join(unread[:3]) + (f" (and {len(unread) - 3} more)" if len(unread) > 3 else ""))
    except ValueError as e:
        print(f"rlnode: refusing to start: {e}", file=sys.stderr)
        return EXIT_USAGE
    # No gc.freeze() before exit, though it would save seconds of final
    # collection on a busy host: frozen objects are never freed, and
    # triton's nanobind module then prints "leaked instances" at every exit.
    return aio.run(Lifecycle(build_roles(cfg, role, resume), http=http).main())
