"""Quantized experts in the tiers (fp8 blocks, mxfp4) against the same random model in bf16, side
by side in one run.

    python bench/quantized.py                  # all parts
    python bench/quantized.py --only store     # 1 and 2 (in process)
    python bench/quantized.py --quick          # small shapes, for a smoke run

1. experts-per-warm-gib-ratio-<family>: warm slots per GiB from the store's own accounting
   (`TierForms`, what its budgets count), quantized over bf16, at published expert shapes:
   DeepSeek-V3 (hidden 7168, expert 2048, fp8 blocks of 128, F32 scales), Qwen3-30B-A3B (2048 x 768,
   fp8, BF16 scales), gpt-oss-20b (2880 x 2880, mxfp4). One layer of 8 experts each: an expert's
   bytes do not depend on how many there are.
2. quantized-promote-ratio-<family>: cold -> hot promotion of every expert through the store with
   the page cache dropped for the cold files (the disk read and the decode into the hot slot),
   quantized over the same experts in bf16, best of --rounds; beside it, decode-GBps-<family>: the
   decode alone (GB/s of bf16 written) against a memcpy of the bf16 bytes, and the disk's own
   O_DIRECT read speed.
3. served-quantized-at-fixed-ram-b<batch>: served decode tokens/s (Ingress + 2 shard groups) with
   each shard's RAM fixed at 25% of its experts' bf16 bytes (hot: one layer's share, the rest
   warm), the mxfp4 checkpoint over the bf16 one of the same random gpt_oss model. Each shard
   replica is moved into a memory cgroup of its own once its tiers are filled: what it charges
   from then on (the page cache of the cold files it reads, new allocations) is capped at
   --page-cache-cap (128 MiB, against 1.2 GB of a shard's experts in bf16 outside its budgets),
   so the page cache cannot hold the experts that do not fit the budgets (reported when the
   cgroup cannot be made).
Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workers"), str(REPO / "operator"), str(REPO / "bench")]

import requests  # noqa: E402
import torch  # noqa: E402

from figures import report, scratch  # noqa: E402
from serving import prompts  # noqa: E402
from tiering import direct_read  # noqa: E402
from moe_workers.store.fileread import drop_from_page_cache  # noqa: E402

# (family, method, scale dtype, dimensions): the published expert shapes, one layer of 8 experts
SHAPES = {
    "deepseek_v3": ("fp8", torch.float32, dict(hidden_size=7168, intermediate_size=2048, num_heads=8, num_kv_heads=8,
                                               top_k=8)),
    "qwen3_moe": ("fp8", torch.bfloat16, dict(hidden_size=2048, intermediate_size=768, num_heads=16, num_kv_heads=4,
                                              top_k=8)),
    "gpt_oss": ("mxfp4", None, dict(hidden_size=2880, intermediate_size=2880, num_heads=45, num_kv_heads=9, top_k=4)),
}
QUICK = {"deepseek_v3": dict(hidden_size=512, intermediate_size=256, num_heads=4, num_kv_heads=4, top_k=2),
         "qwen3_moe": dict(hidden_size=256, intermediate_size=128, num_heads=4, num_kv_heads=2, top_k=2),
         "gpt_oss": dict(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, top_k=2)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["store", "served"], default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="served: tokens generated per request")
    p.add_argument("--page-cache-cap", type=int, default=128 << 20,
                   help="served: bytes each shard replica may charge once its tiers are filled")
    p.add_argument("--cache-dir", default=os.environ.get("MOE_BENCH_CACHE", str(Path(tempfile.gettempdir()) / "moe-bench")))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "quantized.json"))
    return p.parse_args()


def checkpoint_pair(cache: Path, family: str, method: str, scale_dtype, dims: dict, num_layers: int = 1,
                    num_experts: int = 8) -> tuple[Path, Path]:
    """The same random model (same seed, same draws) in bf16 and in `method`'s published layout."""
    from moe_workers.model.random_init import write_random_checkpoint

    shape = dict(vocab_size=512, num_layers=num_layers, num_experts=num_experts, max_position_embeddings=512, **dims)
    name = f"{family}-" + "-".join(f"{k[:3]}{v}" for k, v in shape.items())
    out = []
    for form in ("bf16", method):
        path = cache / f"{name}-{form}"
        if not (path / "config.json").exists():
            print(f"writing {path} ...", flush=True)
            write_random_checkpoint(path, family, dtype=torch.bfloat16, router_scale=10.0,
                                    quantize=None if form == "bf16" else form, block=(128, 128),
                                    scale_dtype=scale_dtype or torch.float32, **shape)
        out.append(path)
    return out[0], out[1]


# -- 1 and 2: in process ----------------------------------------------------------------------------


def bench_store(bf16: Path, quant: Path, work: Path, rounds: int) -> dict:
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.dequant import decode_into
    from moe_workers.store.store import COLD, HOT, WARM, TierConfig, TieredExpertStore

    out: dict = {}
    stores = {}
    for form, path in (("bf16", bf16), ("quantized", quant)):
        ckpt = Checkpoint(path)
        cfg = ckpt.config
        keys = [(layer, e) for layer in cfg.sparse_layers for e in range(cfg.num_experts)]
        probe = TieredExpertStore(ckpt, torch.bfloat16)
        compute = probe.forms.nbytes(HOT)
        s = TieredExpertStore(ckpt, torch.bfloat16, TierConfig(hot_budget=len(keys) * compute, warm_budget=2**30,
                                                               cold_dir=str(work / f"cold-{form}"), prefetch=False))
        s.configure(keys)
        out[form] = {"warm_expert_bytes": s.forms.nbytes(WARM), "hot_expert_bytes": compute,
                     "warm_slots_per_gib": s.pools[WARM].capacity, "cold_file_bytes": s.residency()[COLD]["bytes"]}
        stores[form] = (s, keys)
    out["experts_per_warm_gib_ratio"] = out["quantized"]["warm_slots_per_gib"] / out["bf16"]["warm_slots_per_gib"]

    def promote_all(s, keys, files) -> float:
        while any(s.entries[k].tier != COLD for k in keys):  # (a quantized hot victim is refilled into warm)
            for k in keys:
                s.demote(k)
            s.drain_prefetch()
        drop_from_page_cache(files)
        t0 = time.perf_counter()
        for k in keys:
            assert s.promote(k, HOT)
        return time.perf_counter() - t0

    files = {form: [str(s.cold.get(k, s.entries[k].version.digest)) for k in keys] for form, (s, keys) in stores.items()}
    best = {form: float("inf") for form in stores}
    for _ in range(rounds):  # alternating: both sides see the same machine
        for form, (s, keys) in stores.items():
            best[form] = min(best[form], promote_all(s, keys, files[form]))
    disk = 0.0
    for threads, block in ((1, 64 << 20), (4, 16 << 20)):
        drop_from_page_cache(files["bf16"])
        seconds = direct_read(files["bf16"], block, threads)
        disk = max(disk, sum(os.path.getsize(f) for f in files["bf16"]) / seconds / 1e9)
    out["promote_s"] = best
    out["quantized_promote_ratio"] = best["quantized"] / best["bf16"]
    out["disk_GB_per_s"] = disk

    # the decode alone, from a warm (stored form) copy into a hot slot, against a memcpy of the bf16 bytes
    s, keys = stores["quantized"]
    stored = s.ckpt.expert_stored(*keys[0])
    stored = {k: v.clone() for k, v in stored.items()}
    buf = torch.empty(s.forms.nbytes(HOT), dtype=torch.uint8)
    views = s._layout(buf, HOT)
    src, dst = torch.empty_like(buf).fill_(1), torch.empty_like(buf)
    decode_s = copy_s = float("inf")
    for _ in range(max(3, rounds)):
        t0 = time.perf_counter()
        decode_into(s.model.quant, stored, views)
        decode_s = min(decode_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_s = min(copy_s, time.perf_counter() - t0)
    out["decode_GB_per_s"] = buf.numel() / decode_s / 1e9
    out["memcpy_GB_per_s"] = buf.numel() / copy_s / 1e9
    for s, _ in stores.values():
        s.close()
    return out


# -- 3: served at a fixed RAM budget -----------------------------------------------------------------


class MemoryCap:
    """A memory cgroup (v1 or v2) per process, capping what the process charges from the moment it
    moves there: its new allocations and the page cache it fills (the memory it already holds
    stays charged where it was: these kernels refuse to move charges), so cold files beyond the
    cap are read from the disk again."""

    def __init__(self, name: str):
        self.name, self.dirs, self.problem = name, [], None
        own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.split(":")[1] == "memory"), None)
        v1 = Path("/sys/fs/cgroup/memory")
        if own is not None and v1.is_dir():
            self.root, self.limit_file, self.usage_file = v1 / own.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        elif (Path("/sys/fs/cgroup") / "cgroup.controllers").is_file():
            own2 = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                        if line.startswith("0::"))
            self.root, self.limit_file, self.usage_file = Path("/sys/fs/cgroup") / own2.lstrip("/"), "memory.max", "memory.current"
        else:
            self.root, self.problem = None, "no memory cgroup to make"

    def cap(self, pid: int, limit: int) -> int | None:
        """Move `pid` into a cgroup of its own that may charge `limit` bytes; the limit."""
        if self.root is None:
            return None
        try:
            d = self.root / f"{self.name}-{pid}"
            d.mkdir(exist_ok=True)
            self.dirs.append(d)
            (d / self.limit_file).write_text(str(limit))
            (d / "cgroup.procs").write_text(str(pid))
            return limit
        except OSError as err:
            self.problem = f"cannot cap memory: {err}"
            return None

    def close(self) -> None:
        for d in self.dirs:  # its processes have exited (the Ray head stopped): the cgroup can go
            try:
                d.rmdir()
            except OSError:
                pass


def bench_served(paths: dict[str, Path], work: Path, batches: tuple[int, ...], tokens: int, page_cache_cap: int,
                 groups: int = 2) -> dict:
    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.standalone.local_ray import LocalRayHead
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.serve.config import AppArgs, serve_application
    from moe_workers.store.store import HOT, TieredExpertStore

    bf16 = TieredExpertStore(Checkpoint(paths["bf16"]), torch.bfloat16).forms
    cfg = Checkpoint(paths["bf16"]).config
    layers, experts = cfg.sparse_layers, cfg.num_experts
    per_shard, per_layer = len(layers) * experts // groups, experts // groups
    ram = per_shard * bf16.nbytes(HOT) // 4  # 25% of a shard's experts in bf16, for both checkpoints
    placement = {f"ExpertShard-{g}": [f"{l}.{e}" for l in layers for e in range(experts) if e % groups == g]
                 for g in range(groups)}
    head = LocalRayHead(work_dir=scratch("moe-bench-ray-"), num_cpus=8).start()
    cap = MemoryCap("moe-bench-shard")
    out: dict = {"ram_per_shard_bytes": ram, "experts_per_shard": per_shard, "cap": None}
    try:
        head.connect_driver(namespace="bench")
        from ray import serve

        client = RayServeClient(head.dashboard_url, head.token)
        url = f"http://127.0.0.1:{head.serve_http_port}"
        for batch in batches:
            for form in ("bf16", "quantized", "bf16-again"):
                path = paths[form.split("-")[0]]
                forms = TieredExpertStore(Checkpoint(path), torch.bfloat16).forms
                hot = per_layer * forms.nbytes(HOT)
                tiers = {"hot_budget": hot, "warm_budget": ram - hot, "cold_dir": str(work / f"served-cold-{form}"),
                         "prefetch": True}
                args = AppArgs(model_path=str(path), served_model_name="bench", num_groups=groups,
                               max_batch_size=batch, kv_cache_budget_bytes=2**30, max_model_len=512,
                               ingress_num_cpus=1, shard_num_cpus=1, ingress_torch_threads=2)
                client.put({"http_options": {"host": "127.0.0.1", "port": head.serve_http_port},
                            "applications": [serve_application("bench", "/", args, placement, tiers=tiers,
                                                               prefetch_lookahead=1)]})
                client.wait_running(["bench"], timeout_s=900)
                shards = [serve.get_deployment_handle(f"ExpertShard-{g}", app_name="bench") for g in range(groups)]
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    st = [s.status.remote().result() for s in shards]
                    if all(x["budgets"]["warm"] == ram - hot for x in st):
                        break
                    time.sleep(1)
                ps = prompts(batch, 8, cfg.vocab_size, 2)

                def run(n):
                    t0 = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                        list(pool.map(lambda p: requests.post(url + "/v1/completions", json={
                            "prompt": p, "max_tokens": n, "temperature": 0}, timeout=3600).raise_for_status(), ps))
                    return time.perf_counter() - t0

                run(2)  # warm-up
                caps = [cap.cap(x["pid"], page_cache_cap) for x in st]
                out["cap"] = cap.problem or f"each shard replica may charge {page_cache_cap >> 20} MiB more"
                drop_from_page_cache(sorted(str(f) for f in (work / f"served-cold-{form}").rglob("*.safetensors")))
                before = [s.status.remote().result()["store"] for s in shards]
                one_tok, full = run(1), run(tokens)
                st = [s.status.remote().result() for s in shards]
                reads = sum(a["store"]["cold_reads"]["disk"] + a["store"]["cold_reads"]["cache"] -
                            b["cold_reads"]["disk"] - b["cold_reads"]["cache"] for a, b in zip(st, before))
                misses = sum(a["store"]["misses"]["warm"] - b["misses"]["warm"] for a, b in zip(st, before))
                tps = batch * (tokens - 1) / (full - one_tok)
                out[f"b{batch}-{form}"] = {"decode_tps": tps, "hot_budget": hot, "warm_budget": ram - hot,
                                           "warm_expert_bytes": forms.nbytes("warm"), "cold_reads": reads,
                                           "cold_misses": misses, "caps": caps,
                                           "tiers": [x["tiers"] for x in st]}
                in_ram = [x["tiers"]["hot"]["experts"] + x["tiers"]["warm"]["experts"] for x in st]
                print(f"  batch {batch:2} {form:10}: {tps:7.2f} tok/s, experts in RAM per shard {in_ram} of {per_shard}, "
                      f"cold reads {reads}", flush=True)
            a, b = out[f"b{batch}-bf16"]["decode_tps"], out[f"b{batch}-bf16-again"]["decode_tps"]
            out[f"b{batch}-ratio"] = out[f"b{batch}-quantized"]["decode_tps"] / ((a + b) / 2)
        client.delete_all()
    finally:
        import ray as ray_module

        ray_module.shutdown()
        head.stop()
        cap.close()
    return out


def main() -> int:
    a = parse_args()
    cache = Path(a.cache_dir)
    work = scratch("moe-bench-quantized-")
    results: dict = {"torch_threads": torch.get_num_threads()}
    figures: dict = {}
    if a.only in (None, "store"):
        print(f"1-2. the store at published expert shapes (torch threads {torch.get_num_threads()})", flush=True)
        print(f"  {'family':12} {'form':6} {'warm expert':>12} {'per GiB':>8} {'ratio':>6} {'promote bf16':>13} "
              f"{'quantized':>10} {'ratio':>6} {'decode GB/s':>12} {'memcpy':>7} {'disk':>6}")
        for family, (method, scale_dtype, dims) in SHAPES.items():
            bf16, quant = checkpoint_pair(cache, family, method, scale_dtype, QUICK[family] if a.quick else dims)
            r = results[family] = bench_store(bf16, quant, work / family, a.rounds)
            print(f"  {family:12} {method:6} {r['quantized']['warm_expert_bytes'] / 2**20:10.1f}Mi "
                  f"{r['quantized']['warm_slots_per_gib']:8} {r['experts_per_warm_gib_ratio']:6.2f} "
                  f"{r['promote_s']['bf16'] * 1e3:11.0f}ms {r['promote_s']['quantized'] * 1e3:8.0f}ms "
                  f"{r['quantized_promote_ratio']:6.2f} {r['decode_GB_per_s']:12.2f} {r['memcpy_GB_per_s']:7.1f} "
                  f"{r['disk_GB_per_s']:6.2f}", flush=True)
            figures[f"experts-per-warm-gib-ratio-{family}"] = r["experts_per_warm_gib_ratio"]
            figures[f"quantized-promote-ratio-{family}"] = r["quantized_promote_ratio"]
            figures[f"decode-GBps-{family}"] = r["decode_GB_per_s"]
    if a.only in (None, "served"):
        print("\n3. served decode with each shard's RAM at 25% of its bf16 experts: mxfp4 against bf16 (gpt_oss)",
              flush=True)
        dims = QUICK["gpt_oss"] if a.quick else dict(hidden_size=2048, intermediate_size=2048, num_heads=32,
                                                      num_kv_heads=8, top_k=4)
        bf16, quant = checkpoint_pair(cache, "gpt_oss", "mxfp4", None, dims, num_layers=4 if a.quick else 8,
                                      num_experts=8 if a.quick else 16)
        sv = results["served"] = bench_served({"bf16": bf16, "quantized": quant}, work, (1, 4) if a.quick else (1, 16),
                                              8 if a.quick else a.tokens, a.page_cache_cap)
        print(f"  page cache: {sv['cap']}")
        for batch in (1, 4) if a.quick else (1, 16):
            figures[f"served-quantized-at-fixed-ram-b{batch}"] = sv[f"b{batch}-ratio"]
    return report(a.out, results, figures)


if __name__ == "__main__":
    sys.exit(main())
