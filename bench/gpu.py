"""The GPU bring-up kit: every check of our CUDA paths, ready to run in one go on a bare machine
with torch and transformers (no Ray, no Kubernetes, no network), in under 8 minutes.

    scripts/gpu-check                      # on the GPU machine: the report in bench/results/gpu.json
    scripts/gpu-check --device cpu --quick # the smoke run (the test suite runs it)
    scripts/gpu-check --only families,store

Checks, each reported ran / skipped (why) / failed (the error), with its figures:
- families: for every family a tiny random checkpoint, our engine on the device against
  transformers on the device, fp32 and bf16: the prompt's logits (max difference; fp32 must be
  within 1e-3, bf16 within 0.1) and 8 greedy tokens (fp32 must agree; bf16 agreement reported).
- store: the tiered store with its hot tier on the device (pinned warm slots, its copy stream,
  events) promoting a Mixtral-8x7B-shaped expert (352 MiB bf16; --quick: a small one) from warm, the
  promoted weights checked against the checkpoint, against a plain pinned host-to-device copy of
  the same bytes.
- decode: batch 1 / 16 / 64 decode of one layer of each published shape (bf16; DeepSeek-V3 with
  32 of its 256 experts), ours and transformers on the device, against the bound: bytes a step
  reads over the device's copy bandwidth (a 1 GiB copy counted read + write).
- paged-attention: our engine with the KV cache read through FlexAttention over the block pool
  (the CUDA path) against the gather path, prefill + decode logits.
- quantized: fp8 (DeepSeek-V3 blocks) and mxfp4 (gpt-oss) experts promoted into the device's hot
  tier in their stored form and decoded there (DeviceOps.decode), equal to the host's decode; an
  fp8 model's logits against the same model dequantized.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from moe_workers.model import published  # noqa: E402
from moe_workers.model.family import SUPPORTED  # noqa: E402
from moe_workers.model.random_init import write_random_checkpoint  # noqa: E402
from realshape import step_bytes  # noqa: E402  (the bytes a decode step reads, as bench/realshape counts them)

RAN, SKIPPED, FAILED = "ran", "skipped", "failed"
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
    p.add_argument("--only", default="", help="comma-separated checks: " + ", ".join(c for c, _ in CHECKS_DOC))
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--work-dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu.json"))
    return p.parse_args(argv)


CHECKS_DOC = [("families", "engine vs transformers, every family"), ("store", "hot tier promotion"),
              ("decode", "real-shape decode vs the bandwidth bound"), ("paged-attention", "FlexAttention vs gather"),
              ("quantized", "fp8 / mxfp4 decoded on the device")]


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
                   "tokens_agree": f"{agree}/{len(ref_tokens)}"}
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


def check_store(ctx) -> dict:
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.store.config import TierConfig
    from moe_workers.store.store import TieredExpertStore

    if ctx.quick:
        path = _expert_checkpoint(ctx, "store-small", family="mixtral", hidden_size=256, intermediate_size=512,
                                  num_layers=1, num_experts=2, top_k=1, num_heads=4, num_kv_heads=2, vocab_size=256)
    else:  # one Mixtral-8x7B layer's expert shape, two experts
        fields = published.overrides("mixtral-8x7b", num_layers=1, num_experts=2)
        fields["num_experts_per_tok"] = 1
        path = _expert_checkpoint(ctx, "store-mixtral", family="mixtral", num_layers=1, num_experts=2, top_k=1,
                                  vocab_size=256, overrides=fields)
    ckpt = Checkpoint(path)
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

            def ours_run(n):
                return lambda: ours.generate(ps, max_tokens=n)

            def ref_run(n):
                def run():
                    with torch.inference_mode():
                        ref.generate(torch.tensor(ps, device=ctx.device), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)
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
                   "vs_transformers": step["transformers"] / step["ours"]}
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


CHECKS = {"families": check_families, "store": check_store, "decode": check_decode,
          "paged-attention": check_paged_attention, "quantized": check_quantized}


class Context:
    def __init__(self, a, work: Path):
        self.device = torch.device(a.device)
        self.quick = a.quick
        self.batches = [int(b) for b in a.batches.split(",")]
        self.work = work
        self.last = None


def run(argv=None) -> int:
    a = parse_args(argv)
    only = [c.strip() for c in a.only.split(",") if c.strip()] or list(CHECKS)
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        print(f"--only: {', '.join(unknown)} not among {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    machine = {"python": platform.python_version(), "torch": torch.__version__, "device": a.device,
               "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device (use --device cpu for the smoke run)", file=sys.stderr)
        return 2
    if a.device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        machine["transformers"] = transformers.__version__
    except ImportError:
        machine["transformers"] = None
    print("GPU kit: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    report = {"machine": machine, "checks": {}}
    with tempfile.TemporaryDirectory(prefix="moe-gpu-check-") as tmp:
        work = Path(a.work_dir) if a.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(a, work)
        for name in only:
            t0 = time.perf_counter()
            print(f"-- {name} ...", flush=True)
            try:
                if machine["transformers"] is None and name in ("families", "decode"):
                    raise Skip("transformers is not installed")
                result = {"status": RAN, **CHECKS[name](ctx)}
            except Skip as why:
                result = {"status": SKIPPED, "summary": str(why)}
            except Exception as err:  # noqa: BLE001 - a failed check is reported, the others still run
                result = {"status": FAILED, "summary": f"{type(err).__name__}: {err}"[:500],
                          "traceback": traceback.format_exc()[-4000:]}
            result["seconds"] = round(time.perf_counter() - t0, 1)
            report["checks"][name] = result
            print(f"   {result['status']} in {result['seconds']} s: {result['summary']}", flush=True)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{'check':16s} {'status':8s} {'s':>6s}  summary")
    for name, r in report["checks"].items():
        print(f"{name:16s} {r['status']:8s} {r['seconds']:6.1f}  {r['summary']}")
    figures = {k: v for r in report["checks"].values() for k, v in r.get("figures", {}).items()}
    print()
    for k, v in figures.items():
        print(f"{k}: {v:.3f}")
    print(f"\nreport: {a.out}")
    return 1 if any(r["status"] == FAILED for r in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(run())
