"""The kopf operator against the real apiserver + etcd and a local Ray head: apply -> Ready ->
completions -> hot-swap through the spec (moectl) -> change groups -> invalid spec -> operator killed and restarted -> delete."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import save_file

from moe_operator.backends.ray_rest import RayServeClient
from moe_workers.model.inprocess import InProcessModel
from operator_proc import Operator
from waiting import wait_for
from moe_workers.model.random_init import write_random_mixtral
from moe_workers.store.versions import content_digest, file_sha256

pytestmark = [pytest.mark.k8s, pytest.mark.ray]


def _manifest(name, model_path, groups=2, prefix="/op"):
    return {
        "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name},
        "spec": {"model": {"path": str(model_path)},
                 "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi", "routePrefix": prefix},
                 "experts": {"groups": groups, "numCpus": 0.25,
                             "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"},
                                       "cold": {"path": str(Path(model_path).parent / "cold")}}}},
    }


MOECTL = str(Path(sys.executable).with_name("moectl"))


def _moectl(k8s, *args):
    return subprocess.run([MOECTL, *args], env=k8s.env, capture_output=True, text=True, timeout=300)


def _hot_swap_through_the_spec(k8s, model, endpoint, reference):
    """moectl hot-swap --wait -> new version on every replica; a bad file -> exit 1 with the
    reason and the old one serving; --rollback -> the checkpoint's version again."""
    weights_dir = Path(model).parent / "weights"
    weights_dir.mkdir()
    original = {w: t.clone() for w, t in reference.experts.weights[(1, 1)].items()}
    new = {w: (t * 40).contiguous() for w, t in original.items()}
    f = weights_dir / "e-1.1.safetensors"
    save_file({f"{w}.weight": t for w, t in new.items()}, str(f))
    swapped = InProcessModel(model)
    swapped.experts.weights[(1, 1)] = new
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]

    def tokens(p):
        return requests.post(endpoint + "/completions", json={"prompt": p, "max_tokens": 5, "temperature": 0},
                             timeout=60).json()["choices"][0]["token_ids"]

    want_old = [reference.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
    want_new = [swapped.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
    assert want_old != want_new
    r = _moectl(k8s, "hot-swap", "tiny", "--expert", "1.1", "--weights", str(f), "--sha256", file_sha256(f),
                "--wait", "--timeout", "180")
    assert r.returncode == 0, r.stderr
    assert "serves sha256:" in r.stdout and "on every replica" in r.stdout
    assert [tokens(p) for p in prompts] == want_new
    st = k8s.kubectl_json("get", "moed", "tiny")["status"]
    rec = next(x for x in st["lastSwaps"] if x["expert"] == "1.1")
    assert rec["outcome"] == "Serving" and rec["digest"] == content_digest(new) and rec["durationSeconds"] >= 0
    assert st["overriddenExperts"] == 1
    assert st["tiers"]["hot"]["experts"] > 0 and st["tiers"]["cold"]["experts"] > 0
    events = k8s.kubectl_json("get", "events", "--field-selector", "involvedObject.name=tiny")["items"]
    assert any(e["reason"] == "HotSwapServing" for e in events)

    # a wrong checksum: refused with the reason, exit 1, the swapped version keeps serving
    r = _moectl(k8s, "hot-swap", "tiny", "--expert", "1.1", "--weights", str(f), "--sha256", "0" * 64,
                "--wait", "--timeout", "180")
    assert r.returncode == 1 and "sha256 is" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert [tokens(p) for p in prompts] == want_new
    # dry run changes nothing
    r = _moectl(k8s, "hot-swap", "tiny", "--expert", "1.1", "--rollback", "--dry-run")
    assert r.returncode == 0 and "overrides: []" in r.stdout
    assert k8s.kubectl_json("get", "moed", "tiny")["spec"]["experts"]["overrides"]
    r = _moectl(k8s, "hot-swap", "tiny", "--expert", "1.1", "--rollback", "--wait", "--timeout", "180")
    assert r.returncode == 0, r.stderr
    assert [tokens(p) for p in prompts] == want_old
    st = k8s.kubectl_json("get", "moed", "tiny")["status"]
    assert st["overriddenExperts"] == 0 and st["lastSwaps"][0]["outcome"] == "RolledBack"
    # moectl rebalance: an annotation the operator's autoscale timer answers (reads load from the
    # app's own report, decides now whatever the mode, says why); dry run writes nothing
    r = _moectl(k8s, "rebalance", "tiny", "--dry-run")
    assert r.returncode == 0 and "serving.moe.io/rebalance-requested" in r.stdout, r.stderr
    assert "serving.moe.io/rebalance-requested" not in (k8s.kubectl_json("get", "moed", "tiny")["metadata"]
                                                         .get("annotations") or {})
    r = _moectl(k8s, "rebalance", "tiny", "--wait", "--timeout", "120")
    assert r.returncode == 0 and r.stdout.startswith(("rebalanced default/tiny", "no rebalance:")), (r.stdout, r.stderr)
    obj = k8s.kubectl_json("get", "moed", "tiny")
    request = obj["metadata"]["annotations"]["serving.moe.io/rebalance-requested"]
    assert obj["status"]["autoscaling"]["lastRequest"] == request
    assert obj["status"]["autoscaling"].get("phase", "Steady") == "Steady"
    assert [tokens(p) for p in prompts] == want_old  # whatever the placement, the same tokens
    r = _moectl(k8s, "rebalance", "nope")
    assert r.returncode == 1 and r.stderr.strip() == "error: moedeployment default/nope not found"
    # an unknown object: exit 1, one line
    r = _moectl(k8s, "hot-swap", "nope", "--expert", "1.1", "--rollback")
    assert r.returncode == 1 and r.stderr.strip() == "error: moedeployment default/nope not found"

    # the live views through Kubernetes: status.endpoint of the object
    rows = json.loads(_moectl(k8s, "experts", "tiny", "-o", "json").stdout)["experts"]
    assert len(rows) == 8 and {r["replicas"] for r in rows} == {1}
    assert any(r["tokens"] > 0 for r in rows)
    r = _moectl(k8s, "top", "tiny", "--once")
    assert r.returncode == 0 and "imbalance" in r.stdout
    r = _moectl(k8s, "bench", "tiny", "--duration", "1", "-c", "2", "--prompt-len", "3", "--max-tokens", "2", "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["failed"] == 0, r.stderr
    for cmd in ("experts", "top", "bench"):
        r = _moectl(k8s, cmd, "nope")
        assert r.returncode == 1 and r.stderr.strip() == "error: moedeployment default/nope not found", (cmd, r.stderr)


def _quarantine_through_moectl(k8s, endpoint, reference):
    """moectl quarantine --wait: the Ingress leaves the expert out in place (the tokens follow the
    reference with the same quarantine, status.quarantinedExperts says so); an expert the model
    does not have: exit 1 naming the entry, the quarantine in force keeps serving; --lift: the
    checkpoint's tokens again."""
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]

    def tokens(p):
        return requests.post(endpoint + "/completions", json={"prompt": p, "max_tokens": 5, "temperature": 0},
                             timeout=60).json()["choices"][0]["token_ids"]

    plain = [reference.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
    reference.dense.quarantine(["0.1", "1.0"])
    try:
        contained = [reference.generate([p], 5, stop_at_eos=True)[0] for p in prompts]
    finally:
        reference.dense.quarantine([])
    assert contained != plain
    r = _moectl(k8s, "quarantine", "tiny", "1.0", "0.1", "--wait", "--timeout", "120")
    assert r.returncode == 0 and "the Ingress leaves out 0.1, 1.0" in r.stdout, (r.stdout, r.stderr)
    assert k8s.kubectl_json("get", "moed", "tiny")["status"]["quarantinedExperts"] == ["0.1", "1.0"]
    assert [tokens(p) for p in prompts] == contained
    r = _moectl(k8s, "quarantine", "tiny", "1.9", "--wait", "--timeout", "120")
    assert r.returncode == 1 and "spec.routing.quarantine[2] 1.9 does not exist" in r.stderr, r.stderr
    assert [tokens(p) for p in prompts] == contained  # the refused edit changed nothing served
    r = _moectl(k8s, "quarantine", "tiny", "1.9", "0.1", "1.0", "--lift", "--wait", "--timeout", "120")
    assert r.returncode == 0 and "the Ingress leaves out no expert" in r.stdout, (r.stdout, r.stderr)
    assert [tokens(p) for p in prompts] == plain
    r = _moectl(k8s, "quarantine", "tiny", "1.x")
    assert r.returncode == 2 and "'1.x' is not an expert id" in r.stderr, r.stderr


def _routing_anomaly_and_auto_quarantine(k8s, endpoint):
    """spec.routing.anomaly thresholds and autoQuarantine: varied prompts give the detector its
    baseline (RoutingAnomaly=False NoAnomaly); one key's prompts of one repeated token send every
    token of a layer to the same two experts (of 4): RoutingAnomaly=True naming that key's id, a
    Warning Event, and on a surge the expert quarantined automatically; autoQuarantine off lifts it."""
    from moe_workers.serve.auth import key_id

    def anomaly():
        st = k8s.kubectl_json("get", "moed", "tiny").get("status") or {}
        return st, next((c for c in st.get("conditions", []) if c["type"] == "RoutingAnomaly"), {})

    routing = {"anomaly": {"warmupWindows": 1, "minTokens": 8, "entropyFloor": 0.6, "surgeFactor": 1.5,
                           "minShareFactor": 1.0}, "autoQuarantine": True}
    k8s.kubectl("patch", "moed", "tiny", "--type=merge", "-p", json.dumps({"spec": {"routing": routing}}))
    g = torch.Generator().manual_seed(5)

    def varied():
        requests.post(endpoint + "/completions", json={"prompt": torch.randint(3, 120, (10,), generator=g).tolist(),
                                                       "max_tokens": 3, "temperature": 0}, timeout=60)
        return anomaly()[1].get("reason") == "NoAnomaly"

    wait_for(varied, timeout_s=120, interval_s=0.2, what="RoutingAnomaly=False NoAnomaly on varied prompts")
    attacker = key_id("Bearer sk-e2e-attacker")

    def skewed():
        requests.post(endpoint + "/completions", json={"prompt": [9] * 30, "max_tokens": 1, "temperature": 0},
                      headers={"Authorization": "Bearer sk-e2e-attacker"}, timeout=60)
        st, c = anomaly()
        return c.get("status") == "True" and (st, c)

    st, c = wait_for(skewed, timeout_s=120, interval_s=0.2, what="RoutingAnomaly=True on the skewed prompts")
    assert c["reason"] in ("ExpertSurge", "EntropyDrop") and f"key {attacker}" in c["message"], c
    assert all(r["key"] == attacker for r in st["routingAnomalies"]), st["routingAnomalies"]
    events = k8s.kubectl_json("get", "events", "--field-selector", "involvedObject.name=tiny")["items"]
    assert any(e["reason"] == c["reason"] and e["type"] == "Warning" for e in events)
    surging = sorted({r["expert"] for r in st["routingAnomalies"] if r["kind"] == "surge"})
    if surging:  # a surge is quarantined on the next pass, in place
        st = wait_for(lambda: (s := anomaly()[0]).get("autoQuarantined") and set(s["autoQuarantined"]) <= set(
            s.get("quarantinedExperts") or []) and s, timeout_s=120, what="the surging expert quarantined")
        assert set(st["autoQuarantined"]) <= set(surging)
    k8s.kubectl("patch", "moed", "tiny", "--type=merge", "-p", json.dumps({"spec": {"routing": {
        "anomaly": None, "autoQuarantine": None}}}))
    wait_for(lambda: not (s := anomaly()[0]).get("autoQuarantined") and not s.get("quarantinedExperts"),
             timeout_s=120, what="the automatic quarantine lifted")


def _capacity_through_the_spec(k8s, endpoint, reference):
    """spec.routing.capacityFactor on the real apiserver: applied in place (status.capacityFactor;
    a prompt's tokens follow the reference capped the same way), a factor below 1 refused by the
    schema naming the field, unset: exact routing again."""
    prompt = list(range(20, 60))  # one prefill call of 40 tokens: 20 choices an expert at 1.0
    reference.dense.capacity_factor = 1.0
    try:
        capped = reference.generate([prompt], 4)[0]
        assert sum(reference.dense.rerouted.values()) > 0  # the skewed router overflows some experts
    finally:
        reference.dense.capacity_factor = None
    plain = reference.generate([prompt], 4)[0]

    def tokens():
        return requests.post(endpoint + "/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0},
                             timeout=60).json()["choices"][0]["token_ids"]

    patch = lambda v: k8s.kubectl("patch", "moed", "tiny", "--type", "merge", "-p",  # noqa: E731
                                  json.dumps({"spec": {"routing": {"capacityFactor": v}}}), check=False)
    r = patch(0)
    assert r.returncode != 0 and "spec.routing.capacityFactor" in r.stderr, r.stderr
    assert patch(1.0).returncode == 0
    wait_for(lambda: k8s.kubectl_json("get", "moed", "tiny")["status"].get("capacityFactor") == 1.0,
             timeout_s=120, what="status.capacityFactor 1.0")
    assert tokens() == capped
    assert patch(None).returncode == 0
    wait_for(lambda: k8s.kubectl_json("get", "moed", "tiny")["status"].get("capacityFactor") is None,
             timeout_s=120, what="status.capacityFactor unset")
    assert tokens() == plain


def _api_keys_from_a_secret(k8s, endpoint):
    """spec.ingress.apiKeySecretRef: /v1/* needs a key from the Secret; a changed Secret applies
    without a spec change (the observe timer notices it); removing the reference opens the API."""
    def status_code(key=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.get(endpoint + "/models", headers=headers, timeout=30).status_code

    # a Secret that does not exist yet: Ready=False naming it, the app keeps serving; then it appears
    k8s.kubectl("patch", "moed", "tiny", "--type=merge", "-p",
                json.dumps({"spec": {"ingress": {"apiKeySecretRef": {"name": "tiny-keys", "key": "keys"}}}}))
    _, _, ready = wait_for(lambda: (r := _ready(k8s, "tiny"))[2]["reason"] == "SecretUnavailable" and r,
                           timeout_s=60, what="SecretUnavailable")
    assert ready["status"] == "False" and ready["message"] == \
        "spec.ingress.apiKeySecretRef: Secret default/tiny-keys not found"
    assert status_code() == 200
    k8s.kubectl("create", "secret", "generic", "tiny-keys", "--from-literal=keys=first-key\nsecond-key")
    wait_for(lambda: status_code() == 401, timeout_s=180, what="the API to need a key")
    assert status_code("second-key") == 200 and status_code("wrong") == 401
    # (the app needs keys before the pass writes its status)
    st = wait_for(lambda: (s := k8s.kubectl_json("get", "moed", "tiny")["status"]).get("apiKeys") and s,
                  timeout_s=60, what="status.apiKeys")
    assert st["apiKeys"]["count"] == 2 and "first-key" not in json.dumps(st)
    # rotate: the Secret alone changes
    k8s.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tiny-keys"},
                                                      "stringData": {"keys": "rotated-key"}}))
    wait_for(lambda: status_code("rotated-key") == 200, timeout_s=120, what="the rotated key to apply")
    assert status_code("first-key") == 401
    k8s.kubectl("patch", "moed", "tiny", "--type=json", "-p", json.dumps([{"op": "remove", "path": "/spec/ingress/apiKeySecretRef"}]))
    wait_for(lambda: status_code() == 200, timeout_s=180, what="the API open again")
    wait_for(lambda: "apiKeys" not in k8s.kubectl_json("get", "moed", "tiny")["status"], timeout_s=60,
             what="status.apiKeys gone")  # (the app opens before the pass writes its status)


def _ready(k8s, name):
    obj = k8s.kubectl_json("get", "moed", name)
    st = obj.get("status") or {}
    ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), None)
    return obj, st, ready


def test_operator_lifecycle(crd_installed, ray_head, tmp_path):
    k8s = crd_installed
    roots = tmp_path / "models"
    model = write_random_mixtral(roots / "tiny", num_layers=2, num_experts=4, hidden_size=32, intermediate_size=64,
                                 vocab_size=128, router_scale=10)
    reference = InProcessModel(model)
    log = open(tmp_path / "operator.log", "w+")
    op = Operator(k8s, ray_head, str(roots), log)
    ray = RayServeClient(ray_head.dashboard_url, ray_head.token)
    op.start()
    try:
        k8s.kubectl("apply", "-f", "-", input=json.dumps(_manifest("tiny", model)))
        obj, st, ready = wait_for(lambda: (r := _ready(k8s, "tiny"))[2] and r[2]["status"] == "True" and r,
                               timeout_s=300, what="Ready=True")
        assert ready["reason"] == "Serving" and st["observedGeneration"] == obj["metadata"]["generation"]
        assert obj["metadata"]["finalizers"] == ["serving.moe.io/cleanup"]
        # observed, not assumed: Ray's RUNNING replicas per group
        assert [(g["name"], g["replicas"], g["readyReplicas"]) for g in st["groups"]] == [
            ("ExpertShard-0", 1, 1), ("ExpertShard-1", 1, 1)]
        degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "False" and degraded["reason"] == "AllReplicasReady"
        endpoint = st["endpoint"]
        assert endpoint == f"http://127.0.0.1:{ray_head.serve_http_port}/op/v1"
        prompt = [5, 6, 7, 8]
        got = requests.post(endpoint + "/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                            timeout=60).json()["choices"][0]["token_ids"]
        assert got == reference.generate([prompt], max_tokens=5)[0][: len(got)]
        events = k8s.kubectl_json("get", "events", "--field-selector", "involvedObject.name=tiny")["items"]
        assert any(e["reason"] == "Serving" for e in events)
        row = k8s.kubectl("get", "moed", "tiny").stdout.splitlines()[1].split()
        assert row[:4] == ["tiny", "True", "2", "1"]

        _hot_swap_through_the_spec(k8s, model, endpoint, reference)
        _api_keys_from_a_secret(k8s, endpoint)
        _quarantine_through_moectl(k8s, endpoint, reference)
        _routing_anomaly_and_auto_quarantine(k8s, endpoint)
        _capacity_through_the_spec(k8s, endpoint, reference)

        # the app removed from Ray behind the operator's back: a steady turn cannot read its report,
        # runs the whole pass, finds it gone and applies it again (level-triggered)
        from moe_operator.backends.rest_backend import request_removal

        app = lambda: ray.get().get("applications", {}).get("default.tiny") or {}  # noqa: E731
        deployed_at = app()["last_deployed_time_s"]
        assert request_removal(ray, "default.tiny", ray_head.serve_http_port) is False  # asked
        wait_for(lambda: app().get("status") == "RUNNING" and app().get("last_deployed_time_s") != deployed_at,
                 timeout_s=180, what="the operator to deploy the app again")
        got = wait_for(lambda: (r := requests.post(endpoint + "/completions", json={
            "prompt": prompt, "max_tokens": 5, "temperature": 0}, timeout=60)).status_code == 200 and r,
            timeout_s=60, what="completions again").json()["choices"][0]["token_ids"]
        assert got == reference.generate([prompt], max_tokens=5)[0][: len(got)]

        # change the number of groups: re-planned, re-rendered, still serving the same tokens
        k8s.kubectl("patch", "moed", "tiny", "--type=merge", "-p", json.dumps({"spec": {"experts": {"groups": 3}}}))
        # (Ready stays True while Serve rolls the change out; Progressing=False once it is done)
        wait_for(lambda: (r := _ready(k8s, "tiny"))[1].get("observedGeneration") == r[0]["metadata"]["generation"]
              and len(r[1].get("groups", [])) == 3 and r[2]["status"] == "True"
              and next(c for c in r[1]["conditions"] if c["type"] == "Progressing")["status"] == "False",
              what="3 groups")
        got = requests.post(endpoint + "/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                            timeout=60).json()["choices"][0]["token_ids"]
        assert got == reference.generate([prompt], max_tokens=5)[0][: len(got)]

        # a group pinned to Ray node labels no node has: Ready=False naming it; the edit reverted
        # before kopf retries it (kopf then drops the retry: the spec is what it handled last), and
        # the object is Ready again all the same
        pin = [{"op": "add", "path": "/spec/experts/groupNodes",
                "value": [{"groups": [2], "rayNodeLabels": {"pool": "nowhere"}}]}]
        k8s.kubectl("patch", "moed", "tiny", "--type=json", "-p", json.dumps(pin))
        _, _, bad = wait_for(lambda: (r := _ready(k8s, "tiny"))[2]["status"] == "False" and r, what="Unschedulable")
        assert bad["reason"] == "Unschedulable" and bad["message"].startswith(
            "ExpertShard-2 is pinned to Ray nodes labelled pool=nowhere, and no live node has them"), bad
        k8s.kubectl("patch", "moed", "tiny", "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/spec/experts/groupNodes"}]))
        try:
            wait_for(lambda: _ready(k8s, "tiny")[2]["status"] == "True", timeout_s=120, what="Ready after the revert")
        except AssertionError:
            raise AssertionError(json.dumps(k8s.kubectl_json("get", "moed", "tiny")["metadata"], indent=1))

        # a second MoEDeployment on the same Ray cluster: both serve; deleting it leaves the first alone
        k8s.kubectl("apply", "-f", "-", input=json.dumps(_manifest("second", model, groups=1, prefix="/op2")))
        # killed in mid-reconcile: after its Serve config PUT, before the app runs and status is written
        wait_for(lambda: "default.second" in ray.get().get("applications", {}), timeout_s=120, interval_s=0.1,
                 what="second's config PUT")
        assert (_ready(k8s, "second")[2] or {}).get("status") != "True"
        op.kill()
        op.start()
        _, st2, _ = wait_for(lambda: (r := _ready(k8s, "second"))[2] and r[2]["status"] == "True" and r,
                             timeout_s=300, what="second Ready")
        for ep in (endpoint, st2["endpoint"]):
            got = requests.post(ep + "/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0},
                                timeout=60).json()["choices"][0]["token_ids"]
            assert got == reference.generate([prompt], max_tokens=3)[0][: len(got)]
        assert {"default.tiny", "default.second"} <= set(ray.get()["applications"])
        k8s.kubectl("delete", "moed", "second", "--wait=true", "--timeout=120s")
        assert "default.second" not in ray.get()["applications"]
        assert requests.post(endpoint + "/completions", json={"prompt": prompt, "max_tokens": 2},
                             timeout=60).status_code == 200

        # a spec the schema accepts but that cannot serve
        k8s.kubectl("apply", "-f", "-", input=json.dumps(_manifest("outside", "/etc", prefix="/x")))
        _, _, bad = wait_for(lambda: (r := _ready(k8s, "outside"))[2] and r, what="InvalidSpec")
        assert bad["status"] == "False" and bad["reason"] == "InvalidSpec" and "outside the allowed model roots" in bad["message"]
        events = k8s.kubectl_json("get", "events", "--field-selector", "involvedObject.name=outside")["items"]
        assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events)
        # a quantity the schema lets through (a string) but no parser can hold: InvalidSpec naming it,
        # the reconcile does not crash
        huge = _manifest("huge", model, prefix="/huge")
        huge["spec"]["ingress"]["kvCacheBudget"] = "1e400"
        k8s.kubectl("apply", "-f", "-", input=json.dumps(huge))
        _, _, bad = wait_for(lambda: (r := _ready(k8s, "huge"))[2] and r, what="huge: InvalidSpec")
        assert bad["reason"] == "InvalidSpec" and "spec.ingress.kvCacheBudget: '1e400' is out of range" in bad["message"]
        k8s.kubectl("delete", "moed", "huge", "--wait=true", "--timeout=60s")

        # the operator killed and restarted converges without duplicates
        op.kill()
        op.start()
        time.sleep(5)
        wait_for(lambda: _ready(k8s, "tiny")[2]["status"] == "True", what="Ready after restart")
        apps = ray.get()["applications"]
        assert [n for n in apps if n.startswith("default.")] == ["default.tiny"]
        assert requests.post(endpoint + "/completions", json={"prompt": prompt, "max_tokens": 2},
                             timeout=60).status_code == 200

        # deletion removes the application from the Ray cluster, then the object
        k8s.kubectl("delete", "moed", "tiny", "--wait=true", "--timeout=120s")
        assert "default.tiny" not in ray.get().get("applications", {})
        k8s.kubectl("delete", "moed", "outside", "--wait=true", "--timeout=60s")
    finally:
        op.kill(signal.SIGTERM)
        log.seek(0)
        print(log.read()[-5000:])
