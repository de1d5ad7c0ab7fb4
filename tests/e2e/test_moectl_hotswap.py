"""`moectl hot-swap` writes on the real apiserver: concurrent writers lose nothing (resourceVersion
precondition, re-read on conflict), --dry-run writes nothing, bad input and unknown objects fail
with one line and the right exit code. (Serving and waiting are covered by the operator e2e.)"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

import pytest

from invalid_manifests import build

pytestmark = pytest.mark.k8s
MOECTL = str(Path(sys.executable).with_name("moectl"))


def moectl(k8s, *args):
    return subprocess.run([MOECTL, "hot-swap", *args], env=k8s.env, capture_output=True, text=True, timeout=120)


def test_concurrent_hot_swaps_all_land(crd_installed):
    k8s = crd_installed
    doc = build(None, "swaps")
    doc["spec"]["experts"]["overrides"] = []
    k8s.kubectl("apply", "-f", "-", input=json.dumps(doc))
    experts = [f"{l}.{e}" for l in range(2) for e in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(experts)) as pool:
        results = list(pool.map(lambda eid: moectl(k8s, "swaps", "--expert", eid, "--weights",
                                                    f"/models/patches/{eid}.safetensors"), experts))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    got = k8s.kubectl_json("get", "moed", "swaps")["spec"]["experts"]["overrides"]
    assert sorted(o["expert"] for o in got) == sorted(experts)  # eight writers, none overwritten
    assert all(o["weights"]["path"] == f"/models/patches/{o['expert']}.safetensors" for o in got)

    # a rollback removes only its own entry, a dry run changes nothing
    before = k8s.kubectl_json("get", "moed", "swaps")["metadata"]["resourceVersion"]
    dry = moectl(k8s, "swaps", "--expert", "0.0", "--rollback", "--dry-run")
    assert dry.returncode == 0 and "0.0" not in dry.stdout and "1.3" in dry.stdout
    assert k8s.kubectl_json("get", "moed", "swaps")["metadata"]["resourceVersion"] == before
    assert moectl(k8s, "swaps", "--expert", "0.0", "--rollback").returncode == 0
    left = k8s.kubectl_json("get", "moed", "swaps")["spec"]["experts"]["overrides"]
    assert sorted(o["expert"] for o in left) == sorted(experts[1:])


@pytest.mark.parametrize("args,code,needle", [
    (["swaps", "--expert", "0", "--weights", "/a.safetensors"], 2, "--expert: "),
    (["swaps", "--expert", "0.1", "--weights", "/a.bin"], 2, "--weights: "),
    (["swaps", "--expert", "0.1", "--weights", "/a.safetensors", "--sha256", "xyz"], 2, "--sha256: "),
    (["swaps", "--expert", "0.1"], 2, "give either --weights PATH or --rollback"),
    (["nope", "--expert", "0.1", "--rollback"], 1, "moedeployment default/nope not found"),
])
def test_bad_input_one_line_and_exit_code(crd_installed, args, code, needle):
    r = moectl(crd_installed, *args)
    assert r.returncode == code and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
