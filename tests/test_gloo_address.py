"""Which address each rank of a weight group binds and advertises: the one
the others reach it at, never what the hostname resolves to (loopback on
many hosts, this one included: a second host then dialled its own
127.0.0.1 and every push timed out; tests/test_cluster.py runs it across
real hosts)."""

import socket

import pytest

from rlnode.ops.netaddr import primary_address
from rlnode.weights.rendezvous import RendezvousError, gloo_address
from rlnode.weights.plan import GroupSpec


def spec(host: str) -> GroupSpec:
    return GroupSpec(epoch=1, master_host=host, master_port=29500, world_size=3, backend="gloo", members=())


def test_rank0_binds_the_advertised_host():
    assert gloo_address(spec("10.1.2.3"), 0) == "10.1.2.3"


def test_other_ranks_bind_their_address_on_the_route_to_the_trainer():
    assert gloo_address(spec("127.0.0.1"), 1) == "127.0.0.1"
    try:
        mine = primary_address()
    except ValueError:
        pytest.skip("this host has no non-loopback address")
    # The trainer at this host's own address: the route leaves from it,
    # whatever the hostname resolves to.
    assert gloo_address(spec(mine), 2) == mine
    resolved = socket.gethostbyname(socket.gethostname())
    if resolved.startswith("127."):
        assert gloo_address(spec(mine), 2) != resolved  # what gloo's default device would have bound


def test_a_wildcard_rendezvous_host_gives_rank0_its_primary_address():
    try:
        mine = primary_address()
    except ValueError:
        pytest.skip("this host has no non-loopback address")
    assert gloo_address(spec("0.0.0.0"), 0) == mine


def test_no_route_is_a_rendezvous_error():
    with pytest.raises(RendezvousError, match="no route"):
        gloo_address(spec("no.such.host.invalid"), 1)
