"""The live page (rlnode/ops/dashboard.html) shows every data-derived
string as text, never as HTML (issue 35): cube ids come from the actors'
eval reports and /status's reasons carry peers' error texts, so a cube id
``<img src=x onerror=...>`` must not run script in the operator's browser.

The real OpsServer serves the real page, /status and /history (the
trainer's history and eval records built by TrainerDaemon's own methods)
from roles holding hostile strings; headless Chromium loads the page and
dumps its DOM once the page has drawn."""

from __future__ import annotations

import asyncio
import contextlib
import html
import os
import re
import shutil
import signal
import tempfile
import time
import types

import pytest

from rlnode.ops.http import PAGE, OpsServer
from rlnode.trainer.daemon import TrainerDaemon

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Each one, parsed as HTML, would run script: its image fails to load (/x,
# /y, /z are 404s on the ops server) and the onerror handler sets the title.
CUBE = """<img src=x onerror="document.title='pwned'">"""
# An actor's reply to a failed weight push, as the trainer's reason quotes it
# (WeightPusher.health). No double quote: /status's reasons reach the page
# through JSON.stringify, which would escape it.
PEER_ERROR = "<script>document.title='pwned-script'</script><img src=y onerror=document.title='pwned-reason'>"
LAG = "<img src=z onerror=document.title='pwned-lag'>"  # a token_lag_hist key


class _Trainer:
    """The trainer as OpsServer sees it; history and eval records come from
    TrainerDaemon's own methods (the shapes the page reads)."""

    name = "trainer"
    record_eval = TrainerDaemon.record_eval
    history = TrainerDaemon.history

    def __init__(self):
        self.eval_history, self.step_history = [], []
        self.metrics = types.SimpleNamespace(write=lambda rec: None)
        now = time.time()
        for v in (1, 2, 3):
            self.step_history.append({
                "step": v, "version": v, "time": now - 10 + v, "reward_mean": 0.1 * v, "success_mean": 0.1 * v,
                "groups": 2, "samples": 8, "tokens": 100, "lag_mean": 0.5, "lag_max": 1, "loss": 0.01,
                "step_s": 1.0, "loss/entropy": 1.2, "loss/entropy_coef": 0.01, "offpolicy/mismatch_kl": 0.001,
                "token_lag_hist": {"0": 60, "1": 40, LAG: 1}})
            self.record_eval(v, "guess", {"success_rate": 0.2 * v, "reward_mean": 0.1, "episodes": 8})
            self.record_eval(v, CUBE, {"success_rate": 0.1 * v, "reward_mean": 0.1, "episodes": 8})

    def healthy(self):
        return False, f"weight push failed 3 times in a row (trainer at version 3, actors at 2): {PEER_ERROR}"

    def restart_would_help(self):
        return False

    def status(self):
        return {"version": 3, "step": 3}

    def prometheus(self):
        return []

    def gauges(self):
        return {"version": 3.0}


class _Actor:
    name = "actor"

    def healthy(self):
        return True, ""

    def restart_would_help(self):
        return False

    def status(self):
        return {"version": 2}

    def prometheus(self):
        return []

    def gauges(self):
        return {"in_flight": 1.0, "waiting": 0.0, "tokens_per_s": 10.0, "version": 2.0}

    def history(self):
        return {}


async def _dump_dom(url: str, tmp_path) -> str:
    """The page's DOM after Chromium ran its scripts (virtual time: the
    page fetched and drew at least once)."""
    # Its own TMPDIR, removed after it: a short one (the singleton socket's
    # path must fit in a unix socket address, which tmp_path's may not).
    with tempfile.TemporaryDirectory(prefix="cr-") as tmp:
        return await _run_chromium(url, tmp_path, tmp)


async def _run_chromium(url: str, tmp_path, tmp: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        env={**os.environ, "TMPDIR": tmp})
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)  # a hang guard, not a timing check
    finally:
        # Chromium's helpers (zygote, renderer, utility) share its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == 0 and out, err.decode()[-2000:]
    return out.decode()


@pytest.mark.skipif(CHROMIUM is None,
                    reason="no chromium binary on PATH (chromium or chromium-browser; make test-deps installs it)")
async def test_peer_supplied_strings_render_as_text(tmp_path):
    ops = OpsServer([_Trainer(), _Actor()], "127.0.0.1", 0)
    try:
        await ops.start()
        dom = await _dump_dom(f"http://127.0.0.1:{ops.port}/", tmp_path)
    finally:
        await ops.close()

    # The page drew the hostile data (else the checks below would hold vacuously).
    points = dict(re.findall(r'id="plot-(\w+)"[^>]*data-points="(\d+)"', dom))
    assert int(points["eval"]) == 6 and int(points["taglag"]) == 9, points
    assert "unhealthy" in dom and "trainer version 3" in dom, dom
    # No hostile string ran or made an element: the title is the page's, the
    # page has one script, and outside it (its source may say "<img") no image...
    assert re.search(r"<title>(.*?)</title>", dom).group(1) == "rlnode", dom
    assert dom.count("<script") == 1, dom
    assert "<img" not in re.sub(r"<script>.*?</script>", "", dom, flags=re.S), dom
    # ...each is there as text.
    for s in (CUBE, PEER_ERROR, LAG):
        assert html.escape(s, quote=False) in dom, (s, dom)
    # The page's look: legends are coloured spans, the reasons a red one.
    assert re.search(r'<span style="color: ?(#1f77b4|rgb\(31, 119, 180\));?">■ guess</span>', dom), dom
    assert re.search(r'<span style="color: ?(#d62728|rgb\(214, 39, 40\));?">■ &lt;img src=x', dom), dom
    assert '<span class="bad">unhealthy: {"trainer":"weight push failed' in dom, dom


def test_the_page_parses_no_string_as_html():
    """Paths the browser test does not reach (a failed fetch's message, in
    "cannot reach the daemon") are covered by the rule: no HTML sink."""
    page = PAGE.read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|createContextualFragment|"
                         r"DOMParser|srcdoc", page)
