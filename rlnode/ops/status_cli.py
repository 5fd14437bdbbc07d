"""``rlnode status --peers HOST:PORT,...``: a terminal summary of a running
job, read from each daemon's ``/status`` (the ``[http]`` endpoint).

Exit code: 0 when every daemon answered and is healthy, 1 when one is
unhealthy, 3 when one is unreachable or refused the token. An endpoint
beyond loopback needs its bearer token: ``--token`` or ``RLNODE_HTTP_TOKEN``.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp

EXIT_UNHEALTHY = 1
EXIT_UNREACHABLE = 3


async def fetch(session: aiohttp.ClientSession, peer: str) -> tuple[str, dict | None, str]:
    url = peer if "://" in peer else f"http://{peer}"
    try:
        async with session.get(f"{url}/status") as r:
            if r.status == 401:
                return peer, None, "401 unauthorized (give --token or set RLNODE_HTTP_TOKEN)"
            return peer, await r.json(), ""
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return peer, None, f"{type(e).__name__}: {e}"


def rows(peer: str, st: dict) -> list[str]:
    out = []
    g = st.get("gauges", {})
    for role, s in st["roles"].items():
        if role == "trainer":
            last = s.get("last_step") or {}
            peers = sum(p["connected"] for p in s.get("peers", []))
            rate = f"{last.get('samples', 0) / max(last.get('step_s', 0) or 1e-9, 1e-9):.1f} samples/s" if last else "-"
            benched = ", ".join(b["node_id"] for b in s.get("weights", {}).get("benched", []))
            detail = (f"step {s['step']}, reward {last.get('reward_mean', 0):.3f}, {rate}, "
                      f"{peers} actor(s){f' (benched: {benched})' if benched else ''}, "
                      f"{s['buffered_groups']} groups buffered")
        else:
            link = s.get("link", {})
            conn = "connected" if link.get("connected") else ("no trainer" if not link else "DISCONNECTED")
            detail = (f"{g.get('actor.tokens_per_s', 0):.0f} tok/s, in flight {g.get('actor.in_flight', 0):.0f}, "
                      f"waiting {g.get('actor.waiting', 0):.0f}, {conn}")
        health = "ok" if st["healthy"] else "UNHEALTHY " + "; ".join(f"{k}: {v}" for k, v in st["reasons"].items())
        out.append(f"{peer:<24}{role:<9}{s.get('version', '-')!s:>8}  {health:<12} {detail}")
    return out


async def status_main(peers: list[str], timeout_s: float = 5.0, token: str = "") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers) as session:
        results = await asyncio.gather(*(fetch(session, p) for p in peers))
    print(f"{'node':<24}{'role':<9}{'version':>8}  {'health':<12} detail")
    code = 0
    for peer, st, err in results:
        if st is None:
            print(f"{peer:<24}{'?':<9}{'-':>8}  UNREACHABLE  {err}")
            code = EXIT_UNREACHABLE
            continue
        for line in rows(peer, st):
            print(line)
        if not st["healthy"] and code == 0:
            code = EXIT_UNHEALTHY
    sys.stdout.flush()
    return code
