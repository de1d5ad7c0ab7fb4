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
   decode alone (GB/s of bf16 written, by the C decoder where it builds) against the torch decoder
   (decode-native-over-torch-<family>), a memcpy of the bf16 bytes, and the disk's own O_DIRECT
   read speed.
3. served-quantized-at-fixed-ram-b<batch>: served decode tokens/s (Ingress + 2 shard groups) with
   each shard's RAM fixed at 25% of its experts' bf16 bytes (hot: one layer's share, the rest
   warm), the mxfp4 checkpoint over the bf16 one of the same random gpt_oss model. Each shard
   replica is moved into a memory cgroup of its own once its tiers are filled: what it charges
   from then on (the page cache of the cold files it reads, new allocations) is capped at
   --page-cache-cap (128 MiB, against 1.2 GB of a shard's experts in bf16 outside its budgets),
   so the page cache cannot hold the experts that do not fit the budgets (reported when the
   cgroup cannot be made).
4. layer-tps-b<batch>-<shape>, layer-vs-bound-b<batch>-<shape>, layer-disk-MB-per-token-...: one
   MoE layer at a published shape with every expert (DeepSeek-V3: 7168, 256 x 2048, top-8, fp8,
   11.3 GB; gpt-oss-20b: 2880, 32 x 2880, top-4, mxfp4), served (Ingress + 2 shard groups) with
   each shard's warm tier at 25% of its experts in their stored form and a hot tier of one
   token's experts: decode tokens/s, bytes read from disk a token, and tokens/s over the bound
   that the disk (O_DIRECT, measured) and memory (measured) bandwidth give for those bytes plus
   the weights and KV a step reads.
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
from moe_workers.model import native  # noqa: E402
from moe_workers.store.fileread import drop_from_page_cache  # noqa: E402

# (family, method, scale dtype, dimensions): the published expert shapes, one layer of 8 experts
SHAPES = {
    "deepseek_v3": ("fp8", torch.float32, dict(hidden_size=7168, intermediate_size=2048, num_heads=8, num_kv_heads=8,
                                               top_k=8)),
    "qwen3_moe": ("fp8", torch.bfloat16, dict(hidden_size=2048, intermediate_size=768, num_heads=16, num_kv_heads=4,
                                              top_k=8)),
    "gpt_oss": ("mxfp4", None, dict(hidden_size=2880, intermediate_size=2880, num_heads=45, num_kv_heads=9, top_k=4)),
}
LAYERS = (("deepseek-v3", "fp8"), ("gpt-oss-20b", "mxfp4"))  # part 4: published shape, its release's format
QUICK = {"deepseek_v3": dict(hidden_size=512, intermediate_size=256, num_heads=4, num_kv_heads=4, top_k=2),
         "qwen3_moe": dict(hidden_size=256, intermediate_size=128, num_heads=4, num_kv_heads=2, top_k=2),
         "gpt_oss": dict(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, top_k=2)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["store", "served", "layer"], default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="served: tokens generated per request")
    p.add_argument("--layer-tokens", type=int, default=16, help="layer: tokens generated per request")
    p.add_argument("--layer", action="append", choices=[s for s, _ in LAYERS], help="layer: only these shapes")
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
    out["decoder"] = native.describe()
    # the torch decoder (what runs without a C compiler) on the same expert, same bits
    os.environ[native.ENV_SWITCH] = "0"
    native.reset()
    torch_s = float("inf")
    for _ in range(max(3, rounds)):
        t0 = time.perf_counter()
        decode_into(s.model.quant, stored, views)
        torch_s = min(torch_s, time.perf_counter() - t0)
    os.environ.pop(native.ENV_SWITCH)
    native.reset()
    out["decode_torch_GB_per_s"] = buf.numel() / torch_s / 1e9
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


class ServedApp:
    """A local Ray head with the moe app redeployed per form and batch: `measure` runs one
    deployment's decode with the cold files out of the page cache and the shard replicas
    capped (MemoryCap)."""

    def __init__(self, work: Path, page_cache_cap: int, groups: int = 2):
        from moe_operator.backends.ray_rest import RayServeClient
        from moe_operator.standalone.local_ray import LocalRayHead

        self.work, self.page_cache_cap, self.groups = work, page_cache_cap, groups
        self.head = LocalRayHead(work_dir=scratch("moe-bench-ray-"), num_cpus=8).start()
        self.cap = MemoryCap("moe-bench-shard")
        self.head.connect_driver(namespace="bench")
        self.client = RayServeClient(self.head.dashboard_url, self.head.token)
        self.url = f"http://127.0.0.1:{self.head.serve_http_port}"

    def measure(self, path: Path, label: str, placement: dict, hot: int, warm: int, batch: int, tokens: int) -> dict:
        """Decode tokens/s at `batch` (the prefill and first token's run subtracted), the cold
        reads and warm misses of the decode steps alone, and what the shards report."""
        from ray import serve

        from moe_workers.model.checkpoint import Checkpoint
        from moe_workers.serve.config import AppArgs, serve_application

        cfg = Checkpoint(path).config
        cold = self.work / f"served-cold-{label}"
        tiers = {"hot_budget": hot, "warm_budget": warm, "cold_dir": str(cold), "prefetch": True}
        args = AppArgs(model_path=str(path), served_model_name="bench", num_groups=self.groups,
                       max_batch_size=batch, kv_cache_budget_bytes=2**30, max_model_len=512,
                       ingress_num_cpus=1, shard_num_cpus=1, ingress_torch_threads=2)
        self.client.put({"http_options": {"host": "127.0.0.1", "port": self.head.serve_http_port},
                         "applications": [serve_application("bench", "/", args, placement, tiers=tiers,
                                                            prefetch_lookahead=1)]})
        self.client.wait_running(["bench"], timeout_s=1800)
        deadline = time.monotonic() + 600
        # the app is replaced in place (deleting every app would stop Serve's controller, which this
        # driver's Serve client stays bound to); until the new shards answer with their budgets, the
        # old ones may, or a handle may fail while replicas are replaced
        while True:
            shards = [serve.get_deployment_handle(f"ExpertShard-{g}", app_name="bench") for g in range(self.groups)]
            try:
                st = [s.status.remote().result(timeout_s=60) for s in shards]
                if all(x["budgets"]["warm"] == warm for x in st):
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError("the shards did not report the new app's budgets in 600 s")
            time.sleep(1)
        ps = prompts(batch, 8, cfg.vocab_size, 2)

        def run(n):
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                list(pool.map(lambda p: requests.post(self.url + "/v1/completions", json={
                    "prompt": p, "max_tokens": n, "temperature": 0}, timeout=3600).raise_for_status(), ps))
            return time.perf_counter() - t0

        def counts():
            st = [s.status.remote().result()["store"] for s in shards]
            return (sum(x["cold_reads"]["disk"] + x["cold_reads"]["cache"] for x in st),
                    sum(x["misses"]["warm"] for x in st))

        run(2)  # warm-up
        caps = [self.cap.cap(x["pid"], self.page_cache_cap) for x in st]
        drop_from_page_cache(sorted(str(f) for f in cold.rglob("*.safetensors")))
        c0 = counts()
        one_tok = run(1)
        c1 = counts()
        full = run(tokens)
        c2 = counts()
        st = [s.status.remote().result() for s in shards]
        steps = tokens - 1  # the decode steps `full` has beyond `one_tok`
        reads = (c2[0] - c1[0]) - (c1[0] - c0[0])
        return {"decode_tps": batch * steps / (full - one_tok), "hot_budget": hot, "warm_budget": warm,
                "cold_reads": c2[0] - c0[0], "decode_cold_reads_per_step": max(0, reads) / steps,
                "cold_misses": (c2[1] - c1[1]) - (c1[1] - c0[1]), "caps": caps,
                "cap": self.cap.problem or f"each shard replica may charge {self.page_cache_cap >> 20} MiB more",
                "in_ram": [x["tiers"]["hot"]["experts"] + x["tiers"]["warm"]["experts"] for x in st],
                "decoder": st[0]["tiers"]["hot"].get("decoder"), "tiers": [x["tiers"] for x in st]}

    def close(self) -> None:
        import ray as ray_module

        try:
            self.client.delete_all()
        finally:
            ray_module.shutdown()
            self.head.stop()
            self.cap.close()


def _placement(cfg, groups: int) -> dict[str, list[str]]:
    return {f"ExpertShard-{g}": [f"{l}.{e}" for l in cfg.sparse_layers for e in range(cfg.num_experts) if e % groups == g]
            for g in range(groups)}


def bench_served(paths: dict[str, Path], work: Path, batches: tuple[int, ...], tokens: int, page_cache_cap: int,
                 groups: int = 2) -> dict:
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.store.store import HOT, TieredExpertStore

    bf16 = TieredExpertStore(Checkpoint(paths["bf16"]), torch.bfloat16).forms
    cfg = Checkpoint(paths["bf16"]).config
    layers, experts = cfg.sparse_layers, cfg.num_experts
    per_shard, per_layer = len(layers) * experts // groups, experts // groups
    ram = per_shard * bf16.nbytes(HOT) // 4  # 25% of a shard's experts in bf16, for both checkpoints
    out: dict = {"ram_per_shard_bytes": ram, "experts_per_shard": per_shard, "cap": None}
    app = ServedApp(work, page_cache_cap, groups)
    try:
        for batch in batches:
            for form in ("bf16", "quantized", "bf16-again"):
                path = paths[form.split("-")[0]]
                hot = per_layer * TieredExpertStore(Checkpoint(path), torch.bfloat16).forms.nbytes(HOT)
                r = out[f"b{batch}-{form}"] = app.measure(path, form, _placement(cfg, groups), hot, ram - hot, batch, tokens)
                out["cap"] = r["cap"]
                print(f"  batch {batch:2} {form:10}: {r['decode_tps']:7.2f} tok/s, experts in RAM per shard "
                      f"{r['in_ram']} of {per_shard}, cold reads {r['cold_reads']}", flush=True)
            a, b = out[f"b{batch}-bf16"]["decode_tps"], out[f"b{batch}-bf16-again"]["decode_tps"]
            out[f"b{batch}-ratio"] = out[f"b{batch}-quantized"]["decode_tps"] / ((a + b) / 2)
    finally:
        app.close()
    return out


# -- 4: one layer at a published shape, warm at a quarter ------------------------------------------------


def layer_checkpoint(cache: Path, shape: str, method: str) -> Path:
    """One MoE layer of `shape` at its published dimensions, every expert, in `method`'s layout,
    its router as drawn."""
    from moe_workers.model import published
    from moe_workers.model.random_init import write_random_checkpoint

    path = cache / f"layer-{shape}-{method}-balanced"
    if not (path / "config.json").exists():
        print(f"writing {path} (one {shape} layer, {method}) ...", flush=True)
        # the router as drawn (router_scale 1): near-uniform routing, as the released models are
        # trained to balance it (a sharpened random router sends most tokens to a few experts)
        write_random_checkpoint(path, published.family_of(shape), vocab_size=512, dtype=torch.bfloat16,
                                router_scale=1.0, quantize=method, block=(128, 128),
                                max_position_embeddings=512, overrides=published.overrides(shape, num_layers=1))
    return path


def bench_layer(app: ServedApp, path: Path, work: Path, batches: tuple[int, ...], tokens: int,
                groups: int = 2) -> dict:
    """Served with each shard's warm tier at 25% of its experts (stored form) and a hot tier of
    one token's experts: decode tokens/s, disk bytes a token, and the bound the disk and memory
    bandwidth give (the disk bytes at the disk's O_DIRECT read speed plus the weights and KV a
    step reads at the memory's, both measured in this run)."""
    from realshape import Bandwidth, step_bytes

    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.store.store import HOT, WARM, TieredExpertStore

    cfg = Checkpoint(path).config
    forms = TieredExpertStore(Checkpoint(path), torch.bfloat16).forms
    stored, compute = forms.nbytes(WARM), forms.nbytes(HOT)
    per_shard = cfg.num_experts // groups
    warm, hot = per_shard * stored // 4, cfg.top_k * compute
    out: dict = {"experts": cfg.num_experts, "top_k": cfg.top_k, "stored_expert_bytes": stored,
                 "compute_expert_bytes": compute, "warm_per_shard": warm, "hot_per_shard": hot}
    for batch in batches:
        r = out[f"b{batch}"] = app.measure(path, path.name, _placement(cfg, groups), hot, warm, batch, tokens)
        files = sorted(str(f) for f in (work / f"served-cold-{path.name}").rglob("*.safetensors"))
        drop_from_page_cache(files)
        sample = files[:: max(1, len(files) // 16)]
        disk = sum(os.path.getsize(f) for f in sample) / direct_read(sample, 16 << 20, 4)
        memory = Bandwidth(1 << 29).measure()
        distinct = cfg.num_experts * (1 - (1 - cfg.top_k / cfg.num_experts) ** batch)  # expected, random routing
        disk_bytes = r["decode_cold_reads_per_step"] * stored
        bound_s = disk_bytes / disk + step_bytes(path, distinct, 8, batch) / memory
        r.update(disk_GB_per_s=disk / 1e9, memory_GB_per_s=memory / 1e9, disk_bytes_per_token=disk_bytes / batch,
                 bound_tps=batch / bound_s, vs_bound=r["decode_tps"] / (batch / bound_s))
        print(f"  batch {batch:2}: {r['decode_tps']:6.2f} tok/s, {disk_bytes / batch / 1e6:7.1f} MB from disk a token, "
              f"bound {batch / bound_s:6.2f} tok/s (disk {disk / 1e9:.2f} GB/s, memory {memory / 1e9:.1f} GB/s): "
              f"{r['vs_bound']:.2f}; in RAM {r['in_ram']} of {per_shard}; decoder {r['decoder']}", flush=True)
    return out


def main() -> int:
    a = parse_args()
    cache = Path(a.cache_dir)
    work = scratch("moe-bench-quantized-")
    results: dict = {"torch_threads": torch.get_num_threads()}
    figures: dict = {}
    if a.only in (None, "store"):
        print(f"1-2. the store at published expert shapes (torch threads {torch.get_num_threads()}; "
              f"decoder {native.describe()})", flush=True)
        print(f"  {'family':12} {'form':6} {'warm expert':>12} {'per GiB':>8} {'ratio':>6} {'promote bf16':>13} "
              f"{'quantized':>10} {'ratio':>6} {'decode GB/s':>12} {'torch':>6} {'memcpy':>7} {'disk':>6}")
        for family, (method, scale_dtype, dims) in SHAPES.items():
            bf16, quant = checkpoint_pair(cache, family, method, scale_dtype, QUICK[family] if a.quick else dims)
            r = results[family] = bench_store(bf16, quant, work / family, a.rounds)
            print(f"  {family:12} {method:6} {r['quantized']['warm_expert_bytes'] / 2**20:10.1f}Mi "
                  f"{r['quantized']['warm_slots_per_gib']:8} {r['experts_per_warm_gib_ratio']:6.2f} "
                  f"{r['promote_s']['bf16'] * 1e3:11.0f}ms {r['promote_s']['quantized'] * 1e3:8.0f}ms "
                  f"{r['quantized_promote_ratio']:6.2f} {r['decode_GB_per_s']:12.2f} "
                  f"{r['decode_torch_GB_per_s']:6.2f} {r['memcpy_GB_per_s']:7.1f} "
                  f"{r['disk_GB_per_s']:6.2f}", flush=True)
            figures[f"experts-per-warm-gib-ratio-{family}"] = r["experts_per_warm_gib_ratio"]
            figures[f"quantized-promote-ratio-{family}"] = r["quantized_promote_ratio"]
            figures[f"decode-GBps-{family}"] = r["decode_GB_per_s"]
            figures[f"decode-native-over-torch-{family}"] = r["decode_GB_per_s"] / r["decode_torch_GB_per_s"]
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
    if a.only in (None, "layer"):
        print("\n4. one layer at a published shape, served with each shard's warm tier at 25% of its experts",
              flush=True)
        shapes = [(s, m) for s, m in ((("gpt-oss-20b", "mxfp4"),) if a.quick else LAYERS) if not a.layer or s in a.layer]
        paths = {shape: layer_checkpoint(cache, shape, method) for shape, method in shapes}
        app = ServedApp(work, a.page_cache_cap)  # one head for all: Serve keeps a driver's first cluster
        try:
            for shape, method in shapes:
                print(f"  {shape} ({method}):", flush=True)
                r = results[f"layer-{shape}"] = bench_layer(app, paths[shape], work, (1,) if a.quick else (1, 16),
                                                            8 if a.quick else a.layer_tokens)
                for batch in (1,) if a.quick else (1, 16):
                    figures[f"layer-tps-b{batch}-{shape}"] = r[f"b{batch}"]["decode_tps"]
                    figures[f"layer-vs-bound-b{batch}-{shape}"] = r[f"b{batch}"]["vs_bound"]
                    figures[f"layer-disk-MB-per-token-b{batch}-{shape}"] = r[f"b{batch}"]["disk_bytes_per_token"] / 1e6
        finally:
            app.close()
    return report(a.out, results, figures)


if __name__ == "__main__":
    sys.exit(main())
