"""Everything in Pods on a real node, as a user would do it: `helm install` the chart with the
operator image built from our Dockerfile -> the operator Pod Ready -> a Ray head and two worker
Pods, two Ray nodes labelled pool=a and pool=b, each in its own network namespace on the node's
bridge (examples/ray-cluster.yaml), with the model on a hostPath -> `kubectl apply` a MoEDeployment
(Existing mode, the head's ClusterIP) with shard group 0 pinned to pool a and group 1 to pool b ->
Ready, each group on its node -> completions through the ray-serve ClusterIP equal to the
in-process model (each layer's expert exchange crossing the bridge) -> moectl hot-swap --wait ->
moectl rebalance --wait -> kubectl scale (the new replicas in their pools) -> pool a's worker Pod
deleted under load, its replicas back in the replacement Pod (failures counted and reported) ->
group 1 pinned to a pool no node has: Ready=False naming it, then fixed -> delete -> helm
uninstall, nothing of ours left."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import requests
from safetensors.torch import save_file

from load_clients import Load
from node_cluster import as_yaml, helm_install_args, moedeployment, ray_cluster
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
from moe_workers.serve.openai.chat import write_tokenizer_config
from moe_workers.store.versions import file_sha256
from waiting import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.node]
MOECTL = str(Path(sys.executable).with_name("moectl"))
NS = "moe-system"


def _ready(k8s, name="tiny"):
    obj = k8s.kubectl_json("get", "moed", name)
    st = obj.get("status") or {}
    ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
    return obj, st, ready


def _moectl(k8s, *args):
    return subprocess.run([MOECTL, *args], env=k8s.env, capture_output=True, text=True, timeout=400)


def _pods(k8s, selector: str) -> list[dict]:
    return k8s.kubectl_json("get", "pods", "-l", selector)["items"]


def _replica_ips(ray_ip: str) -> dict[str, tuple[str, str]]:
    """Where Serve runs each replica of our application: replica id -> (deployment, node IP, a Pod IP)."""
    apps = requests.get(f"http://{ray_ip}:8265/api/serve/applications/", timeout=30).json()["applications"]
    deployments = apps["default.tiny"]["deployments"]
    return {r["replica_id"]: (name, r["node_ip"]) for name, d in deployments.items() for r in d["replicas"]
            if r["state"] == "RUNNING"}


def _ips_of(replicas: dict[str, tuple[str, str]], deployment: str) -> set[str]:
    return {ip for name, ip in replicas.values() if name == deployment}


def _pool_ip(k8s, pool: str) -> str:
    """The Pod IP of the Running Ray worker of a pool (one Pod each)."""
    pods = [p for p in _pods(k8s, f"moe.io/pool={pool}") if p["status"]["phase"] == "Running"
            and not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]["status"]["podIP"]


PINS = [{"groups": [0], "rayNodeLabels": {"pool": "a"}}, {"groups": [1], "rayNodeLabels": {"pool": "b"}}]


def _dump(k8s) -> str:
    """What a person would look at when the test fails: Pods, events, the operator's log (its
    timers' routine lines left out), the object's conditions and what Serve says of the app."""
    log = k8s.kubectl("-n", NS, "logs", "statefulset/rel-moe-operator", "--tail=400", check=False).stdout
    out = [k8s.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout,
           k8s.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:],
           "\n".join(line for line in log.splitlines() if "succeeded." not in line and "/healthz" not in line)[-6000:],
           k8s.kubectl("get", "moed", "-o", "jsonpath={.items[*].status.conditions}", check=False).stdout,
           k8s.kubectl("logs", "deploy/ray-head", "--tail=40", check=False).stdout]
    try:
        ray_ip = k8s.kubectl("get", "svc", "ray-head", "-o", "jsonpath={.spec.clusterIP}").stdout
        apps = requests.get(f"http://{ray_ip}:8265/api/serve/applications/", timeout=10).json()["applications"]
        out.append(json.dumps({n: {"status": a["status"], "message": a.get("message", "")[:300], "deployments": {
            d: [v["status"], v.get("message", "")[:300], [r["state"] for r in v["replicas"]]]
            for d, v in a["deployments"].items()}} for n, a in apps.items()}, indent=1))
    except Exception as err:  # noqa: BLE001 - a dump says what it can
        out.append(f"Serve status: {err}")
    return "\n".join(out)


ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"],
    "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


def _agent_calls(endpoint: str) -> None:
    """What an agent framework sends, with the openai client through the cluster's Service: a
    forced tool call whose arguments fit the function, and JSON held to a schema."""
    client = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    called = client.chat.completions.create(model=model, messages=ask, tools=[ADD], parallel_tool_calls=False,
                                            tool_choice={"type": "function", "function": {"name": "add"}},
                                            max_completion_tokens=200, temperature=1.0, seed=1).choices[0]
    assert called.finish_reason == "tool_calls", called
    jsonschema.validate(json.loads(called.message.tool_calls[0].function.arguments), ADD["function"]["parameters"])
    answer = client.chat.completions.create(model=model, messages=ask, max_completion_tokens=200, temperature=1.0,
                                            seed=2, response_format={"type": "json_schema", "json_schema": {
                                                "name": "answer", "schema": ANSWER}}).choices[0]
    jsonschema.validate(json.loads(answer.message.content), ANSWER)


def test_helm_operator_ray_and_model_in_pods(k8s_node, tmp_path, record_property):
    k8s = k8s_node
    models = tmp_path / "models"
    model = write_random_mixtral(models / "tiny", num_layers=2, num_experts=4, hidden_size=32,
                                 intermediate_size=64, vocab_size=BYTE_VOCAB_SIZE, router_scale=10,
                                 max_position_embeddings=1024)
    write_byte_tokenizer(model)  # and init-model's chat template, which renders tools: chat as agents use it
    write_tokenizer_config(model)
    models.chmod(0o755)
    reference = InProcessModel(model)
    t0 = time.monotonic()
    shares = {}

    # the Ray cluster as Pods; its Services first (the worker finds the head by env var)
    k8s.kubectl("apply", "-f", "-", input=as_yaml(ray_cluster(models, k8s.ray_image)))
    ray_ip = k8s.kubectl("get", "svc", "ray-head", "-o", "jsonpath={.spec.clusterIP}").stdout
    serve_ip = k8s.kubectl("get", "svc", "ray-serve", "-o", "jsonpath={.spec.clusterIP}").stdout
    try:
        # the operator, installed with helm from our chart and image
        k8s.helm(*helm_install_args(k8s.operator_image, serve_ip, models, NS), "--wait", "--timeout", "180s")
        op_pod = k8s.kubectl_json("-n", NS, "get", "pod", "rel-moe-operator-0")
        assert op_pod["spec"]["containers"][0]["image"] == k8s.operator_image
        assert next(c for c in op_pod["status"]["conditions"] if c["type"] == "Ready")["status"] == "True"
        shares["operator_ready_s"] = time.monotonic() - t0

        k8s.kubectl("wait", "--for=condition=Ready", "pod", "-l", "app.kubernetes.io/component=head", "--timeout=180s")
        wait_for(lambda: [p["status"]["phase"] for p in _pods(k8s, "app.kubernetes.io/component=worker")]
                 == ["Running", "Running"], timeout_s=120, what="both Ray worker Pods Running")
        shares["ray_ready_s"] = time.monotonic() - t0

        # apply -> Ready, all through the cluster
        # two Ray nodes (worker Pods, each its own network namespace on the bridge): a shard group on each
        moed = moedeployment(ray_ip)
        moed["spec"]["experts"]["groupNodes"] = PINS
        k8s.kubectl("apply", "-f", "-", input=json.dumps(moed))
        try:
            obj, st, ready = wait_for(lambda: (r := _ready(k8s))[2].get("status") == "True" and r,
                                      timeout_s=600, what="MoEDeployment Ready=True")
        except AssertionError:
            raise AssertionError(f"not Ready: {_ready(k8s)[1]}\n{_dump(k8s)}")
        shares["moed_ready_s"] = time.monotonic() - t0
        assert ready["reason"] == "Serving" and st["observedGeneration"] == obj["metadata"]["generation"]
        endpoint = st["endpoint"]
        assert endpoint == f"http://{serve_ip}:8000/tiny/v1"

        prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]

        def tokens(p):
            r = requests.post(endpoint + "/completions", json={"prompt": p, "max_tokens": 5, "temperature": 0},
                              timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        replicas = _replica_ips(ray_ip)
        ip_a, ip_b = _pool_ip(k8s, "a"), _pool_ip(k8s, "b")
        assert ip_a != ip_b
        assert (_ips_of(replicas, "ExpertShard-0"), _ips_of(replicas, "ExpertShard-1")) == ({ip_a}, {ip_b}), replicas
        want_old = [reference.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
        assert [tokens(p) for p in prompts] == want_old  # every layer's exchange crosses the bridge
        _agent_calls(endpoint)

        # moectl hot-swap --wait: a file on the model volume, validated and served by every replica
        original = {w: t.clone() for w, t in reference.experts.weights[(1, 1)].items()}
        new = {w: (t * 40).contiguous() for w, t in original.items()}
        (models / "weights").mkdir()
        f = models / "weights" / "e-1.1.safetensors"
        save_file({f"{w}.weight": t for w, t in new.items()}, str(f))
        swapped = InProcessModel(model)
        swapped.experts.weights[(1, 1)] = new
        want_new = [swapped.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
        assert want_new != want_old
        r = _moectl(k8s, "hot-swap", "tiny", "--expert", "1.1", "--weights", "/models/weights/e-1.1.safetensors",
                    "--sha256", file_sha256(f), "--wait", "--timeout", "300")
        assert r.returncode == 0 and "on every replica" in r.stdout, (r.stdout, r.stderr)
        assert [tokens(p) for p in prompts] == want_new

        # moectl rebalance --wait: answered by the operator's autoscale timer in its Pod
        r = _moectl(k8s, "rebalance", "tiny", "--wait", "--timeout", "300")
        assert r.returncode == 0 and r.stdout.startswith(("rebalanced default/tiny", "no rebalance:")), (r.stdout, r.stderr)
        assert [tokens(p) for p in prompts] == want_new

        # scaled: each group's new replica runs in its own pool
        k8s.kubectl("scale", "moed", "tiny", "--replicas", "2")
        wait_for(lambda: len(_ips_of(now := _replica_ips(ray_ip), "ExpertShard-0")) == 1
                 and sum(name.startswith("ExpertShard") for name, _ in now.values()) == 4 and now,
                 timeout_s=300, what="two replicas a group")
        replicas = _replica_ips(ray_ip)
        assert (_ips_of(replicas, "ExpertShard-0"), _ips_of(replicas, "ExpertShard-1")) == ({ip_a}, {ip_b}), replicas
        assert [tokens(p) for p in prompts] == want_new

        # pool a's worker Pod deleted under load: Kubernetes starts another, Ray and Serve put its
        # replicas back there (group 0 is pinned to it), group 1 stays on pool b; every request is
        # answered or fails, none hangs, and serving recovers
        worker = next(p["metadata"]["name"] for p in _pods(k8s, "moe.io/pool=a"))
        on_a = sum(ip == ip_a for _, ip in replicas.values())
        t_kill = time.monotonic()
        with Load(endpoint.removesuffix("/v1"), clients=2) as load:
            time.sleep(5)
            k8s.kubectl("delete", "pod", worker, "--wait=false")
            wait_for(lambda: any(p["metadata"]["name"] != worker and p["status"]["phase"] == "Running"
                                 and p["status"].get("podIP") for p in _pods(k8s, "moe.io/pool=a")),
                     timeout_s=120, what="a new pool-a Ray worker Pod")
            new_ip = _pool_ip(k8s, "a")
            # recovered once Serve runs every replica again, none on the old Pod, group 0 in the new
            # one (the old Pod's replicas may answer for a while as it terminates, so answers alone
            # do not say so)
            wait_for(lambda: len(now := _replica_ips(ray_ip)) == len(replicas)
                     and ip_a not in {ip for _, ip in now.values()}
                     and _ips_of(now, "ExpertShard-0") == {new_ip} and _ips_of(now, "ExpertShard-1") == {ip_b},
                     timeout_s=300, what="every replica running again, group 0 in the new pool-a Pod")
            ok_before = load.ok
            wait_for(lambda: load.ok >= ok_before + 20, timeout_s=300, what="requests answered after the worker loss")
        shares["worker_loss_recovered_s"] = time.monotonic() - t_kill
        record_property("worker_loss_ok", load.ok)
        record_property("worker_loss_failed", load.failed)
        print(f"worker Pod deleted under load ({on_a} of {len(replicas)} replicas on it): {load.ok} answered, "
              f"{load.failed} failed ({sorted(set(e[:60] for e in load.errors))[:5]})")
        assert load.ok > 20
        assert [tokens(p) for p in prompts] == want_new
        wait_for(lambda: _ready(k8s)[2].get("status") == "True", timeout_s=300, what="Ready again")

        # group 1 pinned to a pool no Ray node has: Ready=False naming the group and the label; group
        # 0 keeps its replicas; pinned back, the app is Ready and answers as before
        patch = [{"op": "replace", "path": "/spec/experts/groupNodes/1/rayNodeLabels", "value": {"pool": "c"}}]
        k8s.kubectl("patch", "moed", "tiny", "--type=json", "-p", json.dumps(patch))
        r = wait_for(lambda: (c := _ready(k8s)[2]).get("status") == "False" and c.get("reason") == "Unschedulable" and c,
                     timeout_s=120, what="Ready=False Unschedulable")
        assert "ExpertShard-1 is pinned to Ray nodes labelled pool=c" in r["message"], r
        assert "ExpertShard-0" not in r["message"].split("(live nodes")[0], r
        assert _ips_of(_replica_ips(ray_ip), "ExpertShard-0") == {new_ip}
        patch[0]["value"] = {"pool": "b"}
        k8s.kubectl("patch", "moed", "tiny", "--type=json", "-p", json.dumps(patch))
        wait_for(lambda: _ready(k8s)[2].get("status") == "True", timeout_s=300, what="Ready after the pin is fixed")
        assert [tokens(p) for p in prompts] == want_new

        # delete: the finalizer removes the Serve app; then helm uninstall leaves nothing of ours
        k8s.kubectl("delete", "moed", "tiny", "--timeout=180s")
        apps = requests.get(f"http://{ray_ip}:8265/api/serve/applications/", timeout=30).json()
        assert not (apps.get("applications") or {}), apps
        k8s.helm("uninstall", "rel", "--namespace", NS, "--wait", "--timeout", "120s")
        wait_for(lambda: not k8s.kubectl_json("-n", NS, "get", "pods")["items"], timeout_s=60, what="operator Pod gone")
        left = k8s.kubectl("get", "all,serviceaccounts,roles,rolebindings,clusterroles,clusterrolebindings",
                           "-A", "-l", "app.kubernetes.io/instance=rel", "-o", "name").stdout.split()
        assert left == [], left
        shares["total_s"] = time.monotonic() - t0
        print("node e2e timings:", {k: round(v, 1) for k, v in shares.items()})
    except BaseException:
        print(_dump(k8s))
        raise
    finally:
        k8s.kubectl("delete", "-f", "-", "--wait=false", check=False,
                    input=as_yaml(ray_cluster(models, k8s.ray_image)))


def test_bad_input_on_the_node(k8s_node, tmp_path):
    """What users get wrong when the operator runs in a Pod: a Ray address that does not answer, a
    model path missing on the node, a namespace the operator has no RBAC for. Each is named in
    Ready=False (or, where the operator may not write, in its log), and the operator Pod never
    restarts."""
    k8s = k8s_node
    models = tmp_path / "models"
    write_random_mixtral(models / "tiny", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64,
                         vocab_size=128)
    models.chmod(0o755)
    k8s.kubectl("create", "namespace", "team-a")
    # a Service with no Pods behind it: kube-proxy rejects connections to it
    k8s.kubectl("create", "service", "clusterip", "nowhere", "--tcp=8265:8265")
    nowhere = k8s.kubectl("get", "svc", "nowhere", "-o", "jsonpath={.spec.clusterIP}").stdout
    k8s.helm(*helm_install_args(k8s.operator_image, "127.0.0.1", models, NS), "--wait", "--timeout", "180s",
             "--set", "watchNamespaces={default,team-a}")
    try:
        unreachable = moedeployment(nowhere, name="unreachable")
        missing = moedeployment(nowhere, name="missing", model="/models/absent")
        k8s.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": [unreachable, missing]}))

        def reason(name):
            ready = _ready(k8s, name)[2]
            return ready.get("status") == "False" and ready.get("reason") != "Pending" and ready

        r = wait_for(lambda: reason("unreachable"), timeout_s=120, what="unreachable: Ready=False")
        assert r["reason"] == "RayUnreachable" and f"http://{nowhere}:8265" in r["message"], r
        r = wait_for(lambda: reason("missing"), timeout_s=120, what="missing: Ready=False")
        assert r["reason"] == "InvalidSpec" and "/models/absent" in r["message"], r

        # no RBAC in team-a any more: the operator cannot even read there; it says so in its log
        k8s.kubectl("-n", "team-a", "delete", "rolebinding", "-l", "app.kubernetes.io/instance=rel")
        k8s.kubectl("-n", "team-a", "apply", "-f", "-", input=json.dumps(moedeployment(nowhere, name="forbidden")))

        def logged():
            log = k8s.kubectl("-n", NS, "logs", "rel-moe-operator-0", check=False).stdout
            return "forbidden" in log.lower() and "team-a" in log and log
        wait_for(logged, timeout_s=120, what="the operator's log naming the forbidden namespace")
        time.sleep(10)
        pod = k8s.kubectl_json("-n", NS, "get", "pod", "rel-moe-operator-0")
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        assert next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["status"] == "True"
    except BaseException:
        print(_dump(k8s))
        raise
    finally:
        for name in ("unreachable", "missing"):
            k8s.kubectl("delete", "moed", name, "--timeout=120s", check=False)
        k8s.helm("uninstall", "rel", "--namespace", NS, "--wait", check=False)
        k8s.kubectl("delete", "namespace", "team-a", "--wait=false", check=False)
        k8s.kubectl("delete", "service", "nowhere", check=False)
