"""Control-plane cost of the operator, on the real apiserver + etcd (scripts/testenv).

    python bench/control_plane.py                       # 50 MoEDeployments on the render-only backend
    python bench/control_plane.py --quick               # 10
    python bench/control_plane.py --only many --count 400   # part B alone, at 400
    python bench/control_plane.py --node                # everything in Pods on a real node (needs root)

A: one MoEDeployment on a local Ray head: seconds from `kubectl apply` to Ready=True, split into
   the operator's own work (its passes), Ray's config writes, and the rest (between passes: Serve
   deploying, watch latency, status write-back; a pass never waits for Ray); then a spec edit
   (`kubectl patch`) to the app serving it. C: passes over an unchanged spec, both backends (Ray
   REST on that head; KubeRay on KubeRay 1.5.0's own RayService CRD): writes per pass (target 0).
   B: N MoEDeployments reconciled with the render-only Ray backend: time until all are Ready,
   apiserver requests and operator CPU seconds per reconcile; then a steady window (--steady-s):
   the operator's writes a minute (target 0), its CPU share of a core (so, objects a core at the
   5 s steady interval) and its loops' turns an object per 5 s (1.0: it keeps up).
   D: beside them, one
   MoEDeployment of DeepSeek-V3's shape (14,848 experts, 32 groups; bench/scale.py): apply to
   Ready, and the object's bytes as the apiserver stores it. Writes every result to --out (JSON)
   and ends with `figure: value` lines.

--node: on `scripts/testenv start --node` (images imported again, so the import is measured):
   the node's start, the images' import, `helm install` -> operator Pod Ready, the Ray head and
   worker Pods -> the dashboard answering, and `kubectl apply` -> Ready of one MoEDeployment
   split into the operator's work, Ray's config writes and the rest (Serve deploying), read
   from the operator Pod's own metrics; side by side in the same run with A (the same apply with
   the operator and Ray as local processes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
from figures import report, scratch

REPO = Path(__file__).resolve().parents[1]
KOPF = str(Path(sys.executable).with_name("kopf"))


def start_control_plane(state: Path, install: bool = True) -> dict:
    """`scripts/testenv start STATE` (after `install` unless told not to: it also builds the node's
    images, which a bench without a node does not need once the binaries are there)."""
    if install:
        subprocess.run([str(REPO / "scripts" / "testenv"), "install"], check=True)
    out = subprocess.run([str(REPO / "scripts" / "testenv"), "start", str(state)], check=True,
                         capture_output=True, text=True).stdout
    env = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines()
               if line.startswith("export ") and "PATH=" not in line)
    env["KUBECTL"] = str(Path(env["MOE_TESTENV_KUBE_BIN"]) / "kubectl")
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


def operator_writes(cp: dict) -> float:
    """Writes to MoEDeployments (status included) and Events so far: in a steady window only the
    operator makes them (the apiserver's own lease updates are not counted)."""
    text = requests.get(cp["MOE_TESTENV_SERVER"] + "/metrics", headers={"Authorization": f"Bearer {cp['TOKEN']}"},
                        verify=False, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("apiserver_request_total{") and re.search(r'verb="(POST|PUT|PATCH|DELETE)"', line)
               and re.search(r'resource="(moedeployments|events)"', line))


def metric_sum(port: int, name: str) -> float:
    return metric_sum_at("127.0.0.1", port, name)


def manifest(name: str, namespace: str, model: Path, prefix: str) -> dict:
    return {"apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"path": str(model)},
                     "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi", "routePrefix": prefix},
                     "experts": {"groups": 2, "numCpus": 0.25,
                                 "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}}


def deepseek_on_the_apiserver(cp: dict, work: Path) -> dict:
    """D: one MoEDeployment of DeepSeek-V3's shape (bench/scale.py: 14,848 routed experts, 32
    groups, 32 spare copies a layer; config.json only, through spec.model.shape) beside the N
    others: seconds from apply to Ready=True through the operator, and the bytes of the object as
    the apiserver stores it (spec and status)."""
    from scale import SHAPES, SPARE

    doc = manifest("deepseek-v3", "bench", work / "models" / "deepseek-v3", "/deepseek-v3")
    doc["spec"]["model"]["shape"] = SHAPES["deepseek-v3"]
    doc["spec"]["experts"].update(groups=32, tiers={"hot": {"budget": "64Gi"}, "warm": {"budget": "256Gi"}})
    doc["spec"]["autoscaling"] = {"redundantExpertSlots": SPARE["deepseek-v3"]}
    t0 = time.perf_counter()
    kubectl(cp, "apply", "-f", "-", input=json.dumps(doc))
    while "deepseek-v3" not in ready_names(cp, "bench"):
        if time.perf_counter() - t0 > 120:
            status = json.loads(kubectl(cp, "get", "moed", "deepseek-v3", "-n", "bench", "-o", "json")).get("status")
            raise SystemExit(f"the DeepSeek-V3-shaped MoEDeployment is not Ready after 120 s: {status}")
        time.sleep(0.2)
    ready_s = time.perf_counter() - t0
    stored = kubectl(cp, "get", "moed", "deepseek-v3", "-n", "bench", "-o", "json")
    render = json.loads((work / "render" / "serve-config.json").read_text())
    app = next(a for a in render["applications"] if a["route_prefix"] == "/deepseek-v3")
    return {"apply_to_ready_s": ready_s, "object_bytes": len(stored), "app_config_bytes": len(json.dumps(app))}


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


STEADY_PASSES = 5


def steady_rest_passes(head, cp: dict, model: Path, name: str) -> tuple[float, float, float]:
    """Passes of the Ray REST backend over an application already serving (the operator's own
    object, read back): Serve config PUTs per steady pass, seconds per steady pass, and seconds of
    one change applied until it runs (a PUT, then passes until Serve reports RUNNING), side by side."""
    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.reconcile import ObjectRef, reconcile

    try:
        from moe_operator.reconcile import deploying
    except ImportError:  # an operator before issue 69, whose pass waited for RUNNING (a before-run)
        def deploying(status):
            return False
    from moe_operator.settings import Settings

    obj = json.loads(kubectl(cp, "get", "moed", name, "-o", "json"))
    spec, status = obj["spec"], obj["status"]
    client = RayServeClient(head.dashboard_url, head.token)
    settings = Settings(allowed_roots=(str(model.parent),), serve_http_port=head.serve_http_port)
    generation = obj["metadata"]["generation"]
    t0 = time.perf_counter()
    for _ in range(STEADY_PASSES):
        assert reconcile(ObjectRef("default", name, generation), spec, status, client, settings).ready
    steady_s = (time.perf_counter() - t0) / STEADY_PASSES
    steady_puts = client.puts / STEADY_PASSES
    changed = {**spec, "ingress": {**spec.get("ingress", {}), "maxBatchSize": 4}}
    t0 = time.perf_counter()
    res = reconcile(ObjectRef("default", name, generation + 1), changed, status, client, settings)
    while deploying(res.status):  # a pass never waits (the old version serves meanwhile): the next one looks again
        time.sleep(res.retry_after_s)
        res = reconcile(ObjectRef("default", name, generation + 1), changed, res.status, client, settings)
    assert res.ready, res.event
    return steady_puts, steady_s, time.perf_counter() - t0


def steady_kuberay_passes(cp: dict, model: Path) -> tuple[float, float, float]:
    """The KubeRay backend against KubeRay's own RayService CRD (as its module ships it; its
    defaults are what would make every pass write if ignored): RayService writes per steady pass
    and seconds per steady pass, side by side with the first pass (which creates it)."""
    import kubernetes

    sys.path.insert(0, str(REPO / "tests"))
    from kuberay_operator import crd_files
    from moe_operator.backends.kuberay import KubeRayClient
    from moe_operator.reconcile import ObjectRef, reconcile_kuberay
    from moe_operator.settings import Settings

    for f in crd_files(Path(cp["MOE_KUBERAY_DIR"])):
        kubectl(cp, "apply", "--server-side", "-f", str(f))
    # (kubectl wait errors out instead of waiting while a new CRD has no conditions yet)
    for _ in range(600):
        if subprocess.run([cp["KUBECTL"], "get", "rayservices"], capture_output=True,
                          env={**os.environ, "KUBECONFIG": cp["KUBECONFIG"]}).returncode == 0:
            break
        time.sleep(0.2)
    kubernetes.config.load_kube_config(cp["KUBECONFIG"])
    client = KubeRayClient(kubernetes.client.CustomObjectsApi())
    spec = {"model": {"path": str(model), "shape": {"numLayers": 2, "numExperts": 4, "topK": 2, "hiddenSize": 32,
                                                     "intermediateSize": 64, "dtype": "float32"}},
            "ray": {"mode": "KubeRay", "kubeRay": {"image": "registry.example/moe-worker:0.1", "workerReplicas": 2}},
            "experts": {"groups": 2, "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}
    settings, obj = Settings(allowed_roots=(str(model.parent),)), ObjectRef("default", "kr", 1, "uid-bench")
    t0 = time.perf_counter()
    res = reconcile_kuberay(obj, spec, {}, client, settings)
    first_s = time.perf_counter() - t0
    assert client.writes == 1 and res.event[1] == "WaitingForKubeRay", res.event  # created; no KubeRay here
    writes0 = client.writes
    t0 = time.perf_counter()
    for _ in range(STEADY_PASSES):
        res = reconcile_kuberay(obj, spec, res.status, client, settings)
    return (client.writes - writes0) / STEADY_PASSES, (time.perf_counter() - t0) / STEADY_PASSES, first_s


def edit_to_serving(cp: dict, head, name: str) -> float:
    """Seconds from a spec edit (`kubectl patch`, spec.ingress.maxBatchSize) to the app serving it:
    status has observed the new generation, Ready=True and not Progressing, and Serve's deployed
    config carries the new value."""
    from moe_operator.backends.ray_rest import RayServeClient
    from moe_operator.names import app_name

    client = RayServeClient(head.dashboard_url, head.token)

    def serving() -> bool:
        obj = json.loads(kubectl(cp, "get", "moed", name, "-o", "json"))
        conditions = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions", [])}
        if (obj.get("status") or {}).get("observedGeneration") != obj["metadata"]["generation"] or \
                conditions.get("Ready") != "True" or conditions.get("Progressing") == "True":
            return False
        app = client.get()["applications"].get(app_name("default", name)) or {}
        return app.get("status") == "RUNNING" and \
            '"max_batch_size": 6' in json.dumps(app.get("deployed_app_config") or {})

    t0 = time.perf_counter()
    kubectl(cp, "patch", "moed", name, "--type", "merge", "-p", json.dumps({"spec": {"ingress": {"maxBatchSize": 6}}}))
    wait_until(serving, timeout_s=300, interval_s=0.1)
    return time.perf_counter() - t0


def steady_window(cp: dict, op: subprocess.Popen, port: int, count: int, window_s: float) -> dict:
    """Over `window_s` of N objects all serving an unchanged spec: the operator's writes (status and
    Events; target 0), its CPU share of one core, and its loops' turns an object per 5 s (1.0: every
    object read each steady interval; absent where the operator has no such metric)."""
    proc = psutil.Process(op.pid)
    cpu0, writes0, turns0 = sum(proc.cpu_times()[:2]), operator_writes(cp), metric_sum(port, "moe_operator_loop_turns_total")
    time.sleep(window_s)
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    turns = metric_sum(port, "moe_operator_loop_turns_total") - turns0
    return {"window_s": window_s, "writes_per_minute": (operator_writes(cp) - writes0) * 60 / window_s,
            "cpu_share": cpu / window_s, "turns_per_object_per_5s": turns / count / (window_s / 5) if turns else None}


def local_apply_to_ready(cp: dict, work: Path, model: Path) -> tuple[float, float, float, tuple]:
    """One MoEDeployment on a local Ray head with the operator as a local process: seconds from
    apply to Ready, the operator's reconcile seconds and, of them, Ray's; then the steady passes."""
    from moe_operator.standalone.local_ray import LocalRayHead, free_port

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
        figures = (total, metric_sum(port_a, "moe_operator_reconcile_seconds_sum"),
                   metric_sum(port_a, "moe_operator_ray_apply_seconds_sum"))
        edit = edit_to_serving(cp, head, "one")
        return (*figures, steady_rest_passes(head, cp, model, "one"), edit)
    finally:
        stop(op)
        head.stop()


def wait_until(predicate, timeout_s: float = 600, interval_s: float = 0.1) -> float:
    """Seconds until predicate() is true (polled)."""
    t0 = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"not true after {timeout_s} s: {predicate}")
        time.sleep(interval_s)
    return time.perf_counter() - t0


def pod_state(cp: dict, namespace: str, selector: str) -> tuple[bool, bool]:
    """(a container of the Pod runs, the Pod is Ready) for the first Pod matching selector."""
    items = json.loads(kubectl(cp, "-n", namespace, "get", "pods", "-l", selector, "-o", "json"))["items"]
    if not items:
        return False, False
    st = items[0].get("status") or {}
    running = any("running" in (c.get("state") or {}) for c in st.get("containerStatuses") or [])
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
    return running, ready


def node_bench(out: str) -> int:
    """Apply -> Ready with the operator, Ray and the model in Pods on a real node."""
    sys.path.insert(0, str(REPO / "tests"))
    from node_cluster import as_yaml, helm_install_args, moedeployment, ray_cluster
    from moe_workers.model.random_init import write_random_mixtral

    subprocess.run([str(REPO / "scripts" / "testenv"), "install"], check=True)
    work = scratch("moe-bench-node-")
    models = work / "models"
    write_random_mixtral(models / "tiny", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64,
                         vocab_size=128)
    models.chmod(0o755)
    t0 = time.perf_counter()
    started = subprocess.run([str(REPO / "scripts" / "testenv"), "start", str(work / "k8s"), "--node"],
                             capture_output=True, text=True, env={**os.environ, "MOE_TESTENV_REIMPORT": "1"})
    start_s = time.perf_counter() - t0
    if started.returncode != 0:
        print(started.stderr[-3000:], file=sys.stderr)
        return 1
    m = re.search(r"node Ready after (\d+) s; images imported in (\d+) s", started.stderr)
    node_s, import_s = (int(m.group(1)), int(m.group(2))) if m else (float("nan"), float("nan"))
    cp = dict(line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines()
              if line.startswith("export ") and "PATH=" not in line)
    cache = Path(os.environ.get("MOE_CACHE_DIR", Path.home() / ".cache" / "moe-operator"))
    cp["KUBECTL"] = str(Path(cp["MOE_TESTENV_KUBE_BIN"]) / "kubectl")
    helm = str(cache / "bin" / "helm")
    env = {**os.environ, "KUBECONFIG": cp["KUBECONFIG"]}
    try:
        t0 = time.perf_counter()
        kubectl(cp, "apply", "-f", "-", input=as_yaml(ray_cluster(models, cp["MOE_RAY_IMAGE"])))
        ray_ip = kubectl(cp, "get", "svc", "ray-head", "-o", "jsonpath={.spec.clusterIP}")
        serve_ip = kubectl(cp, "get", "svc", "ray-serve", "-o", "jsonpath={.spec.clusterIP}")
        head = "app.kubernetes.io/component=head"
        ray_running = wait_until(lambda: pod_state(cp, "default", head)[0])
        ray_ready = wait_until(lambda: pod_state(cp, "default", head)[1]) + ray_running
        worker_running = wait_until(lambda: pod_state(cp, "default", "app.kubernetes.io/component=worker")[0])
        worker_running += ray_ready

        t0 = time.perf_counter()
        subprocess.run([helm, *helm_install_args(cp["MOE_OPERATOR_IMAGE"], serve_ip, models, "moe-system")],
                       check=True, capture_output=True, env=env)
        helm_s = time.perf_counter() - t0
        sel = "app.kubernetes.io/name=moe-operator"
        op_running = wait_until(lambda: pod_state(cp, "moe-system", sel)[0]) + helm_s
        op_ready = wait_until(lambda: pod_state(cp, "moe-system", sel)[1]) + op_running
        op_ip = kubectl(cp, "-n", "moe-system", "get", "pod", "rel-moe-operator-0", "-o", "jsonpath={.status.podIP}")

        def ready() -> bool:
            st = json.loads(kubectl(cp, "get", "moed", "tiny", "-o", "json")).get("status") or {}
            return any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])

        kubectl(cp, "apply", "-f", "-", input=json.dumps(moedeployment(ray_ip)))
        total = wait_until(ready)
        reconcile_s = metric_sum_at(op_ip, 9090, "moe_operator_reconcile_seconds_sum")
        ray_s = metric_sum_at(op_ip, 9090, "moe_operator_ray_apply_seconds_sum")
        # the reference, in the same run: the same apply with the operator and Ray as local processes
        kubectl(cp, "delete", "moed", "tiny", "--timeout=180s")
        subprocess.run([helm, "uninstall", "rel", "-n", "moe-system", "--wait"], check=True, capture_output=True, env=env)
        local_total, local_reconcile, local_ray, _ = local_apply_to_ready(cp, work, models / "tiny")
    finally:
        subprocess.run([str(REPO / "scripts" / "testenv"), "stop", str(work / "k8s")], check=False)
    operator_s = reconcile_s - ray_s
    print(f"\nnode: scripts/testenv start --node        {start_s:7.1f} s (node Ready {node_s} s, images imported {import_s} s)")
    print(f"Ray Pods: apply -> head running           {ray_running:7.1f} s")
    print(f"          -> dashboard answers (Ready)    {ray_ready:7.1f} s")
    print(f"          -> worker running               {worker_running:7.1f} s")
    print(f"operator: helm install                    {helm_s:7.1f} s")
    print(f"          -> Pod running                  {op_running:7.1f} s")
    print(f"          -> Pod Ready (kopf up)          {op_ready:7.1f} s")
    print("MoEDeployment: kubectl apply -> Ready")
    print(f"  total                                   {total:7.2f} s")
    print(f"  operator (reconcile, no Ray)            {operator_s:7.2f} s")
    print(f"  Ray (Serve config read-merge-write)     {ray_s:7.2f} s")
    print(f"  between passes (Serve deploying, watch) {total - reconcile_s:7.2f} s")
    print(f"the same apply, operator and Ray as local processes: {local_total:.2f} s "
          f"(operator {local_reconcile - local_ray:.2f} s, Ray {local_ray:.2f} s)")
    figures = {"node-start-s": start_s, "image-import-s": import_s, "ray-pods-ready-s": ray_ready,
               "operator-pod-ready-s": op_ready, "node-apply-to-ready-s": total,
               "node-operator-share-of-apply-to-ready": operator_s / total,
               "node-ray-share-of-apply-to-ready": ray_s / total, "node-vs-local-apply-to-ready": total / local_total}
    results = {"node": {"start_s": start_s, "ready_s": node_s, "image_import_s": import_s},
               "ray_pods": {"head_running_s": ray_running, "dashboard_ready_s": ray_ready,
                            "worker_running_s": worker_running},
               "operator_pod": {"helm_install_s": helm_s, "running_s": op_running, "ready_s": op_ready},
               "apply_to_ready": {"total_s": total, "operator_s": operator_s, "ray_s": ray_s,
                                  "watch_and_status_s": total - reconcile_s},
               "local_apply_to_ready": {"total_s": local_total, "operator_s": local_reconcile - local_ray,
                                        "ray_s": local_ray}}
    return report(out, results, figures, digits=2)


def metric_sum_at(host: str, port: int, name: str) -> float:
    text = requests.get(f"http://{host}:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if re.match(rf"{name}(\{{|\s)", line))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--count", type=int, default=None)
    p.add_argument("--node", action="store_true", help="everything in Pods on a real node (needs root)")
    p.add_argument("--only", choices=["many"], default=None, help="many: part B alone (N objects, then a steady window)")
    p.add_argument("--steady-s", type=float, default=30.0, help="B's steady window after all are Ready (seconds)")
    p.add_argument("--out", default=None, help="results as JSON (default bench/results/operator.json, "
                   "operator-node.json with --node)")
    a = p.parse_args()
    if a.node:
        return node_bench(a.out or str(REPO / "bench" / "results" / "operator-node.json"))
    a.out = a.out or str(REPO / "bench" / "results" / "operator.json")
    count = a.count or (10 if a.quick else 50)
    import urllib3

    urllib3.disable_warnings()
    from moe_operator.standalone.local_ray import free_port
    from moe_workers.model.random_init import write_random_mixtral

    work = scratch("moe-bench-op-")
    model = write_random_mixtral(work / "models" / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=128)
    cp = start_control_plane(work / "k8s")
    try:
        kubectl(cp, "apply", "-f", str(REPO / "crds"))
        kubectl(cp, "wait", "--for=condition=Established", "crd/moedeployments.serving.moe.io")
        kubectl(cp, "create", "namespace", "bench")

        many_only = a.only == "many"
        if not many_only:  # A: one MoEDeployment on a real local Ray
            total, reconcile_s, ray_s, rest_steady, edit_s = local_apply_to_ready(cp, work, model)
            kuberay_steady = steady_kuberay_passes(cp, model)

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
            steady = steady_window(cp, op, port_b, count, a.steady_s)
            deepseek = None if many_only else deepseek_on_the_apiserver(cp, work)
        finally:
            stop(op)
    finally:
        subprocess.run([str(REPO / "scripts" / "testenv"), "stop", str(work / "k8s")], check=False)

    turns = steady["turns_per_object_per_5s"]
    many = {"count": count, "applications": apps, "all_ready_s": all_ready, "reconciles": reconciles,
            "operator_cpu_s": cpu, "operator_requests": operator_requests,
            "apiserver_requests": requests_total, "bench_requests": ours, "steady": steady}
    figures = {f"all-ready-{count}-s": all_ready, "cpu-seconds-per-reconcile": cpu / reconciles,
               "api-requests-per-reconcile": operator_requests / reconciles,
               f"steady-writes-per-minute-{count}": steady["writes_per_minute"],
               f"steady-cpu-share-{count}": steady["cpu_share"],
               f"objects-per-core-at-5s-{count}": count / max(steady["cpu_share"], 1e-9)}
    if turns is not None:
        figures[f"steady-turns-per-object-per-5s-{count}"] = turns
    if not many_only:
        operator_s = reconcile_s - ray_s
        print("\nA: one MoEDeployment on a local Ray head, apply -> Ready")
        print(f"  total                         {total:7.2f} s")
        print(f"  operator (reconcile, no Ray)  {operator_s:7.2f} s")
        print(f"  Ray (config read-merge-write) {ray_s:7.2f} s")
        print(f"  between passes (Serve deploying, watch, status) {total - reconcile_s:7.2f} s")
        print(f"  a spec edit (kubectl patch) -> serving it     {edit_s:7.2f} s")
        print(f"\nC: {STEADY_PASSES} reconcile passes over an unchanged spec (in-process, against the same cluster)")
        print(f"  Ray REST: Serve config PUTs per pass {rest_steady[0]:.1f}; {rest_steady[1]:.3f} s a pass, against "
              f"{rest_steady[2]:.2f} s for a pass with a change (PUT + wait for RUNNING): {rest_steady[1] / rest_steady[2]:.3f}")
        print(f"  KubeRay: RayService writes per pass {kuberay_steady[0]:.1f}; {kuberay_steady[1]:.3f} s a pass, against "
              f"{kuberay_steady[2]:.3f} s for the first pass (creates it)")
    print(f"\nB: {count} MoEDeployments, render-only Ray backend ({apps} applications rendered)")
    print(f"  all Ready after               {all_ready:7.2f} s")
    print(f"  reconciles                    {reconciles:7.0f}")
    print(f"  operator CPU                  {cpu:7.2f} s ({cpu / reconciles:.3f} s per reconcile)")
    print(f"  apiserver requests by the operator ~{operator_requests:.0f} ({operator_requests / reconciles:.1f} per reconcile;"
          f" all {requests_total:.0f}, of them the bench's own ~{ours:.0f})")
    print(f"  then {a.steady_s:.0f} s steady: writes a minute {steady['writes_per_minute']:.1f}, operator CPU "
          f"{steady['cpu_share']:.3f} of a core (~{count / max(steady['cpu_share'], 1e-9):.0f} objects a core), "
          f"loop turns an object per 5 s {'n/a' if turns is None else f'{turns:.2f}'}")
    results = {"many": many}
    if not many_only:
        print("\nD: a DeepSeek-V3-shaped MoEDeployment (14,848 experts, 32 groups) beside them")
        print(f"  apply -> Ready                {deepseek['apply_to_ready_s']:7.2f} s")
        print(f"  the object as stored          {deepseek['object_bytes'] / 1024:7.1f} KiB "
              f"(its Serve application {deepseek['app_config_bytes'] / 1024:.1f} KiB)")
        figures.update({"deepseek-v3-apply-to-ready-s": deepseek["apply_to_ready_s"],
                        "deepseek-v3-object-bytes": deepseek["object_bytes"], "apply-to-ready-s": total,
                        "edit-to-serving-s": edit_s, "operator-share-of-apply-to-ready": operator_s / total,
                        "ray-share-of-apply-to-ready": ray_s / total, "steady-writes-per-pass-rest": rest_steady[0],
                        "steady-writes-per-pass-kuberay": kuberay_steady[0], "steady-pass-s-rest": rest_steady[1]})
        results.update({"one_apply": {"total_s": total, "operator_s": operator_s, "ray_s": ray_s,
                                      "watch_and_status_s": total - reconcile_s, "edit_to_serving_s": edit_s},
                        "steady_passes": {"passes": STEADY_PASSES,
                                          "rest": {"writes_per_pass": rest_steady[0], "pass_s": rest_steady[1],
                                                   "changed_pass_s": rest_steady[2]},
                                          "kuberay": {"writes_per_pass": kuberay_steady[0], "pass_s": kuberay_steady[1],
                                                      "first_pass_s": kuberay_steady[2]}},
                        "deepseek_v3": deepseek})
    return report(a.out, results, figures)

if __name__ == "__main__":
    sys.exit(main())
