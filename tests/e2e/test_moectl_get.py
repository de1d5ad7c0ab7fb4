"""`moectl get` against the real apiserver: table, -o json/yaml, -A, not found, unreachable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from invalid_manifests import build

pytestmark = pytest.mark.k8s
MOECTL = str(Path(sys.executable).with_name("moectl"))


def _moectl(k8s, *args, kubeconfig=None):
    env = {**k8s.env, "KUBECONFIG": str(kubeconfig or k8s.kubeconfig), "COLUMNS": "200"}
    return subprocess.run([MOECTL, "get", *args], env=env, capture_output=True, text=True, timeout=60)


def test_get_reads_objects_and_status(crd_installed):
    k8s = crd_installed
    k8s.kubectl("create", "namespace", "team-b", check=False)
    doc = build(None, "got")
    k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))
    other = build(None, "elsewhere")
    other["metadata"]["namespace"] = "team-b"
    k8s.kubectl("apply", "-f", "-", input=json.dumps(other))
    status = {"status": {"replicas": 1, "endpoint": "http://127.0.0.1:8000/got/v1", "conditions": [
        {"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": "spec.model.path is outside"}]}}
    k8s.kubectl("patch", "moed", "got", "--subresource=status", "--type=merge", "-p", json.dumps(status))

    table = _moectl(k8s, "got")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.strip().splitlines()[:2]
    assert header.split() == ["NAME", "READY", "REASON", "GROUPS", "REPLICAS", "ENDPOINT"]
    assert row.split() == ["got", "False", "InvalidSpec", "2", "1", "http://127.0.0.1:8000/got/v1"]
    assert "spec.model.path is outside" in _moectl(k8s, "got", "-o", "wide").stdout

    as_json = json.loads(_moectl(k8s, "got", "-o", "json").stdout)
    assert as_json["metadata"]["name"] == "got" and as_json["status"]["replicas"] == 1
    as_yaml = yaml.safe_load(_moectl(k8s, "-o", "yaml").stdout)
    assert "got" in [i["metadata"]["name"] for i in as_yaml["items"]]
    assert "elsewhere" not in [i["metadata"]["name"] for i in as_yaml["items"]]

    everywhere = _moectl(k8s, "-A").stdout
    assert "team-b" in everywhere and "elsewhere" in everywhere and "got" in everywhere
    assert "elsewhere" in _moectl(k8s, "-n", "team-b").stdout


def test_get_failures_are_one_line_with_exit_codes(crd_installed, tmp_path):
    k8s = crd_installed
    missing = _moectl(k8s, "nope")
    assert missing.returncode == 1 and missing.stderr.strip() == "error: moedeployment default/nope not found"
    forbidden = _moectl(k8s, "-A", kubeconfig=k8s.developer_kubeconfig)
    assert forbidden.returncode == 1 and "403" in forbidden.stderr and len(forbidden.stderr.strip().splitlines()) == 1
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(k8s.kubeconfig.read_text().replace(k8s.server, "https://127.0.0.1:1"))
    unreachable = _moectl(k8s, "got", kubeconfig=dead)
    assert unreachable.returncode == 1 and "cannot reach the Kubernetes API" in unreachable.stderr
    usage = _moectl(k8s, "got", "-A")
    assert usage.returncode == 2
