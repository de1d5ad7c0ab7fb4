"""Placement planner, per layer, against an EPLB-style reference and against the lower bound,
side by side in one run.

    python bench/placement.py

A decode step waits, layer by layer, for that layer's busiest shard group, so every figure here
is per layer. Settings: 8 / 64 / 256 experts per layer x 4 / 8 / 32 shard groups (no more groups
than experts), 0 / G / 2G spare copies per layer, loads Zipf 0.6 / 1.0 / 1.4 (a different
ranking per layer) and lognormal (sigma 1), 4 layers, 3 seeds. On the same load matrices:
- ours: `plan()` from the initial round-robin placement (unlimited moves), then again after a
  drift (20% of the experts' loads re-drawn) from its own previous plan;
- reference: DeepSeek's expert-parallel load balancer as published (replicate: each spare slot to
  the expert with the highest load per copy; then balanced packing: copies heaviest first, each to
  the least-loaded group that has a free slot, equal slots per group), from scratch each time;
- lower bound: perfect balance, unless the heaviest copy (after the best replication) is more
  than a group's share.
Balancedness of a layer is mean / max group load (1.0 perfect). Figures:
`balancedness-vs-reference` (ours / reference, mean over settings) and its worst setting,
`worst-layer-balancedness` (the least balanced layer, settings with >= 64 experts and >= G
spare copies), `moves-vs-replan` (copies moved on drift, ours / reference), `plan-ms-256x32`
(256 experts, 32 groups, 4 layers, G spare copies, from the initial placement; median of 3).
Also the co-selection tie-breaker: shard groups a token-layer reaches, with and without it, on a
routing trace where experts are picked in pairs.

    python bench/placement.py --end-to-end

adds the seconds from the onset of a skew to balanced serving on a real local Ray (`moectl up`,
default autoscaling timings: 60 s window, 120 s stabilization, 15 s scrape; mode Auto with one
spare copy per group in each layer): a checkpoint whose routers send nearly every token to two experts of one
group, clients start at the onset; reported next to the stabilization window the policy must wait
by design (the physical floor of any decision with these settings).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator"), str(REPO / "bench")]

from figures import report, scratch  # noqa: E402

from moe_operator.planner.initial import initial_placement, moved_experts  # noqa: E402
from moe_operator.planner.layer import slots_per_group  # noqa: E402
from moe_operator.planner.rebalance import (layer_balancedness, lower_bound_balancedness,  # noqa: E402
                                            plan, replicate)
from moe_operator.planner.synthetic import lognormal_load, zipf_load  # noqa: E402

EXPERT_BYTES = 3 * 1024 * 3584 * 4  # the bench/serving model's expert


def reference(load: dict[str, float], groups: list[str], spare: int) -> dict[str, list[str]]:
    """EPLB-style, from scratch: replicate, then balanced packing into equal slots per group."""
    out: dict[str, list[str]] = {g: [] for g in groups}
    by_layer: dict[str, dict[str, float]] = {}
    for e, v in load.items():
        by_layer.setdefault(e.split(".")[0], {})[e] = v
    for layer in sorted(by_layer, key=int):
        loads = by_layer[layer]
        G = len(groups)
        cap = slots_per_group(len(loads), G, spare)
        copies = replicate(loads, G, min(spare, G * cap - len(loads)))
        gl, n = [0.0] * G, [0] * G
        items = sorted(((loads[e] / copies[e], e) for e in loads for _ in range(copies[e])),
                       key=lambda t: (-t[0], t[1]))
        for w, e in items:
            g = min((k for k in range(G) if n[k] < cap and e not in out[groups[k]]), key=lambda k: (gl[k], k))
            out[groups[g]].append(e)
            gl[g] += w
            n[g] += 1
    return out


def drifted(load: dict[str, float], fresh: dict[str, float], seed: int, share: float = 0.2) -> dict[str, float]:
    """`load` with `share` of the experts re-drawn from `fresh`."""
    keys = sorted(load)
    pick = set(random.Random(seed).sample(keys, int(len(keys) * share)))
    return {e: (fresh[e] if e in pick else v) for e, v in load.items()}


def loads_for(kind: str, layers: int, experts: int, seed: int) -> dict[str, float]:
    if kind == "lognormal":
        return lognormal_load(layers, experts, 1.0, seed)
    return zipf_load(layers, experts, float(kind.split()[1]), seed)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 1.0


def one_setting(experts: int, groups: int, spare: int, kind: str, seed: int, layers: int) -> dict:
    load = loads_for(kind, layers, experts, seed)
    later = drifted(load, loads_for(kind, layers, experts, seed + 1000), seed)
    current = initial_placement(layers, experts, groups)
    names = sorted(current)
    t0 = time.perf_counter()
    ours = plan(load, current, EXPERT_BYTES, redundant_slots=spare)
    ms = (time.perf_counter() - t0) * 1e3
    ours2 = plan(later, ours.placement, EXPERT_BYTES, redundant_slots=spare)
    ref, ref2 = reference(load, names, spare), reference(later, names, spare)
    ref_b = layer_balancedness(ref, load)
    bound = lower_bound_balancedness(load, groups, spare)
    return {"experts": experts, "groups": groups, "spare": spare, "load": kind, "seed": seed,
            "ours": ours.balancedness, "ours_worst_layer": ours.worst_layer[1], "reference": mean(ref_b.values()),
            "reference_worst_layer": min(ref_b.values()), "bound": mean(bound.values()),
            "ours_after_drift": ours2.balancedness, "reference_after_drift": mean(layer_balancedness(ref2, later).values()),
            "ours_moves": ours2.moved_copies, "reference_moves": moved_experts(ref, ref2),
            "copies": sum(len(v) for v in ours2.placement.values()), "plan_ms": ms,
            "slots_per_group": ours.slots_per_group}


def paired_trace(layers: int, experts: int, tokens: int, seed: int) -> list[list[tuple[str, str]]]:
    """Per token, per layer, the top-2 experts: 70% of the time one of a few fixed pairs."""
    rng = random.Random(seed)
    pairs = {layer: [tuple(rng.sample(range(experts), 2)) for _ in range(experts // 2)] for layer in range(layers)}
    out = []
    for _ in range(tokens):
        row = []
        for layer in range(layers):
            a, b = rng.choice(pairs[layer]) if rng.random() < 0.7 else rng.sample(range(experts), 2)
            row.append((f"{layer}.{a}", f"{layer}.{b}"))
        out.append(row)
    return out


def co_selection_effect(layers: int = 4, experts: int = 64, groups: int = 8) -> dict:
    trace = paired_trace(layers, experts, 4000, 7)
    load: dict[str, float] = {}
    co: dict[tuple[str, str], float] = {}
    for row in trace:
        for a, b in row:
            load[a] = load.get(a, 0.0) + 1
            load[b] = load.get(b, 0.0) + 1
            key = (min(a, b), max(a, b))
            co[key] = co.get(key, 0.0) + 1
    current = initial_placement(layers, experts, groups)

    def reached(placement) -> float:
        where: dict[str, set[str]] = {}
        for g, es in placement.items():
            for e in es:
                where.setdefault(e, set()).add(g)
        # a token-layer reaches one group when its two experts share one, else two
        return mean(1 if where[a] & where[b] else 2 for row in trace for a, b in row)

    without = plan(load, current, 1, redundant_slots=groups)
    with_co = plan(load, current, 1, redundant_slots=groups, co_selection=co)
    return {"groups_per_token_layer_without": reached(without.placement),
            "groups_per_token_layer_with": reached(with_co.placement),
            "balancedness_without": without.balancedness, "balancedness_with": with_co.balancedness}


def onset_to_balanced() -> dict:
    """Seconds from the first skewed request to: imbalance seen in status, rebalance decided,
    new placement serving, measured imbalance back under the threshold. Zero failed requests."""
    import os
    import signal
    import subprocess
    import threading

    import requests
    import yaml

    sys.path.insert(0, str(REPO / "tests"))
    from checkpoints import make_skewed_mixtral
    from moe_operator.standalone.local_ray import free_port

    moectl = str(Path(sys.executable).with_name("moectl"))
    work = scratch("moe-bench-onset-")
    env = {**os.environ, "MOE_STATE_DIR": str(work / "state")}
    make_skewed_mixtral(work / "models" / "skewed", num_local_experts=8, hot_experts=(0, 4))
    defaults = {"mode": "Auto", "redundantExpertSlots": 4}  # every timing at its default
    manifest = {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "skewed"},
                "spec": {"model": {"path": "models/skewed"}, "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi"},
                         "experts": {"groups": 4, "numCpus": 0.25,
                                     "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}},
                         "autoscaling": defaults}}
    (work / "skewed.yaml").write_text(yaml.safe_dump(manifest))
    port = free_port()
    log = open(work / "up.log", "w+")
    proc = subprocess.Popen([moectl, "up", "-f", str(work / "skewed.yaml"), "--port", str(port), "--num-cpus", "2"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def status() -> dict:
        out = subprocess.run([moectl, "get", "skewed", "--local", "-o", "json"], env=env, capture_output=True,
                             text=True, timeout=60)
        return json.loads(out.stdout)["status"] if out.returncode == 0 else {}

    stop, counts = threading.Event(), {"ok": 0, "failed": 0}

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                  json={"prompt": [(i * 31 + n * 7 + k) % 90 + 3 for k in range(6)], "max_tokens": 6})
                counts["ok" if r.status_code == 200 else "failed"] += 1
            except requests.RequestException:
                counts["failed"] += 1

    try:
        deadline = time.monotonic() + 300
        while "is serving at" not in (work / "up.log").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moectl up did not serve: " + (work / "up.log").read_text()[-2000:])
            time.sleep(0.5)
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        marks: dict[str, float] = {}
        threshold, stabilization = 1.25, 120.0
        while time.monotonic() - t0 < 900 and "balanced" not in marks:
            st = status()
            auto = st.get("autoscaling") or {}
            now = time.monotonic() - t0
            if (st.get("imbalance") or 0) > threshold:
                marks.setdefault("detected", now)
            if auto.get("lastDecision") == "Rebalance":
                marks.setdefault("decided", now)
                if auto.get("phase") == "Steady":
                    marks.setdefault("serving", now)
                    if (st.get("imbalance") or 99) < threshold:
                        marks["balanced"] = now
            time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    if "balanced" not in marks:
        raise RuntimeError(f"not balanced within 900 s: {marks}; log {work / 'up.log'}")
    print(f"\nonset of skew -> imbalance seen {marks['detected']:.0f} s, rebalance decided {marks['decided']:.0f} s, "
          f"new placement serving {marks['serving']:.0f} s, measured balanced {marks['balanced']:.0f} s "
          f"(stabilization window {stabilization:.0f} s); requests ok {counts['ok']}, failed {counts['failed']}")
    return {"detected_s": marks["detected"], "decided_s": marks["decided"], "serving_s": marks["serving"],
            "balanced_s": marks["balanced"], "stabilization_s": stabilization, **counts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "placement.json"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--end-to-end", action="store_true", help="also measure onset-to-balanced on a local Ray (~5 min)")
    a = p.parse_args()
    rows = []
    cases = [(8, 4), (8, 8), (64, 4), (64, 8), (64, 32), (256, 4), (256, 8), (256, 32)]
    kinds = ["zipf 0.6", "zipf 1.0", "zipf 1.4", "lognormal"]
    print(f"{'experts x groups':>17} {'spare':>5} {'ours':>6} {'ref':>6} {'bound':>6} {'ours/ref':>8} "
          f"{'worst layer':>11} {'ours moves':>10} {'ref moves':>9} {'of copies':>9} {'plan ms':>8}")
    for experts, groups in cases:
        for spare in (0, groups, 2 * groups):
            part = [one_setting(experts, groups, spare, kind, seed, a.layers) for kind in kinds for seed in range(a.seeds)]
            rows += part
            print(f"{experts:>8} x {groups:<6} {spare:5d} {mean(r['ours'] for r in part):6.3f} "
                  f"{mean(r['reference'] for r in part):6.3f} {mean(r['bound'] for r in part):6.3f} "
                  f"{mean(r['ours'] / r['reference'] for r in part):8.3f} {min(r['ours_worst_layer'] for r in part):11.3f} "
                  f"{sum(r['ours_moves'] for r in part):10d} {sum(r['reference_moves'] for r in part):9d} "
                  f"{sum(r['copies'] for r in part):9d} {max(r['plan_ms'] for r in part):8.1f}", flush=True)
    timing = []
    for seed in range(3):
        load = zipf_load(a.layers, 256, 1.0, seed)
        current = initial_placement(a.layers, 256, 32)
        t0 = time.perf_counter()
        plan(load, current, EXPERT_BYTES, redundant_slots=32)
        timing.append((time.perf_counter() - t0) * 1e3)
    co = co_selection_effect()
    print(f"\nco-selection tie-breaker (64 experts, 8 groups, pairs picked 70% of the time): shard groups per "
          f"token-layer {co['groups_per_token_layer_without']:.3f} without, {co['groups_per_token_layer_with']:.3f} "
          f"with; balancedness {co['balancedness_without']:.4f} / {co['balancedness_with']:.4f}")
    big = [r for r in rows if r["experts"] >= 64 and r["spare"] >= r["groups"]]
    figures = {
        "balancedness-vs-reference": mean(r["ours"] / r["reference"] for r in rows),
        "balancedness-vs-reference-worst": min(r["ours"] / r["reference"] for r in rows),
        "balancedness-vs-bound": mean(r["ours"] / r["bound"] for r in rows),
        "reference-vs-bound": mean(r["reference"] / r["bound"] for r in rows),
        "worst-layer-balancedness": min(r["ours_worst_layer"] for r in big),
        "reference-worst-layer-balancedness": min(r["reference_worst_layer"] for r in big),
        "moves-vs-replan": sum(r["ours_moves"] for r in rows) / max(1, sum(r["reference_moves"] for r in rows)),
        "moved-share-ours": sum(r["ours_moves"] for r in rows) / sum(r["copies"] for r in rows),
        "moved-share-reference": sum(r["reference_moves"] for r in rows) / sum(r["copies"] for r in rows),
        "plan-ms-256x32": statistics.median(timing),
        "plan-ms-max": max(r["plan_ms"] for r in rows),
        "co-selection-groups-saved": co["groups_per_token_layer_without"] - co["groups_per_token_layer_with"],
    }
    onset = None
    if a.end_to_end:
        onset = onset_to_balanced()
        figures["onset-to-balanced-s"] = onset["balanced_s"]
        figures["onset-to-balanced-vs-stabilization"] = onset["balanced_s"] / onset["stabilization_s"]
    return report(a.out, {"rows": rows, "co_selection": co, "onset": onset}, figures)


if __name__ == "__main__":
    sys.exit(main())
