"""`moectl up` (standalone mode) end to end: its own local Ray head, a completion, status via
`moectl get --local`, re-reconcile on file change, `moectl hot-swap --local` and rollback,
invalid edits reported without losing the running app, clean shutdown on SIGTERM."""

from __future__ import annotations

import copy

import json
import os
import signal
import subprocess

import pytest
import requests
import yaml
from safetensors.torch import save_file

from moe_operator.standalone.local_ray import free_port
from moe_workers.model.inprocess import InProcessModel
from moectl_proc import MOECTL, moectl
from waiting import wait_for

pytestmark = pytest.mark.ray
_moectl = moectl


def _status(env):
    return json.loads(_moectl("get", "tiny", "--local", "-o", "json", env=env).stdout)


def test_moectl_up_serves_reconciles_and_stops(tmp_path):
    env = {**os.environ, "MOE_STATE_DIR": str(tmp_path / "state")}
    _moectl("init-model", str(tmp_path / "models" / "tiny"), "--layers", "2", "--experts", "4", env=env)
    manifest = {
        "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": "tiny"},
        "spec": {"model": {"path": "models/tiny"}, "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi"},
                 "experts": {"groups": 2, "numCpus": 0.25,
                             "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"},
                                       "cold": {"path": str(tmp_path / "cold")}}}},
    }
    f = tmp_path / "tiny.yaml"
    f.write_text(yaml.safe_dump(manifest))
    port = free_port()
    log = open(tmp_path / "up.log", "w+")
    proc = subprocess.Popen([MOECTL, "up", "-f", str(f), "--port", str(port), "--num-cpus", "2"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def serving():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            return "is serving at" in (tmp_path / "up.log").read_text()

        wait_for(serving, what="moectl up to serve")
        assert f"http://127.0.0.1:{port}/v1" in (tmp_path / "up.log").read_text()
        url = f"http://127.0.0.1:{port}"
        reference = InProcessModel(tmp_path / "models" / "tiny")
        prompt = [40, 41, 42]
        want = reference.generate([prompt], max_tokens=5)[0]
        resp = requests.post(url + "/v1/completions", json={"prompt": "Hi!", "max_tokens": 5, "temperature": 0},
                             timeout=60)
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["token_ids"]) == 5
        got = requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                            timeout=60).json()["choices"][0]["token_ids"]
        assert got == want[: len(got)]

        st = _status(env)
        ready = next(c for c in st["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True" and ready["reason"] == "Serving"
        assert st["status"]["endpoint"] == f"{url}/v1" and st["status"]["observedGeneration"] == 1
        table = _moectl("get", "--local", env=env).stdout
        assert "tiny" in table and "True" in table

        # an edit is picked up: three groups now
        manifest["spec"]["experts"]["groups"] = 3
        f.write_text(yaml.safe_dump(manifest))
        wait_for(lambda: _status(env)["status"]["observedGeneration"] == 2
              and len(_status(env)["status"]["groups"]) == 3, what="re-reconcile")
        assert requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0},
                             timeout=60).json()["choices"][0]["token_ids"] == want[:3]

        # hot-swap with --local: moectl edits the manifest `moectl up` runs and waits on its status
        weights = tmp_path / "models" / "e-1.1.safetensors"
        new = {w: (t * 40).contiguous() for w, t in reference.experts.weights[(1, 1)].items()}
        save_file({f"{w}.weight": t for w, t in new.items()}, str(weights))
        swapped = InProcessModel(tmp_path / "models" / "tiny")
        swapped.experts.weights[(1, 1)] = new
        probes = [[40, 41, 42], [7, 8, 9, 10], [100, 3, 55]]

        def tokens():
            return [requests.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 5, "temperature": 0},
                                  timeout=60).json()["choices"][0]["token_ids"] for p in probes]

        want_new = [swapped.generate([p], 5, stop_at_eos=True)[0] for p in probes]
        want_old = [reference.generate([p], 5, stop_at_eos=True)[0] for p in probes]
        assert want_new != want_old
        r = _moectl("hot-swap", "tiny", "--expert", "1.1", "--weights", str(weights), "--wait", "--timeout", "120",
                    "--local", env=env)
        assert "serves sha256:" in r.stdout and tokens() == want_new
        st = _status(env)["status"]
        assert st["overriddenExperts"] == 1 and st["lastSwaps"][0]["outcome"] == "Serving"
        _moectl("hot-swap", "tiny", "--expert", "1.1", "--rollback", "--wait", "--timeout", "120", "--local", env=env)
        assert tokens() == want_old and _status(env)["status"]["overriddenExperts"] == 0
        assert "HotSwapServing" in (tmp_path / "up.log").read_text()

        # the live views: experts table, heatmap frame, load generator
        table = _moectl("experts", "tiny", "--local", env=env).stdout.splitlines()
        assert table[0].split() == ["EXPERT", "GROUPS", "REPLICAS", "TIER", "VERSION", "LOAD", "VS", "BASE", "P95",
                                    "MISSES", "ERRORS"] and len(table) == 1 + 8
        rows = json.loads(_moectl("experts", "tiny", "--local", "-o", "json", env=env).stdout)["experts"]
        assert [r["expert"] for r in rows] == [f"{l}.{e}" for l in range(2) for e in range(4)]
        assert all(r["version"].startswith("sha256:") and r["replicas"] == 1 for r in rows)
        assert sum(r["tokens"] for r in rows) > 0
        # expert health from the shards: one call in 16 timed an expert at a time, no call failed
        assert sum(r["samples"] for r in rows) > 0 and all(r["errors"] == 0 for r in rows)
        assert all(r["p95_ms"] is None or r["p95_ms"] > 0 for r in rows)
        tail = json.loads(_moectl("experts", "tiny", "--local", "--tail", "3", "-o", "json", env=env).stdout)["experts"]
        load = lambda r: (r["share"] if r.get("share") is not None else float("inf"), r["tokens"])  # noqa: E731
        assert [load(r) for r in tail] == sorted(load(r) for r in rows)[:3]  # the least loaded first
        picked = json.loads(_moectl("experts", "tiny", "--local", "--layer", "1", "--top", "2", "-o", "json",
                                    env=env).stdout)["experts"]
        assert [r["expert"] for r in picked] == [r["expert"] for r in sorted(
            (r for r in rows if r["expert"].startswith("1.")), key=lambda r: -r["tokens"])][:2]
        group = _moectl("experts", "tiny", "--local", "--group", "0", env=env).stdout.splitlines()[1:]
        assert group and all("0" in line.split()[1].split(",") for line in group)
        bad = _moectl("experts", "tiny", "--local", "--layer", "2-1", env=env, check=False)
        assert bad.returncode == 2 and "--layer: '2-1' is not a layer or a range" in bad.stderr
        frame = _moectl("top", "tiny", "--local", "--once", env=env).stdout
        assert "layer" in frame and "imbalance" in frame
        result = json.loads(_moectl("bench", "tiny", "--local", "--duration", "2", "--concurrency", "2",
                                    "--prompt-len", "4", "--max-tokens", "3", "-o", "json", env=env).stdout)
        assert result["requests"] > 0 and result["failed"] == 0 and result["latency_s"]["p50"] > 0
        # streamed: time to first token within the request, gaps between its 3 tokens measured
        assert 0 < result["ttft_s"]["p50"] <= result["latency_s"]["p99"] and result["itl_s"]["p50"] > 0
        # the agent workloads: JSON that fits a schema, and forced tool calls (init-model's template renders tools)
        (tmp_path / "schema.json").write_text(json.dumps({"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}))
        (tmp_path / "tools.json").write_text(json.dumps([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
                                        "additionalProperties": False}}}]))
        for flag, file in (("--json-schema", "schema.json"), ("--tools", "tools.json")):
            agent = json.loads(_moectl("bench", "tiny", "--local", "--duration", "2", "--concurrency", "2",
                                       "--prompt-len", "4", "--max-tokens", "150", flag, str(tmp_path / file),
                                       "-o", "json", env=env).stdout)
            assert agent["failed"] == 0 and agent["ok"] > 0 and agent["structured_ok"] == agent["ok"], agent
        assert _moectl("experts", "tiny", "--local", "-o", "xml", env=env, check=False).returncode == 2
        down = _moectl("bench", "--endpoint", "http://127.0.0.1:9", "--duration", "1", env=env, check=False)
        assert down.returncode == 1 and len(down.stderr.strip().splitlines()) == 1 and "cannot reach" in down.stderr
        gone = _moectl("top", "nope", "--local", "--once", env=env, check=False)
        assert gone.returncode == 1 and "not found" in gone.stderr

        # an invalid edit is reported and the running app keeps serving
        manifest["spec"]["experts"]["tiers"]["hot"]["budget"] = "1Ki"
        f.write_text(yaml.safe_dump(manifest))

        def invalid():
            s = _status(env)
            ready = next(c for c in s["status"]["conditions"] if c["type"] == "Ready")
            return ready["reason"] == "InvalidSpec" and s

        bad = wait_for(invalid, what="invalid edit")
        ready = next(c for c in bad["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
        assert "spec.experts.tiers.hot.budget" in ready["message"]
        assert "InvalidSpec" in _moectl("get", "tiny", "--local", "-o", "wide", env=env).stdout
        assert requests.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                             timeout=60).status_code == 200

        # badly shaped edits (a scalar where a mapping belongs; a bad name) are each InvalidSpec
        # naming the path, and the app keeps serving (they used to end `moectl up`)
        for where, value, named in ((("spec", "experts", "tiers"), -1, "spec.experts.tiers"),
                                    (("spec", "model"), "/path", "spec.model"),
                                    (("spec", "experts", "overrides"), [5], "spec.experts.overrides[0]"),
                                    (("metadata", "name"), "Tiny", "metadata.name")):
            bad_doc = copy.deepcopy(manifest)
            node = bad_doc
            for key in where[:-1]:
                node = node[key]
            node[where[-1]] = value
            f.write_text(yaml.safe_dump(bad_doc))

            def refused(named=named):
                s = _status(env)
                ready = next(c for c in s["status"]["conditions"] if c["type"] == "Ready")
                return ready["reason"] == "InvalidSpec" and named in ready["message"] and s

            wait_for(refused, what=f"the edit of {named} refused")
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-2000:]
            assert requests.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                                 timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    assert rc == 0, (tmp_path / "up.log").read_text()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)


def test_get_unknown_and_bad_usage_exit_codes(tmp_path):
    env = {**os.environ, "MOE_STATE_DIR": str(tmp_path)}
    missing = _moectl("get", "nope", "--local", env=env, check=False)
    assert missing.returncode == 1 and "not found" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    bad = _moectl("get", "nope", "--local", "-o", "xml", env=env, check=False)
    assert bad.returncode == 2 and "expected json, yaml or wide" in bad.stderr
