"""The verifiers smoke recipe on CPU, one command: an SFT warm start on the
answer's format, then RL on the unchanged upstream ``reverse_text`` through
the verifiers cube under the default wall (SmolLM2-135M, 2 cores).

    make smoke VERIFIERS=/path/to/verifiers          # or:
    .venv/bin/python scripts/vf_smoke.py --verifiers /path/to/verifiers [--seeds 0,1,2] [--json]

How it differs from prime-rl's reverse_text smoke run (SFT'd Qwen3-0.6B,
then 20 RL steps): the model is SmolLM2-135M (what runs here), the SFT set
is written offline by ``write_sft_set`` (pseudo-words from syllables,
mixed case and punctuation: another generator than the RL stand-in data of
``upstream_vf_eval.write_datasets``, which picks common English words), and
the seat plays with verifiers' ``null`` harness (a plain chat program: no
bash/edit tools, whose long prompt the task does not use). The environment's
code is upstream's, unchanged.

Steps, all under ``--workdir`` (default runs/vf-smoke):
1. pip-install the two environments from the checkout (``--no-deps``) and
   ``datasets``; write the RL stand-in datasets (``upstream_vf_eval``);
2. write ``sft.jsonl`` and ``smoke.toml``;
3. ``rlnode sft`` once (the SFT start every seed's RL begins from);
4. ``rlnode bench learn --metric reward`` over ``--seeds``: held-out mean
   reward (the env's LCS ratio) at v0 (the SFT start) and after ``--steps``
   RL steps, the rise, and the wall time, per seed;
5. ``--alphabet-sort``: the same RL (one seed, from plain SmolLM2) on
   upstream alphabet_sort (two turns), its mean reward at v0 and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream_vf_eval  # noqa: E402  (the stand-in datasets and the installs)

ROOT = Path(__file__).resolve().parents[1]
# reverse_text's system prompt (reverse_text/taskset.py), which its tasks carry.
SYSTEM = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."
ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl sh st th tr".split()
VOWELS = "a e i o u ai ea ie oo ou".split()
CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]


def pseudo_word(rng: random.Random) -> str:
    word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.randint(1, 3)))
    return word.capitalize() if rng.random() < 0.15 else word


def sft_text(rng: random.Random) -> str:
    words = [pseudo_word(rng) for _ in range(rng.randint(3, 10))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(1, 999)))
    text = " ".join(words)
    if rng.random() < 0.3:
        i = rng.randrange(1, len(words))
        text = " ".join(words[:i]) + ", " + " ".join(words[i:])
    return text[0].upper() + text[1:] + rng.choice(".!?.")


def write_sft_set(path: Path, n: int, seed: int = 1234) -> None:
    """``n`` conversations: the env's system prompt, a text, its reversal in
    the env's tags (what its rubric parses)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            text = sft_text(rng)
            f.write(json.dumps({"messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": text},
                {"role": "assistant", "content": f"<reversed_text>{text[::-1]}</reversed_text>"}]}) + "\n")


CONFIG = """\
# Written by scripts/vf_smoke.py: the verifiers smoke recipe on CPU.
[run]
name = "vf-smoke-{env}"
run_dir = "{workdir}/rl-{env}"
seed = 0

[model]
path = "{model}"
dtype = "float32"
max_model_len = 1024

[sft]
data = "{workdir}/sft.jsonl"
eval_fraction = 0.05
eval_every = 8
epochs = {sft_epochs}
batch_size = 16
max_length = 256

[actor.engine]
device = "cpu"
num_engines = 1
cpu_kv_cache_gib = 1
enforce_eager = true
max_num_seqs = 64
# Half of the CPUs for the engine's threads; the harness programs start on
# the others (upstream_vf_eval.engine_cpus).
cpu_omp_threads_bind = "{omp_bind}"

[actor.router]
llm_max_rollouts = 64

[actor.sampling]
temperature = {temperature}
max_tokens = {max_tokens}

[actor.episode]
max_turns = 4

[actor.scheduler]
attempts = {attempts}
groups_per_step = {groups}
max_lag = 1
eval_every = {steps}
eval_episodes = {eval_episodes}

[trainer]
bind_host = "127.0.0.1"
port = 5555
device = "cpu"
max_steps = {steps}
micro_batch_size = 16
checkpoint_every = 1000
sync = true

[trainer.loss]
kind = "ppo_clip"
entropy_coef = 0.0

[trainer.optim]
lr = {lr}
warmup_steps = 0
max_grad_norm = 1.0

[trainer.weights]
timeout_s = 120.0

[[actor.cubes]]
id = "{env}"
kind = "verifiers"
weight = 1.0

[actor.cubes.options]
env = "{module}"
num_train = 400
num_test = {eval_episodes}
timeout_s = 120.0

[actor.cubes.options.env_args.agent.runtime]
type = "subprocess"

[actor.cubes.options.env_args.agent.harness]
id = "null"
"""


def rlnode(*args: str, cwd: Path, log: Path) -> str:
    """Run ``rlnode ARGS`` in ``cwd`` (where the stand-in datasets are);
    its stderr and stdout go to ``log``, its stdout is returned."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "VLLM_CONFIGURE_LOGGING": "0"}
    with open(log, "a") as f:
        f.write(f"\n$ rlnode {' '.join(args)}\n")
        f.flush()
        done = subprocess.run([str(Path(sys.executable).parent / "rlnode"), *args], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=f, text=True)
        f.write(done.stdout)
    if done.returncode:
        raise SystemExit(f"vf_smoke: rlnode {args[0]} exited {done.returncode}; see {log}")
    return done.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifiers", required=True, type=Path, help="a checkout of PrimeIntellect-ai/verifiers")
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "smollm2-135m")
    p.add_argument("--workdir", type=Path, default=ROOT / "runs" / "vf-smoke")
    p.add_argument("--seeds", default="0,1,2", help="RL seeds (one SFT start for all)")
    p.add_argument("--steps", type=int, default=20, help="RL steps per seed (default 20)")
    p.add_argument("--sft-examples", type=int, default=256, help="SFT conversations (default 256)")
    p.add_argument("--sft-lr", default="1e-4", help="SFT learning rate (default 1e-4)")
    p.add_argument("--sft-epochs", type=int, default=1, help="passes over the SFT set (default 1)")
    p.add_argument("--rl-lr", default="2e-5", help="RL learning rate (default 2e-5)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of RL and of its evaluations (default 1.0)")
    p.add_argument("--attempts", type=int, default=4, help="attempts per group (default 4)")
    p.add_argument("--groups", type=int, default=4, help="groups per RL step (default 4)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the RL runs (repeatable), e.g. trainer.sync=false")
    p.add_argument("--sft-from", type=Path, help="skip SFT: start RL from this model folder (an earlier final/)")
    p.add_argument("--alphabet-sort", action="store_true", help="also RL on alphabet_sort (one seed, plain model)")
    p.add_argument("--no-install", action="store_true", help="skip the pip installs")
    p.add_argument("--json", action="store_true", help="print bench learn's JSON instead of its table")
    args = p.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "smoke.log"
    t0 = time.monotonic()
    if not args.no_install:
        upstream_vf_eval.install(args.verifiers)
    upstream_vf_eval.write_datasets(work)
    write_sft_set(work / "sft.jsonl", args.sft_examples)
    common = dict(workdir=work, steps=args.steps, eval_episodes=64, attempts=args.attempts, groups=args.groups,
                  omp_bind=upstream_vf_eval.engine_cpus(), temperature=args.temperature, lr=args.rl_lr,
                  sft_epochs=args.sft_epochs)
    (work / "reverse-text.toml").write_text(CONFIG.format(
        env="reverse-text", module="reverse_text", model=args.model.resolve(), max_tokens=96, **common))
    start = args.sft_from.resolve() if args.sft_from else work / "sft" / "final"
    if not args.sft_from:
        print(f"vf_smoke: rlnode sft ({args.sft_examples} conversations; log {log})", file=sys.stderr)
        rlnode("sft", "--config", str(work / "reverse-text.toml"), "--run-dir", str(work / "sft"),
               "--set", f"trainer.optim.lr={args.sft_lr}", cwd=work, log=log)
    sft_s = time.monotonic() - t0
    print(f"vf_smoke: SFT done in {sft_s / 60:.1f} min; RL on reverse_text, seeds {args.seeds}", file=sys.stderr)
    bench = ["bench", "learn", "--config", str(work / "reverse-text.toml"), "--metric", "reward", "--target", "0.9",
             "--seeds", args.seeds, "--set", f"model.path={start}", *(a for o in args.overrides for a in ("--set", o))]
    out = rlnode(*bench, *(["--json"] if args.json else []), cwd=work, log=log)
    if args.alphabet_sort:
        (work / "alphabet-sort.toml").write_text(CONFIG.format(
            env="alphabet-sort", module="alphabet_sort", model=args.model.resolve(), max_tokens=256, **common))
        out = (out or "") + (rlnode("bench", "learn", "--config", str(work / "alphabet-sort.toml"), "--metric",
                                    "reward", "--target", "0.9", "--seeds", args.seeds.split(",")[0],
                                    *(["--json"] if args.json else []), cwd=work, log=log) or "")
    print(out)
    print(f"vf_smoke: {(time.monotonic() - t0) / 60:.1f} min end to end (SFT {sft_s / 60:.1f} min); the tables "
          f"are in {log}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
