"""Several Ingress replicas: prefix-aware routing against Serve's default router, and the Ingress
scaling itself on a load step against a scale the user asks for, on one local Ray (2-core machine).

    python bench/ingress.py            # 12 tenants, system prompts of ~1,200 tokens, 2 Ingress replicas
    python bench/ingress.py --quick    # fewer requests, for a smoke run

Part A, multi-tenant chat. Two apps run side by side on one Ray head, each with 2 Ingress replicas
and 2 shard groups (Mixtral layout, hidden 512, 4 layers, 8 experts, top-2, fp32, byte
tokenizer): one with the prefix-affinity router (spec.ingress.prefixRouting, the default), one with
Serve's power of two choices. Each replica's KV cache holds about 8k tokens, two thirds of the
tenants' system prompts together: a replica that sees every tenant evicts them; one that sees half
keeps them. Clients (8 at once) send streamed chat requests, each of a random tenant (system prompt
+ a short question, 8 new tokens); the two apps take turns, a fresh set of tenants each round. Per
side: the prefix hit ratio (cached / prompt tokens, from usage) and time to first token p50 / p99.

Part B, an Ingress that scales (min 1, max 2, target 2 requests a replica, upscale delay 0): from 1
client to 8 at once; the time until the second replica serves and is counted by the admission gate
(status: 2 replicas live, capacity doubled), and requests that failed meanwhile (must be 0). The
reference: the same app with a fixed count asked from 1 to 2 (the Serve config's num_replicas, as
`spec.ingress.replicas` does), timed the same way: the autoscaler's share is the difference.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import threading
import time
from pathlib import Path

import requests

from figures import report, scratch

REPO = Path(__file__).resolve().parents[1]
LAYERS, EXPERTS, HIDDEN, KV_HEADS, HEAD_DIM = 4, 8, 512, 2, 64
KV_TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # fp32


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--system-chars", type=int, default=1200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=96, help="per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache per Ingress replica, in tokens")
    p.add_argument("--out", default=str(REPO / "bench/results/ingress.json"))
    return p.parse_args()


def checkpoint(root: Path) -> Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
    from moe_workers.serve.openai.chat import write_tokenizer_config

    path = root / "ckpt"
    cfg = MixtralConfig(vocab_size=BYTE_VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=LAYERS,
                        num_attention_heads=8, num_key_value_heads=KV_HEADS, num_local_experts=EXPERTS,
                        num_experts_per_tok=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).save_pretrained(path)
    write_byte_tokenizer(path)
    write_tokenizer_config(path)
    return path


def app_args(path: Path, kv_tokens: int, **extra):
    from moe_workers.serve.config import AppArgs

    return AppArgs(model_path=str(path), served_model_name="bench", num_groups=2, max_batch_size=8,
                   max_queued_requests=64, kv_cache_budget_bytes=kv_tokens * KV_TOKEN_BYTES, max_model_len=2048,
                   ingress_num_cpus=0.25, shard_num_cpus=0.25, warm_spares=0, **extra)


def placement() -> dict[str, list[str]]:
    return {f"ExpertShard-{g}": [f"{l}.{e}" for l in range(LAYERS) for e in range(EXPERTS) if e % 2 == g]
            for g in range(2)}


def stream_chat(url: str, messages: list[dict], max_tokens: int = 8) -> dict:
    """One streamed chat request: status, time to its first token, and its usage."""
    start = time.monotonic()
    out = {"status": 0, "ttft_s": None, "usage": None, "error": ""}
    try:
        with requests.post(url + "/v1/chat/completions", stream=True, timeout=300,
                           json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                 "stream_options": {"include_usage": True}}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if out["ttft_s"] is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                    out["ttft_s"] = time.monotonic() - start
                out["usage"] = chunk.get("usage") or out["usage"]
    except requests.RequestException as e:
        out["error"] = e.__class__.__name__
    return out


def tenants(seed: int, n: int, chars: int) -> list[str]:
    rng = random.Random(seed)
    words = ["catalogue", "delivery", "warranty", "invoice", "return", "discount", "order", "support", "stock"]
    return [f"[tenant {seed}-{t}] " + " ".join(rng.choice(words) for _ in range(chars // 8))[:chars] for t in range(n)]


def chat_load(url: str, systems: list[str], clients: int, total: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    jobs = [[{"role": "system", "content": rng.choice(systems)},
             {"role": "user", "content": f"Question {k}: is item {rng.randrange(1000)} in stock?"}] for k in range(total)]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda m: stream_chat(url, m), jobs))


def summary(results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["usage"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok)
    ttft = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
    return {"requests": len(results), "failed": len(results) - len(ok), "hit_ratio": cached / max(prompt, 1),
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]}


def ingress_status(url: str) -> dict:
    return requests.get(url + "/moe/v1/status", timeout=30).json()


def wait_scaled(url: str, per_replica: int, timeout_s: float = 300) -> float:
    """Seconds until two Ingress replicas answer, each counting two live (capacity doubled)."""
    start, pids = time.monotonic(), set()
    while time.monotonic() - start < timeout_s:
        s = ingress_status(url)
        if s["ingress_replicas"]["live"] == 2 and s["admission_capacity"] == 2 * per_replica:
            pids.add(s["ingress"]["pid"])
            if len(pids) == 2:
                return time.monotonic() - start
        time.sleep(0.1)
    raise TimeoutError("the Ingress did not reach 2 replicas")


def main() -> int:
    a = parse_args()
    if a.quick:
        a.requests, a.rounds, a.tenants = 24, 1, 6
    import sys
    sys.path[:0] = [str(REPO / "operator"), str(REPO / "workers")]
    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.standalone.local_ray import LocalRayHead
    from moe_workers.serve.config import IngressScaling, serve_application

    work = scratch("moe-bench-ingress-")
    path = checkpoint(work)
    head = LocalRayHead(work_dir=work / "ray", num_cpus=16).start()
    results: dict = {"shape": f"Mixtral layout, hidden {HIDDEN}, {LAYERS} layers, {EXPERTS} experts top-2, fp32, "
                              f"byte tokenizer; 2 Ingress replicas x {a.kv_tokens} KV tokens",
                     "tenants": a.tenants, "system_chars": a.system_chars, "clients": a.clients}
    try:
        client = RayServeClient(head.dashboard_url, head.token)
        http = {"host": "127.0.0.1", "port": head.serve_http_port}
        url = f"http://127.0.0.1:{head.serve_http_port}"
        apps = {"affinity": serve_application("affinity", "/a", app_args(path, a.kv_tokens, ingress_replicas=2),
                                              placement()),
                "default": serve_application("default", "/d", app_args(path, a.kv_tokens, ingress_replicas=2,
                                                                       prefix_routing=False), placement())}
        client.put({"http_options": http, "applications": list(apps.values())})
        client.wait_running(list(apps), timeout_s=900)
        for side, prefix in (("affinity", "/a"), ("default", "/d")):
            stream_chat(url + prefix, [{"role": "user", "content": "warm up"}])  # the gate learns each app
        runs: dict[str, list[dict]] = {"affinity": [], "default": []}
        for r in range(a.rounds):
            order = [("affinity", "/a"), ("default", "/d")][:: 1 if r % 2 == 0 else -1]
            for side, prefix in order:
                systems = tenants(100 * r + (side == "default"), a.tenants, a.system_chars)
                got = chat_load(url + prefix, systems, a.clients, a.requests, seed=r)
                runs[side] += got
                print(f"round {r} {side}: {summary(got)}")
        results["prefix"] = {side: summary(got) for side, got in runs.items()}
        client.delete_all()
        for name in apps:
            client.wait_gone(name)

        per_replica = 8 + 64
        scaled = serve_application("scaled", "/", app_args(path, a.kv_tokens, ingress_autoscaling=IngressScaling(
            min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=0, downscale_delay_s=600)),
            placement())
        client.put({"http_options": http, "applications": [scaled]})
        client.wait_running(["scaled"], timeout_s=900)
        stream_chat(url, [{"role": "user", "content": "warm up"}])
        stop, outcomes = threading.Event(), []
        systems = tenants(999, 8, 200)

        def loop(i):
            rng = random.Random(i)
            while not stop.is_set():
                outcomes.append(stream_chat(url, [{"role": "system", "content": rng.choice(systems)},
                                                  {"role": "user", "content": "Hi"}], max_tokens=16))

        with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
            futures = [pool.submit(loop, i) for i in range(a.clients)]
            try:
                scale_up_s = wait_scaled(url, per_replica)
                time.sleep(3)
            finally:
                stop.set()
                for f in futures:
                    f.result()
        failed = sum(1 for o in outcomes if o["status"] != 200 or o["error"])
        client.delete_all()
        client.wait_gone("scaled")

        fixed = serve_application("fixed", "/", app_args(path, a.kv_tokens, ingress_replicas=1), placement())
        client.put({"http_options": http, "applications": [fixed]})
        client.wait_running(["fixed"], timeout_s=900)
        stream_chat(url, [{"role": "user", "content": "warm up"}])
        two = serve_application("fixed", "/", app_args(path, a.kv_tokens, ingress_replicas=2), placement())
        client.put({"http_options": http, "applications": [two]})
        manual_s = wait_scaled(url, per_replica)
        results["scale"] = {"autoscaled_s": scale_up_s, "manual_s": manual_s, "requests": len(outcomes),
                            "failed": failed}
        print(results["scale"])
    finally:
        head.stop()
    p, d = results["prefix"]["affinity"], results["prefix"]["default"]
    return report(a.out, results, {
        "prefix-affinity-hit-ratio": p["hit_ratio"], "prefix-default-hit-ratio": d["hit_ratio"],
        "prefix-affinity-over-default-hit": p["hit_ratio"] / max(d["hit_ratio"], 1e-9),
        "ttft-p50-affinity-over-default": p["ttft_p50_s"] / d["ttft_p50_s"],
        "ttft-p99-affinity-over-default": p["ttft_p99_s"] / d["ttft_p99_s"],
        "ingress-scale-up-s": scale_up_s, "ingress-manual-scale-s": manual_s,
        "ingress-scale-failed-requests": failed})


if __name__ == "__main__":
    raise SystemExit(main())
