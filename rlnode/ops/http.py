"""OpsServer: one aiohttp endpoint per daemon.

    /healthz  200 only when every role is really serving (engines up and the
              trainer link bound), else 503 with the reasons
    /metrics  Prometheus text exposition (prometheus_client), built at scrape
              time from each role's ``prometheus()`` samples
    /status   JSON: each role's ``status()``
    /history  JSON time series for the live page (each role's ``history()``,
              plus 1 Hz samples of each role's ``gauges()``)
    /         the live page (dashboard.html): plots of reward and eval success
              over versions, throughput, lag and router occupancy; it polls
              /history and redraws itself

Access: loopback by default. On any other host every request except
/healthz must carry ``Authorization: Bearer TOKEN`` (``http.token`` or
``http.token_file``), and the server refuses to start without a token; a
configured token is required on loopback too.

Owns: the HTTP server, the bearer-token check, the 1 Hz gauge sampler, the
systemd watchdog pings (only while healthy). Must not change any role's
state: it only reads.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import time
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlnode.config import HttpConfig
from rlnode.addresses import is_loopback
from rlnode.log import get_logger
from rlnode.ops.netaddr import local_url_host
from rlnode.ops.notify import Notifier

log = get_logger("rlnode.ops")

PAGE = Path(__file__).with_name("dashboard.html")
# (name, kind, help, labels, value); kind is "gauge" or "counter" (name
# without the _total suffix, which the exposition adds).
Sample = tuple[str, str, str, dict[str, str], float]


OPEN_PATHS = frozenset({"/healthz"})  # probes (load balancers, systemd) carry no token
# The actor's gateway (rlnode/actor/gateway/): each episode's URL holds an
# unguessable token and its requests a per-episode key; the ops token is not
# handed to agents.
EPISODE_PREFIX = "/episodes/"


class HttpAuthError(ValueError):
    """An endpoint that would serve beyond loopback without a token, or a
    token setting that cannot be used: refused at start."""


def resolve_token(http: HttpConfig) -> str:
    """The bearer token from ``http.token`` or ``http.token_file`` ('' =
    none). Raises HttpAuthError when both are set or the file is unreadable
    or empty."""
    if http.token and http.token_file:
        raise HttpAuthError("http.token and http.token_file are both set: keep one (token_file keeps it out of the TOML)")
    if not http.token_file:
        return http.token
    try:
        token = Path(http.token_file).read_text().strip()
    except OSError as e:
        raise HttpAuthError(f"http.token_file {http.token_file!r}: {e.strerror or e}") from None
    if not token:
        raise HttpAuthError(f"http.token_file {http.token_file!r} is empty")
    return token


def check_exposure(host: str, token: str) -> None:
    """Raises HttpAuthError for a non-loopback host without a token."""
    if not token and not is_loopback(host):
        raise HttpAuthError(
            f"http.host = {host!r} serves /status, /metrics and the live page beyond this machine, "
            "but no token is set: set http.token_file (a file holding a long random secret, e.g. from "
            "`openssl rand -hex 32`) or http.token, or serve on loopback (http.host = \"127.0.0.1\")")


class Observable(Protocol):
    name: str

    def healthy(self) -> tuple[bool, str]: ...

    # Whether the watchdog should stop pinging while unhealthy (a restart of
    # this daemon could fix it); False for faults outside it (an unreachable
    # peer), which only turn /healthz red.
    def restart_would_help(self) -> bool: ...

    def status(self) -> dict[str, Any]: ...

    def prometheus(self) -> list[Sample]: ...

    def gauges(self) -> dict[str, float]: ...  # sampled at 1 Hz for the live page

    def history(self) -> dict[str, list]: ...


class _RoleCollector:
    def __init__(self, roles: list[Observable]):
        self.roles = roles

    def collect(self):
        families: dict[str, Any] = {}
        for role in self.roles:
            try:
                samples = role.prometheus()
            except Exception as e:  # a broken collector must not break the scrape
                log.warning("ops.metrics_failed", role=role.name, error=repr(e))
                continue
            for name, kind, help_, labels, value in samples:
                fam = families.get(name)
                if fam is None:
                    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    fam = families[name] = (cls(name, help_, labels=sorted(labels)), sorted(labels))
                fam[0].add_metric([labels[k] for k in fam[1]], float(value))
        return [f for f, _ in families.values()]


class OpsServer:
    def __init__(self, roles: list[Observable], host: str, port: int, notifier: Notifier | None = None,
                 history_points: int = 3600, token: str = ""):
        self.roles = roles
        self.host, self.port = host, port
        self._token = token.encode()
        self.notifier = notifier or Notifier({})
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RoleCollector(roles))
        self.samples: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=history_points))
        self.started = time.time()
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Listen. Raises HttpAuthError on a non-loopback host without a token."""
        check_exposure(self.host, self._token.decode())
        # Large bodies only reach the actor's gateway routes (agent histories).
        app = web.Application(middlewares=[self._auth] if self._token else [], client_max_size=64 * 2**20)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/status", self._status)
        app.router.add_get("/history", self._history)
        app.router.add_get("/", self._page)
        for role in self.roles:  # e.g. the actor's OpenAI gateway
            add = getattr(role, "add_http_routes", None)
            if add is not None:
                add(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # resolved when port = 0
        for role in self.roles:
            bound = getattr(role, "http_bound", None)
            if bound is not None:
                bound(f"http://{local_url_host(self.host)}:{self.port}")
        self._tasks = [asyncio.create_task(self._sampler(), name="ops-sampler")]
        if self.notifier.watchdog_s:
            self._tasks.append(asyncio.create_task(self._watchdog(), name="ops-watchdog"))
        log.info("ops.listening", url=f"http://{self.host}:{self.port}/")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- health ------------------------------------------------------------

    def health(self) -> tuple[bool, dict[str, str]]:
        reasons = {}
        for role in self.roles:
            ok, why = role.healthy()
            if not ok:
                reasons[role.name] = why
        return not reasons, reasons

    async def _watchdog(self) -> None:
        # Ping at half the interval, and only while healthy: a daemon that
        # stopped serving is restarted by systemd.
        while True:
            ok, reasons = self.health()
            if ok or not any(role.restart_would_help() for role in self.roles):
                self.notifier.watchdog()
            if not ok:
                log.warning("ops.unhealthy", reasons=reasons)
            await asyncio.sleep(self.notifier.watchdog_s / 2)

    async def _sampler(self) -> None:
        while True:
            now = time.time()
            for role in self.roles:
                try:
                    for k, v in role.gauges().items():
                        self.samples[f"{role.name}.{k}"].append((now, v))
                except Exception as e:
                    log.warning("ops.sample_failed", role=role.name, error=repr(e))
            await asyncio.sleep(1.0)

    # -- handlers ----------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        # Episode paths carry their own secret (the gateway checks it).
        if request.path not in OPEN_PATHS and not request.path.startswith(EPISODE_PREFIX):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # Constant time: the comparison must not leak how much matched.
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
                return web.json_response({"error": "unauthorized: send Authorization: Bearer TOKEN"}, status=401,
                                         headers={"WWW-Authenticate": 'Bearer realm="rlnode"'})
        return await handler(request)

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, reasons = self.health()
        return web.json_response({"ok": ok, "reasons": reasons}, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _status(self, request: web.Request) -> web.Response:
        ok, reasons = self.health()
        latest = {k: v[-1][1] for k, v in self.samples.items() if v}
        out = {"healthy": ok, "reasons": reasons, "uptime_s": time.time() - self.started,
               "roles": {r.name: r.status() for r in self.roles}, "gauges": latest}
        return web.json_response(out, dumps=_dumps)

    async def _history(self, request: web.Request) -> web.Response:
        out: dict[str, Any] = {"samples": {k: list(v) for k, v in self.samples.items()}}
        for role in self.roles:
            out[role.name] = role.history()
        return web.json_response(out, dumps=_dumps)

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=PAGE.read_text(), content_type="text/html")


def _dumps(obj: Any) -> str:
    import msgspec

    return msgspec.json.encode(obj).decode()

