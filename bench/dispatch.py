"""The ingress' routing and combine of one layer at decode sizes: `model.routes` against the
tensor-op forms of `model.layers` (`group_by_expert` + `combine`), same inputs, same process.

    python bench/dispatch.py            # batch 1, 4, 16 and 32; hidden 256 and 4096; top-2, 8 experts
    python bench/dispatch.py --quick

Each side plans which rows go to which expert, gathers each expert's rows, and combines the
expert outputs (the rows themselves stand in for them) into each token's weighted sum: what a
layer's dispatch costs besides the exchange. The two sides alternate in rounds and the medians
are reported. Both give the same values (checked here too). Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from figures import report  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--hidden", default="256,4096")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "dispatch.json"))
    return p.parse_args()


def main() -> int:
    import torch

    from moe_workers.model import layers, routes

    a = parse_args()
    torch.set_num_threads(1)
    iters = 300 if a.quick else a.iters
    g = torch.Generator().manual_seed(0)
    rows, figures = [], {}
    print(f"{'batch':>5} {'hidden':>6} {'layers forms us':>16} {'routes us':>10} {'ratio':>6}")
    with torch.inference_mode():
        for hidden in (int(h) for h in a.hidden.split(",")):
            for n in (int(b) for b in a.batches.split(",")):
                if n * a.top_k > routes.SMALL:
                    continue
                x = torch.randn(n, hidden, generator=g)
                logits = torch.randn(n, a.experts, generator=g)
                weights, indices = torch.topk(torch.softmax(logits, -1), a.top_k)

                def reference():
                    groups = layers.group_by_expert(indices)
                    outs = {e: x[r] for e, (r, _) in groups.items()}
                    return layers.combine(n, hidden, x.dtype, groups, outs, weights)

                def ours():
                    r = routes.route(indices)
                    experts = list(r.by_expert)
                    outs = torch.cat([routes.gather(x, r, [e]) for e in experts])
                    return routes.combine(r, r.order(experts), outs, weights, x.dtype)

                assert torch.equal(reference(), ours())
                samples = {"reference": [], "ours": []}
                for _ in range(a.rounds):
                    for name, fn in (("reference", reference), ("ours", ours)):
                        t0 = time.perf_counter()
                        for _ in range(iters // a.rounds):
                            fn()
                        samples[name].append((time.perf_counter() - t0) / (iters // a.rounds) * 1e6)
                ref, us = statistics.median(samples["reference"]), statistics.median(samples["ours"])
                rows.append({"batch": n, "hidden": hidden, "layers_forms_us": ref, "routes_us": us})
                print(f"{n:5} {hidden:6} {ref:16.1f} {us:10.1f} {us / ref:6.2f}")
                figures[f"dispatch-plan-us-batch{n}-hidden{hidden}"] = us
                figures[f"dispatch-plan-over-layers-forms-batch{n}-hidden{hidden}"] = us / ref
    return report(a.out, {"rows": rows}, figures)


if __name__ == "__main__":
    sys.exit(main())
