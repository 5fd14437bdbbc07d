"""``rlnode check --config F [--role R]``: will this config run on this machine?

Loading a config already validates its types and cross-field rules; what it
cannot know is the machine. A GPU run that dies 90 s in, after the engines
have taken their memory, because the model directory lacks its tokenizer,
the trainer's port is taken or the rendezvous host is 127.0.0.1 on a
two-node job, costs a node-hour each time. ``check`` looks at the machine the
way the daemons will and prints one line per finding, before anything heavy
starts:

    ok    model     /models/Qwen3-4B: qwen3, 36 layers, vocab 151936, 3 safetensors files
    FAIL  gpus      actor needs 8 GPUs (8 engines x tp 1), this machine has 1
    FAIL  rendezvous trainer.advertise_host 127.0.0.1 is loopback but trainer.bind_host is 0.0.0.0 ...

Exit status: 0 when nothing failed (warnings allowed), 1 otherwise.

Owns: the checks and their report. Must not start engines, bind for longer
than a probe, or write anything but a probe file in the run directory.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from pathlib import Path

from rlnode.config import Config, ConfigError, actor_node_id
from rlnode.addresses import is_loopback as literal_loopback
from rlnode.model_files import model_unreadable
from rlnode.ops.findings import FAIL, OK, WARN, Finding
from rlnode.ops.stack import check_stack, cuda_roles



def is_loopback(host: str) -> bool:
    """Loopback by address, or a name that resolves only to loopback."""
    if host == "" or literal_loopback(host):
        return True
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback
                   for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "*")


def local_address(host: str) -> bool:
    """Can this machine bind ``host`` (is it one of our addresses)?"""
    try:
        infos = socket.getaddrinfo(host, 0, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def port_free(host: str, port: int) -> str:
    """'' when ``host:port`` can be bound now, else why not."""
    bind = "0.0.0.0" if is_wildcard(host) else host
    try:
        family = socket.getaddrinfo(bind, port, proto=socket.IPPROTO_TCP)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bind, port))
        return ""
    except OSError as e:
        return e.strerror or str(e)


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install reads as no GPU; the daemon would fail the same way
        return 0


# --------------------------------------------------------------------------- checks


def check_model(cfg: Config) -> list[Finding]:
    path = Path(cfg.model.path)
    if not cfg.model.path or not path.is_dir():
        return [Finding(FAIL, "model", f"model.path {cfg.model.path!r} is not a directory on this machine "
                        "(models are read from a local path; nothing is downloaded)")]
    out: list[Finding] = []
    if unread := model_unreadable(cfg.model.path, cfg.model.tokenizer):
        return [Finding(FAIL, "model", line) for line in unread]
    conf_file = path / "config.json"
    if not conf_file.is_file():
        return [Finding(FAIL, "model", f"{path}: no config.json")]
    try:
        hf = json.loads(conf_file.read_text())
    except ValueError as e:
        return [Finding(FAIL, "model", f"{conf_file}: not JSON ({e})")]
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        out.append(Finding(FAIL, "model", f"{path}: no *.safetensors weights (the engines and the weight "
                           "check read safetensors)"))
    tok_dir = Path(cfg.model.tokenizer or cfg.model.path)
    if not any((tok_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        out.append(Finding(FAIL, "model", f"{tok_dir}: no tokenizer (tokenizer.json / tokenizer.model / vocab.json)"))
    text = hf.get("text_config", hf)
    max_pos = text.get("max_position_embeddings")
    if max_pos and cfg.model.max_model_len > max_pos:
        out.append(Finding(FAIL, "model", f"model.max_model_len {cfg.model.max_model_len} > the model's "
                           f"max_position_embeddings {max_pos}"))
    if not [f for f in out if f.level == FAIL]:
        out.append(Finding(OK, "model", f"{path}: {text.get('model_type', hf.get('model_type', '?'))}, "
                           f"{text.get('num_hidden_layers', '?')} layers, vocab {text.get('vocab_size', '?')}, "
                           f"{len(weights)} safetensors file(s)"))
    return out


def _engine_gpus(cfg: Config) -> int:
    e = cfg.actor.engine
    return e.num_engines * e.tensor_parallel_size


def check_devices(cfg: Config, role: str, gpus: int) -> list[Finding]:
    out: list[Finding] = []
    e, t = cfg.actor.engine, cfg.trainer
    trainer_cuda, engine_cuda = cuda_roles(cfg, gpus)
    if role in ("actor", "all"):
        if e.device == "cuda" and gpus == 0:
            out.append(Finding(FAIL, "gpus", "actor.engine.device = \"cuda\" but this machine has no visible GPU"))
        elif engine_cuda:
            from rlnode.actor.engine import engine_gpu_assignment

            try:
                slices = engine_gpu_assignment(e, gpus)
            except ValueError as err:
                out.append(Finding(FAIL, "gpus", f"{err} (this machine has {gpus} GPU(s))"))
            else:
                out.append(Finding(OK, "gpus", f"engines on GPU(s) {slices} of {gpus}"))
        else:
            out.append(Finding(OK, "gpus", f"{e.num_engines} engine(s) on cpu"))
    if role in ("trainer", "all"):
        ranks = t.parallel.ranks or max(1, gpus if trainer_cuda else 1)
        if t.device == "cuda" and gpus == 0:
            out.append(Finding(FAIL, "gpus", "trainer.device = \"cuda\" but this machine has no visible GPU"))
        elif trainer_cuda and ranks > gpus:
            out.append(Finding(FAIL, "gpus", f"trainer.parallel.ranks = {ranks} but this machine has {gpus} GPU(s)"))
        elif not trainer_cuda and ranks > 1 and t.parallel.backend == "nccl":
            out.append(Finding(FAIL, "gpus", "trainer.parallel.backend = \"nccl\" needs cuda; the trainer is on cpu"))
        else:
            out.append(Finding(OK, "gpus", f"trainer: {ranks} rank(s) on {'cuda' if trainer_cuda else 'cpu'}"))
        if role == "all" and trainer_cuda and engine_cuda and gpus > 0:
            shared = set(list(e.gpu_ids) or range(_engine_gpus(cfg))) & set(range(ranks))
            if shared and e.gpu_memory_utilization > 0.6:
                out.append(Finding(WARN, "gpus", f"trainer and engine share GPU(s) {sorted(shared)} but "
                                   f"actor.engine.gpu_memory_utilization = {e.gpu_memory_utilization}: vLLM takes "
                                   "that share of the whole GPU; leave the trainer room (e.g. 0.3-0.5)"))
            if shared and t.weights.backend == "nccl":
                out.append(Finding(FAIL, "weights", "trainer.weights.backend = \"nccl\" with trainer and engine on "
                                   "one GPU: NCCL refuses two ranks on one device; use \"auto\" (cuda_ipc)"))
    if trainer_cuda and cfg.trainer.precision == "bf16":
        out.append(Finding(WARN, "trainer", "trainer.precision = \"bf16\" keeps bf16 weights and optimizer state: "
                           f"updates below bf16 resolution (lr {cfg.trainer.optim.lr:g}) are lost; "
                           "\"bf16-mixed\" keeps fp32 master weights"))
    return out


def check_network(cfg: Config, role: str) -> list[Finding]:
    from rlnode.ops.netaddr import resolve_advertise_host

    out: list[Finding] = []
    t = cfg.trainer
    if role in ("trainer", "all"):
        why = port_free(t.bind_host, t.port)
        out.append(Finding(FAIL, "ports", f"trainer.port {t.bind_host}:{t.port}: {why}") if why
                   else Finding(OK, "ports", f"trainer link {t.bind_host}:{t.port} is free"))
        master = "127.0.0.1"
        try:
            adv = resolve_advertise_host(cfg)
        except ValueError as e:
            out.append(Finding(FAIL, "rendezvous", str(e)))
        else:
            master = t.weights.master_host or adv
            if not local_address(master):
                out.append(Finding(FAIL, "rendezvous", f"weight rendezvous host {master!r} "
                                   "(trainer.weights.master_host or trainer.advertise_host) is not an address of "
                                   "this machine: the trainer's store cannot listen there"))
            elif is_loopback(master) and not is_loopback(t.bind_host):
                out.append(Finding(FAIL, "rendezvous", f"weight rendezvous host {master!r} is loopback but "
                                   f"trainer.bind_host = {t.bind_host!r} accepts remote actors: their engines "
                                   "could not join the weight broadcast. Set trainer.advertise_host to this "
                                   "node's address (or \"auto\")"))
            else:
                out.append(Finding(OK, "rendezvous", f"weight rendezvous on {master} (ports from "
                                   f"{t.weights.base_port})"))
        if not any(not port_free(master, p)
                   for p in range(t.weights.base_port, t.weights.base_port + 50)):
            out.append(Finding(FAIL, "ports", f"no free port in trainer.weights.base_port "
                               f"{t.weights.base_port}..{t.weights.base_port + 49}"))
    if cfg.http.enabled:
        ports = []
        if role in ("trainer", "all"):
            ports.append(("http.trainer_port", cfg.http.trainer_port))
        if role in ("actor", "all"):
            ports.append(("http.actor_port", cfg.http.actor_port))
        for key, port in ports:
            if port == 0:
                continue
            why = port_free(cfg.http.host, port)
            if why:
                out.append(Finding(FAIL, "ports", f"{key} {cfg.http.host}:{port}: {why}"))
    if role == "actor":
        if not cfg.actor.peers:
            out.append(Finding(FAIL, "peers", "actor.peers is empty (or give --peers HOST:PORT)"))
        for peer in cfg.actor.peers:
            host, _, port = peer.rpartition(":")
            try:
                socket.getaddrinfo(host, int(port))
                out.append(Finding(OK, "peers", f"trainer {peer} resolves"))
            except (OSError, ValueError) as e:
                out.append(Finding(FAIL, "peers", f"trainer address {peer!r} does not resolve: {e}"))
    return out


def check_files(cfg: Config, role: str) -> list[Finding]:
    out: list[Finding] = []
    run_dir = Path(cfg.run.run_dir)
    probe_at = run_dir if run_dir.exists() else next((p for p in run_dir.parents if p.exists()), Path("."))
    if not os.access(probe_at, os.W_OK):
        out.append(Finding(FAIL, "run_dir", f"run.run_dir {run_dir}: {probe_at} is not writable"))
    else:
        out.append(Finding(OK, "run_dir", f"{run_dir} writable"))
    if cfg.link.curve_dir and not Path(cfg.link.curve_dir).is_dir():
        out.append(Finding(FAIL, "link", f"link.curve_dir {cfg.link.curve_dir!r} does not exist "
                           "(make it with `rlnode keygen DIR --actor NODE_ID ...`)"))
    out += check_exposure(cfg, role)
    if role in ("actor", "all"):
        if not cfg.actor.cubes:
            out.append(Finding(FAIL, "cubes", "actor.cubes is empty: the actor has nothing to train on"))
        for i, c in enumerate(cfg.actor.cubes):
            for key in ("path", "train_path", "test_path", "tasks_path"):
                p = c.options.get(key)
                if isinstance(p, str) and p and not Path(p).exists():
                    out.append(Finding(FAIL, "cubes", f"actor.cubes[{i}] ({c.id}).options.{key}: {p} does not exist"))
        if cfg.actor.cubes:
            out.append(Finding(OK, "cubes", ", ".join(f"{c.id} ({c.kind})" for c in cfg.actor.cubes)))
    return out


# Cube kinds that run code in the wall (rlnode/cubes/wall/isolation.py) unless
# their isolation option says "none": the option's key, and its default.
WALLED_KINDS = {"openai-agent": (("isolation",), "bwrap"), "verifiers": (("isolation",), "bwrap"),
                "python-math": (("sandbox", "isolation"), "auto")}


def _walled_cubes(cfg: Config) -> list[str]:
    """``actor.cubes[i] (id).options.KEY`` of each cube that needs the wall."""
    out = []
    for i, c in enumerate(cfg.actor.cubes):
        if c.kind not in WALLED_KINDS:
            continue
        path, default = WALLED_KINDS[c.kind]
        value = c.options
        for key in path:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        if (value or default) != "none":
            out.append(f"actor.cubes[{i}] ({c.id}).options.{'.'.join(path)}")
    return out


def check_wall(cfg: Config, role: str, unit: str | None = None, unit_user: str | None = None,
               prelude: str = "") -> list[Finding]:
    """Whether agents' and snippets' boxes start here, as this user, or with
    ``unit`` as that systemd unit runs the daemon (``ops/as_unit.py``; its
    ``User=``, or ``unit_user`` in its place). FAIL when a configured cube
    needs the wall and it does not start; the cube's key is named."""
    import asyncio
    import subprocess

    from rlnode.ops import as_unit

    if role not in ("actor", "all"):
        return []
    walled = _walled_cubes(cfg)
    who = "as this user"
    try:
        if unit is None:
            seen = asyncio.run(as_unit.probe_wall())
        else:
            restrictions = as_unit.read_unit(unit)
            who = f"as {unit} runs it (user {unit_user or restrictions.user})"
            argv = as_unit.argv_as_unit(restrictions, [sys.executable, "-m", "rlnode.ops.as_unit"], user=unit_user,
                                        prelude=prelude)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd="/")
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                return [Finding(FAIL, "wall", f"the wall's probe did not run {who}: {tail} (can that user run "
                                f"{sys.executable} and read rlnode's files?)")]
            seen = json.loads(lines[-1])
    except as_unit.UnitError as e:
        return [Finding(FAIL, "wall", str(e))]
    if not seen["works"]:
        level = FAIL if walled else WARN
        needs = (f"; needed by {', '.join(walled)}. Fix that, or set those keys to \"none\" (unwalled, as the "
                 "daemon's user)") if walled else \
            "; no configured cube needs it (openai-agent, verifiers and python-math cubes would)"
        return [Finding(level, "wall", f"agents' and snippets' boxes cannot start {who}: {seen['why']}{needs}")]
    kind = "a fresh uid per run (privileged bwrap, then setpriv)" if seen["uid"] == 0 else \
        "uid 65534 in a user namespace (the daemon's own kernel uid: the bind view is the wall)"
    detail = f"boxes start {who}: {kind}"
    found = []
    if not seen["fresh_procfs"]:
        found.append(Finding(WARN, "wall", f"{detail}; their /proc is empty: the kernel refuses a procfs in a user "
                             "namespace while /proc has read-only overmounts (systemd's ProtectKernelTunables=). "
                             "Programs that read /proc/self in a box see nothing (docs/security.md)"))
    else:
        found.append(Finding(OK, "wall", detail))
    groups = seen["box_cgroups"]
    if groups["under"]:
        found.append(Finding(OK, "wall", f"each box is capped as a whole (options.limits.box_memory_mib, "
                             f"processes): cgroup v{groups['version']} under {', '.join(groups['under'])}"))
    else:
        found.append(Finding(WARN if walled else OK, "wall", f"boxes have no cgroup of their own {who} "
                             f"({groups['why']}): "
                             "each box process keeps its rlimits, a box of many processes is not capped as a whole. "
                             "Delegate=memory pids and ProtectControlGroups=no on the unit, on cgroup v2, give "
                             "them one (docs/security.md)"))
    return found


def check_exposure(cfg: Config, role: str) -> list[Finding]:
    """What the daemons refuse at start: a trainer link beyond loopback
    without keys, key files this role needs, an HTTP endpoint beyond
    loopback without a token."""
    from rlnode.link.curve import InsecureBindError, check_bind
    from rlnode.ops.http import HttpAuthError, check_exposure as check_http, resolve_token

    out: list[Finding] = []
    link = cfg.link
    if role in ("trainer", "all"):
        try:
            if check_bind(cfg.trainer.bind_host, link.curve_dir, link.insecure):
                out.append(Finding(WARN, "link", f"link.insecure: trainer.bind_host {cfg.trainer.bind_host} "
                                   "accepts actors without CurveZMQ"))
        except InsecureBindError as e:
            out.append(Finding(FAIL, "link", str(e)))
    if link.curve_dir and Path(link.curve_dir).is_dir():  # a missing one is reported above
        root = Path(link.curve_dir)
        need = []
        if role in ("trainer", "all"):
            need += ["trainer.key_secret"] + ([] if any((root / "authorized").glob("*.key")) else ["authorized/*.key"])
        if role in ("actor", "all"):
            key = link.key_name or actor_node_id(cfg)
            need += [f for f in ("trainer.key", f"{key}.key_secret") if f not in need]
        missing = [f for f in need if "*" not in f and not (root / f).is_file()] + [f for f in need if "*" in f]
        out.append(Finding(FAIL, "link", f"{root}: missing {', '.join(missing)} (`rlnode keygen` makes them)")
                   if missing else Finding(OK, "link", f"CurveZMQ keys in {root}"))
    try:
        check_http(cfg.http.host, resolve_token(cfg.http) if cfg.http.enabled else "x")
    except HttpAuthError as e:
        out.append(Finding(FAIL, "http", str(e)))
    return out


def check_parsers(cfg: Config) -> list[Finding]:
    """The chat format an actor starts with (it refuses the same at start):
    model.tool_parser / model.reasoning_parser among the installed vLLM's
    parsers, model.chat_template a file. Imports vLLM's parser registry."""
    from rlnode.actor.parsing import check_parser_names

    m = cfg.model
    out: list[Finding] = []
    if m.chat_template and not Path(m.chat_template).is_file():
        out.append(Finding(FAIL, "chat", f"model.chat_template {m.chat_template!r} is not a file (a Jinja chat "
                           "template; a relative path is taken from the working directory)"))
    try:
        check_parser_names(m.tool_parser, m.reasoning_parser)
    except ConfigError as e:
        out.append(Finding(FAIL, "chat", str(e)))
    except ImportError as e:  # no usable vLLM: the vllm finding says why
        out.append(Finding(WARN, "chat", f"parser names not checked: {e}"))
    if not out:
        template = m.chat_template or "the model's own"
        out.append(Finding(OK, "chat", f"tool calls: {m.tool_parser or 'not read'}, reasoning: "
                           f"{m.reasoning_parser or 'not split'}, template: {template}"))
    return out


def run_checks(cfg: Config, role: str = "all", gpus: int | None = None, stack: bool = True,
               gpu_gib: float | None = None, unit: str | None = None, unit_user: str | None = None) -> list[Finding]:
    """Every finding for ``role`` on this machine (``gpus``: override the
    visible GPU count, for tests and for checking a config for another box;
    ``stack``: also the software stack, ``ops/stack.py``)."""
    here = gpus is None  # False: checking a config for another machine (--gpus N)
    gpus = visible_gpus() if gpus is None else gpus
    findings = check_model(cfg)
    findings += check_devices(cfg, role, gpus)
    findings += check_network(cfg, role)
    findings += check_files(cfg, role)
    findings += check_wall(cfg, role, unit, unit_user)
    if stack:
        findings += check_stack(cfg, role, gpus, here, None if gpu_gib is None else int(gpu_gib * 2**30))
        if role in ("actor", "all"):
            findings += check_parsers(cfg)
    return findings


def main_check(cfg: Config, role: str, as_json: bool, gpus: int | None = None, gpu_gib: float | None = None,
               unit: str | None = None, unit_user: str | None = None) -> int:
    findings = run_checks(cfg, role, gpus, gpu_gib=gpu_gib, unit=unit, unit_user=unit_user)
    failed = [f for f in findings if f.level == FAIL]
    if as_json:
        print(json.dumps({"ok": not failed, "role": role,
                          "findings": [f.__dict__ for f in findings]}, indent=1))
    else:
        width = max(len(f.what) for f in findings)
        for f in findings:
            print(f"{f.level:<5} {f.what:<{width}}  {f.detail}")
        print(f"{'FAILED' if failed else 'ok'}: {len(failed)} problem(s), "
              f"{sum(f.level == WARN for f in findings)} warning(s) for --role {role}", file=sys.stderr)
    return 1 if failed else 0
