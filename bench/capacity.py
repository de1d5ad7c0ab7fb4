"""Expert capacity (spec.routing.capacityFactor) against exact routing, served, under skewed
routing: decode throughput and request latency at batch 64, alternating in one window.

    python bench/capacity.py            # hidden 1024, intermediate 3584, 8 experts, top-2, 4 layers, 4 groups
    python bench/capacity.py --quick    # hidden 256, 2 layers: a smoke run

Skew: the batch's requests are `--distinct` prompts repeated, decoded greedily, so the requests
of one prompt route alike at every step (a hot topic's traffic); the checkpoint's routers are
scaled (router_scale 10). Each shard group hosts every `groups`-th expert: the group with a
step's hot experts is the one it waits for. One app on a local Ray; each round applies the factor in place (Serve's
reconfigure, no restart) and runs `--batch` concurrent requests of `--tokens` new tokens, then
the other side; rounds alternate. Decode tokens/s are a run with max_tokens=T minus one with
max_tokens=1 (bench/serving.py's rule); p99 is over every request of the full runs of a side.
Also reported: the share of routed choices the cap moved to a next choice, and means over
layers of the busiest group's share of the expert-tokens and of the busiest expert's load over
the mean expert's, on each side (from the shards' token counters).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from pathlib import Path

import requests

from figures import report
from serving import REPO, ensure_checkpoint, model_shape, prompts, served_app


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    p.add_argument("--factor", type=float, default=1.25)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="new tokens a request")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds a side")
    p.add_argument("--distinct", type=int, default=4,
                   help="distinct prompts among the batch's requests (greedy: each repeats its tokens' routing, "
                        "the skew a hot topic makes); 0: every prompt its own")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the ingress and of each shard")
    p.add_argument("--cache-dir", default=str(Path("/tmp/moe-bench")))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "capacity.json"))
    return p.parse_args()


def timed_requests(url: str, bodies: list[dict]) -> tuple[float, list[float]]:
    """Wall seconds of the whole batch and each request's latency."""
    def one(body):
        t0 = time.perf_counter()
        r = requests.post(url + "/v1/completions", json=body, timeout=3600)
        r.raise_for_status()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        latencies = list(pool.map(one, bodies))
    return time.perf_counter() - t0, latencies


def busiest(before: list[dict], after: list[dict], num_experts: int) -> tuple[float | None, float | None]:
    """Between two reads of the shards' status (their cumulative per-expert token counts), means
    over layers of the busiest shard group's share of the layer's expert-tokens and of the
    busiest expert's load over the mean expert's."""
    groups: dict[str, dict[str, int]] = {}
    experts: dict[str, dict[str, int]] = {}
    for a, b in zip(before, after):
        for eid, n in b["load"].items():
            layer, delta = eid.split(".")[0], n - a["load"].get(eid, 0)
            g = groups.setdefault(layer, {})
            g[b["group"]] = g.get(b["group"], 0) + delta
            experts.setdefault(layer, {})[eid] = experts.get(layer, {}).get(eid, 0) + delta
    group_shares = [max(g.values()) / sum(g.values()) for g in groups.values() if sum(g.values())]
    expert_peaks = [max(e.values()) * num_experts / sum(e.values()) for e in experts.values() if sum(e.values())]
    return (statistics.mean(group_shares) if group_shares else None,
            statistics.mean(expert_peaks) if expert_peaks else None)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def main() -> int:
    a = parse_args()
    shape = model_shape(a.quick)
    path = ensure_checkpoint(a.cache_dir, shape)
    sides = {"exact": None, f"capacity {a.factor:g}": a.factor}
    results = {name: {"tps": [], "latencies": [], "busiest": [], "peak": [], "rerouted": 0, "choices": 0}
               for name in sides}
    with served_app(path, a.groups, a.threads, a.threads, shape["num_layers"], shape["num_experts"], 1, {},
                    a.batch) as (url, stats, redeploy):
        status = lambda: requests.get(url + "/moe/v1/status", timeout=30).json()  # noqa: E731
        distinct = prompts(a.distinct or a.batch, 8, shape["vocab_size"], 3)
        ps = [distinct[i % len(distinct)] for i in range(a.batch)]
        for r in range(a.rounds):
            for name, factor in (sides.items() if r % 2 == 0 else reversed(sides.items())):
                redeploy(capacity_factor=factor)
                while status()["routing"].get("capacity_factor") != factor:
                    time.sleep(0.2)
                one, _ = timed_requests(url, [{"prompt": p, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
                                              for p in ps])
                _, s0 = stats()
                moved0 = status()["routing"]["capacity_rerouted"]
                full, lat = timed_requests(url, [{"prompt": p, "max_tokens": a.tokens, "temperature": 0,
                                                  "ignore_eos": True} for p in ps])
                _, s1 = stats()
                side = results[name]
                side["tps"].append(a.batch * (a.tokens - 1) / (full - one))
                side["latencies"].extend(lat)
                group_share, peak = busiest(s0, s1, shape["num_experts"])
                side["busiest"].append(group_share)
                side["peak"].append(peak)
                side["rerouted"] += status()["routing"]["capacity_rerouted"] - moved0
                side["choices"] += sum(sum(x["load"].values()) for x in s1) - sum(sum(x["load"].values()) for x in s0)
                print(f"round {r + 1} {name}: {side['tps'][-1]:.1f} tok/s, p99 {p99(lat) * 1000:.0f} ms, "
                      f"busiest group {group_share:.2f} of a layer's expert-tokens, busiest expert {peak:.2f}x the mean",
                      flush=True)
    figures = {}
    for name, side in results.items():
        key = "capacity" if sides[name] else "exact"
        figures[f"{key}-decode{a.batch}-tps"] = statistics.median(side["tps"])
        figures[f"{key}-p99-s"] = p99(side["latencies"])
        figures[f"{key}-busiest-group-share"] = statistics.mean(x for x in side["busiest"] if x is not None)
        figures[f"{key}-busiest-expert-over-mean"] = statistics.mean(x for x in side["peak"] if x is not None)
        figures[f"{key}-rerouted-share"] = side["rerouted"] / side["choices"] if side["choices"] else 0.0
    figures["capacity-over-exact-tps"] = figures[f"capacity-decode{a.batch}-tps"] / figures[f"exact-decode{a.batch}-tps"]
    figures["capacity-over-exact-p99"] = figures["capacity-p99-s"] / figures["exact-p99-s"]
    shape_text = {k: v for k, v in shape.items() if k != "max_position_embeddings"}
    return report(a.out, {"shape": shape_text, "groups": a.groups, "distinct_prompts": a.distinct, "factor": a.factor, "batch": a.batch,
                          "tokens": a.tokens, "rounds": {n: {k: v for k, v in s.items() if k != "latencies"}
                                                         for n, s in results.items()}}, figures)


if __name__ == "__main__":
    raise SystemExit(main())
