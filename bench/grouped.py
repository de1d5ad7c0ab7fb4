"""A MoE layer's routed experts on the CPU: grouped GEMM with the routing on the device
(`model.grouped.moe`, the GPU's path) against the per-expert loop (`group_by_expert` +
`experts.compute_rows` + `layers.combine`, the CPU's path for steps over `routes.SMALL` rows),
same weights, same inputs, same process, at published layer shapes.

    python bench/grouped.py                # Qwen3-30B-A3B and DeepSeek-V3 (32 of 256 experts), batch 16 / 64, prefill 512
    python bench/grouped.py --quick        # batch 16 only, 2 rounds

Random bf16 weights; the router's picks are uniform over the layer's experts (a balanced step:
every expert reads its weights). The two sides alternate in rounds; medians are reported with
the ratio loop / grouped (above 1: grouped is faster). The outputs agree within bf16's rounding
(checked). `experts.GROUPED_CPU_ROWS` is set from these figures. Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from figures import report  # noqa: E402

# name -> (hidden, expert intermediate, experts kept, top-k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v3": (7168, 2048, 32, 8)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="16,64,512", help="tokens a step (512: a prefill chunk)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "grouped.json"))
    return p.parse_args()


def main() -> int:
    import torch

    from moe_workers.model import grouped, layers
    from moe_workers.model.experts import compute_rows

    a = parse_args()
    tokens = [16] if a.quick else [int(t) for t in a.tokens.split(",")]
    rounds = 2 if a.quick else a.rounds
    g = torch.Generator().manual_seed(0)
    rows, figures = [], {}
    print(f"{'shape':>14} {'tokens':>6} {'loop ms':>8} {'grouped ms':>10} {'loop/grouped':>12}")
    with torch.inference_mode():
        for name in a.shapes.split(","):
            hidden, inter, experts, k = SHAPES[name]
            cfg = SimpleNamespace(expert_act="silu", experts_out_in=False)
            w = {p: (torch.randn(experts, *shape, generator=g) * 0.02).to(torch.bfloat16)
                 for p, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter)))}
            per_expert = {(0, e): {p: t[e] for p, t in w.items()} for e in range(experts)}
            for n in tokens:
                x = torch.randn(n, hidden, generator=g).to(torch.bfloat16)
                probs = torch.softmax(torch.randn(n, experts, generator=g), -1)
                weights, indices = torch.topk(probs, k)

                def loop():
                    groups = layers.group_by_expert(indices)
                    order = list(groups)
                    counts = [groups[e][0].numel() for e in order]
                    out = torch.empty(sum(counts), hidden, dtype=x.dtype)
                    compute_rows(per_expert, [(0, e) for e in order], counts,
                                 x[torch.cat([groups[e][0] for e in order])], out, cfg)
                    return layers.combine(n, hidden, x.dtype, groups, dict(zip(order, out.split(counts))), weights)

                def ours():
                    return grouped.moe(cfg, x, indices, weights, w)

                diff = float((loop().float() - ours().float()).abs().max())
                scale = float(loop().float().abs().max())
                assert diff <= 0.02 * scale, f"{name} tokens {n}: grouped differs by {diff} (scale {scale})"
                samples = {"loop": [], "grouped": []}
                for _ in range(rounds):
                    for side, fn in (("loop", loop), ("grouped", ours)):
                        t0 = time.perf_counter()
                        fn()
                        samples[side].append((time.perf_counter() - t0) * 1e3)
                lo, gr = statistics.median(samples["loop"]), statistics.median(samples["grouped"])
                rows.append({"shape": name, "tokens": n, "loop_ms": lo, "grouped_ms": gr, "max_diff": diff})
                print(f"{name:>14} {n:6} {lo:8.1f} {gr:10.1f} {lo / gr:12.2f}")
                figures[f"grouped-over-loop-{name}-tokens{n}"] = lo / gr
    return report(a.out, {"rows": rows, "threads": torch.get_num_threads()}, figures)


if __name__ == "__main__":
    sys.exit(main())
