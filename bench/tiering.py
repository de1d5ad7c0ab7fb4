"""Tiered expert store: moves against the raw physical operation, policies against the optimum,
serving with RAM short of the experts, and memory against budgets. Side by side in one run.

    python bench/tiering.py            # the bench/serving model (hidden 1024, 8 experts, 4 layers)
    python bench/tiering.py --quick    # a small model, for a smoke run

1. cold-promote-ratio: cold->warm promotion with the page cache dropped for the cache files
   (fsync + posix_fadvise DONTNEED; mincore confirms) against O_DIRECT reads of the same bytes
   (1, 4 and 16 readers: the disk's speed is the best); cached-promote-ratio: cold->warm from the
   page cache against a memcpy (torch copy_) of the same bytes between preallocated buffers.
   Without an accelerator warm->hot hands the slot between pools and copies nothing. Best of 5.
2. hit-ratio-vs-online-bound: hits of the default policy (RankAware), RecencyFrequency, LRU and LFU against
   the better of two online bounds (a policy told the true popularity; the same plus the trace's
   temporal locality and each layer's last top-1 expert), with Belady's offline optimum as
   context, for synthetic routing traces (Zipf popularity, temporal locality: the next token
   keeps its top-1 expert with probability p, popularity drift) and a trace recorded from the
   model itself, at cache sizes of 25% and 50% of the experts. Calls are replayed as the store
   sees them (the call's experts told to the policy with the router's top-1 first, then each
   missing one brought in, never evicting one the call uses).
3. warm25-tps-ratio / warm50-tps-ratio: served decode tokens/s with each shard's RAM (hot + warm,
   one memory without an accelerator) at 25% / 50% of its experts and the rest on disk (the page
   cache dropped for the cold files and the checkpoint before each run) against all in RAM,
   worst over batch 1 and 16, with prefetch on (the default) and off (the -noprefetch figures);
   and each replica's peak resident memory against its budgets plus its own baseline
   (rss-over-budget-ratio).
Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator"), str(REPO / "bench")]

import requests  # noqa: E402
import torch  # noqa: E402

from figures import report, scratch  # noqa: E402
from serving import ensure_checkpoint, model_shape, prompts  # noqa: E402
from moe_workers.store.fileread import drop_from_page_cache  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cache-dir", default=os.environ.get("MOE_BENCH_CACHE", str(Path(tempfile.gettempdir()) / "moe-bench")))
    p.add_argument("--skip-served", action="store_true", help="only the in-process parts (1 and 2)")
    p.add_argument("--only", choices=["promotion", "policies", "served"], default=None)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "tiering.json"))
    return p.parse_args()


# -- 1. promotion against raw operations --------------------------------------------------------


def resident_fraction(files) -> float:
    """Share of these files' pages in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for f in files:
        size = os.path.getsize(f)
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            arr = np.frombuffer(m, dtype=np.uint8)
            if libc.mincore(ctypes.c_void_p(arr.ctypes.data), size, vec) != 0:
                return float("nan")
            resident += sum(v & 1 for v in vec)
            total += pages
            del arr
        finally:
            m.close()
    return resident / max(1, total)


def direct_read(files, block: int = 64 << 20, threads: int = 1) -> float:
    """Seconds to read the files with O_DIRECT (no page cache) into an aligned buffer, `threads`
    readers each taking a range of every file: the device's own sequential read speed."""
    import mmap

    def read_range(path, start, end):
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
        view = memoryview(buf)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            off = start
            while off < end:
                n = os.preadv(fd, [view[:min(block, end - off + 4095) // 4096 * 4096 or 4096]], off)
                if n <= 0:
                    break
                off += n
        finally:
            os.close(fd)
            view.release()
            buf.close()

    jobs = []
    for f in files:
        size = os.path.getsize(f)
        step = -(-size // threads) // 4096 * 4096 or 4096
        jobs += [(f, s, min(size, s + step)) for s in range(0, size, step)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda j: read_range(*j), jobs))
    return time.perf_counter() - t0


def bench_promotion(path: Path, work_dir: Path, repeats: int = 5) -> dict:
    """cold->warm through the store, (a) from the disk with the page cache dropped for the files
    (fsync + posix_fadvise DONTNEED; mincore confirms) against O_DIRECT reads of the same bytes
    (1, 4 and 16 readers: the device's speed is the best of them), and (b) from the page cache
    against a memcpy of the same bytes between preallocated buffers (torch copy_).
    Best of `repeats` rounds each."""
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.store.store import COLD, WARM, TierConfig, TieredExpertStore

    ckpt = Checkpoint(path)
    cfg = ckpt.config
    keys = [(l, e) for l in range(cfg.num_layers) for e in range(cfg.num_experts)]
    n = cfg.expert_bytes
    store = TieredExpertStore(ckpt, cfg.dtype, TierConfig(hot_budget=len(keys) * n, warm_budget=len(keys) * n,
                                                          cold_dir=str(work_dir / "cold"), prefetch=False))
    store.configure(keys)  # hot and warm each hold every expert: a promotion never needs an eviction
    files = [str(store.cold.get(k, store.entries[k].version.digest)) for k in keys]
    total = len(keys) * n
    best = {"cold_warm_disk": 1e9, "direct_1": 1e9, "direct_4": 1e9, "direct_16": 1e9, "cold_warm_cached": 1e9,
            "memcpy": 1e9}
    resident_after_drop = []

    def to_cold():
        for k in keys:
            while store.entries[k].tier != COLD:
                store.demote(k)

    def promote_all():
        t0 = time.perf_counter()
        for k in keys:
            assert store.promote(k, WARM)
        return time.perf_counter() - t0

    # the memcpy reference moves the same bytes between as many distinct buffers as the store
    # fills (one per expert), all faulted in beforehand, with torch's copy (2 threads here)
    srcs = [torch.empty(n, dtype=torch.uint8).fill_(1) for _ in keys]
    dsts = [torch.empty(n, dtype=torch.uint8).fill_(0) for _ in keys]
    for _ in range(repeats):
        to_cold()
        drop_from_page_cache(files)
        resident_after_drop.append(resident_fraction(files))
        best["cold_warm_disk"] = min(best["cold_warm_disk"], promote_all())
        for threads, block in ((1, 64 << 20), (4, 16 << 20), (16, 4 << 20)):
            drop_from_page_cache(files)
            best[f"direct_{threads}"] = min(best[f"direct_{threads}"], direct_read(files, block, threads))
        to_cold()  # the files are in the page cache now (just read)
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        best["cold_warm_cached"] = min(best["cold_warm_cached"], promote_all())
        t0 = time.perf_counter()
        for src, dst in zip(srcs, dsts):
            dst.copy_(src)
        best["memcpy"] = min(best["memcpy"], time.perf_counter() - t0)
    gbs = {k: total / v / 1e9 for k, v in best.items()}
    disk = max(gbs["direct_1"], gbs["direct_4"], gbs["direct_16"])
    return {"bytes": total, "seconds": best, "GB_per_s": gbs, "disk_GB_per_s": disk,
            "resident_after_drop": max(resident_after_drop),
            "cold_promote_ratio": gbs["cold_warm_disk"] / disk,
            "cached_promote_ratio": gbs["cold_warm_cached"] / gbs["memcpy"]}


# -- 2. policies against the optimum --------------------------------------------------------------


def synthetic_trace(num_layers: int, num_experts: int, top_k: int, tokens: int, zipf_s: float, stay: float,
                    seed: int, shift_every: int | None = None) -> tuple[list[tuple[int, int]], list[dict]]:
    """Accesses (layer, expert) of batch-1 decoding: per token, per layer, top-k experts drawn
    from a Zipf popularity (a different ranking per layer); with probability `stay` the token
    keeps the previous token's top-1 expert of that layer (temporal locality). With
    `shift_every`, the rankings are redrawn every that many tokens (popularity drift). Also
    returns the true probabilities per phase (for the oracle)."""
    rng = random.Random(seed)
    weights = [1 / (r + 1) ** zipf_s for r in range(num_experts)]
    total = sum(weights)
    prev = [None] * num_layers
    trace = []
    phases = []
    for t in range(tokens):
        if t == 0 or (shift_every and t % shift_every == 0):
            ranks = [rng.sample(range(num_experts), num_experts) for _ in range(num_layers)]
            phases.append({"start": len(trace), "stay": stay, "top_k": top_k,
                           "prob": {(l, ranks[l][r]): weights[r] / total
                                    for l in range(num_layers) for r in range(num_experts)}})
        for layer in range(num_layers):
            chosen: list[int] = []
            if prev[layer] is not None and rng.random() < stay:
                chosen.append(prev[layer])
            while len(chosen) < top_k:
                e = ranks[layer][rng.choices(range(num_experts), weights=weights)[0]]
                if e not in chosen:
                    chosen.append(e)
            prev[layer] = chosen[0]
            trace.extend((layer, e) for e in chosen)
    return trace, phases


class OraclePopularity:
    """Online bound: a policy that knows the true popularity of each phase (no future trace).
    Under demand caching of independent draws this static choice is what any online policy can
    at best approach; Belady's MIN sees the future and does better."""

    name = "oracle"

    def __init__(self, phases: list[dict]):
        self.phases, self.clock = phases, 0

    def access(self, key) -> None:
        self.clock += 1

    def visit(self, keys, top1=()) -> None:
        for key in keys:
            self.access(key)

    def forget(self, key) -> None:
        pass

    def phase(self) -> dict:
        """The phase the clock is in."""
        return [p for p in self.phases if p["start"] < self.clock][-1]

    def victim(self, candidates):
        prob = self.phase()["prob"]
        return min(candidates, key=lambda k: (prob.get(k, 0.0), k))


class OracleLocality(OraclePopularity):
    """A stronger online bound: it also knows the trace's temporal locality (`stay`) and which
    expert was each layer's top-1 at its last visit. It evicts the cached expert least likely
    to be chosen at its layer's next visit: stay + (1 - stay) * q for the last top-1, q for the
    others, q being the chance of a fresh top-k draw picking it (about k * popularity)."""

    name = "oracle+locality"

    def __init__(self, phases: list[dict]):
        super().__init__(phases)
        self.last_top1: dict[int, int] = {}
        self.position: dict[int, int] = {}  # accesses of the layer's current visit so far

    def access(self, key) -> None:
        super().access(key)
        layer, expert = key
        phase = self.phase()
        pos = self.position.get(layer, 0)
        if pos == 0:  # a visit's first access is its top-1
            self.last_top1[layer] = expert
        self.position[layer] = (pos + 1) % phase["top_k"]

    def victim(self, candidates):
        phase = self.phase()

        def chance(k):
            q = min(1.0, phase["top_k"] * phase["prob"].get(k, 0.0))
            return phase["stay"] + (1 - phase["stay"]) * q if self.last_top1.get(k[0]) == k[1] else q

        return min(candidates, key=lambda k: (chance(k), k))


def recorded_trace(path: Path, tokens: int) -> list[tuple[int, int]]:
    """The routing of the model itself while it generates (batch 1, greedy)."""
    from moe_workers.model.inprocess import InProcessModel

    model = InProcessModel(path, max_len=tokens + 16, max_sequences=1)
    trace: list[tuple[int, int]] = []
    route = model.dense.route

    def recording(layer, h):
        x, indices, weights = route(layer, h)
        for row in indices[-1:].tolist():  # the newest token (prefill: its last position)
            trace.extend((layer, e) for e in row)
        return x, indices, weights

    model.dense.route = recording
    model.generate([[5, 17, 99, 3]], max_tokens=tokens)
    return trace


def stay_rate(trace, num_layers, top_k) -> float:
    """How often consecutive tokens keep their top-1 expert, averaged over layers."""
    per_token = top_k * num_layers
    firsts = [trace[i:i + per_token:top_k] for i in range(0, len(trace) - per_token + 1, per_token)]
    same = sum(a[l] == b[l] for a, b in zip(firsts, firsts[1:]) for l in range(num_layers))
    return same / max(1, (len(firsts) - 1) * num_layers)


def bench_policies(traces: dict[str, tuple[list, list | None]], num_experts_total: int, top_k: int) -> dict:
    from moe_workers.store.policy import (DEFAULT_POLICY, LFU, LRU, RankAware, RecencyFrequency, belady_hits,
                                          policy_hits_visits, visits_of)

    out = {}
    for name, (trace, phases) in traces.items():
        visits = visits_of(trace, top_k)
        for frac in (0.25, 0.5):
            cap = max(1, int(num_experts_total * frac))
            opt = belady_hits(trace, cap)
            row = {"capacity": cap, "accesses": len(trace), "belady": opt / len(trace)}
            for label, policy in (("RankAware", RankAware()), ("RecencyFrequency", RecencyFrequency()), ("LRU", LRU()),
                                  ("LFU", LFU())):
                row[label] = policy_hits_visits(visits, cap, policy) / len(trace)
            row["oracle"] = policy_hits_visits(visits, cap, OraclePopularity(phases)) / len(trace) if phases else None
            row["oracle_locality"] = (policy_hits_visits(visits, cap, OracleLocality(phases)) / len(trace)
                                      if phases else None)
            default = row[DEFAULT_POLICY]
            row["default_vs_optimal"] = default / row["belady"] if opt else 1.0
            row["default_vs_oracle"] = default / row["oracle"] if row["oracle"] else None
            # the best online bound: the better of the two oracles (popularity; + locality)
            bound = max(row["oracle"], row["oracle_locality"]) if phases else None
            row["online_bound"] = bound
            row["default_vs_bound"] = default / bound if bound else None
            row["recency_frequency_vs_bound"] = row["RecencyFrequency"] / bound if bound else None
            row["lru_vs_optimal"] = row["LRU"] / row["belady"] if opt else 1.0
            out[f"{name}@{int(frac * 100)}%"] = row
    return out


# -- 3. served when the experts do not fit in RAM ----------------------------------------------------


def cache_files(*dirs: Path) -> list[str]:
    """The safetensors files under these directories (the cold cache and the checkpoint)."""
    return sorted(str(f) for d in dirs for f in Path(d).rglob("*.safetensors"))


def store_delta(after: list[dict], before: list[dict]) -> dict:
    """What the shards' stores did between two status reads: expert uses, those found in RAM
    (hot or warm) and those read from the cold tier, and prefetches."""
    out = {"uses": 0, "in_ram": 0, "cold": 0, "cold_reads_cache": 0, "cold_reads_disk": 0,
           "prefetch_issued": 0, "prefetch_used": 0}
    for a, b in zip(after, before):
        out["uses"] += a["hits"]["hot"] + a["misses"]["hot"] - b["hits"]["hot"] - b["misses"]["hot"]
        out["in_ram"] += a["hits"]["hot"] + a["hits"]["warm"] - b["hits"]["hot"] - b["hits"]["warm"]
        out["cold"] += a["misses"]["warm"] - b["misses"]["warm"]
        for where in ("cache", "disk"):  # every read of a cold file (prefetches too)
            out[f"cold_reads_{where}"] += a["cold_reads"][where] - b["cold_reads"][where]
        for k in ("prefetch_issued", "prefetch_used"):
            out[k] += a[k] - b[k]
    accuracy = [a["hint_accuracy"] for a in after if a.get("hint_accuracy") is not None]
    out["hint_accuracy"] = round(sum(accuracy) / len(accuracy), 2) if accuracy else None
    return out


def bench_served(path: Path, shape: dict, work_dir: Path, batches: tuple[int, ...], tokens: int) -> dict:
    """Decode tokens/s with each shard's RAM (hot + warm: one memory without an accelerator) at
    100%, 50% and 25% of its experts, the rest in the cold tier on disk, the page cache dropped for
    the cold files and the checkpoint before each run; prefetch on (router hints one sparse layer
    ahead, the store's prefetch thread) and off; at each batch size."""
    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.standalone.local_ray import LocalRayHead
    from moe_workers.model.config import MoEConfig
    from moe_workers.serve.config import AppArgs, serve_application

    groups = 2
    layers, experts = shape["num_layers"], shape["num_experts"]
    one = MoEConfig.from_dir(path).expert_bytes
    per_shard = layers * experts // groups
    per_layer = experts // groups  # the hot tier holds at least one layer's experts (one call's)
    placement = {f"ExpertShard-{g}": [f"{l}.{e}" for l in range(layers) for e in range(experts) if e % groups == g]
                 for g in range(groups)}
    cold_dir = work_dir / "served-cold"
    head = LocalRayHead(work_dir=scratch("moe-bench-ray-"), num_cpus=8).start()
    out = {}
    try:
        head.connect_driver(namespace="bench")
        from ray import serve

        client = RayServeClient(head.dashboard_url, head.token)
        url = f"http://127.0.0.1:{head.serve_http_port}"
        for batch in batches:
            args = AppArgs(model_path=str(path), served_model_name="bench", num_groups=groups, max_batch_size=batch,
                           kv_cache_budget_bytes=2**30, max_queued_requests=256, max_model_len=256,
                           ingress_num_cpus=1, shard_num_cpus=1, ingress_torch_threads=2)
            # all in RAM first and last: the reference is their mean (this machine drifts within a run)
            for frac, prefetch, rep in ((1.0, True, 0), (0.5, True, 0), (0.5, False, 0), (0.25, True, 0),
                                        (0.25, False, 0), (1.0, True, 1)):
                ram = max(int(per_shard * frac), per_layer)
                hot = per_layer * one
                tiers = {"hot_budget": hot, "warm_budget": ram * one - hot, "cold_dir": str(cold_dir),
                         "prefetch": prefetch}
                client.put({"http_options": {"host": "127.0.0.1", "port": head.serve_http_port},
                            "applications": [serve_application("bench", "/", args, placement, tiers=tiers,
                                                               prefetch_lookahead=1 if prefetch else 0)]})
                client.wait_running(["bench"], timeout_s=900)
                shards = [serve.get_deployment_handle(f"ExpertShard-{g}", app_name="bench") for g in range(groups)]
                # budgets apply in place: wait until every shard holds them
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    st = [s.status.remote().result() for s in shards]
                    if all(x["budgets"]["warm"] == ram * one - hot for x in st):
                        break
                    time.sleep(1)
                ps = prompts(batch, 8, shape["vocab_size"], 2)

                def run(n):
                    t0 = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                        list(pool.map(lambda p: requests.post(url + "/v1/completions", json={
                            "prompt": p, "max_tokens": n, "temperature": 0}, timeout=3600).raise_for_status(), ps))
                    return time.perf_counter() - t0

                run(2)  # warm-up: the app's first requests
                files = cache_files(cold_dir, path)
                drop_from_page_cache(files)
                resident_before = resident_fraction(files)
                before = [s.status.remote().result()["store"] for s in shards]
                one_tok, full = run(1), run(tokens)
                st = [s.status.remote().result() for s in shards]
                moved = store_delta([x["store"] for x in st], before)
                if not prefetch:
                    moved.pop("hint_accuracy")  # the figure of the last run with hints
                label = f"b{batch}-ram{int(frac * 100)}" + (f"-{rep}" if frac == 1.0 else "-prefetch" if prefetch
                                                             else "-noprefetch")
                out[label] = {
                    "batch": batch, "ram_fraction": frac, "prefetch": prefetch, "hot_budget": hot,
                    "warm_budget": ram * one - hot, "decode_tps": batch * (tokens - 1) / (full - one_tok),
                    "resident_before": resident_before, "resident_after": resident_fraction(files),
                    "store_delta": moved,
                    "replicas": [{"group": x["group"], "peak_rss_bytes": x["peak_rss_bytes"],
                                  "baseline_rss_bytes": x["baseline_rss_bytes"], "store": x["store"],
                                  "tiers": x["tiers"]} for x in st],
                }
                row = out[label]
                print(f"  batch {batch:2}  RAM {int(frac * 100):3}%  prefetch {'on ' if prefetch else 'off'}: "
                      f"{row['decode_tps']:7.2f} tok/s  (page cache of the cold files: {resident_before:.0%} before, "
                      f"{row['resident_after']:.0%} after; {moved})", flush=True)
        client.delete_all()
    except BaseException:
        import traceback

        traceback.print_exc()  # now: the driver dies with the head (lost GCS) before Python would print it
        raise
    finally:
        import ray as ray_module

        ray_module.shutdown()
        head.stop()
    return out


def main() -> int:
    a = parse_args()
    shape = model_shape(a.quick)
    path = ensure_checkpoint(a.cache_dir, shape)
    work = scratch("moe-bench-tiering-")
    print(f"model {shape}", flush=True)
    results: dict = {"shape": shape}

    figures: dict = {}
    if a.only in (None, "promotion"):
        print("\n1. cold -> warm promotion against the disk and against memcpy", flush=True)
        pr = results["promotion"] = bench_promotion(path, work)
        g = pr["GB_per_s"]
        print(f"  page cache dropped (resident after the drop: {pr['resident_after_drop']:.1%}):")
        print(f"    cold->warm {g['cold_warm_disk']:.2f} GB/s vs O_DIRECT read of the same bytes "
              f"{g['direct_1']:.2f} / {g['direct_4']:.2f} / {g['direct_16']:.2f} GB/s (1 / 4 / 16 readers): "
              f"{pr['cold_promote_ratio']:.2f}")
        print("  from the page cache:")
        print(f"    cold->warm {g['cold_warm_cached']:.2f} GB/s vs memcpy of the same bytes {g['memcpy']:.2f} GB/s: "
              f"{pr['cached_promote_ratio']:.2f}")
        print("  (warm -> hot: the same host memory without an accelerator, so no copy is made; with CUDA it is a "
              "DMA from pinned memory, not measurable here)")
        figures["cold-promote-ratio"] = pr["cold_promote_ratio"]
        figures["cached-promote-ratio"] = pr["cached_promote_ratio"]
        figures["disk-GB-per-s"] = pr["disk_GB_per_s"]
    if a.only in ("promotion", "served"):
        return _finish(a, results, figures) if a.only == "promotion" else _served(a, path, shape, work, results, figures)

    print("\n2. hit rate against the offline optimum (Belady)", flush=True)
    L, E, K = 32, 8, 2  # Mixtral-8x7B's routing shape for the synthetic traces
    traces = {
        "zipf1.0-stay0.25": synthetic_trace(L, E, K, 1500, 1.0, 0.25, 1),
        "zipf1.2-stay0.25": synthetic_trace(L, E, K, 1500, 1.2, 0.25, 2),
        "zipf0.8-stay0.125": synthetic_trace(L, E, K, 1500, 0.8, 0.125, 3),
        "zipf1.0-stay0.5": synthetic_trace(L, E, K, 1500, 1.0, 0.5, 4),
        "zipf1.0-stay0.25-drift": synthetic_trace(L, E, K, 1500, 1.0, 0.25, 5, shift_every=300),
    }
    recorded = recorded_trace(path, 400 if not a.quick else 100)
    results["recorded_stay_rate"] = stay_rate(recorded, shape["num_layers"], shape["top_k"])
    pol = results["policies"] = bench_policies(traces, L * E, K)
    pol.update(bench_policies({"recorded": (recorded, None)}, shape["num_layers"] * shape["num_experts"],
                              shape["top_k"]))
    print(f"  {'trace @ cache size':30} {'Belady':>7} {'oracle':>7} {'+locality':>9} {'default':>8} {'LRU':>6} "
          f"{'LFU':>6} {'RecFreq':>8} {'default/Belady':>15} {'default/oracle':>15} {'best online/Belady':>19}")
    for name, row in pol.items():
        oracle = f"{row['oracle']:7.3f}" if row["oracle"] is not None else f"{'-':>7}"
        locality = f"{row['oracle_locality']:9.3f}" if row["oracle_locality"] is not None else f"{'-':>9}"
        best = (f"{max(row['oracle'], row['oracle_locality']) / row['belady']:19.2f}"
                if row["oracle"] is not None else f"{'-':>19}")
        vs_oracle = f"{row['default_vs_oracle']:15.2f}" if row["default_vs_oracle"] is not None else f"{'-':>15}"
        print(f"  {name:30} {row['belady']:7.3f} {oracle} {locality} {row['RankAware']:8.3f} {row['LRU']:6.3f} "
              f"{row['LFU']:6.3f} {row['RecencyFrequency']:8.3f} {row['default_vs_optimal']:15.2f} {vs_oracle} {best}")
    print(f"  (recorded trace: consecutive tokens keep their top-1 expert {results['recorded_stay_rate']:.0%} of the time)")

    figures.update({
        "hit-ratio-vs-optimal": min(r["default_vs_optimal"] for r in pol.values()),
        "hit-ratio-vs-online-bound": min(r["default_vs_bound"] for r in pol.values() if r["default_vs_bound"]),
        "default-minus-lru-worst": min(r["RankAware"] - r["LRU"] for r in pol.values()),
        # the policy that was the default before RankAware: RankAware is the default only while never below it
        "recency-frequency-vs-online-bound": min(r["recency_frequency_vs_bound"] for r in pol.values()
                                                 if r["recency_frequency_vs_bound"]),
        "default-minus-recency-frequency-worst": min(r["RankAware"] - r["RecencyFrequency"] for r in pol.values()),
    })
    if a.only is None and not a.skip_served:
        return _served(a, path, shape, work, results, figures)
    return _finish(a, results, figures)


def _served(a, path, shape, work, results: dict, figures: dict) -> int:
    print("\n3. served decode when the experts do not fit in RAM (2 shard groups; the rest of each shard's "
          "experts on disk, the page cache dropped before each run)", flush=True)
    batches = (1, 4) if a.quick else (1, 16)
    sv = results["served"] = bench_served(path, shape, work, batches=batches, tokens=8 if a.quick else 48)
    base = {b: (sv[f"b{b}-ram100-0"]["decode_tps"] + sv[f"b{b}-ram100-1"]["decode_tps"]) / 2 for b in batches}
    results["served_all_in_ram_tps"] = base
    for frac in (25, 50):
        for on in (True, False):
            ratios = [sv[f"b{b}-ram{frac}-{'prefetch' if on else 'noprefetch'}"]["decode_tps"] / base[b]
                      for b in batches]
            suffix = "" if on else "-noprefetch"
            figures[f"warm{frac}-tps-ratio{suffix}"] = min(ratios)
            for b, r in zip(batches, ratios):
                results.setdefault("served_ratios", {})[f"warm{frac}{suffix}-b{b}"] = r
    files = cache_files(work / "served-cold")  # the disk the cold tier read from, with 4 O_DIRECT readers
    drop_from_page_cache(files)
    figures["served-disk-GB-per-s"] = sum(os.path.getsize(f) for f in files) / direct_read(files, 16 << 20, 4) / 1e9
    # the same replicas run every budget (applied in place), so a replica's lifetime peak RSS is
    # held against the largest budgets it had (all in RAM) plus its own baseline
    budget = max(row["hot_budget"] + row["warm_budget"] for row in sv.values())
    ratios = [r["peak_rss_bytes"] / (budget + r["baseline_rss_bytes"]) for row in sv.values() for r in row["replicas"]]
    figures["rss-over-budget-ratio"] = max(ratios)
    print("  decode tokens/s against all in RAM: " + ", ".join(
        f"{k} {v:.2f}" for k, v in results["served_ratios"].items()))
    print(f"  peak RSS / (hot + warm + baseline), worst replica: {max(ratios):.2f}")
    return _finish(a, results, figures)


def _finish(a, results: dict, figures: dict) -> int:
    return report(a.out, results, figures, digits=2)


if __name__ == "__main__":
    sys.exit(main())
