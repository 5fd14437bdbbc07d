"""CurveZMQ key files for the actor <-> trainer link (``rlnode keygen DIR``).

Owns the layout of a curve directory and the socket options that use it:

    DIR/trainer.key          trainer public key   (copy to every actor host)
    DIR/trainer.key_secret   trainer secret key   (trainer host only)
    DIR/NAME.key             actor NAME's public key
    DIR/NAME.key_secret      actor NAME's secret key (that actor's host only)
    DIR/authorized/NAME.key  the actor public keys the trainer accepts

Revoking an actor = deleting its file from ``authorized/`` and restarting the
trainer. Must not touch sockets beyond setting their curve options; the ZAP
authenticator itself is started by the trainer link.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import zmq
import zmq.auth

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


def apply_server(sock: zmq.Socket, directory: str | os.PathLike) -> None:
    """Trainer side: CURVE server with the trainer's key pair."""
    public, secret = _load(Path(directory) / f"{TRAINER}.key_secret", secret=True)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def apply_client(sock: zmq.Socket, directory: str | os.PathLike, name: str = "actor") -> None:
    """Actor side: this actor's key pair (``NAME.key_secret``) and the
    trainer's public key (``trainer.key``)."""
    root = Path(directory)
    public, secret = _load(root / f"{name}.key_secret", secret=True)
    server_public, _ = _load(root / f"{TRAINER}.key", secret=False)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public
