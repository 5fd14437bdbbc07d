"""Which address of this node other nodes should use.

The trainer tells every actor where its weight rendezvous (TCPStore) listens.
"127.0.0.1" is right for one machine and silently wrong for two: the remote
engines would try to join a store on their own loopback and the first weight
push would time out. ``trainer.advertise_host = "auto"`` derives it from
where the trainer accepts actors instead.
"""

from __future__ import annotations

import socket

from rlnode.config import Config
from rlnode.addresses import is_loopback, route_source


def primary_address() -> str:
    """This node's address on its default route (or the hostname's first
    non-loopback address); ValueError when it has neither."""
    try:
        addr = route_source()
        if not is_loopback(addr) and addr != "0.0.0.0":
            return addr
    except OSError:
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            addr = info[4][0]
            if not is_loopback(addr):
                return addr
    except OSError:
        pass
    raise ValueError("trainer.advertise_host = \"auto\": this node has no non-loopback address "
                     "(no default route, hostname resolves to loopback); set trainer.advertise_host")


def resolve_advertise_host(cfg: Config) -> str:
    """trainer.advertise_host with "auto" resolved: loopback when the trainer
    only listens on loopback, the bind address when it is a specific one,
    else this node's primary address (loopback, with a warning, when the
    node has no other)."""
    t = cfg.trainer
    if t.advertise_host != "auto":
        return t.advertise_host
    if is_loopback(t.bind_host):
        return "127.0.0.1"
    if t.bind_host not in ("0.0.0.0", "::", "*", ""):
        return t.bind_host
    try:
        return primary_address()
    except ValueError as e:
        # Nothing but loopback: no remote actor can reach this node anyway,
        # and a local one can. `rlnode check` reports it as a failure.
        from rlnode.log import get_logger

        get_logger("rlnode.trainer").warning("advertise_host.loopback", reason=str(e))
        return "127.0.0.1"


def local_url_host(host: str) -> str:
    """The host part of a URL by which a client on this machine reaches a
    server bound to ``host`` (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
