"""Batch-1 decode the way users get it: `moectl up` on a plain manifest, a streaming HTTP client,
against the same checkpoint in process, alternating in one window.

    python bench/standalone_decode.py                    # 4, 16, 32 layers, 3 rounds each
    python bench/standalone_decode.py --layers 16 --rounds 5

The model is the depth sweep's (`bench/serving.py --only deep`: hidden 256, intermediate 512, 8
experts top-2, vocab 4096). The manifest sets only what a user would (2 expert groups, `numCpus`
0.5 for the Ingress and 0.25 a group, as the standalone examples do on this 2-core machine; hot
and warm tiers of 1 GiB, which hold every expert); every
channel and thread setting is the app's default, unlike bench/serving.py, which sets the torch
threads and CPUs of each side by hand. The client streams one completion of 33 tokens
(`"stream": true`, `requests` reading the SSE lines) and takes the median gap between tokens
after the first; the in-process side (`InProcessModel`, 1 torch thread, as the Ingress' default)
times the same 32 tokens after the first. Figures: `standalone-decode1-ratio-<n>-layers` (in
process ms a token over the stream's) and `standalone-dispatch-ms-per-layer-<n>-layers`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch
import yaml

from figures import report, scratch
from serving import REPO, ensure_checkpoint, inprocess_ms_per_token, wait_until_serving

sys.path.insert(0, str(REPO / "workers"))
sys.path.insert(0, str(REPO / "operator"))

TOKENS = 33


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="4,16,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-dir", default=os.environ.get("MOE_BENCH_CACHE", "/tmp/moe-bench"))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "standalone_decode.json"))
    return p.parse_args()


def streamed_gaps_ms(url: str, prompt: list[int]) -> list[float]:
    """The gaps between a streamed completion's tokens after the first (ms)."""
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    stamps = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
    return [(b - a) * 1000 for a, b in zip(stamps[1:], stamps[2:])]


def point(a, n: int) -> dict:
    from moe_operator.standalone.local_ray import free_port
    from moe_workers.model.inprocess import InProcessModel

    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=n, num_heads=8, num_kv_heads=2,
                 num_experts=8, top_k=2, max_position_embeddings=512)
    path = ensure_checkpoint(a.cache_dir, shape, "mixtral")
    torch.set_num_threads(1)
    model = InProcessModel(path, max_len=512, max_sequences=2)
    prompt = [5, 6, 7]
    model.generate([prompt], max_tokens=4)

    moectl = str(Path(sys.executable).with_name("moectl"))
    work = scratch("moe-bench-standalone-")
    env = {**os.environ, "MOE_STATE_DIR": str(work / "state")}
    os.symlink(path, work / "model")
    manifest = {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "decode"},
                "spec": {"model": {"path": "model"}, "ingress": {"numCpus": 0.5},
                         "experts": {"groups": 2, "numCpus": 0.25,
                                     "tiers": {"hot": {"budget": "1Gi"}, "warm": {"budget": "1Gi"}}}}}
    (work / "decode.yaml").write_text(yaml.safe_dump(manifest))
    port = free_port()
    log = open(work / "up.log", "w+")
    proc = subprocess.Popen([moectl, "up", "-f", str(work / "decode.yaml"), "--port", str(port), "--num-cpus", "4",
                             "--allowed-root", str(path.parent), "--allowed-root", str(work)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    rounds = []
    try:
        wait_until_serving(proc, work / "up.log")
        streamed_gaps_ms(url, prompt)  # warm-up
        for _ in range(a.rounds):
            lm = inprocess_ms_per_token(model, prompt, TOKENS)
            sm = statistics.median(streamed_gaps_ms(url, prompt))
            rounds.append({"in_process_ms": lm, "streamed_ms": sm})
            print(f"  {n} layers: in-process {lm:.2f} ms a token, streamed through moectl up {sm:.2f} ms "
                  f"({lm / sm:.2f})", flush=True)
        channel = requests.get(url + "/moe/v1/status", timeout=30).json()["channel"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    lm = statistics.median(r["in_process_ms"] for r in rounds)
    sm = statistics.median(r["streamed_ms"] for r in rounds)
    via = sorted({r["via"] for rs in channel["members"].values() for r in rs})
    return {"layers": n, "in_process_ms": lm, "streamed_ms": sm, "ratio": lm / sm, "dispatch_ms_per_layer": (sm - lm) / n,
            "via": via, "rounds": rounds}


def main() -> int:
    a = parse_args()
    rows, figures = [], {}
    for n in [int(x) for x in a.layers.split(",") if x.strip()]:
        row = point(a, n)
        rows.append(row)
        print(f"{n} layers: ratio {row['ratio']:.3f}, dispatch {row['dispatch_ms_per_layer']:.3f} ms a layer "
              f"(channel via {row['via']})", flush=True)
        figures[f"standalone-decode1-ratio-{n}-layers"] = row["ratio"]
        figures[f"standalone-dispatch-ms-per-layer-{n}-layers"] = row["dispatch_ms_per_layer"]
    return report(a.out, {"rows": rows}, figures)


if __name__ == "__main__":
    raise SystemExit(main())
