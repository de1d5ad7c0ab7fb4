"""Real layer shapes: one or two layers of each family at its published dimensions, decoded and
prefilled by our engine in process, by the served app (Ingress + 2 shard groups on a local Ray)
and by transformers in process on the same checkpoint, against the bound the machine's memory
sets.

    python bench/realshape.py                      # every family, 5 alternating rounds
    python bench/realshape.py --families mixtral-8x7b --rounds 3
    python bench/realshape.py --only kernels       # the matrix-vector kernels at these shapes
    python bench/realshape.py --only experts --families gpt-oss-20b,gpt-oss-20b-mxfp4   # a decode
                                                   # step's experts, torch against the C kernels
    python bench/realshape.py --no-served          # in process and transformers only

Shapes (`moe_workers.model.published`, written by `moectl init-model --shape`, bf16, byte
tokenizer): mixtral-8x7b 1 layer (hidden 4096, 8 experts of 14336, top-2); qwen3-30b-a3b 2
layers (2048, 128 x 768, top-8); deepseek-v3 1 layer (7168, 2048 an expert, top-8, MLA with q_lora
1536 / kv_lora 512, one shared expert) with 32 of its 256 experts (this machine's RAM holds three
copies of the layer: ours, transformers', the served app's; a step reads the same bytes);
gpt-oss-20b 1 layer (2880, 32 x 2880, top-4), and the same as it ships, experts in mxfp4
(`--quantize mxfp4`: our hot tier decodes them into [out, in], the layout a decode step reads in
one pass; transformers dequantizes them on load into its own [in, out]).

Each round, for each side in turn (so a drifting machine moves all sides alike): the machine's
read bandwidth (a reduction over 1 GiB and a 1 GiB copy counted read + write, the larger; L3 on
this machine is 480 MiB), then batch-1 and batch-16 decode (16 tokens after the first, 8-token
prompts) and a 256-token prefill on each side. The bound of a decode step: the bytes it must read
(every dense weight; the routed experts the step's tokens chose, counted distinct per layer as
our engine saw them; the KV read) over the bandwidth of that round. Figures (medians over
rounds; the JSON keeps every round):
- decode1-vs-bandwidth-<shape>, decode16-vs-bandwidth-<shape>: our in-process step time's bound over
  the step time (1.0 = reads at the machine's bandwidth); served-decode1-vs-bandwidth-<shape> the same served;
- decode1-vs-transformers-<shape>: our in-process tokens/s over transformers';
- served-vs-inprocess-decode1-<shape>, ...decode16, ...prefill: served over in-process tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from figures import report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))
sys.path.insert(0, str(REPO / "operator"))

from moe_workers.model import published  # noqa: E402

# the shapes measured: label -> (published name, layers, routed experts kept or None for all, stored form)
SHAPES = {"mixtral-8x7b": ("mixtral-8x7b", 1, None, None), "qwen3-30b-a3b": ("qwen3-30b-a3b", 2, None, None),
          "deepseek-v3": ("deepseek-v3", 1, 32, None), "gpt-oss-20b": ("gpt-oss-20b", 1, None, None),
          "gpt-oss-20b-mxfp4": ("gpt-oss-20b", 1, None, "mxfp4")}
PROMPT, DECODE_TOKENS, PREFILL = 8, 16, 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(SHAPES), help="comma-separated shapes (default: all)")
    p.add_argument("--only", choices=["kernels", "experts", "models"], default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--no-served", action="store_true", help="skip the served app (no Ray)")
    p.add_argument("--channel", choices=["shm", "unix"], default="shm",
                   help="served: the frames through shared memory (the app's default) or on the Unix socket")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--threads", type=int, default=2, help="torch threads in process and of the served Ingress")
    p.add_argument("--shard-threads", type=int, default=2,
                   help="torch threads of each shard replica (default 2: on this 2-core machine the replicas share "
                        "the cores, as the in-process side has both; the app's default is 1, pinned to its own CPU)")
    p.add_argument("--serve-env", action="append", default=["OMP_WAIT_POLICY=PASSIVE"], metavar="KEY=VALUE",
                   help="extra env var for the served app's replicas (runtime_env), repeatable; default "
                        "OMP_WAIT_POLICY=PASSIVE: replicas sharing cores, a spinning OpenMP thread would hold "
                        "the core another replica's step needs (b16 0.69 of in process with it spinning)")
    p.add_argument("--cache-dir", default=os.environ.get("MOE_BENCH_CACHE", str(Path(tempfile.gettempdir()) / "moe-bench")))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "realshape.json"))
    return p.parse_args()


# -- the machine ------------------------------------------------------------------------------------

class Bandwidth:
    """The machine's memory read rate, measured again each round: a reduction over 1 GiB (bytes
    read) and a copy of 1 GiB (bytes read + written), the larger, best of three."""

    def __init__(self, nbytes: int = 1 << 30):
        self.src = torch.ones(nbytes // 4, dtype=torch.int32)
        self.dst = torch.zeros_like(self.src)

    def measure(self) -> float:
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            self.src.max()
            t1 = time.perf_counter()
            self.dst.copy_(self.src)
            t2 = time.perf_counter()
            n = self.src.numel() * 4
            best = max(best, n / (t1 - t0), 2 * n / (t2 - t1))
        return best


def kernels(shapes: list[str], reps: int = 3) -> tuple[list[dict], dict]:
    """A decode step's matrix-vector products at each shape's expert matrices, bf16, one row:
    F.linear, our `linear` (the C matrix-vector product for one bf16 row), and gpt_oss' x @ W in transformers'
    [in, out] layout by torch and by our `in_out` (the C kernel), each over more matrices than L3
    holds, against a plain read of the same bytes."""
    from moe_workers.model.layers import in_out, linear

    rows, figures = [], {}
    for name in dict.fromkeys(SHAPES[s][0] for s in shapes):
        fields = published.overrides(name, num_layers=1)
        h = fields["hidden_size"]
        i = fields.get("moe_intermediate_size", fields["intermediate_size"])
        out_in = [(2 * i, h), (h, i)] if published.family_of(name) == "gpt_oss" else [(i, h), (h, i)]
        for o, k in out_in:
            n = max(4, (1536 << 20) // (o * k * 2))
            ws = [torch.randn(o, k).to(torch.bfloat16) for _ in range(n)]
            x = torch.randn(1, k).to(torch.bfloat16)

            def rate(fn, mats) -> float:
                fn(mats[0])
                best = min(_timed(lambda: [fn(m) for m in mats]) for _ in range(reps))
                return n * o * k * 2 / best / 1e9

            row = {"shape": name, "matrix": f"{o}x{k}", "read_gbs": rate(lambda m: m.view(torch.int32).max(), ws),
                   "f_linear_gbs": rate(lambda m: F.linear(x, m), ws), "ours_gbs": rate(lambda m: linear(x, m), ws)}
            if published.family_of(name) == "gpt_oss":
                wt = [m.t().contiguous() for m in ws]  # [in, out], as transformers and our store keep them
                del ws
                row["in_out_layout_gbs"] = rate(lambda m: x @ m, wt)
                row["in_out_ours_gbs"] = rate(lambda m: in_out(x, m), wt)  # the C kernel where it builds
            rows.append(row)
            extra = (f", x @ W [in, out] {row['in_out_layout_gbs']:.1f}, ours in [in, out] {row['in_out_ours_gbs']:.1f}"
                     if "in_out_layout_gbs" in row else "")
            print(f"{name:14s} {row['matrix']:>11s}: read {row['read_gbs']:.1f} GB/s, F.linear {row['f_linear_gbs']:.1f}, "
                  f"ours {row['ours_gbs']:.1f}{extra}", flush=True)
    for name in dict.fromkeys(SHAPES[s][0] for s in shapes):
        if published.family_of(name) != "gpt_oss":
            rows.append(_experts_step(next(s for s in shapes if SHAPES[s][0] == name), reps))
    for name in dict.fromkeys(SHAPES[s][0] for s in shapes):
        mine = [r for r in rows if r["shape"] == name and "ours_gbs" in r]
        figures[f"matvec-vs-read-{name}"] = min(r["ours_gbs"] / r["read_gbs"] for r in mine)
        step = [r for r in rows if r["shape"] == name and "step_native_gbs" in r]
        if step:
            figures[f"experts-step-native-over-torch-{name}"] = step[0]["step_native_gbs"] / step[0]["step_torch_gbs"]
    return rows, figures


def _experts_step(label: str, reps: int, batch: int = 1, bandwidth: "Bandwidth | None" = None) -> dict:
    """One decode step's routed experts at the shape: `batch` tokens, each routed to top-k of the
    layer's experts at random (fixed seed; batch 1: k experts of one row each). Expert by expert
    through torch (`layers.expert_forward`: SwiGLU's three products, or gpt_oss' two with their
    biases and its clamped activation; the products the C matrix-vector kernels where they apply)
    against the C kernels (`experts.native_rows`: every expert's gate/up rows in one call, then
    the down rows), over more weights than L3 holds; GB/s of weights read and ms a step, against
    a plain read of the same bytes and, given `bandwidth`, the step's bound (its bytes over the
    machine's read rate). gpt_oss' experts as the hot tier keeps them: bf16 in transformers'
    [in, out], or decoded from mxfp4 into [out, in] (the `-mxfp4` label)."""
    from types import SimpleNamespace

    from moe_workers.model.experts import native_rows
    from moe_workers.model.layers import expert_forward

    name, form = SHAPES[label][0], SHAPES[label][3]
    fields = published.overrides(name, num_layers=1)
    h = fields["hidden_size"]
    i = fields.get("moe_intermediate_size", fields["intermediate_size"])
    k, n_experts = fields["num_experts_per_tok"], published.expert_count(name)
    gpt_oss, out_in = published.family_of(name) == "gpt_oss", form == "mxfp4"
    cfg = SimpleNamespace(expert_act="gpt_oss" if gpt_oss else "silu", swiglu_alpha=1.702, swiglu_limit=7.0,
                          experts_out_in=out_in)  # all expert_forward and native_rows ask of the config
    if not gpt_oss:
        shapes = (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i)))
    elif out_in:
        shapes = (("gate_up", (2 * i, h)), ("gate_up_bias", (2 * i,)), ("down", (h, i)), ("down_bias", (h,)))
    else:
        shapes = (("gate_up", (h, 2 * i)), ("gate_up_bias", (2 * i,)), ("down", (i, h)), ("down_bias", (h,)))
    g = torch.Generator().manual_seed(batch)
    picks = [e for _ in range(batch) for e in torch.randperm(n_experts, generator=g)[:k].tolist()]
    counts = [picks.count(e) for e in sorted(set(picks))]
    per_step = len(counts) * sum(2 * torch.Size(shape).numel() for _, shape in shapes)
    sets = max(1, round((1536 << 20) / per_step))
    steps = [[{p: (torch.randn(*shape) * 0.02).to(torch.bfloat16) for p, shape in shapes} for _ in counts]
             for _ in range(sets)]
    xs = [torch.randn(c, h).to(torch.bfloat16) for c in counts]
    outs = [torch.empty(c, h, dtype=torch.bfloat16) for c in counts]

    def rate(fn) -> float:
        fn(steps[0])
        best = min(_timed(lambda: [fn(st) for st in steps]) for _ in range(reps))
        return sets * per_step / best / 1e9

    def native(st):
        assert native_rows(cfg, xs, st, outs), "the C kernels do not apply here"

    row = {"shape": label, "batch": batch, "experts": len(counts), "rows": counts,
           "matrix": f"{len(counts)} experts x {len(shapes) if not gpt_oss else 2} x {i}x{h}",
           "read_gbs": rate(lambda st: [w[p].view(torch.int32).max() for w in st for p in w]),
           "step_torch_gbs": rate(lambda st: [expert_forward(cfg, x, w) for x, w in zip(xs, st)]),
           "step_native_gbs": rate(native)}
    row["step_torch_ms"], row["step_native_ms"] = (per_step / row[f"step_{s}_gbs"] / 1e6 for s in ("torch", "native"))
    bound = ""
    if bandwidth is not None:
        row["bandwidth_gbs"] = bandwidth.measure() / 1e9
        row["bound_ms"] = per_step / row["bandwidth_gbs"] / 1e6
        bound = f"; bound {row['bound_ms']:.2f} ms ({row['bandwidth_gbs']:.1f} GB/s)"
    print(f"{label:18s} b{batch:<3d} {row['matrix']:>24s} (rows {min(counts)}-{max(counts)}): read "
          f"{row['read_gbs']:.1f} GB/s; expert by expert (torch) {row['step_torch_ms']:.2f} ms "
          f"({row['step_torch_gbs']:.1f} GB/s), one call a phase (C) {row['step_native_ms']:.2f} ms "
          f"({row['step_native_gbs']:.1f} GB/s): {row['step_torch_ms'] / row['step_native_ms']:.2f}x{bound}",
          flush=True)
    return row


def experts(labels: list[str], batches: list[int], reps: int = 3) -> tuple[list[dict], dict]:
    """`_experts_step` at each shape and batch, with the step's bound; figures
    experts-step-native-over-torch-<shape>-b<batch> (torch's step time over the C kernels')."""
    bandwidth, rows, figures = Bandwidth(), [], {}
    for label in labels:
        for b in batches:
            row = _experts_step(label, reps, b, bandwidth)
            rows.append(row)
            figures[f"experts-step-native-over-torch-{label}-b{b}"] = row["step_torch_ms"] / row["step_native_ms"]
    return rows, figures


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- the checkpoints --------------------------------------------------------------------------------

def checkpoint(cache: Path, label: str) -> Path:
    name, layers, experts, form = SHAPES[label]
    path = cache / "realshape" / (f"{name}-l{layers}" + (f"-e{experts}" if experts else "") + (f"-{form}" if form else ""))
    if not (path / "config.json").is_file():
        import subprocess

        cmd = [sys.executable, "-m", "moe_operator.cli.main", "init-model", str(path), "--shape", name,
               "--layers", str(layers), "--dtype", "bfloat16", "--force"] + (["--experts", str(experts)] if experts else [])
        cmd += ["--quantize", form] if form else []
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'workers'}"})
    return path


def step_bytes(path: Path, distinct_experts: float, context: int, batch: int) -> float:
    """Bytes one decode step must read: every dense weight but the embedding (a row per token),
    `distinct_experts` routed experts a MoE layer, the KV of `batch` sequences of `context` tokens."""
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.kv_blocks import token_numel

    ckpt = Checkpoint(path)
    cfg = ckpt.config
    dense = sum(ckpt.info(n).nbytes for n in ckpt.names() if ".experts." not in n and "embed_tokens" not in n)
    experts = distinct_experts * len(cfg.sparse_layers) * cfg.expert_bytes
    kv = batch * context * cfg.num_layers * token_numel(cfg) * 2
    return dense + experts + kv


# -- the three sides --------------------------------------------------------------------------------

def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def prompts_without_eos(ours: "Ours", n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts whose greedy continuation has no end-of-sequence token in its first
    DECODE_TOKENS + 1 (the served app stops a sequence there; every side must decode them all)."""
    cfg = ours.model.cfg
    out: list[list[int]] = []
    while len(out) < n:
        seed += 1000
        ps = prompts(n - len(out), length, cfg.vocab_size, seed)
        tokens = ours.model.generate(ps, max_tokens=DECODE_TOKENS + 1)
        out += [p for p, t in zip(ps, tokens) if cfg.eos_token_id not in t]
    return out


class Ours:
    """Our engine in this process; counts the distinct routed experts each MoE layer's step used."""
    label = "in process"

    def __init__(self, path: Path, batch: int):
        from moe_workers.model.inprocess import InProcessModel

        self.model = InProcessModel(path, max_len=PREFILL + 32, max_sequences=batch)
        self.distinct: list[int] = []
        self.batch = 0
        moe = self.model.experts.moe

        def counting(layer, x, indices, weights):
            if indices.shape[0] == self.batch:  # a decode step's (the prompt's step has more rows)
                self.distinct.append(int(indices.unique().numel()))
            return moe(layer, x, indices, weights)

        self.model.experts.moe = counting
        self.model.generate([[5, 6, 7]], max_tokens=2)

    def decode_step_s(self, ps: list[list[int]]) -> float:
        one = _timed(lambda: self.model.generate(ps, max_tokens=1))
        self.distinct.clear()
        self.batch = len(ps)
        full = _timed(lambda: self.model.generate(ps, max_tokens=DECODE_TOKENS + 1))
        return (full - one) / DECODE_TOKENS

    def prefill_s(self, prompt: list[int]) -> float:
        return _timed(lambda: self.model.generate([prompt], max_tokens=1))


class Transformers:
    label = "transformers"

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.decode_step_s(prompts(1, PROMPT, 200, 0))

    @torch.inference_mode()
    def _generate(self, ps: list[list[int]], n: int) -> None:
        self.model.generate(torch.tensor(ps), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def decode_step_s(self, ps: list[list[int]]) -> float:
        one = _timed(lambda: self._generate(ps, 1))
        return (_timed(lambda: self._generate(ps, DECODE_TOKENS + 1)) - one) / DECODE_TOKENS

    def prefill_s(self, prompt: list[int]) -> float:
        return _timed(lambda: self._generate([prompt], 1))


class Served:
    """The app on a local Ray head: Ingress + 2 shard groups, experts split between them."""
    label = "served"

    def __init__(self, url: str, stats):
        self.url, self.stats = url, stats
        self.breakdown: dict[int, list[dict]] = {}

    def _all(self, ps: list[list[int]], n: int) -> float:
        from serving import _concurrent

        return _timed(lambda: _concurrent(self.url, [{"prompt": p, "max_tokens": n, "temperature": 0} for p in ps]))

    def decode_step_s(self, ps: list[list[int]]) -> float:
        """Also keeps where the decode steps' time went: the Ingress' dense compute, its wait on
        the expert calls, the busiest shard's compute (per step, the prompt's step included)."""
        one = self._all(ps, 1)
        (e0, s0) = self.stats()
        full = self._all(ps, DECODE_TOKENS + 1)
        (e1, s1) = self.stats()
        steps = max(1, e1["steps"] - e0["steps"])
        self.breakdown.setdefault(len(ps), []).append({
            "wall_ms": full / steps * 1e3, "dense_ms": (e1["dense_s"] - e0["dense_s"]) / steps * 1e3,
            "expert_wait_ms": (e1["experts_s"] - e0["experts_s"]) / steps * 1e3,
            "shard_compute_max_ms": max(b["compute_s"] - a["compute_s"] for a, b in zip(s0, s1)) / steps * 1e3})
        return (full - one) / DECODE_TOKENS

    def prefill_s(self, prompt: list[int]) -> float:
        return self._all([prompt], 1)


# -- one shape --------------------------------------------------------------------------------------

def measure(sides: list, bandwidth: Bandwidth, rounds: int, batches: list[int]) -> dict:
    """Rounds of every side in turn (ours first); per side and batch the step times, per round
    the bandwidth."""
    ours = sides[0]
    vocab = ours.model.cfg.vocab_size
    runs: dict = {"bandwidth": [], "distinct": {b: [] for b in batches}}
    for side in sides:
        runs[side.label] = {f"decode{b}": [] for b in batches} | {"prefill": []}
    for r in range(rounds):
        runs["bandwidth"].append(bandwidth.measure())
        for b in batches:
            ps = prompts_without_eos(ours, b, PROMPT, 10 + r)
            for side in sides:
                runs[side.label][f"decode{b}"].append(side.decode_step_s(ps))
                if side is ours:
                    runs["distinct"][b].append(statistics.mean(ours.distinct))
        prompt = prompts(1, PREFILL, vocab, 100 + r)[0]
        for side in sides:
            runs[side.label]["prefill"].append(side.prefill_s(prompt))
        print(f"  round {r + 1}: {runs['bandwidth'][-1] / 1e9:.1f} GB/s; " + "; ".join(
            f"{s.label} " + ", ".join(f"b{b} {runs[s.label][f'decode{b}'][-1] * 1e3:.1f} ms" for b in batches)
            + f", prefill {runs[s.label]['prefill'][-1]:.2f} s" for s in sides), flush=True)
    return runs


def summarize(name: str, path: Path, runs: dict, batches: list[int], sides: list[str]) -> tuple[dict, dict]:
    out, figures = {}, {}
    bw = runs["bandwidth"]
    for b in batches:
        distinct = statistics.median(runs["distinct"][b])
        need = step_bytes(path, distinct, PROMPT + DECODE_TOKENS // 2, b)
        out[f"decode{b}_step_bytes"] = need
        out[f"decode{b}_distinct_experts"] = distinct
        for side in sides:
            steps = runs[side][f"decode{b}"]
            ratios = [need / g / s for g, s in zip(bw, steps)]
            out[f"{side} decode{b}"] = {"ms": statistics.median(steps) * 1e3, "tokens_s": b / statistics.median(steps),
                                        "vs_bandwidth": statistics.median(ratios),
                                        "vs_bandwidth_range": [min(ratios), max(ratios)]}
        figures[f"decode{b}-vs-bandwidth-{name}"] = out[f"in process decode{b}"]["vs_bandwidth"]
        if "served" in sides:
            figures[f"served-decode{b}-vs-bandwidth-{name}"] = out[f"served decode{b}"]["vs_bandwidth"]
            ratio = [i / s for i, s in zip(runs["in process"][f"decode{b}"], runs["served"][f"decode{b}"])]
            out[f"served-vs-inprocess decode{b}"] = {"median": statistics.median(ratio), "range": [min(ratio), max(ratio)]}
            figures[f"served-vs-inprocess-decode{b}-{name}"] = statistics.median(ratio)
        if "transformers" in sides:
            ratio = [t / i for i, t in zip(runs["in process"][f"decode{b}"], runs["transformers"][f"decode{b}"])]
            out[f"vs-transformers decode{b}"] = {"median": statistics.median(ratio), "range": [min(ratio), max(ratio)]}
            figures[f"decode{b}-vs-transformers-{name}"] = statistics.median(ratio)
    for side in sides:
        out[f"{side} prefill_tokens_s"] = PREFILL / statistics.median(runs[side]["prefill"])
    if "served" in sides:
        ratio = [i / s for i, s in zip(runs["in process"]["prefill"], runs["served"]["prefill"])]
        figures[f"served-vs-inprocess-prefill-{name}"] = statistics.median(ratio)
    if "transformers" in sides:
        ratio = [t / i for i, t in zip(runs["in process"]["prefill"], runs["transformers"]["prefill"])]
        figures[f"prefill-vs-transformers-{name}"] = statistics.median(ratio)
    out["bandwidth_gbs"] = [g / 1e9 for g in bw]
    return out, figures


def print_table(name: str, out: dict, batches: list[int], sides: list[str]) -> None:
    print(f"\n{name}: bandwidth {statistics.median(out['bandwidth_gbs']):.1f} GB/s (rounds "
          f"{min(out['bandwidth_gbs']):.1f}-{max(out['bandwidth_gbs']):.1f})")
    print(f"  {'':14s}" + "".join(f"{s:>26s}" for s in sides))
    for b in batches:
        print(f"  decode b{b:<3d} ms" + "".join(f"{out[f'{s} decode{b}']['ms']:17.1f} ({out[f'{s} decode{b}']['vs_bandwidth']:.2f} bw)"
                                           for s in sides)
              + f"   reads {out[f'decode{b}_step_bytes'] / 2**20:.0f} MiB a step "
                f"({out[f'decode{b}_distinct_experts']:.1f} experts a layer)")
    print(f"  {'prefill tok/s':16s}" + "".join(f"{out[f'{s} prefill_tokens_s']:26.1f}" for s in sides))


@contextlib.contextmanager
def served(path: Path, threads: int, shard_threads: int, batch: int, env: dict[str, str], channel: str = "shm"):
    from serving import served_app

    from moe_workers.model.config import MoEConfig

    cfg = MoEConfig.from_dir(path)
    with served_app(path, 2, threads, shard_threads, cfg.num_layers, cfg.num_experts, 1, env, batch) as (url, stats, _):
        if channel != "shm":  # the frames on the Unix socket (the app's default is shared memory)
            from ray import serve

            serve.get_app_handle("bench").tune_channel.remote(shared_memory=False).result()
        yield Served(url, stats)


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    names = [n.strip() for n in a.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        sys.exit(f"--families: {', '.join(unknown)} not among {', '.join(SHAPES)}")
    batches = [int(b) for b in a.batches.split(",")]
    results, figures = {"machine": {"cores": os.cpu_count(), "torch": torch.__version__, "threads": a.threads,
                                "shard_threads": a.shard_threads}}, {}
    if a.only in (None, "kernels"):
        print("matrix-vector products at the experts' shapes (bf16, one row):")
        results["kernels"], f = kernels(names)
        figures.update(f)
    if a.only == "experts":
        print("a decode step's routed experts (bf16), expert by expert in torch against the C kernels:")
        results["experts"], f = experts(names, batches)
        figures.update(f)
    if a.only in (None, "models") and len(names) > 1:
        # a process per shape: each starts its own Ray head (Serve keeps its first cluster's
        # client for the life of a driver) and gives its memory back before the next loads
        import json
        import subprocess

        for name in names:
            part = Path(a.out).with_suffix(f".{name}.json")
            cmd = [sys.executable, __file__, "--only", "models", "--families", name, "--out", str(part),
                   "--rounds", str(a.rounds), "--batches", a.batches, "--threads", str(a.threads),
                   "--shard-threads", str(a.shard_threads), "--cache-dir", a.cache_dir]
            cmd += [x for kv in a.serve_env[1:] for x in ("--serve-env", kv)]  # the default is there already
            cmd += ["--no-served"] * a.no_served + ["--no-transformers"] * a.no_transformers
            subprocess.run(cmd, check=True)
            got = json.loads(part.read_text())
            figures.update(got.pop("figures"))
            results[name] = got[name]
    elif a.only in (None, "models"):
        bandwidth = Bandwidth()
        for name in names:
            path = checkpoint(Path(a.cache_dir), name)
            print(f"\n{name}: {path}", flush=True)
            sides = [Ours(path, max(batches))]
            if not a.no_transformers:
                sides.append(Transformers(path))
            with contextlib.ExitStack() as stack:
                if not a.no_served:
                    sides.append(stack.enter_context(served(path, a.threads, a.shard_threads, max(batches),
                                                            dict(kv.split("=", 1) for kv in a.serve_env),
                                                            a.channel)))
                runs = measure(sides, bandwidth, a.rounds, batches)
            labels = [s.label for s in sides]
            out, f = summarize(name, path, runs, batches, labels)
            for side in sides:
                if isinstance(side, Served):
                    out["served_breakdown"] = side.breakdown
                    for b, rows in side.breakdown.items():
                        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                        print(f"  served b{b}, a step: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f} ms"
                                                                     for k, v in med.items()))
            results[name] = {"runs": runs, **out}
            figures.update(f)
            print_table(name, out, batches, labels)
    return report(a.out, results, figures)


if __name__ == "__main__":
    sys.exit(main())
