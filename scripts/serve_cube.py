"""Serve one installed cube-standard benchmark over JSON-RPC 2.0 (``POST /``).

Runs under the cube-standard venv (Python >= 3.12, ``scripts/cube_server_venv.sh``),
never under rlnode's interpreter: rlnode talks to it only over HTTP
(``rlnode/cubes/protocol.py``). Usage::

    .venv-cube/bin/python scripts/serve_cube.py --benchmark arithmetic-cube --port 8765

``--benchmark`` is a ``cube.benchmarks`` entry-point name (``arithmetic`` is
accepted for ``arithmetic-cube``); the config class is built with its defaults,
or ``--subset NAME`` picks one of its named subsets.

Owns: turning a benchmark name into a running server in the foreground (so the
caller's process-group kill stops it and every task server it forked). Must
not change the protocol: requests and responses are cube-standard's own.

One deliberate change of lifecycle: cube-standard 0.1.0rc10's ``cube/close``
closes the task but leaves its task-server process (forked by ``cube/spawn``)
running until the benchmark server exits, so a training run would pile up one
idle uvicorn process per episode. Here a task server stops itself right after
it has answered ``cube/close``. Task servers also log at ``--log-level``
(upstream: "info", a line per request).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import signal
import sys

import cube.server
import uvicorn

_upstream_task_app = cube.server.make_task_jsonrpc_app


def _task_app_that_exits_on_close(task):
    """The upstream task app, wrapped in a pure ASGI layer that peeks at the
    request body and sends this process SIGTERM (uvicorn's graceful stop)
    once a ``cube/close`` response has gone out."""
    app = _upstream_task_app(task)

    async def wrapper(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        chunks: list[bytes] = []

        async def peek():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        await app(scope, peek, send)
        try:
            method = json.loads(b"".join(chunks)).get("method")
        except (ValueError, AttributeError):
            method = None
        if method == "cube/close":
            # Let uvicorn flush the response before it starts shutting down.
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)

    return wrapper


class _UvicornAtOurLogLevel:
    """``cube.server``'s view of uvicorn: task servers it starts log at our
    level (upstream leaves them at "info": one line per request)."""

    def __getattr__(self, name):
        return getattr(uvicorn, name)

    @staticmethod
    def run(app, **kwargs):
        kwargs.setdefault("log_level", os.environ.get("SERVE_CUBE_LOG_LEVEL", "warning"))
        return uvicorn.run(app, **kwargs)


# Module level on purpose: a ``spawn``/``forkserver`` child re-imports this file
# as ``__mp_main__`` and gets the patches too; ``fork`` children inherit them.
cube.server.make_task_jsonrpc_app = _task_app_that_exits_on_close
cube.server.uvicorn = _UvicornAtOurLogLevel()


def _benchmark_config(name: str, subset: str | None):
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="cube.benchmarks")}
    ep = eps.get(name) or eps.get(f"{name}-cube")
    if ep is None:
        sys.exit(f"serve_cube: no cube benchmark {name!r}; installed: {', '.join(sorted(eps)) or 'none'}")
    config = ep.load()()
    return config.named_subset(subset) if subset else config


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark", required=True, help="cube.benchmarks entry-point name")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--subset", default=None, help="a named subset of the benchmark")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    os.environ["SERVE_CUBE_LOG_LEVEL"] = args.log_level  # read by the task servers
    logging.basicConfig(level=args.log_level.upper())
    benchmark = _benchmark_config(args.benchmark, args.subset).make(None)
    # uvicorn re-raises SIGTERM after its graceful stop; with the default
    # handler that kills us before `finally` and before multiprocessing reaps
    # the task servers. Turned into SystemExit, both run (task servers inherit
    # this through fork and exit cleanly too).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        app = cube.server.make_benchmark_jsonrpc_app(benchmark)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        benchmark.close()


if __name__ == "__main__":
    main()
