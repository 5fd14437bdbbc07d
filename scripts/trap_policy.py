"""Build a demo policy caught in a trap, to test whether a recipe gets out.

The demo's last failure (README "The demo over seeds", run L async seed 2)
was no fall but a plateau at the line's ceiling: a policy deterministic on a
line that loses one target in every attempt. First guess "2"; after
"Higher. It is between 3 and 5." it says "5"; after "Lower. It is between 3
and 4." it says "4". Targets 1, 2, 4, 5 are won, 3 never, and 3's groups,
lost in every attempt alike, carry no policy gradient.

Waiting for such a stall takes many 8-minute runs (1 in 6 to 1 in 12). This
script makes one directly: it fine-tunes the project's tiny model
(cross-entropy on the completion tokens of the trapped line's episodes, one
per target, in the episode format of ``rlnode.actor.episode`` via
``ChatRenderer``) until every decision of the line has probability >=
--p-min, and saves a model directory a run can start from:

    python scripts/trap_policy.py runs/tiny-model runs/trap-2-5-4 --line 2,5,4
    rlnode bench learn --config conf/demo.toml --seeds 0 \\
        --set 'model.path="runs/trap-2-5-4"' --set trainer.max_steps=200 \\
        --set 'trainer.optim.schedule="constant"' --set trainer.optim.lr=5e-4
    python scripts/trap_policy.py --show RUN_DIR/final --line 2,5,4

``--line``: the guesses the trapped policy makes, turn by turn, while they
lie inside the stated range (else the range's low end; a range of one
number gets that number). ``--decisions 1`` trains the first guess only.
``--prior-steps N`` first trains N steps on episodes of uniformly random
digits (a format prior: mass on the digits rather than on the other 250
byte tokens). ``--show MODEL_DIR`` prints, along the line's states of target
3, the probability of each digit and of everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shutil
from pathlib import Path

import torch

from rlnode.actor.episode import ChatRenderer, parse_action
from rlnode.cubes.registry import make_cube

from probe_guessing import token_logprobs  # scripts/ is on sys.path when run as a script


def guessing_cube(max_number: int, max_turns: int):
    return make_cube("g", "guessing", {"max_number": max_number, "max_turns": max_turns, "feedback": "range"},
                     seed=0)


def trap_guess(line: tuple[int, ...], turn: int, lo: int, hi: int) -> int:
    """The trapped policy: line[turn] while it stays inside [lo, hi] and the
    range has more than one number, else the range's low end."""
    if lo == hi:
        return lo
    if turn < len(line) and lo <= line[turn] <= hi:
        return line[turn]
    return lo


async def trajectories(tok, renderer, max_number: int, max_turns: int, line: tuple[int, ...] | None,
                       episodes: int = 0, seed: int = 0):
    """(token ids, completion mask) per episode: the trapped policy's, one per
    target; or, with line None, ``episodes`` of uniformly random digits."""
    rng = random.Random(seed)
    cube = guessing_cube(max_number, max_turns)
    by_target: dict[int, str] = {}
    ids = await cube.task_ids("train")
    for t in ids:
        by_target.setdefault(cube.target(t), t)
    todo = sorted(by_target.items()) if line is not None else [(None, rng.choice(ids)) for _ in range(episodes)]
    out = []
    for target, task_id in todo:
        task = await cube.open_task(task_id)
        reset = await task.reset()
        seq = list(renderer.first_prompt(reset.system, reset.observation, []))
        cmask = [0] * len(seq)
        lo, hi = 1, max_number
        for turn in range(max_turns):
            g = trap_guess(line, turn, lo, hi) if line is not None else rng.randint(1, max_number)
            comp = tok.encode(str(g), add_special_tokens=False)
            assert len(comp) == 1, f"{g!r} is not one token"
            seq += comp
            cmask += [1]
            res = await task.step(parse_action(renderer.completion_text(comp), renderer.parser, task.tools()))
            if res.done:
                break
            lo, hi = task.lo, task.hi
            nxt = renderer.next_message(comp, res.role, res.observation)
            seq += nxt
            cmask += [0] * len(nxt)
        ev = await task.evaluate()
        if line is not None:
            print(f"target {target}: guesses {ev.info['guesses']} success {ev.success}", flush=True)
        out.append((seq, cmask))
    return out


async def show(model_dir: str, line: tuple[int, ...], max_number: int, max_turns: int) -> None:
    """Per state of target 3's episode under the line: p(digit) and the rest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    renderer = ChatRenderer(tok)
    cube = guessing_cube(max_number, max_turns)
    digits = [tok.encode(str(i), add_special_tokens=False)[0] for i in range(1, max_number + 1)]
    task_id = next(t for t in await cube.task_ids("train") if cube.target(t) == 3)
    task = await cube.open_task(task_id)
    reset = await task.reset()
    seq = list(renderer.first_prompt(reset.system, reset.observation, []))
    for turn in range(max_turns):
        with torch.no_grad():
            p = torch.softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
        ent = float(-(p * p.clamp_min(1e-30).log()).sum())
        state = f"[{task.lo}, {task.hi}]"
        print(f"turn {turn + 1}, range {state:8s}: " + " ".join(f"{i + 1}: {float(p[d]):.4f}" for i, d in enumerate(digits))
              + f"  other: {1 - float(p[digits].sum()):.4f}  H = {ent:.3f} nats", flush=True)
        comp = tok.encode(str(trap_guess(line, turn, task.lo, task.hi)), add_special_tokens=False)
        res = await task.step(parse_action(renderer.completion_text(comp), renderer.parser, task.tools()))
        if res.done:
            break
        seq += comp + renderer.next_message(comp, res.role, res.observation)


def first_decisions(eps, decisions: int):
    """``eps`` with only the first ``decisions`` completion tokens of each
    episode left in its mask (all when 0)."""
    if not decisions:
        return eps
    out = []
    for seq, m in eps:
        keep = [i for i, x in enumerate(m) if x][:decisions]
        out.append((seq, [int(i in keep) for i in range(len(m))]))
    return out


def completion_logprobs(model, tok, eps) -> torch.Tensor:
    """log pi of every masked completion token of ``eps`` (probe_guessing's forward)."""
    logp, cm, _ = token_logprobs(model, [s for s, _ in eps], [m for _, m in eps], tok.pad_token_id)
    return logp[cm.bool()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="the model to start from (e.g. runs/tiny-model)")
    p.add_argument("out", nargs="?", help="where to write the trapped model")
    p.add_argument("--show", default="", metavar="MODEL_DIR", help="instead: the digit probabilities along the line")
    p.add_argument("--line", default="2,5,4", help="guesses of the trapped line, comma-separated")
    p.add_argument("--max-number", type=int, default=5)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--p-min", type=float, default=0.99, help="stop when every decision has at least this probability")
    p.add_argument("--decisions", type=int, default=0,
                   help="train only the first N decisions of each episode (0 = all): --decisions 1 fixes the first "
                        "guess and leaves the later turns as the start model has them")
    p.add_argument("--prior-steps", type=int, default=0,
                   help="first, this many steps on episodes of uniformly random digits (a format prior)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=2000)
    a = p.parse_args()
    line = tuple(int(x) for x in a.line.split(","))
    if a.show:
        return asyncio.run(show(a.show, line, a.max_number, a.max_turns))
    if not (a.model and a.out):
        p.error("MODEL and OUT are needed (or --show MODEL_DIR)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    renderer = ChatRenderer(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    if a.prior_steps:
        eps = asyncio.run(trajectories(tok, renderer, a.max_number, a.max_turns, None, episodes=64 * a.prior_steps))
        for step in range(a.prior_steps):
            lp = completion_logprobs(model, tok, eps[64 * step:64 * (step + 1)])
            loss = -lp.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 20 == 0 or step == a.prior_steps - 1:
                print(f"prior step {step} loss {loss.item():.4f} (uniform over the digits: "
                      f"{math.log(a.max_number):.4f})", flush=True)
    eps = first_decisions(asyncio.run(trajectories(tok, renderer, a.max_number, a.max_turns, line)), a.decisions)
    for step in range(a.max_steps):
        lp = completion_logprobs(model, tok, eps)
        pmin = float(lp.detach().exp().min())
        if pmin >= a.p_min:
            break
        loss = -lp.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f} min p {pmin:.4f}", flush=True)
    print(f"done after {step} steps: min p over the line's decisions {pmin:.4f}", flush=True)
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(a.model, out)
    model.save_pretrained(out)


if __name__ == "__main__":
    main()
