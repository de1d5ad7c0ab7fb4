"""The GPU bring-up kit: every check of our CUDA paths, ready to run on a bare machine with torch
and transformers (no Ray, no Kubernetes, no network), in two runs of at most 5 minutes each.

    scripts/gpu-check --run 1      # preflight, families, paged-attention, attention, quantized, store
    scripts/gpu-check --run 2      # preflight, decode, overlap, served
    scripts/gpu-check --device cpu --quick   # the smoke run (the test suite runs it: every check)
    scripts/gpu-check --only families,store

Each check runs in a child process of its own under a time limit (a hung kernel costs that check,
not the run) and the report (bench/results/gpu-run<N>.json, or --out) is written after every check,
so a run cut short still tells what it reached. Each check is reported ran / skipped (why) /
failed (the error) / timed out, with its figures:
- preflight (seconds; limit 20): driver and CUDA versions, the device and its compute capability, Triton, a
  trivial torch.compile on the device, grouped GEMM (bf16, capability 8.0+): what every later
  check needs, said first.
- families: for every family a tiny random checkpoint, our engine on the device against
  transformers on the device, fp32 and bf16: the prompt's logits (max difference; fp32 must be
  within 1e-3, bf16 within 0.1) and 8 greedy tokens (fp32 must agree; bf16 agreement reported);
  which attention path decode ran.
- paged-attention: our engine with the KV cache read through FlexAttention over the block pool
  (the CUDA path) against the gather path, prefill + decode logits.
- attention: decode attention at Qwen3-30B-A3B's heads (32 query, 4 KV, dim 128) over the paged
  cache, flex against gather, at batch 1 / 5 / 16 / 64 / 130 and contexts 1k / 4k / 16k: equal
  outputs, milliseconds each, flex's compile time, the path that ran.
- quantized: fp8 (DeepSeek-V3 blocks) and mxfp4 (gpt-oss) experts promoted into the device's hot
  tier in their stored form and decoded there (DeviceOps.decode), equal to the host's decode.
- store: the tiered store with its hot tier on the device (pinned warm slots, its copy stream,
  events) promoting a Mixtral-8x7B-shaped expert (352 MiB bf16) from warm, checked against the
  checkpoint, against a plain pinned host-to-device copy of the same bytes.
- decode: batch 1 / 16 / 64 decode of one layer of each published shape (bf16; DeepSeek-V3 with
  32 of its 256 experts), sampling at temperature 1, ours and transformers on the device, against
  the bound: bytes a step reads over the device's copy bandwidth (a 1 GiB copy, read + write).
- overlap: a Mixtral-8x7B-shaped expert promoted warm -> hot while decode steps run on the device:
  the steps' time alone, the promotion's alone, and both together (does the copy stream hide it).
- served: the served path without Ray: the engine's step with the expert exchange (ExpertDispatcher,
  ExpertChannel) to an exchange server in another process whose tiered store keeps its hot tier on
  the device; greedy tokens against the in-process model, step time against it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))
sys.path.append(str(REPO / "bench"))  # after the standard library: run with -I, bench/ is not first

from moe_workers.model import published  # noqa: E402
from moe_workers.model.family import SUPPORTED  # noqa: E402
from moe_workers.model.random_init import write_random_checkpoint  # noqa: E402
from realshape import step_bytes  # noqa: E402  (the bytes a decode step reads, as bench/realshape counts them)

RAN, SKIPPED, FAILED, TIMED_OUT = "ran", "skipped", "failed", "timed out"
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            num_experts=8, top_k=2, max_position_embeddings=256)
# published shapes for the decode check: (name, layers, experts kept)
DECODE_SHAPES = [("mixtral-8x7b", 1, None), ("qwen3-30b-a3b", 1, None), ("deepseek-v3", 1, 32), ("gpt-oss-20b", 1, None)]


class Skip(Exception):
    """A check that cannot run here; the message says why."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the smoke run)")
    p.add_argument("--quick", action="store_true", help="small shapes everywhere (the smoke run)")
    p.add_argument("--run", type=int, choices=(1, 2), default=None,
                   help="the first or second run (each at most 5 minutes); default: every check")
    p.add_argument("--only", default="", help="comma-separated checks: " + ", ".join(PLAN))
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--limit-scale", type=float, default=1.0, help="multiply every check's time limit")
    p.add_argument("--work-dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--out", default=None, help="the report (default: bench/results/gpu-run<N>.json, or gpu.json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one check, in a child process
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# check -> (run, time limit in seconds on the GPU): the two runs' limits add up to under 5 minutes
PLAN = {"preflight": ((1, 2), 20), "families": ((1,), 60), "paged-attention": ((1,), 35), "attention": ((1,), 80),
        "quantized": ((1,), 35), "store": ((1,), 25), "decode": ((2,), 140), "overlap": ((2,), 40),
        "served": ((2,), 70)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def device_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes a second the device moves in a large copy (read + write), best of three."""
    src = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src), device) for _ in range(3))
    return 2 * nbytes / best


# -- preflight --------------------------------------------------------------------------------------

def check_preflight(ctx) -> dict:
    """What every later check needs, in seconds: a failure here explains the failures after it."""
    info: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if ctx.device.type == "cuda":
        info["driver"] = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else None
        info["gpu"] = torch.cuda.get_device_name(ctx.device)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(ctx.device)))
        info["memory_gib"] = round(torch.cuda.get_device_properties(ctx.device).total_memory / 2**30, 1)
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    t0 = time.perf_counter()
    double = torch.compile(lambda x: x * 2 + 1)
    x = torch.arange(8, dtype=torch.float32, device=ctx.device)
    if not torch.equal(double(x).cpu(), torch.arange(8, dtype=torch.float32) * 2 + 1):
        raise AssertionError("torch.compile computed a wrong result")
    info["compile_s"] = round(time.perf_counter() - t0, 2)
    from moe_workers.model import grouped
    info["grouped_gemm"] = grouped.applies(ctx.device, torch.bfloat16)
    if ctx.device.type == "cuda":
        if info["triton"] is None:
            raise AssertionError("Triton is not installed: flex attention and torch.compile cannot run")
        w = torch.randn(2, 16, 16, dtype=torch.bfloat16, device=ctx.device)
        ends = torch.tensor([3, 5], dtype=torch.int32, device=ctx.device)
        torch.nn.functional.grouped_mm(torch.randn(5, 16, dtype=torch.bfloat16, device=ctx.device), w, offs=ends)
    return {**info, "summary": ", ".join(f"{k} {v}" for k, v in info.items())}


# -- families ---------------------------------------------------------------------------------------

def check_families(ctx) -> dict:
    from transformers import AutoModelForCausalLM

    from moe_workers.model.inprocess import InProcessModel

    rows, failures = [], []
    prompt = [5, 9, 17, 33, 65, 129, 7, 11]
    for family in SUPPORTED:
        path = ctx.work / f"tiny-{family}"
        if not (path / "config.json").is_file():
            write_random_checkpoint(path, family, router_scale=10.0, **TINY)
        for dtype, limit in ((torch.float32, 1e-3), (torch.bfloat16, 0.1)):
            ours = InProcessModel(path, dtype=dtype, max_len=64, max_sequences=1, device=ctx.device)
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(ctx.device).eval()
            with torch.inference_mode():
                ref_logits = ref(torch.tensor([prompt], device=ctx.device)).logits[0].float()
                # transformers stops at the end-of-sequence token: the tokens up to it are compared
                ref_tokens = ref.generate(torch.tensor([prompt], device=ctx.device), max_new_tokens=8, do_sample=False,
                                          pad_token_id=0)[0, len(prompt):].tolist()
            diff = float((ours.prompt_logits(prompt).float() - ref_logits).abs().max())
            tokens = ours.generate([prompt], max_tokens=8)[0][:len(ref_tokens)]
            agree = sum(a == b for a, b in zip(tokens, ref_tokens))
            row = {"family": family, "dtype": str(dtype).removeprefix("torch."), "max_logit_diff": diff,
                   "tokens_agree": f"{agree}/{len(ref_tokens)}", "attention": ours.cache.attention_path()}
            rows.append(row)
            if diff > limit or (dtype == torch.float32 and agree != len(ref_tokens)):
                failures.append(f"{family} {row['dtype']}: logits differ by {diff:.2e} (limit {limit}), "
                                f"tokens agree {row['tokens_agree']}")
            del ours, ref
    if failures:
        raise AssertionError("; ".join(failures))
    worst = {d: max(r["max_logit_diff"] for r in rows if r["dtype"] == d) for d in ("float32", "bfloat16")}
    return {"rows": rows, "summary": f"{len(SUPPORTED)} families; worst logit diff fp32 {worst['float32']:.1e}, "
                                     f"bf16 {worst['bfloat16']:.1e}", "figures": {f"families-max-diff-{d}": v
                                                                                  for d, v in worst.items()}}


# -- the store's hot tier ---------------------------------------------------------------------------

def _expert_checkpoint(ctx, name: str, **kw) -> Path:
    path = ctx.work / name
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, dtype=torch.bfloat16, **kw)
    return path


def _store_checkpoint(ctx) -> Path:
    """Two experts of one Mixtral-8x7B layer's shape (352 MiB each in bf16); --quick: small ones."""
    if ctx.quick:
        return _expert_checkpoint(ctx, "store-small", family="mixtral", hidden_size=256, intermediate_size=512,
                                  num_layers=1, num_experts=2, top_k=1, num_heads=4, num_kv_heads=2, vocab_size=256)
    fields = published.overrides("mixtral-8x7b", num_layers=1, num_experts=2)
    fields["num_experts_per_tok"] = 1
    return _expert_checkpoint(ctx, "store-mixtral", family="mixtral", num_layers=1, num_experts=2, top_k=1,
                              vocab_size=256, overrides=fields)


def check_store(ctx) -> dict:
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.store.config import TierConfig
    from moe_workers.store.store import TieredExpertStore

    ckpt = Checkpoint(_store_checkpoint(ctx))
    nbytes = ckpt.config.with_dtype(torch.bfloat16).expert_bytes
    store = TieredExpertStore(ckpt, torch.bfloat16, TierConfig(hot_budget=nbytes, warm_budget=2 * nbytes),
                              device=ctx.device)
    keys = [(0, 0), (0, 1)]
    store.configure(keys)
    times = []
    for round_ in range(4):  # each round promotes the expert that is warm (the other goes back to warm)
        key = keys[(round_ + 1) % 2]

        def promote():
            with store.use([key]) as w:
                ctx.last = w[key]

        times.append(_timed(promote, ctx.device))
        want = ckpt.expert(*key, dtype=torch.bfloat16)
        for part, t in want.items():
            if not torch.equal(ctx.last[part].cpu(), t):
                raise AssertionError(f"expert {key} part {part}: the hot copy differs from the checkpoint")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.device.type == "cuda")
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dev.copy_(host)
    plain = min(_timed(lambda: dev.copy_(host, non_blocking=True), ctx.device) for _ in range(3))
    promote_s = min(times[1:])
    store.close()
    return {"promote_s": times, "plain_copy_s": plain, "expert_bytes": nbytes,
            "summary": f"{nbytes / 2**20:.0f} MiB expert warm->hot {promote_s * 1e3:.1f} ms, plain pinned copy "
                       f"{plain * 1e3:.1f} ms ({nbytes / promote_s / 1e9:.1f} vs {nbytes / plain / 1e9:.1f} GB/s)",
            "figures": {"store-promote-vs-plain-copy": plain / promote_s}}


# -- decode at the published shapes -----------------------------------------------------------------

def _decode_checkpoint(ctx, name: str, layers: int, experts: int | None) -> Path:
    if ctx.quick:  # the same families, small
        family = published.family_of(name)
        return _expert_checkpoint(ctx, f"decode-{name}-small", family=family, vocab_size=256, hidden_size=128,
                                  intermediate_size=128, num_layers=1, num_experts=8, top_k=2, num_heads=4,
                                  num_kv_heads=2)
    fields = published.overrides(name, num_layers=layers, num_experts=experts)
    return _expert_checkpoint(ctx, f"decode-{name}", family=published.family_of(name), vocab_size=256,
                              overrides=fields)


def check_decode(ctx) -> dict:
    from transformers import AutoModelForCausalLM

    from moe_workers.model.inprocess import InProcessModel

    bandwidth = device_bandwidth(ctx.device, (256 << 20) if ctx.quick else (1 << 30))
    rows, figures = [], {}
    for name, layers, experts in DECODE_SHAPES:
        path = _decode_checkpoint(ctx, name, layers, experts)
        ours = InProcessModel(path, dtype=torch.bfloat16, max_len=64, max_sequences=max(ctx.batches), device=ctx.device)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(ctx.device).eval()
        distinct: list[int] = []
        moe = ours.experts.moe

        def counting(layer, x, indices, weights):
            if indices.shape[0] == len(ps):  # a decode step's routing (the prompt's step has more rows)
                distinct.append(int(indices.unique().numel()))
            return moe(layer, x, indices, weights)

        ours.experts.moe = counting
        for b in ctx.batches:
            ps = [[3 + (7 * i + j) % 200 for j in range(8)] for i in range(b)]

            def ours_run(n):  # sampled at temperature 1, as a chat client asks
                return lambda: ours.generate(ps, max_tokens=n, temperature=1.0, seed=0)

            def ref_run(n):
                def run():
                    with torch.inference_mode():
                        ref.generate(torch.tensor(ps, device=ctx.device), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
                return run

            step = {}
            for side, run in (("ours", ours_run), ("transformers", ref_run)):
                run(2)()  # warm-up
                if side == "ours":
                    distinct.clear()
                step[side] = (_timed(run(17), ctx.device) - _timed(run(1), ctx.device)) / 16
            experts = sum(distinct) / max(1, len(distinct))  # distinct experts a layer read in a decode step
            need = step_bytes(path, experts, 8 + 8, b)  # 8-token prompts, 16 decode steps: 8 more on average
            row = {"shape": name, "batch": b, "ours_ms": step["ours"] * 1e3, "transformers_ms": step["transformers"] * 1e3,
                   "experts_a_step": experts, "bound_ms": need / bandwidth * 1e3, "vs_bandwidth": need / bandwidth / step["ours"],
                   "vs_transformers": step["transformers"] / step["ours"], "attention": ours.cache.attention_path()["running"]}
            rows.append(row)
            figures[f"gpu-decode{b}-vs-bandwidth-{name}"] = row["vs_bandwidth"]
            figures[f"gpu-decode{b}-vs-transformers-{name}"] = row["vs_transformers"]
        ours = ref = None  # freed before the next shape loads
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return {"bandwidth_gbs": bandwidth / 1e9, "rows": rows, "figures": figures,
            "summary": f"{len(rows)} points; bandwidth {bandwidth / 1e9:.0f} GB/s; ours over bound "
                       + ", ".join(f"{r['shape']} b{r['batch']} {r['vs_bandwidth']:.2f}" for r in rows)}


# -- paged attention --------------------------------------------------------------------------------

def check_paged_attention(ctx) -> dict:
    from moe_workers.model.dense import Chunk
    from moe_workers.model.inprocess import InProcessModel
    from moe_workers.model.kv_cache import PagedKVCache

    path = ctx.work / "tiny-mixtral"
    if not (path / "config.json").is_file():
        write_random_checkpoint(path, "mixtral", router_scale=10.0, **TINY)
    logits = {}
    for attention in ("gather", "flex"):
        m = InProcessModel(path, max_len=128, max_sequences=2, device=ctx.device)
        m.cache = PagedKVCache(m.cfg, m.cache.num_blocks, m.cache.block_size, m.cfg.dtype, ctx.device,
                               prefix_caching=False, attention=attention)
        seqs = [m.cache.allocate() for _ in range(2)]
        prompts = [list(range(5, 45)), list(range(50, 70))]
        out = [m.step([Chunk(s, 0, p) for s, p in zip(seqs, prompts)])]
        for i in range(6):  # decode steps read the blocks the prefill wrote
            out.append(m.step([Chunk(s, len(p) + i, [7 + i]) for s, p in zip(seqs, prompts)]))
        used = m.cache.attention
        logits[attention] = (torch.stack(out).float().cpu(), used)
    flex, used = logits["flex"]
    if used != "flex":
        raise Skip(f"FlexAttention is not available on {ctx.device.type} in this torch build (fell back to {used})")
    diff = float((flex - logits["gather"][0]).abs().max())
    if diff > 1e-3:
        raise AssertionError(f"flex and gather logits differ by {diff:.2e}")
    return {"max_logit_diff": diff, "summary": f"prefill + 6 decode steps, flex vs gather max diff {diff:.1e}",
            "figures": {"paged-flex-vs-gather-max-diff": diff}}


# -- quantized experts ------------------------------------------------------------------------------

def check_quantized(ctx) -> dict:
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.dequant import decode
    from moe_workers.store.config import TierConfig
    from moe_workers.store.store import TieredExpertStore

    out, figures = {}, {}
    forms = [("fp8", "deepseek_v3", dict(hidden_size=256, intermediate_size=256) if ctx.quick else
              dict(hidden_size=7168, intermediate_size=2048)),
             ("mxfp4", "gpt_oss", dict(hidden_size=256, intermediate_size=256) if ctx.quick else
              dict(hidden_size=2880, intermediate_size=2880))]
    for method, family, dims in forms:
        path = ctx.work / f"quant-{method}-{dims['hidden_size']}"
        if not (path / "config.json").is_file():
            write_random_checkpoint(path, family, dtype=torch.bfloat16, vocab_size=256, num_layers=1, num_experts=2,
                                    top_k=1, num_heads=4, num_kv_heads=2, quantize=method, **dims)
        ckpt = Checkpoint(path)
        nbytes = ckpt.config.with_dtype(torch.bfloat16).expert_bytes
        store = TieredExpertStore(ckpt, torch.bfloat16, TierConfig(hot_budget=nbytes, warm_budget=2 * nbytes),
                                  device=ctx.device)
        store.configure([(0, 0), (0, 1)])
        times = []
        for key in ((0, 1), (0, 0), (0, 1)):
            def promote():
                with store.use([key]) as w:
                    ctx.last = {k: v.clone() for k, v in w[key].items()}
            times.append(_timed(promote, ctx.device))
            want = decode(ckpt.config.quant, ckpt.expert_stored(*key), torch.bfloat16)
            for part, t in want.items():
                if not torch.equal(ctx.last[part].cpu(), t):
                    raise AssertionError(f"{method} expert {key} part {part}: decoded on {ctx.device} differs from the host's")
        store.close()
        out[method] = {"promote_s": times, "expert_bytes": nbytes}
        figures[f"quantized-promote-gbs-{method}"] = nbytes / min(times[1:]) / 1e9
    return {**out, "figures": figures, "summary": ", ".join(
        f"{m} promote+decode {figures[f'quantized-promote-gbs-{m}']:.1f} GB/s of bf16, equal to the host decode"
        for m, _, _ in forms)}


# -- attention at a real shape, flex against gather -------------------------------------------------

def check_attention(ctx) -> dict:
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.dense import Chunk, DenseModel, StepBatch
    from moe_workers.model.kv_cache import PagedKVCache

    if ctx.quick:
        path = _expert_checkpoint(ctx, "attention-small", family="qwen3_moe", vocab_size=256, hidden_size=128,
                                  intermediate_size=64, num_layers=1, num_experts=4, top_k=2, num_heads=8,
                                  num_kv_heads=2, overrides={"head_dim": 16})
        batches, contexts = [1, 17], [40]
    else:  # Qwen3-30B-A3B's attention (32 query heads, 4 KV heads of 128), 8 of its experts
        path = _expert_checkpoint(ctx, "attention-qwen3", family="qwen3_moe", num_layers=1, num_experts=8, top_k=2,
                                  vocab_size=256, overrides=published.overrides("qwen3-30b-a3b", num_layers=1,
                                                                               num_experts=8))
        batches, contexts = [1, 5, 16, 64, 130], [1024, 4096, 16384]
    ckpt = Checkpoint(path)
    cfg = ckpt.config.with_dtype(torch.bfloat16)
    dense = DenseModel(cfg, ckpt.dense_state(), ctx.device)
    rows, figures, compile_s, worst = [], {}, None, 0.0
    bs = 16
    for context in contexts:
        per_seq = -(-(context + 1) // bs)
        caches = {}
        for way in ("gather", "flex"):
            cache = PagedKVCache(cfg, max(batches) * per_seq + 1, bs, cfg.dtype, ctx.device, attention=way)
            g = torch.Generator(device=ctx.device).manual_seed(context)
            for t in (*cache.k, *cache.v):
                t.normal_(generator=g)
            for seq in range(max(batches)):
                cache.allocate()
                cache.reserve(seq, context + 1, context)
            caches[way] = cache
        for b in batches:
            h = torch.randn(b, cfg.hidden_size, dtype=cfg.dtype, device=ctx.device,
                            generator=torch.Generator(device=ctx.device).manual_seed(b))
            out, ms = {}, {}
            for way, cache in caches.items():
                def step():
                    batch = StepBatch([Chunk(seq, context, [5]) for seq in range(b)])  # the plan and mask each step
                    with torch.inference_mode():
                        dense.embed(batch)
                        return dense.attention(0, h, batch, cache)

                first = _timed(step, ctx.device)
                if way == "flex" and compile_s is None:
                    compile_s = first
                out[way] = step()
                ms[way] = min(_timed(step, ctx.device) for _ in range(3)) * 1e3
            path_run = caches["flex"].attention_path()
            if path_run["running"] != "flex":
                raise AssertionError(f"flex attention fell back to gather at batch {b}, context {context}: "
                                     f"{path_run['error'][:300]}")
            diff = float((out["flex"].float() - out["gather"].float()).abs().max())
            scale = float(out["gather"].float().abs().max())
            worst = max(worst, diff / max(scale, 1e-6))
            rows.append({"batch": b, "context": context, "flex_ms": ms["flex"], "gather_ms": ms["gather"],
                         "max_diff": diff})
            figures[f"attention-gather-over-flex-b{b}-ctx{context}"] = ms["gather"] / ms["flex"]
        del caches
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    if worst > 0.02:
        raise AssertionError(f"flex and gather differ by {worst:.3f} of the output's scale")
    return {"rows": rows, "flex_first_call_s": compile_s, "figures": figures,
            "summary": f"{len(rows)} points, flex ran at every batch (first call {compile_s:.1f} s), worst "
                       f"difference {worst:.1e} of scale; gather/flex ms " +
                       ", ".join(f"b{r['batch']}@{r['context']} {r['gather_ms'] / r['flex_ms']:.2f}" for r in rows)}


# -- a promotion overlapping decode steps -----------------------------------------------------------

def check_overlap(ctx) -> dict:
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.inprocess import InProcessModel
    from moe_workers.store.config import TierConfig
    from moe_workers.store.store import TieredExpertStore
    import threading

    model = InProcessModel(_decode_checkpoint(ctx, "mixtral-8x7b", 1, None), dtype=torch.bfloat16, max_len=64,
                           max_sequences=1, device=ctx.device)
    store_path = _store_checkpoint(ctx)
    ckpt = Checkpoint(store_path)
    nbytes = ckpt.config.with_dtype(torch.bfloat16).expert_bytes
    store = TieredExpertStore(ckpt, torch.bfloat16, TierConfig(hot_budget=nbytes, warm_budget=2 * nbytes),
                              device=ctx.device)
    keys = [(0, 0), (0, 1)]
    store.configure(keys)
    prompt, steps, promotions = [[5, 9, 17, 33]], 16, 4

    def decode():
        model.generate(prompt, max_tokens=steps)

    def promote():
        for i in range(promotions):
            with store.use([keys[i % 2]]):
                pass
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)

    decode(), promote()  # warm-up
    alone_decode = min(_timed(decode, ctx.device) for _ in range(2))
    alone_promote = min(_timed(promote, ctx.device) for _ in range(2))
    both = []
    for _ in range(2):
        t = threading.Thread(target=promote)
        t0 = time.perf_counter()
        t.start()
        decode()
        t.join()
        _sync(ctx.device)
        both.append(time.perf_counter() - t0)
    store.close()
    together = min(both)
    hidden = (alone_decode + alone_promote - together) / max(min(alone_decode, alone_promote), 1e-9)
    return {"decode_s": alone_decode, "promote_s": alone_promote, "together_s": together, "expert_bytes": nbytes,
            "figures": {"overlap-hidden-share": hidden},
            "summary": f"{steps} decode steps {alone_decode * 1e3:.1f} ms, {promotions} promotions of "
                       f"{nbytes / 2**20:.0f} MiB {alone_promote * 1e3:.1f} ms, together {together * 1e3:.1f} ms "
                       f"(share of the shorter hidden: {hidden:.2f})"}


# -- served without Ray ------------------------------------------------------------------------------

def _served_shard(path: str, device: str, ready, port, local) -> None:
    """An exchange server whose store keeps its hot tier on `device` (the shard replica's part)."""
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.serve.expert_call import compute_call
    from moe_workers.store.config import TierConfig
    from moe_workers.store.store import TieredExpertStore
    from moe_workers.transport import ExchangeServer

    ckpt = Checkpoint(path)
    cfg = ckpt.config.with_dtype(torch.bfloat16)
    store = TieredExpertStore(ckpt, cfg.dtype, TierConfig(), device=torch.device(device))
    store.configure([(layer, e) for layer in cfg.sparse_layers for e in range(cfg.num_experts)])

    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        keys = [(layer, e) for e in experts]
        first = [k for k, n in zip(keys, top1) if n] if top1 is not None else ()
        compute_call(store, cfg, keys, counts, first, prefetch, x, out)

    server = ExchangeServer(compute, lambda: ["kit"], torch_threads=1)
    port.value = server.port
    local.value = server.local_endpoint.encode()
    ready.set()
    while True:
        time.sleep(3600)


def check_served(ctx) -> dict:
    import multiprocessing as mp

    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.dense import Chunk, DenseModel, StepBatch
    from moe_workers.model.inprocess import InProcessModel
    from moe_workers.model.kv_cache import PagedKVCache
    from moe_workers.serve.dispatch import ExpertDispatcher
    from moe_workers.engine import Engine
    from moe_workers.serve.routing import ExpertRouter
    from moe_workers.transport import ExpertChannel, Member

    path = _decode_checkpoint(ctx, "mixtral-8x7b", 1, None)
    spawn = mp.get_context("spawn")
    ready, port, local = spawn.Event(), spawn.Value("i", 0), spawn.Array("c", 128)
    shard = spawn.Process(target=_served_shard, args=(str(path), str(ctx.device), ready, port, local), daemon=True)
    shard.start()
    try:
        if not ready.wait(120):
            raise AssertionError("the exchange server did not start in 120 s")
        ckpt = Checkpoint(path)
        cfg = ckpt.config.with_dtype(torch.bfloat16)
        dense = DenseModel(cfg, ckpt.dense_state(), ctx.device)
        cache = PagedKVCache(cfg, 64, 16, cfg.dtype, ctx.device)
        channel = ExpertChannel(node="kit")
        channel.update([Member("g0", "r0", f"127.0.0.1:{port.value}", local_endpoint=local.value.decode(),
                               node="kit")], "kit")
        dispatcher = ExpertDispatcher(channel, dense.pick, cfg.sparse_layers, cfg.num_experts)
        dispatcher.configure(ExpertRouter({"g0": [f"{layer}.{e}" for layer in cfg.sparse_layers
                                                  for e in range(cfg.num_experts)]}))
        engine = Engine(dense, cache, dispatcher, max_batch_size=1, max_queued=1)
        prompt, steps = [5, 9, 17, 33, 65, 129, 7, 11], 16
        seq = cache.allocate()
        served, times = [], []
        with torch.inference_mode():
            chunk = Chunk(seq, 0, prompt)
            for i in range(steps + 1):
                cache.reserve(seq, chunk.start + len(chunk.tokens), chunk.start)
                t0 = time.perf_counter()
                logits = engine.runner.forward(StepBatch([chunk]))
                times.append(time.perf_counter() - t0)
                tok = int(logits[0].argmax())
                served.append(tok)
                chunk = Chunk(seq, chunk.start + len(chunk.tokens), [tok])
        model = InProcessModel(path, dtype=torch.bfloat16, max_len=64, max_sequences=1, device=ctx.device)
        model.generate([prompt], max_tokens=2)
        local_s = (_timed(lambda: model.generate([prompt], max_tokens=steps + 1), ctx.device)
                   - _timed(lambda: model.generate([prompt], max_tokens=1), ctx.device)) / steps
        want = model.generate([prompt], max_tokens=steps + 1)[0]
    finally:
        shard.kill()
        shard.join(10)
    agree = sum(a == b for a, b in zip(served, want))
    if agree < len(want) - 2:  # bf16 over a process boundary: the same values; allow a near tie or two
        raise AssertionError(f"served tokens {served} against in-process {want}")
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    return {"tokens_agree": f"{agree}/{len(want)}", "served_step_ms": step_s * 1e3, "in_process_step_ms": local_s * 1e3,
            "attention": cache.attention_path()["running"],
            "figures": {"served-over-in-process-decode": local_s / step_s},
            "summary": f"greedy tokens agree {agree}/{len(want)}; decode step served {step_s * 1e3:.2f} ms, in process "
                       f"{local_s * 1e3:.2f} ms; attention {cache.attention_path()['running']}"}


CHECKS = {"preflight": check_preflight, "families": check_families, "paged-attention": check_paged_attention,
          "attention": check_attention, "quantized": check_quantized, "store": check_store, "decode": check_decode,
          "overlap": check_overlap, "served": check_served}


class Context:
    def __init__(self, a, work: Path):
        self.device = torch.device(a.device)
        self.quick = a.quick
        self.batches = [int(b) for b in a.batches.split(",")]
        self.work = work
        self.last = None


def _child(a) -> int:
    """One check, in this process (the parent's child): its result as JSON in a.result."""
    work = Path(a.work_dir)
    ctx = Context(a, work)
    try:
        if a.child in ("families", "decode"):
            try:
                import transformers  # noqa: F401
            except ImportError:
                raise Skip("transformers is not installed") from None
        result = {"status": RAN, **CHECKS[a.child](ctx)}
    except Skip as why:
        result = {"status": SKIPPED, "summary": str(why)}
    except Exception as err:  # noqa: BLE001 - a failed check is reported, the others still run
        result = {"status": FAILED, "summary": f"{type(err).__name__}: {err}"[:500],
                  "traceback": traceback.format_exc()[-4000:]}
    Path(a.result).write_text(json.dumps(result, default=str))
    return 0


def _run_check(a, name: str, work: Path, limit: float) -> dict:
    """`name` in a child process of its own (its own session: a timeout ends it and whatever it
    started), under `limit` seconds."""
    result_file = work / f"result-{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-I", str(Path(__file__).resolve()), "--child", name, "--result", str(result_file),
           "--device", a.device, "--batches", a.batches, "--work-dir", str(work)] + (["--quick"] if a.quick else [])
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return {"status": TIMED_OUT, "summary": f"not done in its limit of {limit:.0f} s (--limit-scale to allow more)"}
    if not result_file.is_file():
        return {"status": FAILED, "summary": f"the check's process exited with {proc.returncode} and no result"}
    return json.loads(result_file.read_text())


def run(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        return _child(a)
    if a.only:
        only = [c.strip() for c in a.only.split(",") if c.strip()]
    else:
        only = [c for c, (runs, _) in PLAN.items() if a.run is None or a.run in runs]
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        print(f"--only: {', '.join(unknown)} not among {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    machine = {"python": platform.python_version(), "torch": torch.__version__, "device": a.device,
               "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device (use --device cpu for the smoke run)", file=sys.stderr)
        return 2
    try:
        import transformers
        machine["transformers"] = transformers.__version__
    except ImportError:
        machine["transformers"] = None
    out = Path(a.out or REPO / "bench" / "results" / (f"gpu-run{a.run}.json" if a.run else "gpu.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    # the limits are the GPU's; the CPU smoke run's shapes are small, but this CPU is slower
    scale = a.limit_scale * (1.0 if a.device.startswith("cuda") else 8.0)
    print("GPU kit: " + ", ".join(f"{k} {v}" for k, v in machine.items()) +
          f"; checks {', '.join(only)} (limits {sum(PLAN[c][1] for c in only) * scale:.0f} s in all)", flush=True)
    report = {"machine": machine, "run": a.run, "checks": {}}
    with tempfile.TemporaryDirectory(prefix="moe-gpu-check-") as tmp:
        work = Path(a.work_dir) if a.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in only:
            t0 = time.perf_counter()
            limit = PLAN[name][1] * scale
            print(f"-- {name} (limit {limit:.0f} s) ...", flush=True)
            result = _run_check(a, name, work, limit)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            report["checks"][name] = result
            out.write_text(json.dumps(report, indent=2, default=str))  # after every check: a cut run keeps its part
            print(f"   {result['status']} in {result['seconds']} s: {result['summary']}", flush=True)
    print(f"\n{'check':16s} {'status':9s} {'s':>6s}  summary")
    for name, r in report["checks"].items():
        print(f"{name:16s} {r['status']:9s} {r['seconds']:6.1f}  {r['summary']}")
    figures = {k: v for r in report["checks"].values() for k, v in r.get("figures", {}).items()}
    print()
    for k, v in figures.items():
        print(f"{k}: {v:.3f}")
    print(f"\nreport: {out}")
    return 1 if any(r["status"] in (FAILED, TIMED_OUT) for r in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(run())
