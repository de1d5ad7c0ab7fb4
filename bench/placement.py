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

    python bench/placement.py --end-to-end

adds the seconds from the onset of a skew to balanced serving on a real local Ray (`moectl up`,
default autoscaling timings: 60 s window, 120 s stabilization, 15 s scrape; mode Auto with one
spare copy per group): a checkpoint whose routers send nearly every token to two experts of one
group, clients start at the onset; reported next to the stabilization window the policy must wait
by design (the physical floor of any decision with these settings).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator"), str(REPO / "bench")]

from moe_operator.planner.initial import initial_placement, moved_experts  # noqa: E402
from moe_operator.planner.rebalance import balancedness, lower_bound_balancedness, plan  # noqa: E402
from moe_operator.planner.synthetic import zipf_load  # noqa: E402

EXPERT_BYTES = 3 * 1024 * 3584 * 4  # the bench/serving model's expert


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


def onset_to_balanced() -> dict:
    """Seconds from the first skewed request to: imbalance seen in status, rebalance decided,
    new placement serving, measured imbalance back under the threshold. Zero failed requests."""
    import os
    import signal
    import subprocess
    import tempfile
    import threading

    import requests
    import yaml

    sys.path.insert(0, str(REPO / "tests"))
    from checkpoints import make_skewed_mixtral
    from moe_operator.standalone.local_ray import free_port

    moectl = str(Path(sys.executable).with_name("moectl"))
    work = Path(tempfile.mkdtemp(prefix="moe-bench-onset-"))
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
    p.add_argument("--end-to-end", action="store_true", help="also measure onset-to-balanced on a local Ray (~5 min)")
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
    onset = None
    if a.end_to_end:
        onset = onset_to_balanced()
        figures["onset-to-balanced-s"] = onset["balanced_s"]
        figures["onset-to-balanced-vs-stabilization"] = onset["balanced_s"] / onset["stabilization_s"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": rows, "recorded": recorded, "onset": onset, "figures": figures},
                                      indent=2))
    print()
    for k, v in figures.items():
        print(f"{k}: {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
