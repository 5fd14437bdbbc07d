"""CurveZMQ key files for the actor <-> trainer link (``rlnode keygen DIR``).

Owns the layout of a curve directory and the socket options that use it:

    DIR/trainer.key          trainer public key   (copy to every actor host)
    DIR/trainer.key_secret   trainer secret key   (trainer host only)
    DIR/NAME.key             actor NAME's public key
    DIR/NAME.key_secret      actor NAME's secret key (that actor's host only)
    DIR/authorized/NAME.key  the actor public keys the trainer accepts

Each actor node has its own key pair, named after its node id: the trainer
binds ``authorized/NAME.key`` to node id NAME (``KeyRing``) and accepts
frames under node id NAME only from a connection that authenticated with
that key. Revoking an actor = deleting its file from ``authorized/``: the
folder is read again at every CURVE handshake, so the node is refused at its
next connection (and dropped by a running trainer within a heartbeat), no
restart needed. Adding a key works the same way.

Must not touch sockets beyond setting their curve options; the ZAP
authenticator itself is started by the trainer link.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import msgspec
import zmq
import zmq.auth

from rlnode.addresses import is_loopback

TRAINER = "trainer"
AUTHORIZED = "authorized"


class CurveError(ValueError):
    """The curve directory is missing, incomplete or unreadable (fatal at
    start-up: running without the configured authentication is never an
    option)."""


class KeygenResult(msgspec.Struct):
    directory: str
    trainer_public: str
    actors: dict[str, str]  # actor name -> secret key file
    authorized: list[str]  # public key files the trainer accepts


def keygen(directory: str | os.PathLike, actor_names: list[str] | None = None,
           overwrite: bool = False) -> KeygenResult:
    """Write the trainer key pair, one key pair per actor name and the
    ``authorized/`` folder. Existing key files are kept unless ``overwrite``
    (regenerating the trainer key silently locks every actor out)."""
    names = list(actor_names or ["actor"])
    bad = [n for n in names if not n or n == TRAINER or "/" in n or n.startswith(".")]
    if bad or len(set(names)) != len(names):
        raise CurveError(f"actor names must be distinct, non-empty, not {TRAINER!r}, without '/': {names}")
    root = Path(directory)
    auth = root / AUTHORIZED
    auth.mkdir(parents=True, exist_ok=True)
    actors: dict[str, str] = {}
    for name in [TRAINER, *names]:
        public, secret = root / f"{name}.key", root / f"{name}.key_secret"
        if overwrite or not (public.exists() and secret.exists()):
            zmq.auth.create_certificates(root, name)
        # Secret keys are credentials: owner-only, whatever the umask was.
        os.chmod(secret, 0o600)
        if name != TRAINER:
            shutil.copyfile(public, auth / f"{name}.key")
            actors[name] = str(secret)
    return KeygenResult(str(root), str(root / f"{TRAINER}.key"), actors,
                        sorted(str(p) for p in auth.glob("*.key")))


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveError(f"curve key file {path} not found (make one with `rlnode keygen DIR`)")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveError(f"cannot read curve key file {path}: {e}") from e
    if secret and sec is None:
        raise CurveError(f"{path} holds no secret key")
    return public, sec


def authorized_dir(directory: str | os.PathLike) -> str:
    """The folder of accepted actor keys; fails if it holds none (the ZAP
    authenticator would otherwise deny everyone with only a debug log)."""
    auth = Path(directory) / AUTHORIZED
    if not auth.is_dir() or not any(auth.glob("*.key")):
        raise CurveError(f"{auth} holds no actor public keys (*.key); run `rlnode keygen {directory}`")
    return str(auth)


class KeyRing:
    """The actor keys the trainer accepts, from ``DIR/authorized/``, looked
    up at every handshake and every heartbeat's revocation scan, so adding
    or deleting a key file takes effect without a restart. A key file under
    two names binds to neither (ambiguous).

    Cached, because those lookups are O(files) each: with N actors a tick
    parsed N key files N times (O(N^2) when N actors reconnect at once).
    The listing is re-read when the directory's mtime changes (a key added,
    deleted or renamed into place) and at least every ``RESCAN_S``; a file
    is re-parsed only when its (inode, size, mtime) changed, so a key
    rewritten in place is seen within ``RESCAN_S``."""

    RESCAN_S = 2.0

    def __init__(self, directory: str | os.PathLike):
        self.auth = Path(authorized_dir(directory))
        self._dir_mtime: int | None = None
        self._scanned_at = float("-inf")
        self._files: dict[str, tuple[tuple[int, int, int], bytes | None]] = {}  # name -> (stat id, public key)
        self._names: dict[bytes, str] = {}
        self.parses = 0  # key files parsed: what the cache saves

    def names(self) -> dict[bytes, str]:
        """Z85 public key -> node id, for every readable ``NAME.key``."""
        try:
            mtime = self.auth.stat().st_mtime_ns
        except OSError:
            mtime = None
        now = time.monotonic()
        if mtime == self._dir_mtime and now - self._scanned_at < self.RESCAN_S:
            return self._names
        self._dir_mtime, self._scanned_at = mtime, now
        files: dict[str, tuple[tuple[int, int, int], bytes | None]] = {}
        for path in sorted(self.auth.glob("*.key")):
            try:
                st = path.stat()
            except OSError:
                continue  # deleted while listing
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._files.get(path.name)
            if cached is not None and cached[0] == ident:
                files[path.name] = cached
                continue
            self.parses += 1
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError):
                public = None  # not a key file: not accepted
            files[path.name] = (ident, public)
        out: dict[bytes, str] = {}
        ambiguous: set[bytes] = set()
        for name, (_, public) in files.items():
            if public is None:
                continue
            if public in out:
                ambiguous.add(public)
            out[public] = name[: -len(".key")]
        for key in ambiguous:
            del out[key]
        self._files, self._names = files, out
        return out

    def name_of(self, z85_public: bytes) -> str | None:
        return self.names().get(z85_public)


AUTO_DIR = "link-keys"


def auto_keys(run_dir: str | os.PathLike, node_id: str) -> str:
    """A curve directory under ``run_dir`` (made once, owner-only) for a
    trainer and the actor of this node when the config names none but runs
    agent cubes: their code (a function agent in the daemon, a verifiers
    runtime) can reach loopback, so loopback is no trust boundary and an
    unauthenticated link would take their frames (a registered node id, a
    group with chosen rewards). Both daemons of a node derive the same path
    from the same config; a lock makes the first one write the keys and the
    second read them."""
    import fcntl

    root = Path(run_dir) / AUTO_DIR
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        keygen(root, [node_id])
    return str(root)


class InsecureBindError(CurveError):
    """A non-loopback trainer bind without CurveZMQ and without
    ``link.insecure``: refused at start."""


def check_bind(host: str, curve_dir: str, insecure: bool) -> bool:
    """True when the link is exposed without authentication (allowed by
    ``insecure``: the caller warns); raises InsecureBindError when that is
    not allowed; False when the bind is loopback or CURVE is on."""
    if curve_dir or is_loopback(host):
        return False
    if insecure:
        return True
    raise InsecureBindError(
        f"trainer.bind_host = {host!r} accepts actors from the network, but link.curve_dir is empty: "
        "anyone who reaches the port could register, deliver groups and join weight pushes. "
        "Make keys with `rlnode keygen DIR --actor NODE_ID ...` and set link.curve_dir = \"DIR\" on every "
        "node, or bind loopback (trainer.bind_host = \"127.0.0.1\"), or, on a network you trust "
        "entirely, set link.insecure = true")


def apply_server(sock: zmq.Socket, directory: str | os.PathLike) -> None:
    """Trainer side: CURVE server with the trainer's key pair."""
    public, secret = _load(Path(directory) / f"{TRAINER}.key_secret", secret=True)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def apply_client(sock: zmq.Socket, directory: str | os.PathLike, name: str) -> None:
    """Actor side: this actor's own key pair (``NAME.key_secret``, NAME =
    its node id) and the trainer's public key (``trainer.key``)."""
    root = Path(directory)
    public, secret = _load(root / f"{name}.key_secret", secret=True)
    server_public, _ = _load(root / f"{TRAINER}.key", secret=False)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public
