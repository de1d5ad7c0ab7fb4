"""Every moectl command that reads or writes MoEDeployments on the apiserver fails the same way
when the object is missing or the apiserver is out of reach: exit 1 and one line naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.k8s
MOECTL = str(Path(sys.executable).with_name("moectl"))

COMMANDS = {
    "get": ["get", "{name}"],
    "hot-swap": ["hot-swap", "{name}", "--expert", "0.1", "--rollback"],
    "rebalance": ["rebalance", "{name}"],
    "experts": ["experts", "{name}"],
    "top": ["top", "{name}", "--once"],
    "profile": ["profile", "{name}", "--seconds", "0.2"],
    "bench": ["bench", "{name}", "--duration", "1"],
}


def _moectl(k8s, command: str, name: str, kubeconfig: Path) -> subprocess.CompletedProcess:
    args = [a.format(name=name) for a in COMMANDS[command]]
    return subprocess.run([MOECTL, *args], env={**k8s.env, "KUBECONFIG": str(kubeconfig)}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_missing_object_is_one_line(crd_installed, command):
    r = _moectl(crd_installed, command, "nope", crd_installed.kubeconfig)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.strip() == "error: moedeployment default/nope not found", r.stderr


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unreachable_apiserver_is_one_line(crd_installed, tmp_path, command):
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(crd_installed.kubeconfig.read_text().replace(crd_installed.server, "https://127.0.0.1:1"))
    r = _moectl(crd_installed, command, "anything", dead)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the Kubernetes API: "), r.stderr
