"""Hot-swap under load: swap latency against the raw load time of the expert file, request
latency during swaps against steady state, and failed requests. Side by side in one run.

    python bench/hotswap.py            # the bench/serving model (one expert = 44 MB fp32)
    python bench/hotswap.py --quick

Swaps go the way the operator sends them: a Serve config PUT with the expert's override in the
shard's user_config, applied by reconfigure() on the live replica. "Request to serving" is from
the PUT until the replica reports the new digest serving; "in replica" is the replica's own
stage + validate + commit time. The raw reference is reading the same file into memory
(`safetensors.torch.load_file` + a copy out of the mapping; page cache warm for both). Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator"), str(REPO / "bench")]

import requests  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from figures import scratch  # noqa: E402
from serving import ensure_checkpoint, model_shape, prompts  # noqa: E402

EID = "0.1"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--swaps", type=int, default=6)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--steady-s", type=float, default=20.0)
    p.add_argument("--cache-dir", default=os.environ.get("MOE_BENCH_CACHE", str(Path(tempfile.gettempdir()) / "moe-bench")))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "hotswap.json"))
    return p.parse_args()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def main() -> int:
    a = parse_args()
    shape = model_shape(a.quick)
    path = ensure_checkpoint(a.cache_dir, shape)
    work = scratch("moe-bench-hotswap-")
    weights = work / "weights"
    weights.mkdir()
    from moe_workers.model.checkpoint import Checkpoint

    base = Checkpoint(path).expert(0, 1)
    files = []
    for i, scale in enumerate((1.01, 0.99)):
        f = weights / f"expert-{EID}-v{i + 1}.safetensors"
        save_file({f"{w}.weight": (t * scale).contiguous() for w, t in base.items()}, str(f))
        files.append(f)
    raw = []
    for _ in range(3):
        for f in files:
            t0 = time.perf_counter()
            {k: t.clone() for k, t in load_file(str(f)).items()}  # load_file maps; clone reads the bytes
            raw.append(time.perf_counter() - t0)
    raw_load_s = min(raw)
    print(f"model {shape}\nexpert file {files[0].stat().st_size / 2**20:.1f} MiB; raw load_file {raw_load_s * 1e3:.1f} ms",
          flush=True)

    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.standalone.local_ray import LocalRayHead
    from moe_workers.serve.config import AppArgs, serve_application

    groups = 2
    L, E = shape["num_layers"], shape["num_experts"]
    placement = {f"ExpertShard-{g}": [f"{l}.{e}" for l in range(L) for e in range(E) if e % groups == g]
                 for g in range(groups)}
    args = AppArgs(model_path=str(path), served_model_name="bench", num_groups=groups, max_batch_size=a.clients,
                   kv_cache_budget_bytes=2**30, max_queued_requests=256, max_model_len=256, ingress_num_cpus=1,
                   shard_num_cpus=1, ingress_torch_threads=2, allowed_weight_roots=[str(weights)])
    head = LocalRayHead(work_dir=scratch("moe-bench-ray-"), num_cpus=8).start()
    try:
        ray = head.connect_driver(namespace="bench")
        from ray import serve

        client = RayServeClient(head.dashboard_url, head.token)

        def put(override: dict | None):
            client.put({"http_options": {"host": "127.0.0.1", "port": head.serve_http_port},
                        "applications": [serve_application("bench", "/", args, placement,
                                                           overrides={EID: override} if override else None)]})

        put(None)
        client.wait_running(["bench"], timeout_s=900)
        shard = serve.get_deployment_handle("ExpertShard-1", app_name="bench")  # hosts expert 1 of each layer
        url = f"http://127.0.0.1:{head.serve_http_port}"
        pool = prompts(32, 8, shape["vocab_size"], 3)
        log: list[tuple[float, float, int]] = []  # (start, latency, status)
        stop = threading.Event()

        def loop(i):
            k = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    status = requests.post(url + "/v1/completions", json={"prompt": pool[(i + k) % len(pool)],
                                           "max_tokens": 8, "temperature": 0}, timeout=600).status_code
                except requests.RequestException:
                    status = -1
                log.append((t0, time.monotonic() - t0, status))
                k += 1

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        time.sleep(5)  # warm-up, not measured
        steady_start = time.monotonic()
        time.sleep(a.steady_s)
        steady_end = time.monotonic()
        swaps = []
        for i in range(a.swaps):
            f = files[i % 2]
            override = {"path": str(f)}
            seen = shard.status.remote().result()["swaps"].get(EID, {}).get("seq", 0)
            t0 = time.monotonic()
            put(override)
            while True:
                rec = shard.status.remote().result()["swaps"].get(EID, {})
                if rec.get("seq", 0) > seen:
                    break
                time.sleep(0.02)
            swaps.append({"request_to_serving_s": time.monotonic() - t0, "record": rec})
            time.sleep(1.0)
        swaps_end = time.monotonic()
        stop.set()
        for t in threads:
            t.join(600)
        client.delete_all()
        ray.shutdown()
    finally:
        head.stop()

    steady = [lat for t0, lat, st in log if steady_start <= t0 < steady_end]
    during = [lat for t0, lat, st in log if steady_end <= t0 < swaps_end]
    failed = sum(1 for _, _, st in log if st != 200)
    e2e = [s["request_to_serving_s"] for s in swaps]
    inside = [s["record"]["duration_s"] for s in swaps]
    outcomes = [s["record"]["outcome"] for s in swaps]
    res = {
        "raw_load_s": raw_load_s, "swaps": swaps, "requests": len(log), "failed": failed,
        "steady": {"n": len(steady), "p50": pct(steady, 0.5), "p99": pct(steady, 0.99)},
        "during_swaps": {"n": len(during), "p50": pct(during, 0.5), "p99": pct(during, 0.99)},
    }
    figures = {
        "swap-overhead-ratio": statistics.median(e2e) / raw_load_s,
        "swap-in-replica-ratio": statistics.median(inside) / raw_load_s,
        "p50-during-vs-steady": res["during_swaps"]["p50"] / res["steady"]["p50"],
        "p99-during-vs-steady": res["during_swaps"]["p99"] / res["steady"]["p99"],
        "failed-requests": failed,
    }
    res["figures"] = figures
    print(f"\nswaps: {len(swaps)} ({', '.join(sorted(set(outcomes)))}); raw load of the file {raw_load_s * 1e3:.1f} ms")
    print(f"  request to serving  median {statistics.median(e2e) * 1e3:8.1f} ms  max {max(e2e) * 1e3:8.1f} ms")
    print(f"  in replica          median {statistics.median(inside) * 1e3:8.1f} ms  max {max(inside) * 1e3:8.1f} ms "
          "(stage + validate + commit)")
    print(f"requests: {len(log)}, failed {failed}")
    print(f"  steady       p50 {res['steady']['p50'] * 1e3:7.1f} ms  p99 {res['steady']['p99'] * 1e3:7.1f} ms  (n={len(steady)})")
    print(f"  during swaps p50 {res['during_swaps']['p50'] * 1e3:7.1f} ms  p99 {res['during_swaps']['p99'] * 1e3:7.1f} ms  (n={len(during)})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print()
    for k, v in figures.items():
        print(f"{k}: {v:.2f}")
    return 0 if failed == 0 and all(o == "Serving" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
