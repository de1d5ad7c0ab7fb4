"""Session fixtures: a real kube-apiserver + etcd (scripts/testenv) and a local Ray head.

Both start once per test session, on free loopback ports with fresh state directories, and are
stopped by process id at the end. `scripts/testenv install` must have run (the README's test
command does it); a missing binary fails the fixture with the command to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTENV = REPO / "scripts" / "testenv"
sys.path.insert(0, str(REPO / "tests"))


@dataclass
class KubeEnv:
    """The running control plane and its clients."""

    dir: Path
    kubeconfig: Path
    developer_kubeconfig: Path
    server: str
    bin_dir: Path
    kube_bin: Path  # kubectl and the control plane of the release under test (MOE_KUBE_VERSION)
    kube_version: str
    kuberay_dir: Path  # KubeRay's CRDs (crd/) and ClusterRole (rbac/) as its module ships them

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.kube_bin}:{self.bin_dir}:{os.environ.get('PATH', '')}"}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
        env = self.env
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        proc = subprocess.run([str(self.kube_bin / "kubectl"), *args], input=input, env=env,
                              capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.bin_dir / "helm"), *args], env=self.env,
                              capture_output=True, text=True, timeout=300)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc


def _cache_bin() -> Path:
    cache = Path(os.environ.get("MOE_CACHE_DIR", Path.home() / ".cache" / "moe-operator"))
    return cache / "bin"


def _testenv_start(state: Path, *flags: str, timeout_s: float) -> dict[str, str]:
    """`scripts/testenv start STATE FLAGS...` -> the variables it exports (PATH aside)."""
    proc = subprocess.run([str(TESTENV), "start", str(state), *flags], capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"scripts/testenv start {' '.join(flags)} failed: {proc.stderr[-3000:]}", pytrace=False)
    return dict(line.removeprefix("export ").split("=", 1) for line in proc.stdout.splitlines()
                if line.startswith("export ") and "PATH=" not in line)


def _kube_fields(exports: dict[str, str]) -> dict:
    return dict(kubeconfig=Path(exports["KUBECONFIG"]),
                developer_kubeconfig=Path(exports["MOE_TESTENV_DEVELOPER_KUBECONFIG"]),
                server=exports["MOE_TESTENV_SERVER"], bin_dir=_cache_bin(),
                kube_bin=Path(exports["MOE_TESTENV_KUBE_BIN"]), kube_version=exports["MOE_TESTENV_KUBE_VERSION"],
                kuberay_dir=Path(exports["MOE_KUBERAY_DIR"]))


@pytest.fixture(scope="session")
def k8s(tmp_path_factory) -> KubeEnv:
    """etcd + kube-apiserver of the release MOE_KUBE_VERSION names (scripts/testenv's default
    otherwise); a missing binary fails here with the command that installs it."""
    state = tmp_path_factory.mktemp("testenv")
    exports = _testenv_start(state, timeout_s=180)
    env = KubeEnv(dir=state, **_kube_fields(exports))
    try:
        yield env
    finally:
        subprocess.run([str(TESTENV), "stop", str(state)], timeout=60)


@dataclass
class NodeEnv(KubeEnv):
    """A control plane with a real node (kubelet + containerd) and the project's images in it."""

    operator_image: str = ""
    ray_image: str = ""
    kuberay_image: str = ""  # KubeRay's ray-operator, built from its module


@pytest.fixture(scope="module")
def k8s_node(tmp_path_factory) -> NodeEnv:
    """`scripts/testenv start --node`: its own apiserver on the node's bridge, a kubelet, kube-proxy,
    scheduler and controller-manager, the operator and Ray images imported. Needs root. Module
    scope: stopped once the node tests are done, not held idle through the rest of the suite
    (seven servers and containerd on CI's two cores)."""
    state = tmp_path_factory.mktemp("testenv-node")
    exports = _testenv_start(state, "--node", timeout_s=900)
    env = NodeEnv(dir=state, **_kube_fields(exports),
                  operator_image=exports["MOE_OPERATOR_IMAGE"], ray_image=exports["MOE_RAY_IMAGE"],
                  kuberay_image=exports["MOE_KUBERAY_IMAGE"])
    try:
        yield env
    finally:
        subprocess.run([str(TESTENV), "stop", str(state)], timeout=180)


@pytest.fixture(scope="session")
def crd_installed(k8s: KubeEnv) -> KubeEnv:
    k8s.kubectl("apply", "-f", str(REPO / "crds"))
    # served once Established (kubectl wait errors out, not waits, while a new CRD has no conditions yet)
    from waiting import wait_for
    wait_for(lambda: k8s.kubectl("get", "moedeployments", check=False).returncode == 0, timeout_s=60,
             what="the MoEDeployment CRD served")
    return k8s


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    from moe_operator.standalone.local_ray import LocalRayHead

    head = LocalRayHead(work_dir=tmp_path_factory.mktemp("ray"), num_cpus=4)
    head.start()
    try:
        yield head
    finally:
        head.stop()
