"""A weight push whose peer vanishes fails within the group's timeout and
never hangs, on either end, and the next epoch works.

The peer is a real process on the real gloo transport (rlnode.weights.comm):
it receives the first bucket of a push and then dies (SIGKILL: its sockets
close) or freezes (SIGSTOP: its sockets stay open, nothing moves; what a
partitioned or swapped-out host looks like). No engine: the engine's side of
a failed transfer (notice, discard, old weights kept) is covered in
test_weights and test_push_safety."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from test_weights import _receiver  # rank 1 in a thread: votes, receives
from rlnode.config import WeightSyncConfig
from rlnode.weights.broadcast import WeightBroadcaster, update_tensors
from rlnode.weights.comm import WeightComm, agree_on_plan, keep_stdout
from rlnode.weights.plan import GroupMember, GroupSpec, TransferError, encode
from rlnode.weights.rendezvous import new_secret

TIMEOUT_S = 4.0  # the group's per-collective timeout
# What "within its timeout" may add: detecting the failure, tearing down.
SLACK_S = 6.0

# The peer: joins the group at rank 1 (or 0 with "send"), agrees on the plan,
# moves the first bucket, then does what argv[3] says.
PEER = r"""
import os, signal, sys
import torch
from rlnode.weights.comm import WeightComm, agree_on_plan
from rlnode.weights.plan import decode_plan, decode_spec
spec, plan = decode_spec(bytes.fromhex(sys.argv[1])), decode_plan(bytes.fromhex(sys.argv[2]))
rank = 0 if sys.argv[4] == "send" else 1
print("ready", flush=True)
comm = WeightComm(spec, rank, "cpu")
assert not agree_on_plan(comm, plan.digest(), reject=False)
for i, bucket in enumerate(plan.buckets):
    comm.broadcast(torch.zeros(bucket.nbytes, dtype=torch.uint8))
    print("bucket", i, flush=True)
    if i == 0:
        os.kill(os.getpid(), getattr(signal, sys.argv[3]))
"""


def _model() -> torch.nn.Module:
    # Buckets of 1 MiB: the first moves, the rest meet a vanished peer.
    return torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))


def _peer(spec: GroupSpec, plan, how: str, role: str = "receive") -> subprocess.Popen:
    """Started and past its imports (seconds on a loaded host, which must
    not count against the group's timeout)."""
    proc = subprocess.Popen([sys.executable, "-c", PEER, encode(spec).hex(), encode(plan).hex(), how, role],
                            stdout=subprocess.PIPE, text=True)
    _expect(proc, "ready")
    return proc


def _expect(proc: subprocess.Popen, line: str) -> None:
    """Read the peer's output up to ``line`` (its log lines go there too)."""
    for got in proc.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"peer {proc.pid} ended (code {proc.wait()}) before saying {line!r}")


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(10)
    proc.stdout.close()


def _wait_first_bucket(proc: subprocess.Popen) -> None:
    _expect(proc, "bucket 0")
    # The signal is sent right after the line: let it land.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "Z") or proc.poll() is not None:
            return
        time.sleep(0.01)
    raise AssertionError(f"peer {proc.pid} neither stopped nor died")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_push_whose_receiver_vanishes_fails_within_its_timeout(how):
    """Trainer side: the broadcast raises TransferError within the timeout
    (a killed receiver at once, a frozen one when the collective times
    out), and a new epoch with a live receiver carries the next push."""
    tensors = update_tensors(_model())
    cfg = WeightSyncConfig(backend="gloo", bucket_mb=1, base_port=29500 + os.getpid() % 20000)
    bc = WeightBroadcaster(cfg, master_host="127.0.0.1", timeout_s=TIMEOUT_S)
    spec = bc.new_epoch([("peer/0", 1)])
    # The plan needs the open group; the peer needs the plan: make it on a
    # throwaway copy of the spec's shape (same tensors, same epoch).
    bc.spec = spec
    plan = bc.plan(tensors, 1)
    bc.spec = None
    assert len(plan.buckets) >= 4
    proc = _peer(spec, plan, how)
    try:
        bc.open_group(spec)
        outcome: list = []

        def push() -> None:
            t0 = time.monotonic()
            try:
                bc.broadcast(plan, tensors)
                outcome.append(("sent", time.monotonic() - t0))
            except TransferError as e:
                outcome.append((e, time.monotonic() - t0))

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        _wait_first_bucket(proc)
        pusher.join(TIMEOUT_S + SLACK_S)
        assert not pusher.is_alive(), f"the push hangs {TIMEOUT_S + SLACK_S} s after its receiver got {how}"
        (err, took), = outcome
        assert isinstance(err, TransferError), f"the push to a receiver that got {how} succeeded"
        assert "broadcast failed" in str(err) and took < TIMEOUT_S + SLACK_S
        # The epoch is unusable now, and says so without touching the wire.
        with pytest.raises(TransferError, match="failed earlier"):
            bc.broadcast(plan, tensors)
    finally:
        _end(proc)
    # A new epoch (fresh port and secret) with a live receiver works.
    spec2 = bc.new_epoch([("peer/0", 1)])
    plans: queue.Queue = queue.Queue()
    got: list = []
    joined = threading.Event()
    thread = threading.Thread(target=_receiver, args=(spec2, joined, plans, [False], got))
    try:
        with keep_stdout():
            thread.start()
            bc.open_group(spec2)
        plan2 = bc.plan(tensors, 2)
        plans.put(encode(plan2))
        assert bc.broadcast(plan2, tensors).buckets == len(plan2.buckets)
    finally:
        thread.join(30)
        bc.close_group()
    (received,) = got
    assert received.keys() == dict(tensors).keys() and all(torch.equal(received[n], t) for n, t in tensors)


def test_a_receive_whose_trainer_freezes_fails_within_its_timeout():
    """Engine side: the trainer (rank 0, another process) sends one bucket
    and freezes; the receiving rank's broadcast raises within the timeout
    instead of waiting for bytes that never come."""
    import socket

    tensors = update_tensors(_model())
    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    listen.close()  # the peer binds it as rank 0
    spec = GroupSpec(1, "127.0.0.1", port, 2, "gloo", (GroupMember("me/0", 1),), TIMEOUT_S, secret=new_secret())
    cfg = WeightSyncConfig(backend="gloo", bucket_mb=1)
    bc = WeightBroadcaster(cfg, master_host="127.0.0.1", timeout_s=TIMEOUT_S)
    bc.spec = spec  # only to make the plan
    plan = bc.plan(tensors, 1)
    proc = _peer(spec, plan, "SIGSTOP", role="send")
    comm = None
    try:
        comm = WeightComm(spec, 1, "cpu")
        assert not agree_on_plan(comm, plan.digest(), reject=False)
        comm.broadcast(torch.empty(plan.buckets[0].nbytes, dtype=torch.uint8))
        _wait_first_bucket(proc)
        t0 = time.monotonic()
        with pytest.raises(Exception) as caught:  # gloo's own error type: the timeout
            comm.broadcast(torch.empty(plan.buckets[1].nbytes, dtype=torch.uint8))
        took = time.monotonic() - t0
        assert took < TIMEOUT_S + SLACK_S, took
        assert "imed out" in str(caught.value) or "timeout" in str(caught.value).lower(), caught.value
    finally:
        if comm is not None:
            comm.close()
        _end(proc)
