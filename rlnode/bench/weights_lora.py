"""``rlnode bench weights --lora``: a LoRA adapter's updates beside
full-weight updates of the same model, measured in the same run
(rlnode.bench.weights runs each).

The LoRA path moves the adapter only and the engine serves each version as
a new vLLM adapter: no pause, so the generation stall is 0 by construction
and the largest token gap during an update is compared with the engine's
own jitter (the 99th percentile of the gaps away from the updates), and
with the largest gap of a window as long just before the update. The goal (issue
38): an update, trainer start -> first token of a new request on the new
version, within ``GOAL_UPDATE_S`` at rank 16 on 2 CPU cores, with a stall
of 0 and parity < 1e-4 (fp32).
"""

from __future__ import annotations

import msgspec

from rlnode.bench.weights import WeightsBenchResult

GOAL_UPDATE_S = 0.050
PARITY = 1e-4


class LoraComparison(msgspec.Struct):
    full: WeightsBenchResult
    lora: WeightsBenchResult
    # LoRA over full weights, same model, same run:
    update_ratio: float  # update_to_first_token_s
    bytes_ratio: float  # bytes moved per update
    # The goal's parts, each measured:
    update_within_goal: bool  # lora update_to_first_token_s <= GOAL_UPDATE_S
    no_pause: bool  # generation never paused (generation_stall_s == 0)
    # No token gap during an update above the usual: the p99 of the gaps
    # away from updates (token_gap_p99_s).
    gap_within_usual: bool
    parity: bool  # engine vs trainer (fp32) < PARITY after the updates
    # What the update added to the largest gap: max_token_gap_s minus the
    # same window's just before it (control_token_gap_s), LoRA and full.
    lora_gap_added_s: float = 0.0
    full_gap_added_s: float = 0.0
    goal_update_s: float = GOAL_UPDATE_S


def compare(full: WeightsBenchResult, lora: WeightsBenchResult) -> LoraComparison:
    return LoraComparison(
        full=full, lora=lora,
        update_ratio=lora.update_to_first_token_s / full.update_to_first_token_s,
        bytes_ratio=lora.nbytes / full.nbytes,
        update_within_goal=lora.update_to_first_token_s <= GOAL_UPDATE_S,
        no_pause=lora.generation_stall_s == 0.0, gap_within_usual=lora.max_token_gap_s <= lora.token_gap_p99_s,
        parity=lora.max_abs_logprob_diff_after_update < PARITY,
        lora_gap_added_s=lora.max_token_gap_s - lora.control_token_gap_s,
        full_gap_added_s=full.max_token_gap_s - full.control_token_gap_s)


def print_comparison(c: LoraComparison) -> None:
    f, lo = c.full, c.lora
    print(f"\nLoRA vs full-weight updates: {f.model}")
    print(f"  over {lo.backend}; trainer on {lo.trainer_device} ({lo.precision}), engine on {lo.engine_device}; "
          f"median of {lo.rounds} updates each, with requests streaming through every update")
    rows = [
        ("parameters moved", f"{f.params / 1e6:.2f}M", f"{lo.params / 1e6:.3f}M (rank {lo.lora_rank})", ""),
        ("bytes moved", f"{f.nbytes / 2**20:.2f} MiB", f"{lo.nbytes / 2**20:.3f} MiB", f"{c.bytes_ratio:.3f}"),
        ("update: trainer -> first token on new version", f"{f.update_to_first_token_s:.4f} s",
         f"{lo.update_to_first_token_s:.4f} s", f"{c.update_ratio:.3f}"),
        ("  engine took it in (update_s)", f"{f.update_s:.4f} s", f"{lo.update_s:.4f} s", ""),
        ("  receive (generating)", f"{f.receive_s:.4f} s", f"{lo.receive_s:.4f} s", ""),
        ("  load (full: paused reload; LoRA: add_lora)", f"{f.load_s:.4f} s", f"{lo.load_s:.4f} s", ""),
        ("generation stall (pause -> resume)", f"{f.generation_stall_s:.4f} s", f"{lo.generation_stall_s:.4f} s", ""),
        ("max token gap during an update", f"{f.max_token_gap_s:.4f} s", f"{lo.max_token_gap_s:.4f} s", ""),
        ("  the same window just before it (no update)", f"{f.control_token_gap_s:.4f} s",
         f"{lo.control_token_gap_s:.4f} s", ""),
        ("token gap away from updates: median / p99", f"{f.usual_token_gap_s:.4f} / {f.token_gap_p99_s:.4f} s",
         f"{lo.usual_token_gap_s:.4f} / {lo.token_gap_p99_s:.4f} s", ""),
        ("max |logprob engine - trainer| after", f"{f.max_abs_logprob_diff_after_update:.2e}",
         f"{lo.max_abs_logprob_diff_after_update:.2e}", ""),
        ("adapters loaded at most / removed", "", f"{lo.adapters_loaded_max} / {lo.adapters_removed}", ""),
    ]
    print(f"  {'':<48}{'full weights':>22}{'LoRA':>26}{'LoRA/full':>11}")
    for name, a, b, r in rows:
        print(f"  {name:<48}{a:>22}{b:>26}{r:>11}")
    print(f"  the update added to the largest token gap: full {c.full_gap_added_s * 1000:.1f} ms, "
          f"LoRA {c.lora_gap_added_s * 1000:.1f} ms")
    print(f"  goal: update <= {c.goal_update_s * 1000:.0f} ms: {'met' if c.update_within_goal else 'MISSED'}; "
          f"no pause: {'met' if c.no_pause else 'MISSED'}; no gap above the usual (p99 away from updates): "
          f"{'met' if c.gap_within_usual else 'MISSED'}; parity < {PARITY:g}: {'met' if c.parity else 'MISSED'}")
