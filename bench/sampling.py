"""The sampling step at the published vocabularies: our batched sampler (model/sampling.py) against
the same parameters sampled row by row (a per-sequence loop, as the engine sampled before) and
against transformers' logits processors on the whole batch (which take one value per parameter
for the batch, not one per sequence).

    python bench/sampling.py                          # every vocabulary, batch 1, 16 and 64
    python bench/sampling.py --vocab qwen3-30b-a3b --batches 64

Workloads, every row the same parameters (so that transformers can run them too):
- greedy: temperature 0, nothing else (the engine's fast path, one argmax);
- nucleus: temperature 0.8, top_p 0.95;
- full: temperature 0.8, top_k 50, top_p 0.95, min_p 0.05, repetition_penalty 1.1,
  presence 0.5 and frequency 0.3 (transformers: no presence / frequency processor, so its row
  runs the rest), 8 logit_bias entries, a 2,048-token prompt and 256 tokens of output per row.
Figures: batched-vs-rowwise-<workload>-b<batch>-<vocab> (row-by-row time over batched time: how
much the batching saves) and batched-vs-transformers-full-b<batch>-<vocab> (transformers' time
over ours). Medians of 7 repeats after a warm-up; torch threads as set (default: all cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from figures import report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from moe_workers.model.published import VOCAB_SIZES  # noqa: E402
from moe_workers.model.sampling import History, SamplingParams, sample_batch  # noqa: E402

WORKLOADS = {
    "greedy": SamplingParams(),
    "nucleus": SamplingParams(temperature=0.8, top_p=0.95),
    "full": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                           presence_penalty=0.5, frequency_penalty=0.3,
                           logit_bias=tuple((7 + 13 * i, 1.0) for i in range(8))),
}
PROMPT, OUTPUT = 2048, 256


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", nargs="+", default=["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b"],
                    choices=sorted(VOCAB_SIZES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sampling.json"))
    return ap.parse_args()


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transformers_full(p: SamplingParams):
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    procs = LogitsProcessorList([SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias]),
                                 RepetitionPenaltyLogitsProcessor(p.repetition_penalty),
                                 TemperatureLogitsWarper(p.temperature), TopKLogitsWarper(p.top_k),
                                 TopPLogitsWarper(p.top_p), MinPLogitsWarper(p.min_p)])

    def run(logits, input_ids):
        scores = procs(input_ids, logits.double())
        return torch.multinomial(torch.softmax(scores, dim=-1), 1)

    return run


def main() -> int:
    a = parse_args()
    rows, figures = [], {}
    for name in a.vocab:
        vocab = VOCAB_SIZES[name]
        for batch in a.batches:
            g = torch.Generator().manual_seed(batch)
            logits = torch.randn(batch, vocab, generator=g) * 4
            ids = torch.randint(0, vocab, (batch, PROMPT + OUTPUT), generator=g)
            histories = [History(vocab, r[:PROMPT].tolist(), r[PROMPT:].tolist()) for r in ids]
            gens = [torch.Generator().manual_seed(i) for i in range(batch)]
            for work, p in WORKLOADS.items():
                hist = histories if p.penalized else None
                batched = timed(lambda: sample_batch(logits, [p] * batch, gens, hist), a.repeats)
                rowwise = timed(lambda: [sample_batch(logits[i:i + 1], [p], gens[i:i + 1],
                                                      hist[i:i + 1] if hist else None) for i in range(batch)],
                                a.repeats)
                row = {"vocab": name, "vocab_size": vocab, "batch": batch, "workload": work,
                       "batched_ms": batched * 1e3, "rowwise_ms": rowwise * 1e3}
                figures[f"batched-vs-rowwise-{work}-b{batch}-{name}"] = rowwise / batched
                if work == "full":
                    ref = transformers_full(p)
                    row["transformers_ms"] = timed(lambda: ref(logits, ids), a.repeats) * 1e3
                    figures[f"batched-vs-transformers-full-b{batch}-{name}"] = row["transformers_ms"] / row["batched_ms"]
                rows.append(row)
                print(f"{name:>14} b{batch:<3} {work:>8}: batched {row['batched_ms']:8.2f} ms, row by row "
                      f"{row['rowwise_ms']:8.2f} ms" + (f", transformers {row['transformers_ms']:8.2f} ms"
                                                      if "transformers_ms" in row else ""), flush=True)
    return report(a.out, {"threads": torch.get_num_threads(), "rows": rows}, figures)


if __name__ == "__main__":
    raise SystemExit(main())
