"""The control plane at DeepSeek-V3's scale, side by side with Mixtral-8x7B's in the same run.

    python bench/scale.py            # 8, 16, 32 and 64 shard groups
    python bench/scale.py --quick    # 32 only

DeepSeek-V3: 61 layers, the first 3 dense, 58 of 256 routed experts (14,848 experts), top-8,
hidden 7168, experts of 2048, bf16 (88 MB an expert), 32 spare copies a layer
(spec.autoscaling.redundantExpertSlots). Mixtral-8x7B: 32 layers of 8 experts (256 experts),
the same spare share (1 a layer). The MoEDeployment gives the shape (spec.model.shape: config.json
only, no weights), and each pass is the operator's own reconcile pass on the render-only backend
(backends/render_only.py): no apiserver, no Ray, so the figures are the operator's own work.

Per shape and group count:
- reconcile: the first pass (plan, render, write the Serve config) and a pass over the unchanged
  spec, in ms (median of 3);
- sizes against the apiserver's 1.5 MB object limit: status, the Serve config, the Ingress
  user_config (the placement every Ingress replica receives), the largest shard user_config,
  and the RayService (ray.mode KubeRay carries the Serve config inside the object);
- rebalance: one autoscale pass on Zipf-1.0 load (a `moectl rebalance` request, max moves 8 and
  unlimited), in ms, beside DeepSeek's EPLB packing (bench/placement.py's reference) on the
  same load; then the pass that starts applying it (status holds the target placement), its ms
  and the status bytes then;
- moectl views: the rows of `moectl experts` (one a layer past 500 experts) and the widest line
  of `moectl top --once` in a 200-column terminal.
Figures: `plan-ms-deepseek-v3` (first pass, 32 groups), `reconcile-ms-deepseek-v3` (unchanged),
`status-bytes-deepseek-v3` (the largest, while a rebalance applies), `serve-config-bytes-deepseek-v3`
(64 groups), `rayservice-over-limit` (its bytes / 1.5 MB), `rebalance-ms-deepseek-v3` (max moves
8), `rebalance-vs-eplb-ms` (unlimited moves / EPLB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "workers"), str(REPO / "bench")]

from figures import report, scratch  # noqa: E402
from placement import reference  # noqa: E402
from rich.console import Console  # noqa: E402

from moe_operator.api.validation import parse_spec  # noqa: E402
from moe_operator.autoscaling.loop import autoscale  # noqa: E402
from moe_operator.backends.render_only import RenderOnlyClient  # noqa: E402
from moe_operator.cli.views import expert_rows, heatmap, layer_summary, load_grid  # noqa: E402
from moe_operator.planner.synthetic import zipf_load  # noqa: E402
from moe_operator.reconcile import ObjectRef, reconcile  # noqa: E402
from moe_operator.render.rayservice import render_rayservice  # noqa: E402
from moe_operator.settings import Settings  # noqa: E402

LIMIT = 1.5 * 2**20  # the apiserver's largest object (etcd's request limit)
SHAPES = {
    "deepseek-v3": dict(numLayers=61, numExperts=256, topK=8, hiddenSize=7168, intermediateSize=2048,
                        dtype="bfloat16", sparseLayers=list(range(3, 61))),
    "mixtral-8x7b": dict(numLayers=32, numExperts=8, topK=2, hiddenSize=4096, intermediateSize=14336,
                         dtype="bfloat16"),
}
SPARE = {"deepseek-v3": 32, "mixtral-8x7b": 1}


def manifest(root: str, shape: str, groups: int, max_moves: int = 8) -> dict:
    return {"model": {"path": f"{root}/model", "shape": SHAPES[shape]},
            "ingress": {"numCpus": 1, "kvCacheBudget": "40Gi"},
            "experts": {"groups": groups, "numCpus": 4,
                        "tiers": {"hot": {"budget": "64Gi"}, "warm": {"budget": "256Gi"}}},
            "autoscaling": {"mode": "Auto", "redundantExpertSlots": SPARE[shape], "maxMovesPerStep": max_moves},
            "ray": {"mode": "Existing"}}


def timed(fn, rounds: int = 3):
    times, out = [], None
    for _ in range(rounds):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), out


def app_sizes(root: str) -> dict:
    config = json.loads((Path(root) / "ray" / "serve-config.json").read_text())
    app = config["applications"][0]
    user = {d["name"]: len(json.dumps(d.get("user_config") or {})) for d in app["deployments"]}
    return {"serve_config": len(json.dumps(config)), "ingress_user_config": user.pop("Ingress"),
            "largest_shard_user_config": max(user.values()), "app": app}


def rates_for(placement: dict[str, list[str]], load: dict[str, float]) -> dict[tuple[str, str], float]:
    """Each expert's load split evenly over the groups hosting it."""
    hosts: dict[str, list[str]] = {}
    for g, experts in placement.items():
        for e in experts:
            hosts.setdefault(e, []).append(g)
    return {(g, e): load[e] / len(gs) for e, gs in hosts.items() for g in gs}


def one(shape: str, groups: int) -> dict:
    root = str(scratch("moe-bench-scale-"))
    settings = Settings(allowed_roots=(root,))
    obj = ObjectRef("default", "big", 1, uid="00000000-0000-0000-0000-000000000000")
    raw = manifest(root, shape, groups)
    client = RenderOnlyClient(f"{root}/ray")

    def first():
        (Path(root) / "ray" / "serve-config.json").unlink(missing_ok=True)
        return reconcile(obj, raw, {}, client, settings, fetch=lambda url: None)

    first_ms, res = timed(first)
    assert res.ready, res.event
    again_ms, res2 = timed(lambda: reconcile(obj, raw, res.status, client, settings, fetch=lambda url: None))
    sizes = app_sizes(root)
    spec = parse_spec(raw)
    kuberay = parse_spec({**raw, "ray": {"mode": "KubeRay", "kubeRay": {"image": "rayproject/ray:2.54.0"}},
                          "model": {**raw["model"]}})
    rayservice = render_rayservice("default", "big", obj.uid, kuberay, sizes.pop("app"))
    placement = res.placement
    sparse = SHAPES[shape].get("sparseLayers") or list(range(SHAPES[shape]["numLayers"]))
    experts = SHAPES[shape]["numExperts"]
    zipf = zipf_load(len(sparse), experts, 1.0, seed=groups)
    load = {f"{sparse[int(k.split('.')[0])]}.{k.split('.')[1]}": v for k, v in zipf.items()}
    rates = rates_for(placement, load)
    expert_bytes = 3 * SHAPES[shape]["hiddenSize"] * SHAPES[shape]["intermediateSize"] * 2
    status = {**res.status, "groups": [{**g, "load": 0.0} for g in res.status["groups"]]}
    rebalance_ms, step = timed(lambda: autoscale(spec, status, placement, rates, time.time(), expert_bytes, groups,
                                                 request="bench"))
    unlimited = parse_spec(manifest(root, shape, groups, max_moves=10_000))
    unlimited_ms, _ = timed(lambda: autoscale(unlimited, status, placement, rates, time.time(), expert_bytes, groups,
                                              request="bench"))
    eplb_ms, _ = timed(lambda: reference(load, sorted(placement), SPARE[shape]))
    applying = {**status, "autoscaling": step.autoscaling}
    apply_ms, res3 = timed(lambda: reconcile(obj, raw, applying, client, settings, fetch=lambda url: None),
                           rounds=1)
    # what the replicas would report: every expert once, on the group hosting it
    rep = {"replicas": [{"group": g, "replica": g, "versions": {e: {"tier": "hot", "tokens": int(load.get(e, 0)),
                                                                 "digest": "sha256:00", "source": "checkpoint"}
                                                             for e in es}} for g, es in placement.items()]}
    rows = expert_rows(rep)
    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))
    grid, layers, _ = load_grid(rep)
    console.print(heatmap(grid, "t", layers, 200))
    return {
        "shape": shape, "groups": groups, "experts": len(sparse) * experts, "spare_per_layer": SPARE[shape],
        "first_pass_ms": round(first_ms, 1), "unchanged_pass_ms": round(again_ms, 1),
        "status_bytes": len(json.dumps(res2.status)), **sizes, "rayservice_bytes": len(json.dumps(rayservice)),
        "rebalance_ms_max_moves_8": round(rebalance_ms, 1), "rebalance_ms_unlimited": round(unlimited_ms, 1),
        "eplb_ms": round(eplb_ms, 1), "moved_copies": step.autoscaling.get("movedCopies"),
        "imbalance_before": step.autoscaling.get("imbalanceBefore"),
        "imbalance_after": step.autoscaling.get("imbalanceAfter"),
        "apply_pass_ms": round(apply_ms, 1), "status_bytes_applying": len(json.dumps(res3.status)),
        "experts_view_rows": len(layer_summary(rows)) if len(rows) > 500 else len(rows),
        "top_widest_line": max(len(line) for line in console.export_text().splitlines()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    a = ap.parse_args()
    groups = [32] if a.quick else [8, 16, 32, 64]
    rows = []
    for shape in SHAPES:
        for g in groups:
            if g > SHAPES[shape]["numExperts"] * 4:
                continue
            r = one(shape, g)
            rows.append(r)
            print(json.dumps(r))
    ds = {r["groups"]: r for r in rows if r["shape"] == "deepseek-v3"}
    mx = {r["groups"]: r for r in rows if r["shape"] == "mixtral-8x7b"}
    at = 32 if 32 in ds else max(ds)
    widest = max(ds)
    figures = {
        "plan-ms-deepseek-v3": ds[at]["first_pass_ms"],
        "plan-ms-deepseek-v3-over-mixtral": ds[at]["first_pass_ms"] / mx[at]["first_pass_ms"],
        "reconcile-ms-deepseek-v3": ds[at]["unchanged_pass_ms"],
        "status-bytes-deepseek-v3": max(max(r["status_bytes"], r["status_bytes_applying"]) for r in ds.values()),
        "serve-config-bytes-deepseek-v3": ds[widest]["serve_config"],
        "rayservice-over-limit": max(r["rayservice_bytes"] for r in ds.values()) / LIMIT,
        "rebalance-ms-deepseek-v3": ds[at]["rebalance_ms_max_moves_8"],
        "rebalance-vs-eplb-ms": ds[at]["rebalance_ms_unlimited"] / ds[at]["eplb_ms"],
    }
    return report(a.out, {"rows": rows, "limit_bytes": LIMIT}, figures)


if __name__ == "__main__":
    raise SystemExit(main())
