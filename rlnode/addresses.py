"""Addresses, without name resolution or sockets held open: what counts as
loopback, and which local address the kernel routes a destination from.
A base module: the link (CURVE bind checks), the weight rendezvous (gloo's
bind address) and ops (advertise host, HTTP exposure) all ask it."""

from __future__ import annotations

import ipaddress
import socket

# Any routable address: connecting a UDP socket to it sends nothing, it only
# asks the kernel which local address the route leaves from.
ROUTE_PROBE = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737): never a real peer


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or "localhost" (names are not resolved: a name that
    happens to resolve to loopback today is not a promise)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_source(host: str = ROUTE_PROBE[0], port: int = ROUTE_PROBE[1]) -> str:
    """The local address the kernel routes ``host`` from (by default: this
    node's address on its default route). OSError when there is no route."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # a UDP connect sends nothing
        return s.getsockname()[0]
