"""bf16 self-consistency of the decode path and the prompt path, teacher-forced, on a deep random model.

    python bench/consistency.py                        # gpt_oss and qwen3_moe, 8 layers
    python bench/consistency.py --families gpt_oss --hidden 512

One random checkpoint per family, written in bfloat16 (the float32 model has the same weights),
loaded twice in process (`InProcessModel`): in bfloat16 and in float32 (the reference). The same prompts go through
- the prompt path: every position in one prefill (`prompt_logits`),
- the decode path: the same tokens fed one a step, each step's logits kept,
in bf16, and through the prompt path in fp32. Per family: how many positions' argmax agree
(decode against prompt, each against fp32) and the mean |logit difference| against fp32 per path.
llama.cpp's figure to hold this against (issue #66): 57 / 64 decode-vs-prompt on an 8-layer gpt-oss.
Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from figures import report, scratch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from moe_workers.model.dense import Chunk  # noqa: E402
from moe_workers.model.inprocess import InProcessModel  # noqa: E402
from moe_workers.model.random_init import write_random_checkpoint  # noqa: E402


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["gpt_oss", "qwen3_moe"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--length", type=int, default=64, help="tokens a prompt (positions: prompts x length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-scale", type=float, default=1.0,
                    help="router weights' std over 0.02 (write_random_checkpoint): > 1 sharpens routing")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "consistency.json"))
    return ap.parse_args()


@torch.inference_mode()
def decode_logits(model: InProcessModel, ids: list[int]) -> torch.Tensor:
    """Each position's logits with the tokens fed one a decode step (teacher-forced)."""
    seq = model.cache.allocate()
    try:
        return torch.cat([model.step([Chunk(seq, i, [t])]) for i, t in enumerate(ids)])
    finally:
        model.cache.release(seq)


def measure(path: Path, prompts: list[list[int]]) -> dict:
    bf16 = InProcessModel(path, dtype="bfloat16", max_sequences=2)
    fp32 = InProcessModel(path, dtype="float32", max_sequences=2)
    prompt = torch.cat([bf16.prompt_logits(p).float() for p in prompts])
    decode = torch.cat([decode_logits(bf16, p).float() for p in prompts])
    ref = torch.cat([fp32.prompt_logits(p).float() for p in prompts])
    ref_decode = torch.cat([decode_logits(fp32, p).float() for p in prompts])
    am = {k: v.argmax(-1) for k, v in
          {"prompt": prompt, "decode": decode, "ref": ref, "ref_decode": ref_decode}.items()}
    return {
        "positions": int(prompt.shape[0]),
        "decode_vs_prompt": int((am["decode"] == am["prompt"]).sum()),
        "prompt_vs_fp32": int((am["prompt"] == am["ref"]).sum()),
        "decode_vs_fp32": int((am["decode"] == am["ref"]).sum()),
        "fp32_decode_vs_prompt": int((am["ref_decode"] == am["ref"]).sum()),
        "prompt_mean_abs_vs_fp32": float((prompt - ref).abs().mean()),
        "decode_mean_abs_vs_fp32": float((decode - ref).abs().mean()),
        "decode_mean_abs_vs_prompt": float((decode - prompt).abs().mean()),
        "fp32_logit_std": float(ref.std()),
    }


def main() -> int:
    a = parse_args()
    g = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(0, a.vocab, (a.length,), generator=g).tolist() for _ in range(a.prompts)]
    shape = dict(hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers, num_experts=a.experts,
                 top_k=a.top_k, vocab_size=a.vocab, num_heads=8, num_kv_heads=2)
    results, figures = {"shape": shape, "threads": torch.get_num_threads(), "families": {}}, {}
    root = scratch("moe-consistency-")
    for family in a.families:
        t0 = time.perf_counter()
        path = write_random_checkpoint(root / family, family, seed=a.seed, dtype=torch.bfloat16,
                                       router_scale=a.router_scale, **shape)
        r = measure(path, prompts)
        results["families"][family] = r
        n = r["positions"]
        print(f"{family}: decode==prompt {r['decode_vs_prompt']}/{n}  prompt==fp32 {r['prompt_vs_fp32']}/{n}  "
              f"decode==fp32 {r['decode_vs_fp32']}/{n}  (fp32 decode==prompt {r['fp32_decode_vs_prompt']}/{n})  "
              f"mean|logit - fp32|: prompt {r['prompt_mean_abs_vs_fp32']:.4f} decode {r['decode_mean_abs_vs_fp32']:.4f}"
              f"  mean|decode - prompt| {r['decode_mean_abs_vs_prompt']:.4f}"
              f"  (fp32 logit std {r['fp32_logit_std']:.3f})"
              f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        figures[f"decode-vs-prompt-argmax-{family}"] = r["decode_vs_prompt"]
        figures[f"prompt-vs-fp32-argmax-{family}"] = r["prompt_vs_fp32"]
        figures[f"decode-vs-fp32-argmax-{family}"] = r["decode_vs_fp32"]
        figures[f"prompt-mean-abs-vs-fp32-{family}"] = r["prompt_mean_abs_vs_fp32"]
        figures[f"decode-mean-abs-vs-fp32-{family}"] = r["decode_mean_abs_vs_fp32"]
    return report(a.out, results, figures, digits=4)


if __name__ == "__main__":
    raise SystemExit(main())
