"""Who may talk to a trainer, over real ZeroMQ sockets with CURVE and a real
aiohttp endpoint: a non-loopback link needs keys (or an explicit
``link.insecure``), each actor node speaks only under the node id its key is
named after, deleting a key file revokes that node, and a non-loopback HTTP
endpoint needs a bearer token."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
import structlog.testing

from rlnode.config import HttpConfig, LinkConfig
from rlnode.link import ActorLink, LinkFatalError, TrainerLink, keygen
from rlnode.link.curve import InsecureBindError, KeyRing, check_bind
from rlnode.ops.http import HttpAuthError, OpsServer, resolve_token
from rlnode.ops.status_cli import status_main

from daemons import free_port
from test_link import ANY_PORT, FAST, delivery, drain, until


def _curve(keys, **kw) -> LinkConfig:
    return LinkConfig(curve_dir=str(keys), heartbeat_s=0.1, peer_timeout_s=1.0, **kw)


@pytest.fixture
def keys(tmp_path):
    keygen(tmp_path / "keys", ["a1", "b1", "c1"])
    (tmp_path / "keys" / "authorized" / "c1.key").unlink()  # c1 has a key pair the trainer does not accept
    return tmp_path / "keys"


@pytest.fixture(autouse=True)
def no_leftover_threads():
    """The ZAP authenticator, sockets and contexts die with each link."""
    before = set(threading.enumerate())
    yield
    left = [t for t in set(threading.enumerate()) - before if t.is_alive() and not t.daemon]
    assert not left, left


@pytest.fixture
async def links():
    """Closes every link a test opens, actors first, even when it fails."""
    opened: list = []
    yield opened
    for link in reversed(opened):
        await link.close()


async def _open(links: list, link):
    await link.start()
    links.append(link)
    return link


# ---- binding -----------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_loopback_binds_need_no_keys(host):
    assert check_bind(host, "", insecure=False) is False


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "10.1.2.3", "trainer.example"])
def test_a_network_bind_without_curve_is_refused(host):
    with pytest.raises(InsecureBindError) as e:
        check_bind(host, "", insecure=False)
    msg = str(e.value)
    assert all(k in msg for k in ("link.curve_dir", "rlnode keygen", "link.insecure", "trainer.bind_host"))
    assert check_bind(host, "/some/keys", insecure=False) is False
    assert check_bind(host, "", insecure=True) is True


async def test_trainer_link_refuses_a_public_bind_without_curve():
    port = free_port()
    t = TrainerLink(f"tcp://0.0.0.0:{port}", FAST)
    with pytest.raises(InsecureBindError, match="rlnode keygen"):
        await t.start()
    assert t._ctx is None and t.endpoint == ""
    # Nothing was bound: the port is still free.
    import socket
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))


async def test_insecure_bind_starts_warns_and_says_so(links):
    with structlog.testing.capture_logs() as logs:
        t = await _open(links, TrainerLink("tcp://0.0.0.0:*", LinkConfig(insecure=True, heartbeat_s=0.1,
                                                                          peer_timeout_s=1.0)))
    warned = [e for e in logs if e["event"] == "link.trainer.INSECURE"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning" and "rlnode keygen" in warned[0]["detail"]
    assert t.security() == {"curve": False, "insecure": True, "authorized_nodes": []}
    port = t.endpoint.rsplit(":", 1)[1]
    a = await _open(links, ActorLink(f"tcp://127.0.0.1:{port}", "a1", [(0, 1)], FAST))
    assert await a.wait_connected(5)
    # A loopback bind is not "insecure", with or without the knob.
    lo = await _open(links, TrainerLink(ANY_PORT, LinkConfig(insecure=True)))
    assert lo.security()["insecure"] is False


# ---- one key per node --------------------------------------------------------


async def test_each_actor_speaks_under_its_own_key(keys, links):
    trainer = await _open(links, TrainerLink("tcp://0.0.0.0:*", _curve(keys)))  # curve: a public bind is fine
    assert trainer.security() == {"curve": True, "insecure": False, "authorized_nodes": ["a1", "b1"]}
    endpoint = "tcp://127.0.0.1:" + trainer.endpoint.rsplit(":", 1)[1]
    a = await _open(links, ActorLink(endpoint, "a1", [(0, 1)], _curve(keys)))  # key = node id
    b = await _open(links, ActorLink(endpoint, "b1", [(0, 1)], _curve(keys)))
    assert (a.curve_key, b.curve_key) == ("a1", "b1")
    assert await a.wait_connected(5) and await b.wait_connected(5)
    assert a.submit(delivery("a1-g1", node="a1")) and b.submit(delivery("b1-g1", node="b1"))
    assert await a.flush(5) and await b.flush(5)
    peers = trainer.peers()
    assert {(p.node_id, p.user_id) for p in peers.values()} == {("a1", "a1"), ("b1", "b1")}
    assert sorted((pid.split("/")[0], g.group_id) for pid, g in drain(trainer.deliveries)) == [
        ("a1", "a1-g1"), ("b1", "b1-g1")]
    assert trainer.counters.identity_mismatch == 0


def test_key_name_other_than_the_node_id_fails_at_start(keys):
    with pytest.raises(ValueError, match="actor.node_id = 'b1'"):
        ActorLink("tcp://127.0.0.1:1", "a1", [], _curve(keys, key_name="b1"))
    assert ActorLink("tcp://127.0.0.1:1", "a1", [], _curve(keys, key_name="a1")).curve_key == "a1"


async def test_a_key_cannot_speak_for_another_node(keys, links):
    trainer = await _open(links, TrainerLink(ANY_PORT, _curve(keys)))
    a = await _open(links, ActorLink(trainer.endpoint, "a1", [(0, 1)], _curve(keys)))
    assert await a.wait_connected(5)
    a_peer = f"a1/{a.incarnation}"
    assert a.submit(delivery("a1-g1")) and await a.flush(5)

    # b1's valid key claiming node a1: under a fresh incarnation, and under
    # a1's live identity itself (what ROUTER_HANDOVER would hand over).
    fake = await _open(links, ActorLink(trainer.endpoint, "a1", [(0, 1)], _curve(keys), curve_key="b1"))
    twin = await _open(links, ActorLink(trainer.endpoint, "a1", [(0, 1)], _curve(keys), curve_key="b1",
                                        incarnation=a.incarnation))
    fake.submit(delivery("fake-g1"))
    twin.submit(delivery("twin-g1"))
    with pytest.raises(LinkFatalError, match="identity mismatch"):
        await asyncio.wait_for(_fatal(fake), 5)
    assert trainer.counters.identity_mismatch >= 1
    await asyncio.sleep(1.0)  # the twin keeps trying; a1 keeps heartbeating

    # Without handover the live a1 keeps its routing id: the twin's
    # connection never gets it (whatever it sends is dropped or rejected).
    assert not fake.connected and not twin.connected and twin.counters().registrations == 0
    assert trainer.counters.registrations == 1 and list(trainer.peers()) == [a_peer]
    assert trainer.peers()[a_peer].connected and trainer.peers()[a_peer].user_id == "a1"
    # a1 is undisturbed: same connection, its next group goes through.
    assert a.connected and a.counters().disconnects == 0
    assert a.submit(delivery("a1-g2")) and await a.flush(5)
    assert [g.group_id for _, g in drain(trainer.deliveries)] == ["a1-g1", "a1-g2"]
    assert trainer.counters.groups_accepted == 2


async def _fatal(actor: ActorLink) -> None:
    while True:
        await actor.next_control()


async def test_an_unauthorized_key_gets_no_frame_through(keys, links):
    trainer = await _open(links, TrainerLink(ANY_PORT, _curve(keys)))
    c = await _open(links, ActorLink(trainer.endpoint, "c1", [(0, 1)], _curve(keys)))
    c.submit(delivery("c1-g1", node="c1"))
    await until(lambda: trainer.counters.auth_denied >= 2, what="repeated ZAP denials")
    assert not c.connected and trainer.peers() == {}
    assert trainer.counters.frames_in == 0  # the handshake failed: nothing reached the trainer's code


async def test_deleting_a_key_file_revokes_that_node(keys, links):
    trainer = await _open(links, TrainerLink(ANY_PORT, _curve(keys)))
    a = await _open(links, ActorLink(trainer.endpoint, "a1", [(0, 1)], _curve(keys)))
    b = await _open(links, ActorLink(trainer.endpoint, "b1", [(0, 1)], _curve(keys)))
    assert await a.wait_connected(5) and await b.wait_connected(5)
    drain(trainer.events)

    (keys / "authorized" / "b1.key").unlink()
    # The running session ends within a heartbeat, and b1 learns it for good.
    with pytest.raises(LinkFatalError, match="revoked"):
        await asyncio.wait_for(_fatal(b), 5)
    left = [e for e in drain(trainer.events) if e.kind == "left"]
    assert [(e.node_id, e.reason) for e in left] == [("b1", "revoked")] and trainer.counters.revoked == 1
    assert trainer.security()["authorized_nodes"] == ["a1"]

    # Its next connection is refused in the handshake, no trainer restart.
    frames, denied = trainer.counters.frames_in, trainer.counters.auth_denied
    b2 = await _open(links, ActorLink(trainer.endpoint, "b1", [(0, 1)], _curve(keys)))
    b2.submit(delivery("b1-g2", node="b1"))
    await until(lambda: trainer.counters.auth_denied > denied, what="b1 denied at its next connection")
    # a1 carries on meanwhile.
    assert a.submit(delivery("a1-g1")) and await a.flush(5)
    assert not b2.connected and b2.counters().acked == 0
    assert trainer.counters.frames_in > frames  # a1's
    assert [g.group_id for _, g in drain(trainer.deliveries)] == ["a1-g1"]

    # Putting the key back re-admits the node, again without a restart.
    (keys / "authorized" / "b1.key").write_bytes((keys / "b1.key").read_bytes())
    assert await b2.wait_connected(5)


def test_a_key_filed_under_two_names_binds_to_neither(keys):
    (keys / "authorized" / "x1.key").write_bytes((keys / "authorized" / "a1.key").read_bytes())
    assert sorted(KeyRing(keys).names().values()) == ["b1"]


# ---- HTTP endpoint -------------------------------------------------------------


class _Role:
    name = "trainer"

    def healthy(self):
        return True, ""

    def status(self):
        return {"version": 3, "step": 7, "buffered_groups": 0, "peers": []}

    def prometheus(self):
        return [("rlnode_step", "gauge", "optimizer steps", {}, 7.0)]

    def gauges(self):
        return {}

    def history(self):
        return {}


async def test_http_beyond_loopback_needs_a_token():
    with pytest.raises(HttpAuthError, match="http.token_file"):
        await OpsServer([_Role()], "0.0.0.0", free_port()).start()
    ops = OpsServer([_Role()], "127.0.0.1", 0)  # loopback: open, as before
    await ops.start()
    try:
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{ops.port}/status") as r:
            assert r.status == 200 and (await r.json())["roles"]["trainer"]["step"] == 7
    finally:
        await ops.close()


async def test_http_token_guards_everything_but_healthz(capsys):
    token = "s3cret-" + "x" * 32
    ops = OpsServer([_Role()], "0.0.0.0", 0, token=token)
    await ops.start()
    base = f"http://127.0.0.1:{ops.port}"
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/status", "/metrics", "/history", "/"):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"},
                                {"Authorization": f"Bearer {token}x"}):
                    async with s.get(base + path, headers=headers) as r:
                        assert r.status == 401, (path, headers)
                async with s.get(base + path, headers={"Authorization": f"Bearer {token}"}) as r:
                    assert r.status == 200, path
                    body = await r.text()
            async with s.get(base + "/healthz") as r:
                assert r.status == 200 and (await r.json())["ok"]
            async with s.get(base + "/metrics", headers={"Authorization": f"Bearer {token}"}) as r:
                assert "rlnode_step 7.0" in await r.text()
        assert body  # the live page
        # `rlnode status` sends it; without it the daemon reads as refused.
        assert await status_main([f"127.0.0.1:{ops.port}"], 5, token) == 0
        assert await status_main([f"127.0.0.1:{ops.port}"], 5) == 3
        out = capsys.readouterr().out
        assert "step 7" in out and "401 unauthorized" in out
    finally:
        await ops.close()


def test_token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text("  abc123\n")
    assert resolve_token(HttpConfig(token_file=str(f))) == "abc123"
    assert resolve_token(HttpConfig(token="t")) == "t" and resolve_token(HttpConfig()) == ""
    with pytest.raises(HttpAuthError, match="both set"):
        resolve_token(HttpConfig(token="t", token_file=str(f)))
    f.write_text("\n")
    with pytest.raises(HttpAuthError, match="empty"):
        resolve_token(HttpConfig(token_file=str(f)))
    with pytest.raises(HttpAuthError, match="absent"):
        resolve_token(HttpConfig(token_file=str(tmp_path / "absent")))


def test_agent_cubes_give_a_loopback_link_keys_of_its_own(tmp_path):
    """Agent code on the node can reach loopback: a config with an agent cube
    and no curve_dir gets CurveZMQ keys under its run dir, the same for the
    trainer and the actor of the node; without agent cubes, or with a
    curve_dir, nothing changes."""
    from rlnode.config import CubeConfig, load_config
    from rlnode.daemon import agent_link_keys

    def cfg(kind, **link):
        c = load_config(None, [f"run.run_dir={tmp_path / 'run'}", "actor.node_id=n1", "actor.peers=[\"127.0.0.1:5555\"]"])
        c.actor.cubes = [CubeConfig(id="c", kind=kind)]
        for k, v in link.items():
            setattr(c.link, k, v)
        return c

    trainer, actor = cfg("openai-agent"), cfg("openai-agent")
    assert agent_link_keys(trainer, "trainer") == agent_link_keys(actor, "actor") == str(tmp_path / "run" / "link-keys")
    assert trainer.link.curve_dir == actor.link.curve_dir
    assert (tmp_path / "run" / "link-keys" / "authorized" / "n1.key").is_file()
    secret = (tmp_path / "run" / "link-keys" / "n1.key_secret").read_bytes()
    assert agent_link_keys(cfg("verifiers"), "all") and (tmp_path / "run" / "link-keys" / "n1.key_secret").read_bytes() == secret
    assert agent_link_keys(cfg("guessing"), "all") == ""
    assert agent_link_keys(cfg("openai-agent", curve_dir="/elsewhere"), "all") == ""


def test_the_keyring_parses_a_key_file_once_until_it_changes(tmp_path, monkeypatch):
    """Issue 36: every handshake and every heartbeat's revocation scan asked
    the keyring, which parsed every key file each time (O(N) per lookup,
    O(N^2) when N actors reconnect). Now a lookup on an unchanged directory
    parses nothing; a key added or deleted is seen at the next lookup (the
    directory's mtime), one rewritten in place within RESCAN_S."""
    from rlnode.link.curve import KeyRing

    names = [f"n{i}" for i in range(40)]
    keygen(tmp_path / "keys", names)
    ring = KeyRing(tmp_path / "keys")
    assert sorted(ring.names().values()) == sorted(names) and ring.parses == 40
    for _ in range(200):
        ring.names()
    assert ring.parses == 40
    auth = tmp_path / "keys" / "authorized"
    (auth / "n0.key").unlink()
    assert "n0" not in ring.names().values() and ring.parses == 40  # a deletion: nothing re-parsed
    keygen(tmp_path / "more", ["late"])
    (auth / "late.key").write_bytes((tmp_path / "more" / "authorized" / "late.key").read_bytes())
    assert "late" in ring.names().values() and ring.parses == 41
    # n1's file rewritten in place with late's key: a key under two names binds to neither.
    monkeypatch.setattr(KeyRing, "RESCAN_S", 0.0)
    (auth / "n1.key").write_bytes((auth / "late.key").read_bytes() + b"\n")
    found = ring.names()
    assert "n1" not in found.values() and "late" not in found.values() and ring.parses == 42
