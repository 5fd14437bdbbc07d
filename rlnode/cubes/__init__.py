"""Cubes: benchmarks the agent acts in. base.py is the contract, registry.py
finds cubes by kind (built-ins and the ``rlnode.cubes`` entry-point group);
one module per built-in cube; protocol.py speaks the CUBE JSON-RPC protocol."""
