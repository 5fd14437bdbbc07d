"""The authenticated rendezvous of a weight-broadcast group epoch.

Owns: the epoch's TCPStore (rank 0 serves it on loopback, behind the
byte-bounded gate on the socket the trainer bound to the advertised
address), the admission of ranks
(phase 1), the gloo group built on it with its channel check (phase 2), and
the pickle-free exchange of the NCCL unique id. ``WeightComm`` is the only
user. Must not touch: engines, models, the ZeroMQ link (the secret arrives
inside ``GroupSpec``, which the link carries). Importing this module does
not import torch or vLLM.

Threat model. A TCPStore has no authentication: whoever reaches its port
can read (``list_keys`` enumerates them), write and delete every key. So
nothing in the store is secret and the secret never enters it; the store
holds only MACs and sealed values. The secret (``GroupSpec.secret``, 32
random bytes per epoch) travels over the CURVE link only.

  1. Admission (store, before any group exists). Each rank k > 0 appends an
     attempt ``nonce:HMAC(secret, join/epoch/k/world/nonce)`` under
     ``proof/k``; rank 0 reads the attempts of every rank and decides. A
     rank is admitted by its first valid attempt, so garbage an intruder
     appends cannot keep a legitimate rank out. A rank that shows only
     invalid attempts for ``PROOF_GRACE_S`` fails the epoch at once, naming
     the rank (a member given the wrong secret fails in seconds, not after
     the epoch timeout). Rank 0 then writes its verdict, MACed so that no
     one else can forge it; every rank waits for it.
  2. Channel check (gloo). Gloo publishes its listening addresses in the
     store in clear, and its TCP connections carry no credentials: an
     intruder who read the store could connect to a listener as some rank.
     Before the group is used, every rank therefore sends each peer
     ``HMAC(secret, channel/epoch/me/peer)`` over that very connection and
     checks what comes back; one all-reduce makes every rank fail together
     if any connection failed. No bucket flows on an unchecked connection.
  3. NCCL. vLLM's ``StatelessProcessGroup`` unpickles what it reads from the
     store (code execution for anyone reaching the port); it is not used.
     Rank 0 seals the ncclUniqueId with the secret and the others open it:
     only members learn the id, and NCCL's bootstrap admits only peers that
     present it.

Memory. A TCPStore keeps whatever is written to it, without limit. Rank
0's server listens on loopback only; the rendezvous port belongs to a gate
process (``rlnode.weights.store_gate``) that relays to it and cuts a connection
past 4 MiB sent, or once all clients sent 64 MiB: that bounds what the
store can hold. The gate stops once the transport is up, so after a group
forms the port refuses.

What it does not stop: a peer that reaches the ports can make an epoch fail
(delete keys, append bad proofs, take a gloo connection); every such case
ends in a ``RendezvousError`` within the epoch's timeout, and rank 0 names
the rank. The weight bytes themselves are neither encrypted nor MACed: an
on-path attacker between two members can read or alter them after the
check. Keep the weight-sync ports on a trusted network.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from rlnode.addresses import ROUTE_PROBE, route_source
from rlnode.log import get_logger
from rlnode.weights.plan import GroupSpec, TransferError

if TYPE_CHECKING:
    import torch

log = get_logger("rlnode.weights.rendezvous")

SECRET_BYTES = 32
# How long rank 0 waits for a valid proof of a rank after it saw an invalid
# one (and a rank waits on a verdict it cannot verify): long enough for the
# legitimate rank to arrive beside an intruder's garbage, short next to the
# epoch timeout (minutes).
PROOF_GRACE_S = 3.0
# Attempts rank 0 reads per rank: bounds the work an intruder can make it do.
MAX_PROOF_ATTEMPTS = 16
POLL_S = 0.02
MAC_HEX = 64  # sha256
_CHANNEL_TAG = 7301  # gloo send/recv tag of the channel check


class RendezvousError(TransferError):
    """The epoch's rendezvous failed: a rank did not prove it holds the
    secret, did not come in time, or the store was tampered with. The epoch
    is unusable, as after any ``TransferError``: form a new one. ``ranks``:
    the ranks rank 0 found at fault (missing, unproven), () when it cannot
    say; the trainer maps them back to actors."""

    def __init__(self, message: str, ranks: tuple[int, ...] | list[int] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


def new_secret() -> str:
    """A fresh per-epoch secret (hex), made by the trainer for each epoch."""
    return secrets.token_hex(SECRET_BYTES)


def secret_key(spec: GroupSpec) -> bytes:
    """The MAC key of ``spec``'s epoch. Refuses an epoch without a secret
    (a trainer too old to send one): no unauthenticated rendezvous."""
    try:
        key = bytes.fromhex(spec.secret)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise RendezvousError(f"group epoch {spec.epoch}: no valid rendezvous secret in the spec; "
                              "refusing an unauthenticated rendezvous (is the trainer older than this actor?)")
    return key


def mac(key: bytes, *parts: object) -> str:
    """HMAC-SHA256 over the parts joined by '/'; the first part names the
    purpose, so a MAC made for one step is never valid for another."""
    return hmac.new(key, "/".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def _seal_key(key: bytes, label: str) -> bytes:
    """The AES-256 key of values sealed under ``label`` (derived, so the MAC
    key of the proofs is never used as a cipher key)."""
    return hmac.new(key, f"seal/{label}".encode(), hashlib.sha256).digest()


def seal(key: bytes, label: str, data: bytes) -> bytes:
    """AES-256-GCM over ``data`` (nonce | ciphertext+tag), bound to ``label``
    as associated data: a value sealed for one epoch or name does not open
    as another."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = secrets.token_bytes(12)
    return nonce + AESGCM(_seal_key(key, label)).encrypt(nonce, data, label.encode())


def unseal(key: bytes, label: str, blob: bytes) -> bytes | None:
    """``data`` of ``seal``, or None when ``blob`` was not sealed with
    ``key`` for ``label`` (tampered, or another secret)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(blob) < 12 + 16:
        return None
    try:
        return AESGCM(_seal_key(key, label)).decrypt(blob[:12], blob[12:], label.encode())
    except InvalidTag:
        return None


def _serve(host: str, port: int, listen_socket: socket.socket | None, timeout: timedelta):
    """Rank 0: the store's server on loopback, and the gate
    (``store_gate``) that relays the network to it on ``listen_socket``
    (bound by the trainer to the advertised host), counting what clients
    send: the store can never hold more than the gate let through. Without
    ``listen_socket``, bind ``host:port`` here (never every interface, as
    TCPStore's own server would). Returns (store, gate)."""
    import torch.distributed as dist

    from rlnode.weights.store_gate import GateProcess

    if listen_socket is None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listen_socket = socket.create_server((host, port), family=family)
    inner = socket.create_server(("127.0.0.1", 0))
    inner_port = inner.getsockname()[1]
    fd = inner.detach()
    try:
        # wait_for_workers=False: the server never counts connections, so
        # an intruder's connections cannot stand in for members.
        store = dist.TCPStore("127.0.0.1", inner_port, is_master=True, master_listen_fd=fd,
                              wait_for_workers=False, timeout=timeout)
    except Exception:
        socket.close(fd)
        listen_socket.close()
        raise
    try:
        return store, GateProcess(listen_socket, inner_port)
    except Exception:
        listen_socket.close()
        raise


@dataclass
class _Claim:
    """What rank 0 has read of one rank's proof attempts."""

    seen: set[int] = field(default_factory=set)  # attempt indices read
    admitted: bool = False  # one of them was valid
    first_invalid: float = 0.0  # monotonic time of the first invalid one (0: none)

    def refuted(self, now: float) -> bool:
        """Only invalid proofs, for the grace period or up to the cap."""
        if self.admitted or not self.first_invalid:
            return False
        return now - self.first_invalid > PROOF_GRACE_S or len(self.seen) >= MAX_PROOF_ATTEMPTS


class Rendezvous:
    """One rank's side of an epoch's store. Construction blocks until rank
    0 admitted every rank (phase 1) or raises ``RendezvousError``; then
    ``gloo_group`` or ``nccl_communicator`` builds the transport."""

    def __init__(self, spec: GroupSpec, rank: int, listen_socket: socket.socket | None = None):
        import torch.distributed as dist

        self.spec, self.rank = spec, rank
        self.timeout = timedelta(seconds=spec.timeout_s)
        self._key = secret_key(spec)
        self._base = f"rlnode/e{spec.epoch}/"
        self._gate = None
        if rank == 0:
            self.store, self._gate = _serve(spec.master_host, spec.master_port, listen_socket, self.timeout)
        else:
            try:
                self.store = dist.TCPStore(spec.master_host, spec.master_port, is_master=False, timeout=self.timeout)
            except Exception as e:
                raise RendezvousError(f"group epoch {spec.epoch}: rank {rank} cannot reach the rendezvous "
                                      f"{spec.master_host}:{spec.master_port}: {e}") from e
        try:
            if rank == 0:
                self._admit_all()
            else:
                self._prove()
        except BaseException:
            self.close()
            raise

    # -- phase 1: admission --------------------------------------------------

    def _prove(self) -> None:
        """Rank k > 0: append a proof attempt, then wait for rank 0's verdict."""
        spec, k = self.spec, self.rank
        nonce = secrets.token_hex(16)
        attempt = self.store.add(f"{self._base}proof/{k}/n", 1)
        if attempt > MAX_PROOF_ATTEMPTS:
            raise RendezvousError(f"group epoch {spec.epoch}: rank {k} found {attempt - 1} proofs for its rank "
                                  "already (someone else claims it)")
        proof = mac(self._key, "join", spec.epoch, k, spec.world_size, nonce)
        self.store.set(f"{self._base}proof/{k}/{attempt}", f"{nonce}:{proof}")
        self._await_verdict()

    def _await_verdict(self) -> None:
        """Poll for rank 0's verdict; a value that does not verify (written
        by someone else, or this rank holds another secret) is waited out
        for ``PROOF_GRACE_S``, in case rank 0 overwrites it."""
        spec, key = self.spec, f"{self._base}admit"
        ok, refused = (mac(self._key, "admit", spec.epoch, spec.world_size, v) for v in ("ok", "refused"))
        # Later than rank 0's own deadline, so that its verdict (it names
        # the missing ranks) arrives before this rank gives up.
        deadline, unverified_since = time.monotonic() + spec.timeout_s + PROOF_GRACE_S, None
        while True:
            try:
                value = self.store.get(key).decode(errors="replace") if self.store.check([key]) else None
            except Exception as e:  # rank 0 closed the store: it gave up on the epoch
                raise RendezvousError(f"group epoch {spec.epoch}: rank {self.rank} lost the rendezvous "
                                      f"(the trainer refused or abandoned the epoch, or formed it "
                                      f"without this rank): {e}") from e
            if value is not None and hmac.compare_digest(value, ok):
                return
            if value is not None and hmac.compare_digest(value, refused):
                raise RendezvousError(f"group epoch {spec.epoch}: the trainer refused the epoch (its log says why)")
            now = time.monotonic()
            if value is not None:
                unverified_since = unverified_since or now
                if now - unverified_since > PROOF_GRACE_S:
                    raise RendezvousError(f"group epoch {spec.epoch}: rank {self.rank} cannot verify the trainer's "
                                          "admission (this rank holds another secret, or someone else wrote it)")
            if now > deadline:
                raise RendezvousError(f"group epoch {spec.epoch}: rank {self.rank} not admitted "
                                      f"within {spec.timeout_s:g} s")
            time.sleep(POLL_S)

    def _admit_all(self) -> None:
        """Rank 0: read every rank's attempts until each has a valid one,
        then publish the verdict. Fails fast for a rank that shows only
        invalid proofs, and at the timeout for ranks that never came."""
        spec = self.spec
        claims = {k: _Claim() for k in range(1, spec.world_size)}
        deadline = time.monotonic() + spec.timeout_s
        try:
            while True:
                for k, claim in claims.items():
                    if not claim.admitted:
                        self._read_attempts(k, claim)
                if not (pending := [k for k, c in claims.items() if not c.admitted]):
                    break
                now = time.monotonic()
                if bad := [k for k in pending if claims[k].refuted(now)]:
                    raise RendezvousError(f"group epoch {spec.epoch}: rank(s) {bad} did not prove they hold the "
                                          "epoch's secret (a wrong secret, or a peer outside the epoch "
                                          "claiming the rank)", bad)
                if now > deadline:
                    raise RendezvousError(f"group epoch {spec.epoch}: rank(s) {pending} did not join "
                                          f"within {spec.timeout_s:g} s", pending)
                time.sleep(POLL_S)
        except RendezvousError as e:
            log.warning("rendezvous.refused", epoch=spec.epoch, error=str(e))
            self._verdict("refused")
            raise
        self._verdict("ok")

    def _read_attempts(self, k: int, claim: _Claim) -> None:
        """Read rank ``k``'s new attempts into ``claim``. An index counted
        but not yet written is read on a later pass, and never holds up the
        attempts after it."""
        spec = self.spec
        count = min(self.store.add(f"{self._base}proof/{k}/n", 0), MAX_PROOF_ATTEMPTS)
        for i in range(1, count + 1):
            key = f"{self._base}proof/{k}/{i}"
            if i in claim.seen or not self.store.check([key]):
                continue
            claim.seen.add(i)
            nonce, _, got = self.store.get(key).decode(errors="replace").partition(":")
            expected = mac(self._key, "join", spec.epoch, k, spec.world_size, nonce)
            if len(got) == MAC_HEX and hmac.compare_digest(got, expected):
                claim.admitted = True
                return
            claim.first_invalid = claim.first_invalid or time.monotonic()
            log.warning("rendezvous.bad_proof", epoch=spec.epoch, rank=k, attempt=i)

    def _verdict(self, verdict: str) -> None:
        spec = self.spec
        self.store.set(f"{self._base}admit", mac(self._key, "admit", spec.epoch, spec.world_size, verdict))

    # -- sealed values (NCCL unique id) ----------------------------------------

    def publish(self, name: str, data: bytes) -> None:
        """Rank 0: put ``data`` in the store, sealed with the secret."""
        self.store.set(f"{self._base}sealed/{name}", seal(self._key, f"{self.spec.epoch}/{name}", data))

    def fetch(self, name: str) -> bytes:
        """Ranks > 0: wait for (up to the timeout) and open rank 0's value."""
        try:
            blob = self.store.get(f"{self._base}sealed/{name}")
        except Exception as e:
            raise RendezvousError(f"group epoch {self.spec.epoch}: no {name} from the trainer: {e}") from e
        data = unseal(self._key, f"{self.spec.epoch}/{name}", blob)
        if data is None:
            raise RendezvousError(f"group epoch {self.spec.epoch}: the {name} in the store is not sealed with "
                                  "this epoch's secret (tampered with)")
        return data

    # -- transports ------------------------------------------------------------

    def gloo_group(self) -> GlooGroup:
        """Phase 2 on gloo: the group, checked connection by connection."""
        import torch.distributed as dist

        # Keys under a name derived from the secret: members who hold
        # another secret never meet in one namespace (an intruder can still
        # list it: the channel check is what keeps it out).
        tag = mac(self._key, "gloo-namespace", self.spec.epoch)[:16]
        store = dist.PrefixStore(f"{self._base}gloo/{tag}/", self.store)
        group = GlooGroup(store, self.rank, self.spec, self._key, self.timeout)
        self.close_gate()  # every rank passed the channel check: done with the store
        return group

    def nccl_communicator(self, device):
        """A ``PyNcclCommunicator`` whose unique id travelled sealed."""
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        device = torch.device(device)
        if device.index is None:
            # PyNcclCommunicator compares tensor.device with the device it
            # holds; tensors always carry an index (weight_plan.indexed_device).
            raise ValueError(f"nccl_communicator needs an indexed device (cuda:N), got {device}")
        comm = PyNcclCommunicator(unique_id_group(self), device=device)
        self.close_gate()  # every rank joined NCCL (each read the sealed id first)
        return comm

    def close_gate(self) -> None:
        """Rank 0: stop the network's way to the store (the group is up, or
        the epoch is over); from now on the rendezvous port refuses."""
        gate, self._gate = self._gate, None
        if gate is not None:
            counts = gate.stop()
            report = log.warning if counts.get("cut") or counts.get("refused") else log.info
            report("rendezvous.gate_closed", epoch=self.spec.epoch, **counts)

    def close(self) -> None:
        """Drop the store (rank 0: the gate stops now; the server once the
        group that holds it is gone too)."""
        self.close_gate()
        self.store = None


class GlooGroup:
    """A gloo backend whose every connection passed the channel check: the
    collectives ``WeightComm`` uses, with its call shapes."""

    def __init__(self, store, rank: int, spec: GroupSpec, key: bytes, timeout: timedelta):
        import torch.distributed as dist

        self.rank, self.size, self.timeout = rank, spec.world_size, timeout
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Every rank listens for gloo connections on, and advertises in the
        # store, the address the others reach it at: rank 0 the advertised
        # rendezvous address, every other rank its own address on the route
        # to it. Never gloo's default device: that resolves the hostname,
        # which is loopback on many hosts (/etc/hosts), and a remote peer
        # then dials its own 127.0.0.1 until the epoch times out.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=gloo_address(spec, rank))]
        try:
            self._pg = dist.ProcessGroupGloo(store, rank, spec.world_size, opts)
        except Exception as e:
            raise RendezvousError(f"group epoch {spec.epoch}: rank {rank}: gloo connect failed: {e}") from e
        try:
            prove_channels(self._pg, key, spec.epoch, rank, spec.world_size, timeout)
        except BaseException:
            self.shutdown()
            raise

    def broadcast(self, tensor: torch.Tensor, root: int):
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = root, 0, self.timeout
        return self._pg.broadcast([tensor], opts)

    def allreduce(self, tensors: list[torch.Tensor]):
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.timeout = self.timeout
        return self._pg.allreduce(tensors, opts)

    def shutdown(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()


def gloo_address(spec: GroupSpec, rank: int) -> str:
    """The address rank ``rank`` binds its gloo device to: for rank 0 the
    advertised rendezvous host (or, when that is a wildcard, its address on
    the default route), for the others the local address that the kernel
    routes the rendezvous host from (so: the interface the trainer reaches
    this node on, whatever the hostname resolves to)."""
    host = spec.master_host
    if rank == 0 and host not in ("", "0.0.0.0", "::"):
        return host
    target = host if rank > 0 and host not in ("", "0.0.0.0", "::") else ROUTE_PROBE[0]
    try:
        return route_source(target, spec.master_port or ROUTE_PROBE[1])
    except OSError as e:
        raise RendezvousError(f"group epoch {spec.epoch}: rank {rank}: no route to the trainer's rendezvous "
                              f"host {host!r}: {e}") from e



def prove_channels(pg, key: bytes, epoch: int, rank: int, world_size: int, timeout: timedelta) -> None:
    """Phase 2: over each gloo connection, send the peer a MAC naming both
    ends and check the peer's; then agree on the outcome (one all-reduce),
    so that every rank fails together. Raises RendezvousError naming the
    peers (by the rank they connected as) that do not hold the secret."""
    import torch
    import torch.distributed as dist

    peers = [j for j in range(world_size) if j != rank]
    mine = {j: torch.frombuffer(bytearray(bytes.fromhex(mac(key, "channel", epoch, rank, j))), dtype=torch.uint8)
            for j in peers}
    theirs = {j: torch.zeros(MAC_HEX // 2, dtype=torch.uint8) for j in peers}
    try:
        works = [pg.send([mine[j]], j, _CHANNEL_TAG) for j in peers]
        works += [pg.recv([theirs[j]], j, _CHANNEL_TAG) for j in peers]
        for w in works:
            w.wait(timeout)
        bad = [j for j in peers if not hmac.compare_digest(
            theirs[j].numpy().tobytes(), bytes.fromhex(mac(key, "channel", epoch, j, rank)))]
        total = torch.tensor([len(bad)], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.timeout = timeout
        pg.allreduce([total], opts).wait(timeout)
    except Exception as e:
        raise RendezvousError(f"group epoch {epoch}: rank {rank}: channel check failed: {e}") from e
    if bad:
        log.warning("rendezvous.bad_channel", epoch=epoch, rank=rank, peers=bad)
        raise RendezvousError(f"group epoch {epoch}: rank {rank}: the peer(s) connected as rank(s) {bad} "
                              "do not hold the epoch's secret", bad)
    if int(total.item()):
        raise RendezvousError(f"group epoch {epoch}: {int(total.item())} connection(s) between other ranks "
                              "failed the secret check")


@functools.cache
def _unique_id_group_class():
    """vLLM's ``PyNcclCommunicator.__init__`` takes a ``StatelessProcessGroup``
    (an isinstance check) and calls on it exactly: ``rank``, ``world_size``
    and ``broadcast_obj(unique_id, src=0)`` (vLLM 0.26 to 0.32). This
    subclass provides those without pickle; every other method of the base
    class (each would pickle over the store) raises."""
    import ctypes

    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId
    from vllm.distributed.utils import StatelessProcessGroup

    # vLLM 0.32 names this NCCL_UNIQUE_ID_BYTES; 0.26-0.31 do not have it.
    id_bytes = ctypes.sizeof(ncclUniqueId)

    def refuse(self, *args, **kwargs):
        raise NotImplementedError("rlnode's NCCL rendezvous group carries the ncclUniqueId only (no pickle)")

    class UniqueIdGroup(StatelessProcessGroup):
        rendezvous: Rendezvous

        def broadcast_obj(self, obj, src: int):
            if src != 0 or not isinstance(obj, ncclUniqueId):
                raise NotImplementedError("rlnode's NCCL rendezvous group broadcasts rank 0's ncclUniqueId only")
            if self.rank == 0:
                self.rendezvous.publish("nccl-unique-id", bytes(obj.internal))
                return obj
            data = self.rendezvous.fetch("nccl-unique-id")
            if len(data) != id_bytes:
                raise RendezvousError(f"ncclUniqueId of {len(data)} bytes, expected {id_bytes}")
            return ncclUniqueId.from_buffer_copy(data)

    for name in ("send_obj", "recv_obj", "all_gather_obj", "broadcast", "send", "recv", "all_reduce", "barrier"):
        setattr(UniqueIdGroup, name, refuse)
    return UniqueIdGroup


def unique_id_group(rdv: Rendezvous):
    """The pickle-free group ``PyNcclCommunicator`` exchanges its id on."""
    group = _unique_id_group_class()(rank=rdv.rank, world_size=rdv.spec.world_size, store=rdv.store)
    group.rendezvous = rdv
    return group
