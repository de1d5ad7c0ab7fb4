"""Served decode with the shard groups on another Ray node, against the same groups on the Ingress'
own node, over model depth, on the real test node (needs root; scripts/testenv start --node).

    python bench/cross_node.py              # depths 4, 16, 32
    python bench/cross_node.py --depths 4   # one depth, for a smoke run

The Ray cluster of examples/ray-cluster.yaml: a head and two worker Pods (pools a and b), each its
own network namespace on the node's bridge, as Pods on two machines would be (one 2-core machine
here, so both pools share its CPUs). Per depth, two MoEDeployments side by side (Mixtral layout,
hidden 256, intermediate 512, 8 experts, top-2, fp32, 2 groups): the Ingress pinned to pool a in
both; the groups pinned to pool a ("local": the expert channel over Unix sockets) or to pool b
("across": TCP over the veth pairs and the bridge). Batch-1 decode through the cluster's Service:
ms a token of the decode steps alone (a request of 33 new tokens minus one of 1), the two apps
taking turns, median of --rounds. Figures: `cross-node-decode-ms-per-token-depth{L}` (across),
`cross-node-over-local-decode-depth{L}`, and the cost a layer, (across - local) / L.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

from figures import report, scratch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "workers"), str(REPO / "tests")]

from node_cluster import as_yaml, helm_install_args, moedeployment, ray_cluster  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="4,16,32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "cross_node.json"))
    return p.parse_args()


def main() -> int:
    a = parse_args()
    from moe_workers.model.random_init import write_random_mixtral
    from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE

    work = scratch("moe-bench-cross-node-")
    models = work / "models"
    depths = [int(d) for d in a.depths.split(",")]
    for depth in depths:
        write_random_mixtral(models / f"d{depth}", num_layers=depth, num_experts=8, hidden_size=256,
                             intermediate_size=512, vocab_size=BYTE_VOCAB_SIZE, max_position_embeddings=512)
    models.chmod(0o755)
    started = subprocess.run([str(REPO / "scripts" / "testenv"), "start", str(work / "k8s"), "--node"],
                             capture_output=True, text=True)
    if started.returncode != 0:
        print(started.stderr[-3000:], file=sys.stderr)
        return 1
    cp = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines()
              if line.startswith("export ") and "PATH=" not in line)
    cache = Path(os.environ.get("MOE_CACHE_DIR", Path.home() / ".cache" / "moe-operator"))
    env = {**os.environ, "KUBECONFIG": cp["KUBECONFIG"]}

    def kubectl(*args: str, input: str | None = None) -> str:
        return subprocess.run([str(Path(cp["MOE_TESTENV_KUBE_BIN"]) / "kubectl"), *args], input=input, capture_output=True, text=True,
                              check=True, env=env).stdout

    def ready(name: str) -> bool:
        st = json.loads(kubectl("get", "moed", name, "-o", "json")).get("status") or {}
        return any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])

    def wait(predicate, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(str(predicate))
            time.sleep(1)

    results: dict = {"shape": "Mixtral layout, hidden 256, intermediate 512, 8 experts top-2, fp32, 2 groups, "
                              "batch 1; two worker Pods on one 2-core node", "depths": {}}
    figures: dict[str, float] = {}
    try:
        kubectl("apply", "-f", "-", input=as_yaml(ray_cluster(models, cp["MOE_RAY_IMAGE"])))
        ray_ip = kubectl("get", "svc", "ray-head", "-o", "jsonpath={.spec.clusterIP}")
        serve_ip = kubectl("get", "svc", "ray-serve", "-o", "jsonpath={.spec.clusterIP}")
        subprocess.run([str(cache / "bin" / "helm"), *helm_install_args(cp["MOE_OPERATOR_IMAGE"], serve_ip, models,
                                                                        "moe-system"), "--wait", "--timeout", "300s"],
                       check=True, capture_output=True, env=env)
        for depth in depths:
            names = {}
            for side, pool in (("local", "a"), ("across", "b")):
                name = names[side] = f"d{depth}-{side}"
                moed = moedeployment(ray_ip, name=name, model=f"/models/d{depth}")
                moed["spec"]["ingress"].update(rayNodeLabels={"pool": "a"}, kvCacheBudget="64Mi")
                moed["spec"]["experts"]["rayNodeLabels"] = {"pool": pool}
                kubectl("apply", "-f", "-", input=json.dumps(moed))
            for name in names.values():
                wait(lambda n=name: ready(n))
            url = {side: f"http://{serve_ip}:8000/{name}/v1/completions" for side, name in names.items()}

            def run(side: str, tokens: int) -> float:
                t0 = time.perf_counter()
                r = requests.post(url[side], json={"prompt": [5, 6, 7, 8], "max_tokens": tokens, "temperature": 0,
                                                   "ignore_eos": True}, timeout=300)
                r.raise_for_status()
                return time.perf_counter() - t0

            for side in url:  # warm-up
                run(side, 8)
            per_token: dict[str, list[float]] = {"local": [], "across": []}
            for k in range(a.rounds):
                for side in (("local", "across") if k % 2 == 0 else ("across", "local")):
                    per_token[side].append((run(side, 33) - run(side, 1)) / 32 * 1000)
            local, across = (statistics.median(per_token[s]) for s in ("local", "across"))
            results["depths"][depth] = {"local_ms_per_token": local, "across_ms_per_token": across,
                                        "rounds": per_token}
            print(f"depth {depth}: local {local:.2f} ms/token, across {across:.2f} ms/token, "
                  f"{(across - local) / depth:.3f} ms a layer more")
            figures[f"cross-node-decode-ms-per-token-depth{depth}"] = across
            figures[f"cross-node-over-local-decode-depth{depth}"] = across / local
            figures[f"cross-node-extra-ms-per-layer-depth{depth}"] = (across - local) / depth
            for name in names.values():
                kubectl("delete", "moed", name, "--timeout=180s")
    finally:
        subprocess.run([str(REPO / "scripts" / "testenv"), "stop", str(work / "k8s")], check=False)
    return report(a.out, results, figures)


if __name__ == "__main__":
    raise SystemExit(main())
