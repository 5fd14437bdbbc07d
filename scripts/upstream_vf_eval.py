"""Run unchanged upstream verifiers environments (``reverse_text``,
``alphabet_sort``) through ``rlnode eval`` on a real model, offline.

    git clone https://github.com/PrimeIntellect-ai/verifiers /tmp/verifiers   # or any checkout
    rlnode pretrained smollm2-135m runs/smollm2-135m
    .venv/bin/python scripts/upstream_vf_eval.py --verifiers /tmp/verifiers \\
        --model runs/smollm2-135m --episodes 64 --workdir /tmp/vf-eval

What it does, and what it changes of upstream: nothing in the environments'
code. It pip-installs the two environment packages from the checkout (with
``--no-deps``) and ``datasets``. Their datasets live on the Hugging Face hub,
which these machines cannot reach, so it writes a local stand-in of each
under the same name in ``--workdir`` and runs from there: ``datasets``
resolves ``load_dataset("PrimeIntellect/Reverse-Text-RL")`` to a local
folder of that relative path before it asks the hub. The stand-ins are
synthetic (sentences of common words to reverse; lists of made-up names to
sort), the shapes the environments read (``prompt``; ``names``).

Both cubes run with the verifiers seat's runtime set to ``subprocess``
(upstream's default is the remote Prime sandbox, refused at start), and
``--episodes`` test episodes per cube at once (``eval_share`` 1.0: all run
concurrently; ``--env`` runs one of them alone). It prints ``rlnode
eval``'s JSON: per cube the episodes, success rate, mean reward, errors,
retries and where the episodes' time went (``phases_s``); the daemon's log
goes to ``--workdir``/eval.log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet "
         "rivers and old mountains near small towns where people read books about time space "
         "music history light water stone garden winter summer morning evening city road").split()
FIRST = ("Alice Bruno Carla Daniel Elena Farid Grace Hiro Ines Jonas Keiko Lars Maria Nadia Omar "
         "Priya Quentin Rosa Stefan Tariq Uma Viktor Wen Xenia Yusuf Zora").split()
LAST = ("Abbott Becker Castro Dubois Eriksen Fischer Garcia Haddad Ivanova Jensen Kowalski Larsen "
        "Moreau Novak Okafor Petrov Quinn Rossi Schmidt Tanaka Ueda Vargas Weber Xu Yamamoto Zhang").split()


def write_datasets(workdir: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    rev = workdir / "PrimeIntellect" / "Reverse-Text-RL"
    rev.mkdir(parents=True, exist_ok=True)
    with open(rev / "train.jsonl", "w") as f:
        for _ in range(512):
            words = rng.sample(WORDS, rng.randint(4, 9))
            f.write(json.dumps({"prompt": " ".join(words).capitalize() + "."}) + "\n")
    names = workdir / "kalomaze" / "alphabetic-arxiv-authors-it1"
    names.mkdir(parents=True, exist_ok=True)
    with open(names / "train.jsonl", "w") as f:
        for _ in range(256):
            people = {f"{rng.choice(FIRST)} {rng.choice(LAST)}" for _ in range(24)}
            f.write(json.dumps({"names": sorted(people, key=lambda _: rng.random())}) + "\n")


CONFIG = """\
[run]
name = "upstream-vf"
run_dir = "{workdir}/run"
seed = 0

[model]
path = "{model}"
dtype = "float32"
max_model_len = 4096

[actor.engine]
device = "cpu"
cpu_kv_cache_gib = 2
enforce_eager = true
max_num_seqs = {episodes}
# The engine's threads on half of the CPUs, the harness programs start on
# the others (scheduler.max_starting_agents defaults to those).
cpu_omp_threads_bind = "{omp_bind}"

[actor.router]
llm_max_rollouts = {episodes}

[actor.sampling]
temperature = 1.0
max_tokens = {max_tokens}

[actor.episode]
max_turns = 8

[actor.scheduler]
max_concurrent_episodes = {both}
eval_episodes = {episodes}

"""
CUBE = """
[[actor.cubes]]
id = "{id}"
kind = "verifiers"
[actor.cubes.options]
env = "{env}"
num_train = 1
num_test = 64
timeout_s = {timeout_s}
isolation = "{isolation}"
[actor.cubes.options.env_args.agent.runtime]
type = "subprocess"
"""
ENVS = {"reverse-text": "reverse_text", "alphabet-sort": "alphabet_sort"}


def engine_cpus() -> str:
    """Half of this machine's CPUs for the engine (at least one), as
    VLLM_CPU_OMP_THREADS_BIND lists them: the rest start the harness
    programs."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cpus[:max(1, len(cpus) // 2)]))


def install(verifiers: Path) -> None:
    """The two environments from the checkout, as they are, and ``datasets``."""
    py = sys.executable
    envs = [str(verifiers / "environments" / n) for n in ENVS.values()]
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", *envs], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "datasets"], check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifiers", required=True, type=Path, help="a checkout of PrimeIntellect-ai/verifiers")
    p.add_argument("--model", required=True, type=Path, help="model folder (rlnode pretrained ...)")
    p.add_argument("--workdir", required=True, type=Path)
    p.add_argument("--episodes", type=int, default=64, help="concurrent test episodes per cube (default 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens per LLM call (default 256)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per episode (default 600)")
    p.add_argument("--no-install", action="store_true", help="skip the pip installs")
    p.add_argument("--env", choices=sorted(ENVS), action="append",
                   help="run only this environment (repeat for several; default: both, at the same time)")
    p.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap",
                   help="options.isolation of both cubes (default bwrap, the product's default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="passed to rlnode eval (repeatable), e.g. --set actor.scheduler.max_starting_agents=1")
    args = p.parse_args()
    py = sys.executable
    if not args.no_install:
        install(args.verifiers)
    args.workdir.mkdir(parents=True, exist_ok=True)
    write_datasets(args.workdir)
    conf = args.workdir / "upstream-vf.toml"
    envs = {cid: ENVS[cid] for cid in (args.env or ENVS)}
    conf.write_text(CONFIG.format(workdir=args.workdir.resolve(), model=args.model.resolve(), omp_bind=engine_cpus(),
                                  episodes=args.episodes, both=len(envs) * args.episodes, max_tokens=args.max_tokens)
                    + "".join(CUBE.format(id=cid, env=env, timeout_s=args.timeout_s, isolation=args.isolation)
                              for cid, env in envs.items()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    rlnode = str(Path(py).parent / "rlnode")
    log_path = args.workdir / "eval.log"
    with open(log_path, "w") as log:
        done = subprocess.run([rlnode, "--log-level", "info", "--log-json", "eval", "--config", str(conf),
                               "--episodes", str(args.episodes), "--json", *(f"--set={kv}" for kv in args.set)],
                              cwd=args.workdir, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    if done.returncode:
        sys.stderr.write(log_path.read_text()[-4000:])
    print(f"# the daemon's log: {log_path}", file=sys.stderr)
    print(done.stdout)
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
