"""The gate in front of a weight epoch's TCPStore (rlnode.weights.store_gate): a
real TCPStore server on loopback, the gate process on its own port, and
clients that are plain TCPStore clients, as anyone reaching the port is."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from rlnode.weights.rendezvous import new_secret
from rlnode.weights.store_gate import MAX_CONN_BYTES, GateProcess
from rlnode.weights.plan import GroupMember, GroupSpec
from rlnode.weights.comm import WeightComm

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=10)


class Served:
    """A loopback TCPStore server and a gate in front of it."""

    def __init__(self, **limits):
        inner = socket.create_server(("127.0.0.1", 0))
        inner_port = inner.getsockname()[1]
        self.store = dist.TCPStore("127.0.0.1", inner_port, is_master=True, master_listen_fd=inner.detach(),
                                   wait_for_workers=False, timeout=T)
        listen = socket.create_server(("127.0.0.1", 0))
        self.port = listen.getsockname()[1]
        self.gate = GateProcess(listen, inner_port, **limits)

    def client(self, timeout: timedelta = T) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timeout)

    def close(self) -> dict:
        self.store = None
        return self.gate.stop()  # idempotent: the counts again


@pytest.fixture
def served(request):
    s = Served(**getattr(request, "param", {}))
    yield s
    s.close()


@pytest.mark.parametrize("served", [{"max_conn_bytes": 64 * 1024, "max_total_bytes": 256 * 1024}], indirect=True)
def test_a_connection_past_its_bytes_is_cut_and_nothing_of_it_is_stored(served):
    c = served.client()
    c.set("small", b"s" * 1024)
    assert served.store.get("small") == b"s" * 1024  # relayed both ways
    with pytest.raises(RuntimeError):  # DistNetworkError: the gate closed the connection
        c.set("big", b"b" * (128 * 1024))
        c.check(["small"])  # a set is not answered: the next call finds the connection gone
    assert not served.store.check(["big"])  # the cut value never reached the store
    # All clients together: 256 KiB, then every connection is cut.
    written, short = 0, timedelta(seconds=2)
    for _ in range(6):  # 6 x 64 KiB > 256 KiB
        try:
            c2 = served.client(short)  # refused outright once the total is spent
        except RuntimeError:
            break
        try:
            for _ in range(8):
                c2.set(f"k{written}", b"x" * (32 * 1024 - 64))
                c2.check([f"k{written}"])  # answered only if the connection still stands
                written += 1
        except RuntimeError:
            continue
    # 64 KiB a connection is one 32 KiB set each (the second goes past it);
    # the 256 KiB in all ends it after a few connections.
    assert 2 <= written <= 8, written
    assert all(len(served.store.get(f"k{i}")) == 32 * 1024 - 64 for i in range(written))
    with pytest.raises(RuntimeError):
        served.client(short).check(["late"])  # the total is spent: cut at its first bytes
    counts = served.close()
    assert counts["cut"] >= 3 and counts["bytes_in"] <= 256 * 1024 + 64 * 1024, counts


@pytest.mark.parametrize("served", [{"max_conns": 2}], indirect=True)
def test_connections_over_the_limit_are_closed_at_accept(served):
    a, b = served.client(), served.client()  # each TCPStore client holds one connection
    extra = socket.create_connection(("127.0.0.1", served.port), timeout=5)
    extra.settimeout(5)
    assert extra.recv(1) == b""  # closed by the gate, never relayed
    a.set("a", b"1")
    b.set("b", b"2")
    extra.close()
    del a
    time.sleep(0.3)  # the gate sees the close
    served.client().set("c", b"3")  # a slot is free again
    assert served.store.get("c") == b"3"
    assert served.close()["refused"] == 1


def test_a_stopped_gate_refuses_and_its_counts_come_back(served):
    served.client().set("k", b"v")
    counts = served.close()
    assert counts["accepted"] == 1 and counts["cut"] == 0 and counts["bytes_in"] > 0, counts
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", served.port), timeout=2)


def test_the_gate_dies_with_its_parent(tmp_path):
    """The trainer killed -9: its gate exits by itself within a second or two."""
    script = (
        "import socket, sys, time, torch.distributed as dist\n"
        "from rlnode.weights.store_gate import GateProcess\n"
        "inner = socket.create_server(('127.0.0.1', 0)); p = inner.getsockname()[1]\n"
        "s = dist.TCPStore('127.0.0.1', p, is_master=True, master_listen_fd=inner.detach(), wait_for_workers=False)\n"
        "g = GateProcess(socket.create_server(('127.0.0.1', 0)), p)\n"
        "print(g.proc.pid, flush=True); time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        gate_pid = int(parent.stdout.readline())
        gate = psutil.Process(gate_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        gate.wait(5)  # psutil.TimeoutExpired if it outlived its parent
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.wait(10)


def test_a_flood_during_admission_is_cut_and_the_members_still_form_the_group():
    listen = socket.create_server(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    spec = GroupSpec(1, "127.0.0.1", port, 2, "gloo", (GroupMember("n/1", 1),), 20.0, secret=new_secret())
    comms, errors = {}, {}

    def rank(r):
        try:
            comms[r] = WeightComm(spec, r, "cpu", listen if r == 0 else None)
        except BaseException as e:  # reported through `errors`
            errors[r] = e

    t0 = threading.Thread(target=rank, args=(0,))
    t0.start()
    flooded = None
    try:
        time.sleep(0.3)  # rank 0 serves the store through its gate
        intruder = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=T)
        try:
            intruder.set("flood", b"f" * (2 * MAX_CONN_BYTES))
            intruder.check(["flood"])  # a set is not answered: this call finds the connection cut
        except RuntimeError as e:
            flooded = e
        rank(1)
    finally:
        t0.join(30)
    try:
        assert flooded is not None, "an 8 MiB value went through the gate"
        assert not errors and set(comms) == {0, 1}, errors
        assert not comms[0]._rdv.store.check(["flood"])
        sent = torch.arange(64, dtype=torch.float32)
        got = torch.zeros(64)
        t = threading.Thread(target=comms[0].broadcast, args=(sent,))
        t.start()
        comms[1].broadcast(got)
        t.join(10)
        assert torch.equal(got, sent)
    finally:
        for c in comms.values():
            c.close()
