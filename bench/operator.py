"""Control-plane cost of the operator, on the real apiserver + etcd (scripts/testenv).

    python bench/operator.py            # 50 MoEDeployments on the render-only backend
    python bench/operator.py --quick    # 10

A: one MoEDeployment on a local Ray head: seconds from `kubectl apply` to Ready=True, split into
   the operator's own work, Ray's (Serve config PUT -> app RUNNING), and the rest (watch latency,
   status write-back). B: N MoEDeployments reconciled with the render-only Ray backend: time until
   all are Ready, apiserver requests and operator CPU seconds per reconcile. Ends with
   `figure: value` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parents[1]
KOPF = str(Path(sys.executable).with_name("kopf"))


def start_control_plane(state: Path) -> dict:
    subprocess.run([str(REPO / "scripts" / "testenv"), "install"], check=True)
    out = subprocess.run([str(REPO / "scripts" / "testenv"), "start", str(state)], check=True,
                         capture_output=True, text=True).stdout
    env = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines()
               if line.startswith("export ") and "PATH=" not in line)
    cache = Path(os.environ.get("MOE_CACHE_DIR", Path.home() / ".cache" / "moe-operator"))
    env["KUBECTL"] = str(cache / "bin" / "kubectl")
    env["TOKEN"] = next(line.split(",")[0] for line in (state / "tokens.csv").read_text().splitlines()
                        if ",admin," in line)
    return env


def kubectl(cp: dict, *args: str, input: str | None = None) -> str:
    return subprocess.run([cp["KUBECTL"], *args], input=input, capture_output=True, text=True, check=True,
                          env={**os.environ, "KUBECONFIG": cp["KUBECONFIG"]}).stdout


def apiserver_requests(cp: dict) -> float:
    text = requests.get(cp["MOE_TESTENV_SERVER"] + "/metrics", headers={"Authorization": f"Bearer {cp['TOKEN']}"},
                        verify=False, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("apiserver_request_total{"))


def metric_sum(port: int, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(rf"{name}(\{{|\s)", line))


def manifest(name: str, namespace: str, model: Path, prefix: str) -> dict:
    return {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"path": str(model)},
                     "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi", "routePrefix": prefix},
                     "experts": {"groups": 2, "numCpus": 0.25,
                                 "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}}


def start_operator(cp: dict, namespace: str, extra_env: dict, log: Path) -> subprocess.Popen:
    env = {**os.environ, "KUBECONFIG": cp["KUBECONFIG"], **extra_env}
    return subprocess.Popen([KOPF, "run", "--standalone", "--namespace", namespace, "-m",
                             "moe_operator.handlers.operator"], env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def ready_names(cp: dict, namespace: str) -> set[str]:
    items = json.loads(kubectl(cp, "get", "moed", "-n", namespace, "-o", "json"))["items"]
    return {i["metadata"]["name"] for i in items
            if any(c["type"] == "Ready" and c["status"] == "True" for c in (i.get("status") or {}).get("conditions", []))}


def wait_metrics(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            return
        except requests.RequestException:
            time.sleep(0.3)
    raise RuntimeError("operator metrics endpoint did not come up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--count", type=int, default=None)
    a = p.parse_args()
    count = a.count or (10 if a.quick else 50)
    import urllib3

    urllib3.disable_warnings()
    from moe_operator.standalone.local_ray import LocalRayHead, free_port
    from moe_workers.model.random_init import write_random_mixtral

    work = Path(tempfile.mkdtemp(prefix="moe-bench-op-"))
    model = write_random_mixtral(work / "models" / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=128)
    cp = start_control_plane(work / "k8s")
    try:
        kubectl(cp, "apply", "-f", str(REPO / "crds"))
        kubectl(cp, "wait", "--for=condition=Established", "crd/moedeployments.serving.moe.io")
        kubectl(cp, "create", "namespace", "bench")

        # A: one MoEDeployment on a real local Ray
        head = LocalRayHead(work_dir=work / "ray", num_cpus=4).start()
        port_a = free_port()
        op = start_operator(cp, "default", {"MOE_RAY_ADDRESS": head.dashboard_url, "MOE_RAY_TOKEN": head.token,
                                            "MOE_ALLOWED_ROOTS": str(work / "models"),
                                            "MOE_SERVE_HTTP_PORT": str(head.serve_http_port),
                                            "MOE_METRICS_PORT": str(port_a)}, work / "operator-a.log")
        try:
            wait_metrics(port_a)
            t0 = time.perf_counter()
            kubectl(cp, "apply", "-f", "-", input=json.dumps(manifest("one", "default", model, "/one")))
            while "one" not in ready_names(cp, "default"):
                time.sleep(0.1)
            total = time.perf_counter() - t0
            reconcile_s = metric_sum(port_a, "moe_operator_reconcile_seconds_sum")
            ray_s = metric_sum(port_a, "moe_operator_ray_apply_seconds_sum")
        finally:
            stop(op)
            head.stop()

        # B: N MoEDeployments, render-only Ray backend
        port_b = free_port()
        op = start_operator(cp, "bench", {"MOE_RAY_BACKEND": "render-only", "MOE_RENDER_ONLY_DIR": str(work / "render"),
                                          "MOE_ALLOWED_ROOTS": str(work / "models"), "MOE_METRICS_PORT": str(port_b)},
                            work / "operator-b.log")
        try:
            wait_metrics(port_b)
            time.sleep(2)  # let the operator settle (watches established) before counting
            proc = psutil.Process(op.pid)
            cpu0 = sum(proc.cpu_times()[:2])
            req0 = apiserver_requests(cp)
            docs = {"apiVersion": "v1", "kind": "List",
                    "items": [manifest(f"m{i:03d}", "bench", model, f"/m{i:03d}") for i in range(count)]}
            t0 = time.perf_counter()
            kubectl(cp, "apply", "-f", "-", input=json.dumps(docs))
            polls = 0
            while len(ready_names(cp, "bench")) < count:
                polls += 1
                time.sleep(0.5)
            all_ready = time.perf_counter() - t0
            time.sleep(3)  # trailing event posts
            cpu = sum(proc.cpu_times()[:2]) - cpu0
            # ours: one apply (discovery + openapi + 1 request per object, measured once below) and one list per poll
            ours_probe0 = apiserver_requests(cp)
            kubectl(cp, "get", "moed", "-n", "bench", "-o", "json")
            per_poll = apiserver_requests(cp) - ours_probe0 - 1  # the probe's own /metrics read counts once
            reconciles = metric_sum(port_b, "moe_operator_reconciles_total")
            requests_total = apiserver_requests(cp) - req0 - 2
            ours = (polls + 2) * per_poll + count + per_poll  # polls, final check, the apply (~ a get + creates)
            operator_requests = max(0.0, requests_total - ours)
            apps = len(json.loads((work / "render" / "serve-config.json").read_text())["applications"])
        finally:
            stop(op)
    finally:
        subprocess.run([str(REPO / "scripts" / "testenv"), "stop", str(work / "k8s")], check=False)

    operator_s = reconcile_s - ray_s
    print("\nA: one MoEDeployment on a local Ray head, apply -> Ready")
    print(f"  total                         {total:7.2f} s")
    print(f"  operator (reconcile, no Ray)  {operator_s:7.2f} s")
    print(f"  Ray (PUT -> app RUNNING)      {ray_s:7.2f} s")
    print(f"  watch latency + status write  {total - reconcile_s:7.2f} s")
    print(f"\nB: {count} MoEDeployments, render-only Ray backend ({apps} applications rendered)")
    print(f"  all Ready after               {all_ready:7.2f} s")
    print(f"  reconciles                    {reconciles:7.0f}")
    print(f"  operator CPU                  {cpu:7.2f} s ({cpu / reconciles:.3f} s per reconcile)")
    print(f"  apiserver requests by the operator ~{operator_requests:.0f} ({operator_requests / reconciles:.1f} per reconcile;"
          f" all {requests_total:.0f}, of them the bench's own ~{ours:.0f})")
    print()
    print(f"apply-to-ready-s: {total:.2f}")
    print(f"operator-share-of-apply-to-ready: {operator_s / total:.2f}")
    print(f"ray-share-of-apply-to-ready: {ray_s / total:.2f}")
    print(f"all-ready-{count}-s: {all_ready:.2f}")
    print(f"cpu-seconds-per-reconcile: {cpu / reconciles:.3f}")
    print(f"api-requests-per-reconcile: {operator_requests / reconciles:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
