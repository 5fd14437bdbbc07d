"""Learnability probe: can a tiny random model learn the ``guessing`` cube by RL?

Plain torch, no engine: completions are sampled by the transformers model
itself, but everything else is the real episode format: the project's tiny
model + tokenizer, the built-in cube, ``ChatRenderer`` prompts built token-in /
token-out exactly as ``rlnode.actor.episode`` builds them, ``parse_action`` on
the decoded completion. RL: groups of ``attempts`` episodes of one task,
advantage = episode reward - group mean, every completion token of every LLM
call of the episode gets the episode's advantage, loss = -sum(A * logpi) /
tokens, AdamW with warm-up + decay, grad-norm clipping. ``--lag L`` samples
with the policy of L steps ago (a pipelined loop at its staleness bound) and
weighs by the ratio to it: truncated IS (``--loss tis``) or PPO-clip
(``--loss ppo``).

The async question (issue 22), ~8 min a run, two at once on 2 cores:

    for loss in tis ppo; do python scripts/probe_guessing.py --max-number 5 \
        --max-turns 3 --max-tokens 1 --lr 1e-3 --ent 0.01 --steps 500 \
        --eval-every 50 --seed 1 --lag 2 --loss $loss & done

Example (the recommended demo setting; prints a learning curve, writes JSON
with --out; ~0.5 s/step on one thread):

    python scripts/probe_guessing.py --max-number 5 --max-turns 3 --max-tokens 1 \
        --lr 2e-3 --warmup 10 --groups 8 --attempts 8 --steps 300

What a trained demo policy does, target by target (the plateau's wrong
decision shows here; the demo's defaults are this script's --max-number 5
--max-turns 3 --max-tokens 1):

    python scripts/probe_guessing.py --max-number 5 --max-turns 3 --max-tokens 1 \
        --inspect runs/demo/final

Held-out success is measured on the test split at T=1 and greedily every
``--eval-every`` steps. Also printed: uniform random guessing, the best
feedback-ignoring policy and random-inside-the-remaining-range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from functools import lru_cache

import torch

from rlnode.actor.episode import ChatRenderer, parse_action
from rlnode.cubes.base import Action
from rlnode.cubes.registry import make_cube
from rlnode.tiny_model import build_tiny_model


# --------------------------------------------------------------------------
# Reference policies (exact, by enumeration)


def uniform_random_success(n: int, turns: int) -> float:
    return 1 - (1 - 1 / n) ** turns


def ignoring_success(n: int, turns: int) -> float:
    return min(1.0, turns / n)


def in_range_success(n: int, turns: int) -> float:
    """Guess uniformly inside the remaining interval (what a Markov policy
    that only reads the range can do without binary search)."""

    @lru_cache(None)
    def win(size: int, k: int) -> float:
        # target uniform in an interval of `size`, k guesses left
        if k == 0 or size == 0:
            return 0.0
        tot = 0.0
        for t in range(size):
            for g in range(size):
                if g == t:
                    tot += 1
                elif g < t:
                    tot += win_fixed(size - g - 1, t - g - 1, k - 1)
                else:
                    tot += win_fixed(g, t, k - 1)
        return tot / size / size

    @lru_cache(None)
    def win_fixed(size: int, t: int, k: int) -> float:
        if k == 0:
            return 0.0
        tot = 0.0
        for g in range(size):
            if g == t:
                tot += 1
            elif g < t:
                tot += win_fixed(size - g - 1, t - g - 1, k - 1)
            else:
                tot += win_fixed(g, t, k - 1)
        return tot / size

    return win(n, turns)


def binary_search_success(n: int, turns: int) -> float:
    return min(1.0, (2 ** turns - 1) / n)


# --------------------------------------------------------------------------
# Batched sampling with the HF model (left-padded, KV cache)


@torch.no_grad()
def sample_batch(model, prompts: list[list[int]], max_tokens: int, temperature: float,
                 eos_id: int, pad_id: int, gen: torch.Generator) -> list[list[int]]:
    B = len(prompts)
    L = max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    past = out.past_key_values
    logits = out.logits[:, -1, :]
    done = torch.zeros(B, dtype=torch.bool)
    comps: list[list[int]] = [[] for _ in range(B)]
    last_pos = pos[:, -1]
    for t in range(max_tokens):
        if temperature == 0:
            tok = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temperature, -1)
            tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        for i in range(B):
            if not done[i]:
                comps[i].append(int(tok[i]))
        done |= tok == eos_id
        if bool(done.all()) or t == max_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], 1)
        last_pos = last_pos + 1
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                    past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :]
    return comps


# --------------------------------------------------------------------------
# Episodes, run in lockstep over a batch of tasks


async def play(model, renderer, cube, task_ids: list[str], max_turns: int, max_tokens: int,
               temperature: float, gen: torch.Generator):
    """Plays one episode per task id (ids may repeat). Returns per episode:
    (success, reward, final token sequence, completion mask, turns)."""
    tasks = [await cube.open_task(t) for t in task_ids]
    eps = []
    for task in tasks:
        reset = await task.reset()
        eps.append(dict(task=task, prompt=renderer.first_prompt(reset.system, reset.observation, []),
                        seq=None, cmask=None, done=False, turns=0))
        eps[-1]["seq"] = list(eps[-1]["prompt"])
        eps[-1]["cmask"] = [0] * len(eps[-1]["prompt"])
    tok = renderer.tok
    for turn in range(max_turns):
        active = [e for e in eps if not e["done"]]
        if not active:
            break
        comps = sample_batch(model, [e["seq"] for e in active], max_tokens, temperature,
                             renderer.eos_id, tok.pad_token_id, gen)
        for e, c in zip(active, comps):
            e["seq"] = e["seq"] + c
            e["cmask"] = e["cmask"] + [1] * len(c)
            e["turns"] += 1
            res = await e["task"].step(parse_action(renderer.completion_text(c), renderer.parser, e["task"].tools()))
            if res.done or turn == max_turns - 1:
                e["done"] = True
            else:
                nxt = renderer.next_message(c, res.role, res.observation)
                e["seq"] = e["seq"] + nxt
                e["cmask"] = e["cmask"] + [0] * len(nxt)
    out = []
    for e in eps:
        ev = await e["task"].evaluate()
        await e["task"].close()
        out.append(dict(success=ev.success, reward=ev.reward, seq=e["seq"], cmask=e["cmask"],
                        turns=e["turns"], guesses=ev.info.get("guesses")))
    return out


def token_logprobs(model, seqs: list[list[int]], cmasks: list[list[int]], pad_id: int):
    """Right-padded forward; returns (logp of each next token [B, L-1],
    completion mask [B, L-1], entropy [B, L-1])."""
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    cm = torch.zeros((B, L), dtype=torch.float)
    am = torch.zeros((B, L), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, cmasks)):
        ids[i, :len(s)] = torch.tensor(s)
        cm[i, :len(s)] = torch.tensor(m, dtype=torch.float)
        am[i, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, -1)
    tgt = ids[:, 1:]
    logp = logp_all.gather(-1, tgt[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, cm[:, 1:], ent


def lr_at(step: int, a) -> float:
    if a.warmup and step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if a.schedule == "constant":
        return a.lr
    frac = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    if a.schedule == "cosine":
        f = 0.5 * (1 + math.cos(math.pi * frac))
    else:
        f = 1 - frac
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * f)


def shaped_reward(ep, a) -> float:
    r = float(ep["reward"])
    if a.partial == "fast" and ep["success"]:
        # prefer solving in fewer turns (pushes towards binary search)
        r = 1.0 - 0.5 * (ep["turns"] - 1) / max(1, a.max_turns - 1)
    return r


async def evaluate(model, renderer, cube, test_ids, a, gen):
    res = {}
    model.eval()
    for name, temp in (("T1", 1.0), ("greedy", 0.0)):
        eps = await play(model, renderer, cube, test_ids, a.max_turns, a.max_tokens, temp, gen)
        res[name] = sum(e["success"] for e in eps) / len(eps)
        if name == "greedy":
            res["greedy_turns"] = sum(e["turns"] for e in eps) / len(eps)
            res["example"] = eps[0]["guesses"]
    return res


async def main(a):
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tempfile.mkdtemp(prefix="probe_model_")
    build_tiny_model(d, arch="qwen2", tie_embeddings=False, seed=a.seed, layers=a.layers, hidden=a.hidden)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    renderer = ChatRenderer(tok)
    # --lag L: episodes are sampled by the policy of L steps ago (an async
    # loop whose generation runs L versions ahead of the trainer).
    olds: list = []
    if a.lag:
        import copy
        olds = [copy.deepcopy(model) for _ in range(a.lag)]
    ref = None
    if a.kl:
        import copy
        ref = copy.deepcopy(model).eval()
    opts = {"max_number": a.max_number, "max_turns": a.max_turns, "feedback": a.feedback}
    cube = make_cube("g", "guessing", opts, seed=0)
    train_ids = await cube.task_ids("train")
    test_ids = await cube.task_ids("test")
    n, k = a.max_number, a.max_turns
    refs = dict(uniform=uniform_random_success(n, k), ignoring=ignoring_success(n, k),
                in_range=in_range_success(n, k), binary=binary_search_success(n, k))
    print(f"config {vars(a)}", flush=True)
    print("reference success: " + " ".join(f"{x}={v:.3f}" for x, v in refs.items()), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), weight_decay=0.0, eps=a.adam_eps)
    rng = random.Random(a.seed)
    curve = []
    t_start = time.monotonic()
    t_gen = t_train = 0.0
    steps_to = {}
    ev = await evaluate(model, renderer, cube, test_ids, a, gen)
    curve.append(dict(step=0, wall=0.0, **ev))
    print(f"step 0 eval T1={ev['T1']:.3f} greedy={ev['greedy']:.3f}", flush=True)
    for step in range(1, a.steps + 1):
        t0 = time.monotonic()
        group_tasks = [rng.choice(train_ids) for _ in range(a.groups)]
        ids = [t for t in group_tasks for _ in range(a.attempts)]
        sampler = olds[0] if a.lag else model
        sampler.eval()
        eps = await play(sampler, renderer, cube, ids, a.max_turns, a.max_tokens, 1.0, gen)
        t1 = time.monotonic()
        rewards = torch.tensor([shaped_reward(e, a) for e in eps]).view(a.groups, a.attempts)
        adv = rewards - (rewards.mean() if a.baseline == "batch" else rewards.mean(1, keepdim=True))
        if a.std_norm:
            adv = adv / (rewards.std(1, keepdim=True) + 1e-6)
        adv = adv.flatten()
        train_succ = sum(e["success"] for e in eps) / len(eps)
        # drop episodes with zero advantage (no gradient) to save compute
        keep = [i for i in range(len(eps)) if adv[i] != 0]
        if a.lag:
            with torch.no_grad():
                old_lp, _, _ = token_logprobs(sampler, [eps[i]["seq"] for i in keep],
                                              [eps[i]["cmask"] for i in keep], tok.pad_token_id) if keep else (None, None, None)
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, a)
        ntok = sum(sum(e["cmask"]) for e in eps)
        loss_v = ent_v = 0.0
        model.train()
        if keep or a.ent or a.kl:
            sel = keep if not (a.ent or a.kl) else list(range(len(eps)))
            logp, cm, ent = token_logprobs(model, [eps[i]["seq"] for i in sel],
                                           [eps[i]["cmask"] for i in sel], tok.pad_token_id)
            A = adv[sel][:, None]
            w = torch.ones_like(logp)
            if a.lag and keep:
                # TIS weight on the kept rows (sel == keep when no ent/kl)
                full = torch.zeros_like(logp)
                idx = [sel.index(i) for i in keep]
                full[idx, :old_lp.shape[1]] = old_lp[:, :logp.shape[1]]
                if a.loss == "ppo":
                    # PPO-clip against the sampling policy: a token whose ratio
                    # left [1-eps_low, 1+eps_high] on the side its advantage
                    # pushes gets no gradient (a trust region around the data).
                    r = torch.exp(logp - full)
                    w = torch.minimum(r * A, r.clamp(1 - a.eps_low, 1 + a.eps_high) * A)
                else:
                    w = A * torch.exp(logp.detach() - full).clamp(max=a.is_cap) * logp
            else:
                w = A * logp
            loss = -(w * cm).sum() / ntok
            if a.ent:
                ecm = cm
                if a.ent_where == "unsolved":
                    # only where the group did not all succeed
                    solved_group = (rewards > 0).all(dim=1)  # [groups]
                    solved = solved_group[torch.tensor(sel) // a.attempts]
                    ecm = cm * (~solved)[:, None].to(cm.dtype)
                loss = loss - a.ent * (ent * ecm).sum() / ntok
            if a.kl:
                with torch.no_grad():
                    ref_lp, _, _ = token_logprobs(ref, [eps[i]["seq"] for i in sel],
                                                  [eps[i]["cmask"] for i in sel], tok.pad_token_id)
                d_ = ref_lp - logp
                k3 = d_.exp() - d_ - 1
                loss = loss + a.kl * (k3 * cm).sum() / ntok
            opt.zero_grad()
            loss.backward()
            if a.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            opt.step()
            loss_v = loss.item()
            ent_v = float((ent * cm).sum() / cm.sum())
        if a.lag:  # the sampler becomes the newest copy
            olds.append(olds.pop(0))
            olds[-1].load_state_dict(model.state_dict())
        t2 = time.monotonic()
        t_gen += t1 - t0
        t_train += t2 - t1
        if step % a.log_every == 0:
            print(f"step {step} train_succ={train_succ:.3f} loss={loss_v:+.4f} ent={ent_v:.3f} "
                  f"lr={lr_at(step - 1, a):.2e} gen={t1 - t0:.2f}s train={t2 - t1:.2f}s", flush=True)
        if step % a.eval_every == 0 or step == a.steps:
            ev = await evaluate(model, renderer, cube, test_ids, a, gen)
            wall = time.monotonic() - t_start
            curve.append(dict(step=step, wall=wall, train=train_succ, **ev))
            for thr in (0.5, 0.7, 0.8, 0.85):
                if ev["T1"] >= thr and f"T1>={thr}" not in steps_to:
                    steps_to[f"T1>={thr}"] = step
                if ev["greedy"] >= thr and f"greedy>={thr}" not in steps_to:
                    steps_to[f"greedy>={thr}"] = step
            print(f"step {step} eval T1={ev['T1']:.3f} greedy={ev['greedy']:.3f} "
                  f"turns={ev['greedy_turns']:.2f} ex={ev['example']} wall={wall:.0f}s "
                  f"gen/step={t_gen / step:.3f}s train/step={t_train / step:.3f}s", flush=True)
            if a.time_limit and wall > a.time_limit:
                print("time limit", flush=True)
                break
    summary = dict(config=vars(a), refs=refs, steps_to=steps_to, curve=curve,
                   gen_per_step=t_gen / step, train_per_step=t_train / step,
                   final=curve[-1], best_T1=max(c["T1"] for c in curve))
    print("SUMMARY " + json.dumps({k: summary[k] for k in ("steps_to", "final", "best_T1", "gen_per_step",
                                                         "train_per_step")}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-number", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--feedback", default="range", choices=["range", "direction"])
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--schedule", default="constant", choices=["constant", "cosine", "linear"])
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max grad norm (0 = none)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--attempts", type=int, default=8)
    p.add_argument("--std-norm", action="store_true")
    p.add_argument("--partial", default="none", choices=["none", "fast"])
    p.add_argument("--ent", type=float, default=0.0, help="entropy bonus coefficient")
    p.add_argument("--kl", type=float, default=0.0, help="k3 KL-to-init coefficient")
    p.add_argument("--lag", type=int, default=0, help="sample with the policy of this many steps ago")
    p.add_argument("--is-cap", type=float, default=2.0)
    p.add_argument("--baseline", default="group", choices=["group", "batch"])
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--ent-where", default="all", choices=["all", "unsolved"])
    p.add_argument("--loss", default="tis", choices=["tis", "ppo"], help="with --lag: truncated IS or PPO-clip")
    p.add_argument("--eps-low", type=float, default=0.2)
    p.add_argument("--eps-high", type=float, default=0.28)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--time-limit", type=float, default=0, help="stop after this many seconds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--inspect", default="", metavar="MODEL_DIR",
                   help="instead of training: what a trained policy (e.g. runs/demo/final) does per target")
    return p.parse_args(argv)


async def inspect(a) -> None:
    """Per target: the greedy guesses and the 4 commonest guess sequences of
    32 episodes at T=1 (None = a reply that is no number: a wasted turn).
    Shows which decision a plateaued policy gets wrong."""
    import collections

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.inspect)
    model = AutoModelForCausalLM.from_pretrained(a.inspect, dtype=torch.float32).eval()
    renderer = ChatRenderer(tok)
    opts = {"max_number": a.max_number, "max_turns": a.max_turns, "feedback": a.feedback}
    cube = make_cube("g", "guessing", opts, seed=0)
    by_target: dict[int, str] = {}
    for t in await cube.task_ids("test"):
        by_target.setdefault(cube.target(t), t)
    gen = torch.Generator().manual_seed(a.seed)
    for target, t in sorted(by_target.items()):
        greedy = (await play(model, renderer, cube, [t], a.max_turns, a.max_tokens, 0.0, gen))[0]
        eps = await play(model, renderer, cube, [t] * 32, a.max_turns, a.max_tokens, 1.0, gen)
        seqs = collections.Counter(tuple(e["guesses"]) for e in eps).most_common(4)
        print(f"target {target}: greedy {greedy['guesses']}, T=1 success "
              f"{sum(e['success'] for e in eps) / 32:.2f}, commonest {seqs}", flush=True)


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    asyncio.run(inspect(args) if args.inspect else main(args))
