"""The weight rendezvous is authenticated (rlnode.weights.rendezvous): real TCPStore
and gloo on CPU, every rank in a thread of this process; intruders are raw
TCPStore clients and plain sockets, as an outsider reaching the port would be."""

from __future__ import annotations

import random
import socket
import threading
import time
from datetime import timedelta

import msgspec
import psutil
import pytest
import structlog.testing
import torch
import torch.distributed as dist

from rlnode.config import WeightSyncConfig
from rlnode.weights.rendezvous import (
    MAX_PROOF_ATTEMPTS,
    PROOF_GRACE_S,
    Rendezvous,
    RendezvousError,
    new_secret,
    prove_channels,
    unique_id_group,
)
from rlnode.weights.broadcast import WeightBroadcaster
from rlnode.weights.plan import GroupMember, GroupSpec, decode_spec, encode
from rlnode.weights.comm import WeightComm

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=20)


def _listen(host: str = "127.0.0.1") -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))  # the kernel picks a free port
    sock.listen()
    return sock, sock.getsockname()[1]


def _spec(port: int, world: int, secret: str, timeout_s: float = 20.0, backend: str = "gloo") -> GroupSpec:
    members = tuple(GroupMember(f"n/{r}", r) for r in range(1, world))
    return GroupSpec(1, "127.0.0.1", port, world, backend, members, timeout_s, secret=secret)  # type: ignore[arg-type]


def _in_threads(jobs: dict[str, callable], join_s: float = 45.0) -> tuple[dict, dict]:
    """Run each job in its own thread; (results, errors) by name."""
    results, errors = {}, {}

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as e:  # reported to the test through `errors`
            errors[name] = e

    threads = [threading.Thread(target=run, args=item, name=f"rank-{item[0]}") for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), "a rank is still blocked"
    return results, errors


def _broadcast_all(comms: dict, value: torch.Tensor) -> list[torch.Tensor]:
    """One gloo broadcast from rank 0 across ``comms`` (rank -> WeightComm)."""
    bufs = {r: value.clone() if r == 0 else torch.zeros_like(value) for r in comms}
    _, errors = _in_threads({r: (lambda r=r: comms[r].broadcast(bufs[r])) for r in comms})
    assert not errors
    return [bufs[r] for r in sorted(comms)]


def _close(comms: dict) -> None:
    for c in comms.values():
        c.close()


def test_spec_secret_travels_but_never_shows_in_its_repr():
    secret = new_secret()
    spec = _spec(29511, 2, secret)
    assert len(secret) == 64 and decode_spec(encode(spec)).secret == secret
    for text in (repr(spec), str(spec), f"{spec}", repr(list(spec.__rich_repr__()))):
        assert secret not in text and "master_port=29511" in repr(spec)

    class OldSpec(msgspec.Struct, frozen=True):  # an actor that predates the secret drops it
        epoch: int
        master_host: str
        master_port: int
        world_size: int
        backend: str
        members: tuple[GroupMember, ...]
        timeout_s: float = 300.0

    assert msgspec.msgpack.decode(encode(spec), type=OldSpec).master_port == 29511
    old = decode_spec(msgspec.msgpack.encode(OldSpec(1, "h", 29511, 2, "gloo", (GroupMember("n/1", 1),))))
    assert old.secret == ""  # ... and a spec from an old trainer has none: refused below


def test_an_epoch_without_a_secret_is_refused_at_both_ends():
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=20)
    spec = bc.new_epoch([("n/1", 1)])
    assert len(spec.secret) == 64 and spec.secret != bc.new_epoch([("n/1", 1)]).secret  # fresh per epoch
    spec = bc.new_epoch([("n/1", 1)])
    with pytest.raises(RendezvousError, match="no valid rendezvous secret"):
        bc.open_group(msgspec.structs.replace(spec, secret=""))
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match="refusing an unauthenticated rendezvous"):
        WeightComm(msgspec.structs.replace(spec, secret=""), 1, "cpu")
    assert time.monotonic() - t0 < 1  # refused before it connects anywhere
    for sock in bc._reserved.values():
        sock.close()


def test_ranks_with_the_secret_form_the_group_and_broadcast():
    listen, port = _listen()
    spec = _spec(port, 3, new_secret())
    comms, errors = _in_threads({r: (lambda r=r: WeightComm(spec, r, "cpu", listen if r == 0 else None))
                                 for r in range(3)})
    assert not errors
    try:
        sent = torch.arange(1000, dtype=torch.float32)
        assert all(torch.equal(b, sent) for b in _broadcast_all(comms, sent))
        votes, _ = _in_threads({r: (lambda r=r: comms[r].sum_int(r)) for r in comms})
        assert votes == {0: 3, 1: 3, 2: 3}
        # Everything the store held was readable by whoever reached the
        # port while the group formed: none of it is the secret.
        store = comms[0]._rdv.store
        keys = store.list_keys()
        assert keys and not any(spec.secret in k or spec.secret.encode() in store.get(k) for k in keys)
        # The group is up: the gate is gone, and the port refuses.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        _close(comms)


def _spam(port: int, epoch: int, forged: threading.Event, stop: threading.Event, written: list[str]) -> None:
    """An intruder who knows the code (public): appends forged proofs for
    each rank (then sets ``forged``), lists and reads every key, writes
    garbage keys, until ``stop``."""
    spy = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
    for rank in (1, 2):
        for _ in range(3):
            i = spy.add(f"rlnode/e{epoch}/proof/{rank}/n", 1)
            spy.set(f"rlnode/e{epoch}/proof/{rank}/{i}", f"{'0' * 32}:{'f' * 64}")
            written.append(f"proof {rank}/{i}")
    forged.set()
    n, cut = 0, ""
    while not stop.is_set():
        try:
            for key in spy.list_keys():
                spy.get(key)
            spy.set(f"garbage/{n}", b"x" * 1024)
            spy.set(f"rlnode/e{epoch}/garbage/{n}", b"\x00" * 64)
        except RuntimeError:  # the group formed: rank 0 closed the gate, and the port with it
            cut = " cut"
            break
        n += 1
        time.sleep(0.005)
    written.append(f"garbage x{n}{cut}")


def _blocked_wait(port: int, outcome: list) -> None:
    """An intruder parked in a wait on a key that never comes."""
    spy = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=4))
    try:
        spy.wait(["never"])
        outcome.append("returned")
    except RuntimeError as e:  # the wait timed out (DistStoreError), or the gate closed (DistNetworkError)
        outcome.append(type(e).__name__)


def test_an_intruder_cannot_join_nor_stall_the_epoch():
    listen, port = _listen()
    spec = _spec(port, 3, new_secret())
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]  # connections that say nothing
    forged, stop, written, waited = threading.Event(), threading.Event(), [], []
    spammer = threading.Thread(target=_spam, args=(port, spec.epoch, forged, stop, written))
    waiter = threading.Thread(target=_blocked_wait, args=(port, waited))
    spammer.start()
    waiter.start()
    impostor = msgspec.structs.replace(spec, secret=new_secret())  # runs our code, claims rank 1
    # Members 1 and 2 come after the forged proofs for their ranks.
    jobs = {0: lambda: WeightComm(spec, 0, "cpu", listen),
            **{r: (lambda r=r: forged.wait(20) and WeightComm(spec, r, "cpu")) for r in (1, 2)},
            "impostor": lambda: Rendezvous(impostor, 1)}
    try:
        t0 = time.monotonic()
        comms, errors = _in_threads(jobs)
        formed_s = time.monotonic() - t0
        assert set(errors) == {"impostor"} and set(comms) == {0, 1, 2}
        assert isinstance(errors["impostor"], RendezvousError)
        # It waits out the grace period on a verdict it cannot verify, or
        # the group forms first and the port closes under it.
        assert ("cannot verify the trainer's admission" in str(errors["impostor"])
                or "formed it without this rank" in str(errors["impostor"])), errors["impostor"]
        # Not stalled: the legitimate ranks were admitted as soon as they
        # proved the secret, beside the forged proofs (well under a grace
        # period after the impostor's), not at a timeout.
        assert formed_s < PROOF_GRACE_S + 5, formed_s
        sent = torch.randn(4096)
        assert all(torch.equal(b, sent) for b in _broadcast_all(comms, sent))
    finally:
        stop.set()
        spammer.join(30)
        waiter.join(30)
        for s in idle:
            s.close()
    _close(comms)  # last: rank 0's store goes with it
    assert [w.split("/")[0] for w in written[:6]] == ["proof 1"] * 3 + ["proof 2"] * 3  # before the members' own
    assert any(w.startswith("garbage x") for w in written)
    assert waited in (["DistStoreError"], ["DistNetworkError"])


def test_a_rank_with_a_wrong_secret_fails_the_epoch_fast_naming_it():
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=60)  # a long timeout: the failure must come first
    spec = bc.new_epoch([("n/1", 1), ("n/2", 1)])
    wrong = msgspec.structs.replace(spec, secret=new_secret())
    t0 = time.monotonic()
    _, errors = _in_threads({0: lambda: bc.open_group(spec),
                             1: lambda: WeightComm(spec, 1, "cpu"),
                             2: lambda: WeightComm(wrong, 2, "cpu")})
    took = time.monotonic() - t0
    assert set(errors) == {0, 1, 2} and all(isinstance(e, RendezvousError) for e in errors.values())
    assert "rank(s) [2] did not prove they hold the epoch's secret" in str(errors[0])
    assert took < PROOF_GRACE_S + 8, took
    assert bc._comm is None  # no group for this epoch


def test_a_rank_that_never_comes_fails_the_epoch_at_the_timeout_naming_it():
    listen, port = _listen()
    spec = _spec(port, 3, new_secret(), timeout_s=2.0)
    t0 = time.monotonic()
    _, errors = _in_threads({0: lambda: WeightComm(spec, 0, "cpu", listen), 1: lambda: WeightComm(spec, 1, "cpu")})
    assert "rank(s) [2] did not join within 2 s" in str(errors[0])
    assert "refused the epoch" in str(errors[1]) or "lost the rendezvous" in str(errors[1])
    assert time.monotonic() - t0 < 10


def test_the_channel_check_rejects_a_gloo_peer_without_the_secret():
    """Phase 2 alone: an intruder that read the store could take a gloo
    connection in place of a member; over that very connection it cannot
    answer. Here rank 2 of a plain gloo group holds another secret."""
    key, other = bytes.fromhex(new_secret()), bytes.fromhex(new_secret())
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    port = server.port

    def rank(r: int):
        store = server if r == 0 else dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("plain/", store), r, 3, T)
        try:
            prove_channels(pg, other if r == 2 else key, 1, r, 3, T)
        finally:
            pg.shutdown()

    t0 = time.monotonic()
    _, errors = _in_threads({r: (lambda r=r: rank(r)) for r in range(3)})
    assert time.monotonic() - t0 < 10
    assert "connected as rank(s) [2] do not hold" in str(errors[0])
    assert "connected as rank(s) [2] do not hold" in str(errors[1])
    assert "connected as rank(s) [0, 1] do not hold" in str(errors[2])
    del server


def _other_local_addresses() -> list[str]:
    """Addresses of this machine other than 127.0.0.1 that a socket bound
    to all interfaces answers on (the whole 127/8 on Linux, eth0, ...)."""
    control, port = _listen("0.0.0.0")
    candidates = ["127.0.0.2"] + [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                                  if a.family == socket.AF_INET and a.address != "127.0.0.1"]
    reachable = []
    for addr in candidates:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            reachable.append(addr)
        except OSError:
            continue
    control.close()
    return reachable


def test_the_store_listens_on_the_advertised_address_only():
    others = _other_local_addresses()
    if not others:
        pytest.skip("this machine answers on no local address besides 127.0.0.1")
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=20)
    spec = bc.new_epoch([("n/1", 1)])
    opener = threading.Thread(target=bc.open_group, args=(spec,))
    opener.start()  # rank 0 serves the store and waits for rank 1
    try:
        time.sleep(0.5)
        for addr in others:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((addr, spec.master_port), timeout=2)
        socket.create_connection(("127.0.0.1", spec.master_port), timeout=2).close()
        comm = WeightComm(spec, 1, "cpu")
    finally:
        opener.join(30)
    assert bc._comm is not None
    comm.close()
    bc.close_group()


def test_the_secret_never_reaches_the_logs(capfd):
    """An epoch that fails (a wrong proof) and one that succeeds, under the
    trainer's own broadcaster: no log line, structured or printed by torch,
    carries the secret."""
    bc = WeightBroadcaster(WeightSyncConfig(backend="gloo", base_port=random.randrange(30000, 60000)),
                           master_host="127.0.0.1", timeout_s=20)
    secrets_seen = []
    with structlog.testing.capture_logs() as logs:
        spec = bc.new_epoch([("n/1", 1)])
        secrets_seen.append(spec.secret)
        _, failed = _in_threads({0: lambda: bc.open_group(spec),
                                 1: lambda: WeightComm(msgspec.structs.replace(spec, secret=new_secret()), 1, "cpu")})
        assert set(failed) == {0, 1}
        spec = bc.new_epoch([("n/1", 1)])
        secrets_seen.append(spec.secret)
        comms, errors = _in_threads({0: lambda: bc.open_group(spec), 1: lambda: WeightComm(spec, 1, "cpu")})
        assert not errors
        comms[1].close()
        bc.close_group()
    out, err = capfd.readouterr()
    events = {e["event"] for e in logs}
    assert {"rendezvous.bad_proof", "rendezvous.refused", "weights.group_opened", "weights.group_closed"} <= events
    text = repr(logs) + out + err + "".join(repr(e) for e in failed.values())
    assert not any(s in text for s in secrets_seen)


def test_the_nccl_unique_id_travels_sealed_without_pickle():
    """The part of the NCCL path that runs without a GPU: the id exchange
    PyNcclCommunicator drives through our StatelessProcessGroup adapter."""
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
    from vllm.distributed.utils import StatelessProcessGroup

    listen, port = _listen()
    spec = _spec(port, 3, new_secret(), backend="nccl")
    uid = bytes(random.randrange(256) for _ in range(128))
    rdvs, errors = _in_threads({r: (lambda r=r: Rendezvous(spec, r, listen if r == 0 else None)) for r in range(3)})
    assert not errors
    try:
        groups = {r: unique_id_group(rdvs[r]) for r in rdvs}
        assert all(isinstance(g, StatelessProcessGroup) for g in groups.values())
        got, errors = _in_threads({r: (lambda r=r: groups[r].broadcast_obj(
            ncclUniqueId.from_buffer_copy(uid) if r == 0 else ncclUniqueId(), src=0)) for r in groups})
        assert not errors
        assert all(bytes(got[r].internal) == uid for r in got)
        spy = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
        (key,) = [k for k in spy.list_keys() if "sealed" in k]
        blob = spy.get(key)
        assert uid not in blob and uid[:16] not in blob  # the id is not readable from the store
        for method, args in (("send_obj", (b"x", 1)), ("recv_obj", (0,)), ("all_gather_obj", (1,)), ("barrier", ())):
            with pytest.raises(NotImplementedError):
                getattr(groups[1], method)(*args)
        spy.set(key, blob[:-1] + bytes([blob[-1] ^ 1]))  # tampered with: refused, not trusted
        with pytest.raises(RendezvousError, match="not sealed with this epoch's secret"):
            groups[2].broadcast_obj(ncclUniqueId(), src=0)
        del spy
    finally:
        for r in rdvs.values():
            r.close()


def test_a_flooded_rank_slot_fails_the_epoch_fast_naming_it():
    """Forged proofs up to the cap for rank 1, which never comes: rank 0
    reads no more than the cap and says which rank was claimed."""
    listen, port = _listen()
    spec = _spec(port, 2, new_secret(), timeout_s=30.0)

    def flood():
        spy = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
        for _ in range(MAX_PROOF_ATTEMPTS + 4):
            i = spy.add("rlnode/e1/proof/1/n", 1)
            spy.set(f"rlnode/e1/proof/1/{i}", "junk")

    t0 = time.monotonic()
    _, errors = _in_threads({0: lambda: WeightComm(spec, 0, "cpu", listen), "flood": flood})
    assert "rank(s) [1] did not prove" in str(errors[0])
    assert time.monotonic() - t0 < PROOF_GRACE_S + 5
