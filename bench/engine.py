"""The engine's memory: the paged KV cache against one maxModelLen slot per sequence, prefix
caching, chunked prefill, absorbed latent attention (in process, real engine, random weights).

    python bench/engine.py            # every part
    python bench/engine.py --quick    # smaller loads, for a smoke run
    python bench/engine.py --only capacity|prefix|itl|attention|mla
    python bench/engine.py --shape mixtral-kv --only capacity   # one layer at Mixtral-8x7B's attention dims

- capacity: a lognormal length mix (prompts and completions, mean ~600 tokens together, capped at
  8k; maxModelLen 8192) submitted at once against a KV budget of --budget-tokens tokens. The
  paged engine against the same engine admitting as the slot cache did (one maxModelLen reserved
  per sequence: at most budget / maxModelLen sequences). `kv-capacity-ratio`: sequences running at
  once (mean over steps while requests wait) over budget / mean length; `throughput-at-fixed-kv`:
  generated tokens/s, paged over slots.
- prefix: TTFT of a request whose 2k-token prefix is cached over the same request cold, and a
  multi-turn chat (each turn resends the history) with prefix caching on over off.
- itl: inter-token p99 of 8 running streams while a 4k-token prompt arrives, chunked
  (maxNumBatchedTokens 512) over unchunked.
- attention: one decode step's attention read through block tables at Mixtral-8x7B's KV dims (32 query
  heads, 8 KV heads of 128, batch 16, 1k / 4k context, pool blocks shuffled): gather + the grouped
  matmuls (the CPU path), gather + SDPA, and FlexAttention over the pool (the CUDA path) against
  torch's SDPA on contiguous keys (the raw operation, no paging).
- mla: one decode step of a DeepSeek-V3 attention layer (hidden 7168, 128 heads, q_lora 1536,
  kv_lora 512, nope 128, rope 64, v 128) at 1k / 4k / 16k context, absorbed over expanded.
Also prints what the published configs' KV budgets hold (the same sizing code the Ingress uses).
Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from figures import report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from moe_workers.model import published  # noqa: E402
from moe_workers.model.checkpoint import Checkpoint  # noqa: E402
from moe_workers.model.config import MoEConfig  # noqa: E402
from moe_workers.model.dense import Chunk, DenseModel, StepBatch, decode_attention  # noqa: E402
from moe_workers.model.experts import LocalExperts  # noqa: E402
from moe_workers.model.kv_blocks import budget_blocks, sequence_blocks, token_numel  # noqa: E402
from moe_workers.model.kv_cache import PagedKVCache  # noqa: E402
from moe_workers.model.random_init import random_config, write_random_checkpoint  # noqa: E402
from moe_workers.engine import Engine, GenerationRequest  # noqa: E402

# the published configs whose KV budgets are tabled (moe_workers.model.published has their fields)
PUBLISHED = {"Mixtral-8x7B": "mixtral-8x7b", "Qwen3-30B-A3B": "qwen3-30b-a3b", "DeepSeek-V3": "deepseek-v3",
             "gpt-oss-120b": "gpt-oss-120b"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["capacity", "prefix", "itl", "attention", "mla"], default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", choices=["bench", "mixtral-kv"], default="bench",
                   help="capacity, prefix, itl: the bench's small models, or one layer at Mixtral-8x7B's attention "
                        "dims (hidden 4096, 32 heads, 8 KV heads of 128)")
    p.add_argument("--budget-tokens", type=int, default=16384, help="capacity: the KV budget, in tokens")
    p.add_argument("--requests", type=int, default=96, help="capacity: requests in the length mix")
    p.add_argument("--out", default=str(REPO / "bench/results/engine.json"))
    return p.parse_args()


def engine_for(path: Path, blocks: int, max_batch: int = 256, budget: int = 512, prefix_caching: bool = True,
               block_size: int = 16) -> Engine:
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    dense = DenseModel(cfg, ckpt.dense_state())
    experts = LocalExperts(ckpt, cfg.dtype)
    cache = PagedKVCache(cfg, blocks, block_size, cfg.dtype, prefix_caching=prefix_caching)
    return Engine(dense, cache, lambda layer, x, i, w: experts.moe(layer, x, i, w), max_batch, 100_000,
                  max_num_batched_tokens=budget)


async def collect(req: GenerationRequest, gaps: list | None = None) -> GenerationRequest:
    last = None
    while await req.out.get() is not None:
        now = time.perf_counter()
        if gaps is not None and last is not None:
            gaps.append((now, now - last))
        last = now
    return req


# -- published configs ------------------------------------------------------------------------

def published_table() -> list[dict]:
    rows = []
    for name, shape in PUBLISHED.items():
        family = published.family_of(shape)
        raw = random_config(family, vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=512, dtype=torch.bfloat16)
        raw.update(published.overrides(shape))
        cfg = MoEConfig.from_dict(raw)
        per_token = cfg.num_layers * token_numel(cfg) * 2
        row = {"model": name, "kv_bytes_per_token": per_token, "max_len": cfg.max_position_embeddings}
        for label, budget in (("1Gi", 2**30), ("40Gi", 40 * 2**30)):
            usable = budget_blocks(cfg, budget, 16, 2) - 1
            row[f"max_len_fits_{label}"] = usable >= sequence_blocks(cfg, 16, cfg.max_position_embeddings)
            row[f"seqs_600_{label}"] = usable // sequence_blocks(cfg, 16, 600)
            row[f"seqs_2k_{label}"] = usable // sequence_blocks(cfg, 16, 2048)
        rows.append(row)
        print(f"{name:14s} KV {per_token / 1024:6.1f} KiB/token; 1Gi: maxModelLen fits {row['max_len_fits_1Gi']}, "
              f"{row['seqs_600_1Gi']} seqs of 600; 40Gi: {row['seqs_600_40Gi']} of 600, {row['seqs_2k_40Gi']} of 2k")
    return rows


# -- capacity ---------------------------------------------------------------------------------

def length_mix(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, completion) lengths, lognormal, mean ~300 each, total capped at 8k."""
    g = torch.Generator().manual_seed(seed)
    out = []
    sigma = 0.8
    mu = math.log(300) - sigma ** 2 / 2
    for _ in range(n):
        p, c = (max(4, int(math.exp(mu + sigma * float(torch.randn(1, generator=g))))) for _ in range(2))
        out.append((min(p, 4096), min(c, 8192 - min(p, 4096))))
    return out


def run_mix(path: Path, blocks: int, max_batch: int, mix: list[tuple[int, int]]) -> dict:
    engine = engine_for(path, blocks, max_batch=max_batch)
    g = torch.Generator().manual_seed(1)
    running: list[int] = []
    orig_step = engine.step

    def step():
        outputs = orig_step()
        if engine.scheduler.waiting:
            running.append(len(engine.scheduler.running))
        return outputs

    engine.step = step

    async def main():
        reqs = [engine.submit(GenerationRequest(prompt=torch.randint(3, 500, (p,), generator=g).tolist(),
                                                max_tokens=c, stop_at_eos=False)) for p, c in mix]
        t0 = time.perf_counter()
        await asyncio.gather(*(collect(r) for r in reqs))
        return time.perf_counter() - t0, reqs

    seconds, reqs = asyncio.run(main())
    generated = sum(len(r.produced) for r in reqs)
    return {"seconds": seconds, "generated": generated, "tokens_per_s": generated / seconds,
            "running_mean": statistics.mean(running) if running else float("nan"),
            "preemptions": engine.scheduler.kv.preemptions, "steps": engine.timings.steps}


def bench_capacity(args, tmp: Path) -> tuple[dict, dict]:
    dims = (dict(hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8, intermediate_size=256)
            if args.shape == "mixtral-kv" else dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                                    intermediate_size=256))
    path = write_random_checkpoint(tmp / "cap", "mixtral", vocab_size=512, num_experts=8, top_k=2,
                                   max_position_embeddings=8192, **dims)
    n = 40 if args.quick else args.requests
    budget_tokens = 8192 if args.quick else args.budget_tokens
    mix = length_mix(n)
    mean_len = statistics.mean(p + c for p, c in mix)
    cfg = Checkpoint(path).config
    blocks = budget_tokens // 16 + 1
    slots = max(1, (blocks - 1) // sequence_blocks(cfg, 16, 8192))
    bound = budget_tokens / mean_len
    print(f"capacity: {n} requests, mean {mean_len:.0f} tokens, budget {budget_tokens} tokens "
          f"({blocks - 1} blocks): bound {bound:.1f} sequences; slot policy {slots}")
    paged = run_mix(path, blocks, 256, mix)
    slot = run_mix(path, blocks, slots, mix)
    for name, r in (("paged", paged), ("slots", slot)):
        print(f"  {name:6s} {r['running_mean']:6.1f} running, {r['tokens_per_s']:8.1f} tok/s, "
              f"{r['preemptions']} preemptions, {r['seconds']:.1f} s")
    figures = {"kv-capacity-ratio": paged["running_mean"] / bound,
               "kv-capacity-ratio-slots": slot["running_mean"] / bound,
               "throughput-at-fixed-kv": paged["tokens_per_s"] / slot["tokens_per_s"]}
    return {"mean_len": mean_len, "bound": bound, "paged": paged, "slots": slot}, figures


# -- prefix and ITL ---------------------------------------------------------------------------

def serving_model(tmp: Path, shape: str) -> Path:
    dims = (dict(hidden_size=4096, num_layers=1, num_heads=32, num_kv_heads=8, intermediate_size=1024)
            if shape == "mixtral-kv" else dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                                               intermediate_size=1024))
    return write_random_checkpoint(tmp / "srv", "mixtral", vocab_size=512, num_experts=8, top_k=2,
                                   max_position_embeddings=8192, **dims)


def bench_prefix(args, path: Path) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(2)

    def toks(n):
        return torch.randint(3, 500, (n,), generator=g).tolist()

    engine = engine_for(path, 8192 // 16 * 8 + 1, budget=4096)
    reps = 2 if args.quick else 4

    async def ttft(prompt):
        req = engine.submit(GenerationRequest(prompt=prompt, max_tokens=1, stop_at_eos=False))
        await collect(req)
        return time.perf_counter() - req.t_submit, req.cached_tokens

    async def main():
        cold, warm = [], []
        await ttft(toks(64))  # warm-up
        for _ in range(reps):
            prefix = toks(2048)
            cold.append((await ttft(prefix + toks(16)))[0])
            t, hit = await ttft(prefix + toks(16))
            assert hit == 2048, hit
            warm.append(t)
        return cold, warm

    cold, warm = asyncio.run(main())
    ratio = statistics.median(warm) / statistics.median(cold)
    print(f"prefix: TTFT of a 2064-token prompt, cold {statistics.median(cold) * 1e3:.0f} ms, "
          f"2048 cached {statistics.median(warm) * 1e3:.1f} ms: {ratio:.3f}")

    def chat(prefix_caching: bool) -> float:
        eng = engine_for(path, 8192 // 16 * 8 + 1, budget=512, prefix_caching=prefix_caching)
        gg = torch.Generator().manual_seed(3)
        system = torch.randint(3, 500, (512,), generator=gg).tolist()
        turns = 3 if args.quick else 6

        async def conversation(k):
            history = list(system) + torch.randint(3, 500, (32,), generator=gg).tolist()
            produced = 0
            for _ in range(turns):
                req = await collect(eng.submit(GenerationRequest(prompt=list(history), max_tokens=32,
                                                                 stop_at_eos=False)))
                produced += len(req.produced)
                history += req.produced + torch.randint(3, 500, (64,), generator=gg).tolist()
            return produced

        async def main():
            t0 = time.perf_counter()
            n = sum(await asyncio.gather(*(conversation(k) for k in range(4))))
            return n / (time.perf_counter() - t0)

        return asyncio.run(main())

    on, off = chat(True), chat(False)
    print(f"prefix: multi-turn chat (4 conversations, 512-token system prompt, 64 new tokens a turn): "
          f"{on:.1f} tok/s cached against {off:.1f}: {on / off:.2f}")
    return ({"ttft_cold_s": cold, "ttft_cached_s": warm, "chat_tps_on": on, "chat_tps_off": off},
            {"prefix-ttft-ratio": ratio, "prefix-chat-tps-ratio": on / off})


def bench_itl(args, path: Path) -> tuple[dict, dict]:
    long_len = 2048 if args.quick else 4096

    def run(budget: int) -> float:
        engine = engine_for(path, 8192 // 16 * 12 + 1, budget=budget, prefix_caching=False)
        g = torch.Generator().manual_seed(4)
        gaps: list[tuple[float, float]] = []

        async def main():
            streams = [engine.submit(GenerationRequest(prompt=torch.randint(3, 500, (32,), generator=g).tolist(),
                                                       max_tokens=4000, stop_at_eos=False)) for _ in range(8)]
            tasks = [asyncio.create_task(collect(s, gaps)) for s in streams]
            while min(len(s.produced) for s in streams) < 8:
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            long = engine.submit(GenerationRequest(prompt=torch.randint(3, 500, (long_len,), generator=g).tolist(),
                                                   max_tokens=4, stop_at_eos=False))
            await collect(long)
            t1 = time.perf_counter()
            for s in streams:
                engine.cancel(s)
            await asyncio.gather(*tasks)
            return t0, t1

        t0, t1 = asyncio.run(main())
        window = sorted(gap for at, gap in gaps if t0 <= at <= t1 + 0.5)
        return window[min(len(window) - 1, int(0.99 * len(window)))]

    chunked, whole = run(512), run(1 << 20)
    print(f"itl: p99 inter-token gap of 8 streams while a {long_len}-token prompt arrives: chunked (512) "
          f"{chunked * 1e3:.0f} ms, unchunked {whole * 1e3:.0f} ms: {chunked / whole:.3f}")
    return {"p99_chunked_s": chunked, "p99_unchunked_s": whole}, {"itl-p99-during-long-prefill": chunked / whole}


# -- paged attention ----------------------------------------------------------------------------

def bench_attention(args) -> tuple[dict, dict]:
    import torch.nn.functional as F

    raw = random_config("mixtral", vocab_size=64, hidden_size=4096, intermediate_size=64, num_layers=1,
                        num_heads=32, num_kv_heads=8, num_experts=2, top_k=1, max_position_embeddings=8192,
                        dtype=torch.float32)
    cfg = MoEConfig.from_dict(raw)
    b, bs = 16, 16
    results, figures = {}, {}
    for ctx in ((1024,) if args.quick else (1024, 4096)):
        times: dict[str, list[float]] = {}
        cache = {way: PagedKVCache(cfg, b * ctx // bs + 2, bs, attention=way) for way in ("gather", "flex")}
        g = torch.Generator().manual_seed(0)
        perm = (torch.randperm(b * ctx // bs + 1, generator=g) + 1).tolist()
        for c in cache.values():
            for t in (*c.k, *c.v):
                t.normal_(generator=torch.Generator().manual_seed(1))
            for seq in range(b):
                c.allocate()
                c.manager.seqs[seq].tables[0] = perm[seq * ctx // bs:(seq + 1) * ctx // bs]
        batch = StepBatch([Chunk(seq, ctx - 1, [1]) for seq in range(b)])
        q = torch.randn(b, cfg.num_heads, cfg.head_dim, generator=g)
        plans = {way: c.plan(batch) for way, c in cache.items()}
        kc, vc = cache["gather"].gather(0, plans["gather"][0].decode_blocks)
        kc, vc = kc.contiguous(), vc.contiguous()
        mask = plans["gather"][0].decode_mask

        def gather():  # what a decode step runs on the CPU
            k, v = cache["gather"].gather(0, plans["gather"][0].decode_blocks)
            return decode_attention(q, k, v, mask, cfg.head_dim ** -0.5)

        def gather_sdpa():
            k, v = cache["gather"].gather(0, plans["gather"][0].decode_blocks)
            return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]

        def flex():
            plans["flex"][0].flex_mask = None  # the mask is made once a step: count it
            return cache["flex"].flex_decode(0, q, plans["flex"], cfg.head_dim ** -0.5)

        slot_k = torch.randn(1, b, cfg.num_kv_heads, ctx, cfg.head_dim, generator=g)  # the slot cache, before
        slot_v = torch.randn(1, b, cfg.num_kv_heads, ctx, cfg.head_dim, generator=g)
        slots = torch.arange(b)

        def slot_cache():  # the slot cache's read: each running slot's keys up to the longest, then SDPA
            k, v = slot_k[0][slots, :, :ctx], slot_v[0][slots, :, :ctx]
            return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]

        def contiguous():
            return F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask, enable_gqa=True)[:, :, 0]

        with torch.inference_mode():
            flex()  # compile
            if cache["flex"].attention != "flex":
                print(f"attention: flex unavailable here ({cache['flex'].flex_error[:200]})")
            ways = {"gather": gather, "gather-sdpa": gather_sdpa, "slot-cache": slot_cache, "contiguous": contiguous}
            torch.testing.assert_close(gather(), contiguous(), atol=1e-4, rtol=1e-4)
            if cache["flex"].attention == "flex":
                torch.testing.assert_close(flex(), gather(), atol=1e-4, rtol=1e-4)
                ways["flex"] = flex
            for _ in range(3):
                for name, fn in ways.items():
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(5):
                        fn()
                    times.setdefault(name, []).append((time.perf_counter() - t0) / 5)
        best = {k: min(v) for k, v in times.items()}
        print(f"attention: batch {b} x {ctx} tokens, Mixtral KV dims: gather + grouped matmuls {best['gather'] * 1e3:.1f} ms "
              f"(gather + SDPA {best['gather-sdpa'] * 1e3:.1f}), "
              + (f"flex {best['flex'] * 1e3:.1f} ms, " if "flex" in best else "")
              + f"the slot cache's read {best['slot-cache'] * 1e3:.1f} ms, contiguous SDPA {best['contiguous'] * 1e3:.1f} ms")
        results[ctx] = best
        figures[f"paged-gather-over-contiguous-{ctx // 1024}k"] = best["gather"] / best["contiguous"]
        figures[f"paged-gather-over-slot-cache-{ctx // 1024}k"] = best["gather"] / best["slot-cache"]
        if "flex" in best:
            figures[f"paged-flex-over-gather-{ctx // 1024}k"] = best["flex"] / best["gather"]
    return results, figures


# -- MLA --------------------------------------------------------------------------------------

def bench_mla(args) -> tuple[dict, dict]:
    raw = random_config("deepseek_v3", vocab_size=256, hidden_size=7168, intermediate_size=64, num_layers=1,
                        num_heads=128, num_kv_heads=128, num_experts=4, top_k=2, max_position_embeddings=32768,
                        dtype=torch.bfloat16)
    raw.update(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               head_dim=64, first_k_dense_replace=0)
    cfg = MoEConfig.from_dict(raw)
    g = torch.Generator().manual_seed(0)
    state = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(*s, generator=g) * 0.02).to(cfg.dtype)
             for n, s in cfg.tensor_shapes().items()}
    dense = DenseModel(cfg, state)
    results, figures = {}, {}
    for ctx in ((1024, 4096) if args.quick else (1024, 4096, 16384)):
        cache = PagedKVCache(cfg, ctx // 16 + 2, 16, cfg.dtype, prefix_caching=False)
        for t in (*cache.k, *cache.v):
            t.normal_(generator=g)
        seq = cache.allocate()
        cache.reserve(seq, ctx + 1, ctx)
        h = torch.randn(1, cfg.hidden_size, generator=g).to(cfg.dtype)
        times = {}
        for mode in (True, False, True, False):  # alternating rounds
            dense.mla_absorb = mode
            batch = StepBatch([Chunk(seq, ctx, [5])])
            dense.embed(batch)
            reps = 3 if (not mode and ctx >= 16384) else 5
            with torch.inference_mode():
                dense.attention(0, h, batch, cache)
                t0 = time.perf_counter()
                for _ in range(reps):
                    dense.attention(0, h, batch, cache)
            times.setdefault(mode, []).append((time.perf_counter() - t0) / reps)
        absorbed, expanded = min(times[True]), min(times[False])
        print(f"mla: decode step of one DeepSeek-V3 attention layer at {ctx} tokens: absorbed {absorbed * 1e3:.1f} ms, "
              f"expanded {expanded * 1e3:.1f} ms: {absorbed / expanded:.3f}")
        results[ctx] = {"absorbed_s": absorbed, "expanded_s": expanded}
        figures[f"mla-decode-step-ratio-{ctx // 1024}k"] = absorbed / expanded
    return results, figures


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"published": published_table()}
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.only in (None, "capacity"):
            results["capacity"], f = bench_capacity(args, tmp)
            figures.update(f)
        if args.only in (None, "prefix", "itl"):
            path = serving_model(tmp, args.shape)
            if args.only in (None, "prefix"):
                results["prefix"], f = bench_prefix(args, path)
                figures.update(f)
            if args.only in (None, "itl"):
                results["itl"], f = bench_itl(args, path)
                figures.update(f)
        if args.only in (None, "attention"):
            results["attention"], f = bench_attention(args)
            figures.update(f)
        if args.only in (None, "mla"):
            results["mla"], f = bench_mla(args)
            figures.update(f)
    return report(args.out, results, figures)


if __name__ == "__main__":
    sys.exit(main())
