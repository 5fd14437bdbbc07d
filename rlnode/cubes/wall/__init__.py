"""The wall: what keeps code the policy steers away from the node.

Everything that runs model-driven code on an actor goes through this
package: python-math's snippets, agent commands, function agents' worker
processes and verifiers environments' harness programs. What it promises,
for each of them under the default ``isolation = "bwrap"``:

* **Nothing of the node is shown.** A box sees a read-only system (/usr,
  /lib, /bin), the Python installation, and the files its cube names
  (agent scripts, ``ro_paths``, ``cwd``, PYTHONPATH folders); no run
  directory, link keys, HTTP token, model cache, /home or /etc beyond public
  CA and host files. A shown path that is, holds or lies inside a guarded
  one (``run_dir``, ``link.curve_dir``, ``http.token_file``, the Hugging
  Face cache) is refused at cube start, naming the key
  (``isolation.guard_paths``, ``agent_sandbox.check_shown``).
* **No way out but the gateway.** Own pid, network (loopback only), ipc
  and uts namespaces. An agent reaches the gateway's episode routes
  through one relay per box (``agent_sandbox.GatewayRelay``, at most
  ``limits.connections`` at once); a worker also has its typed socket pair
  to the daemon (``agent_workers``: msgspec frames, never pickle).
* **No secret on an argv, none in the environment.** Boxes start with an
  allowlisted environment; values never go on bwrap's argv (world-readable
  in /proc).
* **Bounded.** rlimits per process (processes, address space, open files,
  CPU seconds, file size), a size-bounded private /tmp, output read with a
  bound and never the daemon's stdout/stderr (``isolation.OutputTail``),
  and a cgroup per box capping its memory and tasks as a whole where the
  node lets the daemon make one (``box_cgroup``). A box past a limit ends
  as its episode's error, naming the key; the daemon serves on.
* **Host-side file access stays inside.** The verifiers runtime's host-side
  reads and writes in its box's working folder never follow a link out of
  it (``vf_runtime.open_beneath``); that folder is the box uid's, mode 0700.

Who the box's processes are: a root daemon runs bwrap privileged and drops
each run to a fresh kernel uid with no capabilities (``setpriv``); a
non-root daemon (the shipped systemd units) runs bwrap in a user namespace
as 65534, which is the daemon's own kernel uid outside, so there the bind
view alone keeps the guarded paths out, and under ``ProtectKernelTunables``
boxes get an empty /proc (``isolation``). ``rlnode check`` probes all of it
as the user it runs as, ``--as-unit`` as a unit runs the daemon.

The modules: ``isolation`` (the layers, bwrap's argv, the probe, guarded
paths), ``sandbox`` (python snippets), ``agent_sandbox`` (agents' boxes,
the relay, ``AgentLimits``), ``agent_workers`` (function agents' workers
and their channel), ``vf_runtime`` (verifiers' runtime, walled) and
``vf_box`` (the one box it starts its programs in),
``box_cgroup`` (a box's cgroup). docs/security.md is the long form, per
path (root and unit) and per agent kind.
"""
