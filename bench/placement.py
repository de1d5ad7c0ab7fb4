"""Placement planner against a greedy packing without replication and against the lower bound,
side by side in one run.

    python bench/placement.py

Loads: Zipf expert popularity (a different ranking per layer) at several skews, 8 to 256 experts
per layer and 4 to 64 shard groups (4 layers), and the per-expert token counts recorded from the
served model (bench/serving's checkpoint, in process). From the initial round-robin placement:
- ours: plan() with redundant slots = number of groups (one spare copy per group);
- greedy: longest-processing-time packing, one copy per expert, ignoring the current placement;
- lower bound: perfect balance, limited by the hottest expert's share per copy (with ours' copies).
Balancedness is mean / max group load (1.0 perfect). Also bytes moved (42 MiB experts) and
planning time per call. Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator"), str(REPO / "bench")]

from moe_operator.planner.initial import initial_placement, moved_experts  # noqa: E402
from moe_operator.planner.rebalance import balancedness, lower_bound_balancedness, plan  # noqa: E402

EXPERT_BYTES = 3 * 1024 * 3584 * 4  # the bench/serving model's expert


def zipf_load(layers: int, experts: int, s: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    out = {}
    for l in range(layers):
        ranks = rng.sample(range(experts), experts)
        for r, e in enumerate(ranks):
            out[f"{l}.{e}"] = 1000.0 / (r + 1) ** s
    return out


def greedy(load: dict[str, float], groups: list[str]) -> dict[str, list[str]]:
    placed = {g: [] for g in groups}
    gl = {g: 0.0 for g in groups}
    for e in sorted(load, key=lambda e: (-load[e], e)):
        g = min(groups, key=lambda g: (gl[g], g))
        placed[g].append(e)
        gl[g] += load[e]
    return placed


def recorded_load(tokens: int) -> dict[str, float]:
    from serving import ensure_checkpoint, model_shape
    from tiering import recorded_trace

    import tempfile

    path = ensure_checkpoint(str(Path(tempfile.gettempdir()) / "moe-bench"), model_shape(False))
    counts: dict[str, float] = {}
    for layer, expert in recorded_trace(path, tokens):
        counts[f"{layer}.{expert}"] = counts.get(f"{layer}.{expert}", 0.0) + 1
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "placement.json"))
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    rows = []
    cases = [(8, 4), (64, 8), (64, 16), (256, 16), (256, 64)]
    skews = [0.6, 1.0, 1.4]
    print(f"{'experts x groups':>17} {'skew':>5} {'initial':>8} {'greedy':>7} {'ours':>6} {'bound':>6} "
          f"{'ours/bound':>10} {'moved':>6} {'GiB moved':>9} {'greedy moved':>12} {'plan ms':>8}")
    for experts, groups in cases:
        for s in skews:
            load = zipf_load(a.layers, experts, s, seed=experts * 7 + groups)
            current = initial_placement(a.layers, experts, groups)
            t0 = time.perf_counter()
            ours = plan(load, current, EXPERT_BYTES, redundant_slots=groups)
            ms = (time.perf_counter() - t0) * 1e3
            g = greedy(load, sorted(current))
            row = {"experts": experts, "groups": groups, "skew": s, "initial": balancedness(current, load),
                   "greedy": balancedness(g, load), "ours": ours.balancedness,
                   "bound": lower_bound_balancedness(load, groups, ours.copies), "moved": ours.moved_copies,
                   "bytes_moved": ours.bytes_moved, "greedy_moved": moved_experts(current, g), "plan_ms": ms}
            rows.append(row)
            print(f"{experts:>8} x {groups:<6} {s:5.1f} {row['initial']:8.3f} {row['greedy']:7.3f} {row['ours']:6.3f} "
                  f"{row['bound']:6.3f} {row['ours'] / row['bound']:10.3f} {row['moved']:6d} "
                  f"{row['bytes_moved'] / 2**30:9.2f} {row['greedy_moved']:12d} {ms:8.1f}")
    rec = recorded_load(400)
    current = initial_placement(4, 8, 4)
    ours = plan(rec, current, EXPERT_BYTES, redundant_slots=4)
    recorded = {"initial": balancedness(current, rec), "greedy": balancedness(greedy(rec, sorted(current)), rec),
                "ours": ours.balancedness, "bound": lower_bound_balancedness(rec, 4, ours.copies),
                "moved": ours.moved_copies}
    print(f"\nrecorded from the served model (8 experts x 4 layers, 4 groups): initial {recorded['initial']:.3f}, "
          f"greedy {recorded['greedy']:.3f}, ours {recorded['ours']:.3f}, bound {recorded['bound']:.3f}, "
          f"{recorded['moved']} copies moved")
    figures = {
        "balancedness-vs-bound-worst": min(r["ours"] / r["bound"] for r in rows),
        "balancedness-ours-worst": min(r["ours"] for r in rows),
        "balancedness-greedy-worst": min(r["greedy"] for r in rows),
        "plan-ms-max": max(r["plan_ms"] for r in rows),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": rows, "recorded": recorded, "figures": figures}, indent=2))
    print()
    for k, v in figures.items():
        print(f"{k}: {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
