"""`bench/chaos.py --kubernetes`: the quickstart app as a MoEDeployment reconciled by the operator
(kopf, a local process) on the real kube-apiserver + etcd (scripts/testenv), its Serve app on a
local Ray head, and two control-plane faults under load:

- the operator SIGKILLed mid-reconcile: the shard groups are scaled to 2 replicas each through
  the spec, the operator is killed as soon as Ray's REST API shows its new Serve config (the PUT
  done, the new replicas starting, the reconcile waiting for them), and started again; recovery
  is when the object is Ready at the new generation with 2 ready replicas in every group, one
  Serve application for it;
- the apiserver stopped (SIGTERM) for --apiserver-down-s and started again with the same flags:
  the app must keep serving, the operator must not redeploy it (Ray's `last_deployed_time_s` of
  the app unchanged over the outage), and must reconcile a change made after the restart (the
  groups back to 1 replica each); recovery is when that change is Ready.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_control_plane", REPO / "bench" / "control_plane.py")
bench_operator = importlib.util.module_from_spec(_spec)  # bench/control_plane.py: the control-plane helpers
_spec.loader.exec_module(bench_operator)  # type: ignore[union-attr]

def write_expert_file(model: Path, path: Path, seed: int = 2) -> Path:
    """A safetensors file with new weights for one expert of the (Mixtral-family) checkpoint at `model`."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w1.weight": torch.randn(f, h, generator=g) * 0.02, "w2.weight": torch.randn(h, f, generator=g) * 0.02,
               "w3.weight": torch.randn(f, h, generator=g) * 0.02}, str(path))
    return path


class KubernetesApp:
    """The quickstart manifest applied to the apiserver, the operator reconciling it onto a local Ray."""

    ingress_replicas = 1
    replicas_per_group = 1

    def __init__(self, work: Path, num_cpus: int, moectl: str):
        from moe_operator.standalone.local_ray import LocalRayHead

        self.work, self.moectl = work, moectl
        self.state = work / "k8s"
        cache = Path(os.environ.get("MOE_CACHE_DIR", Path.home() / ".cache" / "moe-operator")) / "bin"
        have = (cache / "etcd").exists() and any((cache.parent / "kube").glob("v*/kube-apiserver"))
        self.cp = bench_operator.start_control_plane(self.state, install=not have)
        self.kubectl("apply", "-f", str(REPO / "crds"))
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/moedeployments.serving.moe.io")
        self.head = LocalRayHead(work_dir=work / "ray-k8s", num_cpus=num_cpus).start()
        model = work / "models" / "mixtral-tiny"
        if not (model / "config.json").exists():
            subprocess.run([moectl, "init-model", str(model)], check=True, capture_output=True)
        self.op_env = {"MOE_ALLOWED_ROOTS": str(work), "MOE_RAY_ADDRESS": self.head.dashboard_url,
                       "MOE_RAY_TOKEN": self.head.token, "MOE_SERVE_HTTP_PORT": str(self.head.serve_http_port)}
        self.op_log = work / "k8s-operator.log"
        self.operator = bench_operator.start_operator(self.cp, "default", self.op_env, self.op_log)
        manifest = yaml.safe_load((REPO / "examples" / "standalone" / "quickstart.yaml").read_text())
        manifest["spec"]["model"]["path"] = str(model)
        manifest["spec"]["experts"]["tiers"]["cold"]["path"] = str(work / "models" / ".expert-cache-k8s")
        self.name = manifest["metadata"]["name"]
        self.app_name = f"default.{self.name}"
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        self.url = ""
        self.expect = lambda obj: True  # what a fault's recovery waits for, besides Ready at the generation

    # -- plumbing -----------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return bench_operator.kubectl(self.cp, *args, input=input)

    def obj(self) -> dict:
        return json.loads(self.kubectl("get", "moed", self.name, "-o", "json"))

    def ray_apps(self) -> dict:
        from moe_operator.backends.ray_rest import RayServeClient

        return RayServeClient(self.head.dashboard_url, self.head.token, timeout_s=10).get().get("applications", {})

    def wait_serving(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready(self.obj()):
            if time.monotonic() > deadline:
                raise SystemExit(f"the MoEDeployment never got Ready:\n{self.op_log.read_text()[-3000:]}")
            time.sleep(1)
        self.url = self.obj()["status"]["endpoint"].removesuffix("/v1")

    @staticmethod
    def _ready(obj: dict) -> bool:
        st = obj.get("status") or {}
        return st.get("observedGeneration") == obj["metadata"]["generation"] and any(
            c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))

    def status(self) -> dict:
        return requests.get(self.url + "/moe/v1/status", timeout=10).json()

    def whole(self, gone: set[int]) -> bool:
        try:
            obj = self.obj()
            requests.get(self.url + "/v1/models", timeout=5).raise_for_status()
            ours = [n for n in self.ray_apps() if n.startswith("default.")]
        except (subprocess.CalledProcessError, requests.RequestException, ValueError):
            return False
        return self._ready(obj) and ours == [self.app_name] and self.expect(obj)

    def stop(self) -> None:
        bench_operator.stop(self.operator)
        self.head.stop()
        subprocess.run([str(REPO / "scripts" / "testenv"), "stop", str(self.state)], capture_output=True)

    # -- the faults ---------------------------------------------------------------------------

    def _deployed(self) -> str:
        """The Serve config Ray runs for this object, as text (changes with every PUT)."""
        return json.dumps(self.ray_apps()[self.app_name].get("deployed_app_config"), sort_keys=True)

    def _scale_to(self, replicas: int):
        """spec.experts.replicasPerGroup through the apiserver; recovery then waits for every group
        Ready with that many replicas at the new generation."""
        generation = self.obj()["metadata"]["generation"]
        self.kubectl("patch", "moed", self.name, "--type=merge", "-p",
                     json.dumps({"spec": {"experts": {"replicasPerGroup": replicas}}}))
        self.expect = lambda o: o["metadata"]["generation"] > generation and all(
            g.get("replicas") == replicas and g.get("readyReplicas") == replicas
            for g in (o.get("status") or {}).get("groups") or [{}])

    def kill_operator_mid_reconcile(self):
        """The shard groups scaled to 2 replicas each through the spec; SIGKILL of the operator
        as soon as Ray has the new Serve config (its PUT done, the new replicas starting, the
        reconcile waiting for them); the operator started again."""
        before = self._deployed()
        self._scale_to(2)
        t0 = time.monotonic()
        while self._deployed() == before:
            if time.monotonic() - t0 > 60:
                raise SystemExit(f"the operator never PUT the change:\n{self.op_log.read_text()[-3000:]}")
            time.sleep(0.05)
        obj = self.obj()  # where the reconcile stood when it was killed
        st = obj.get("status") or {}
        ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
        at_kill = (f"observedGeneration {st.get('observedGeneration')} of {obj['metadata']['generation']}, Ready "
                   f"{ready.get('status')} {ready.get('reason')}, ready replicas "
                   f"{[g.get('readyReplicas') for g in st.get('groups') or []]}")
        os.killpg(self.operator.pid, signal.SIGKILL)
        self.operator.wait(timeout=60)
        self.operator = bench_operator.start_operator(self.cp, "default", self.op_env, self.op_log.with_suffix(".2.log"))
        return [], 0.0, {"operation": f"replicasPerGroup 1 -> 2; killed {time.monotonic() - t0:.2f} s after the "
                                      f"spec write, its Serve config PUT seen; the object then: {at_kill}",
                         "killed_mid_reconcile": not self.expect(obj)}

    def stop_apiserver(self, down_s: float):
        """SIGTERM of kube-apiserver, `down_s` of outage, the same command line started again;
        then a change (the groups back to one replica each) that the operator must reconcile."""
        pids_file = self.state / "pids"
        pids = pids_file.read_text().split()
        api_pid = int(pids[1])  # scripts/testenv start: etcd, then kube-apiserver
        argv = [a.decode() for a in Path(f"/proc/{api_pid}/cmdline").read_bytes().split(b"\0") if a]
        deployed = self.ray_apps()[self.app_name].get("last_deployed_time_s")
        os.kill(api_pid, signal.SIGTERM)
        t_down = time.monotonic()
        while Path(f"/proc/{api_pid}").exists() and time.monotonic() - t_down < 30:
            time.sleep(0.1)
        time.sleep(max(0.0, down_s - (time.monotonic() - t_down)))
        log = open(self.state / "apiserver.log", "a")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        pids_file.write_text("\n".join(p if int(p) != api_pid else str(proc.pid) for p in pids) + "\n")
        outage = time.monotonic() - t_down
        t_up = time.monotonic()
        while True:  # the apiserver answers again
            try:
                self.obj()
                break
            except subprocess.CalledProcessError:
                if time.monotonic() - t_up > 120:
                    raise SystemExit("kube-apiserver did not come back within 120 s")
                time.sleep(0.5)
        answering = time.monotonic() - t_up
        time.sleep(5.0)  # the operator's watch reconnects: it must not redeploy an unchanged app
        redeployed = self.ray_apps()[self.app_name].get("last_deployed_time_s") != deployed
        self._scale_to(1)
        return [], 0.0, {"change_after_s": round(time.monotonic() - t_down, 2),
                         "operation": f"apiserver down {outage:.1f} s, answering {answering:.1f} s "
                                      f"after its restart; the app {'was' if redeployed else 'was not'} redeployed "
                                      f"meanwhile; then replicasPerGroup 2 -> 1 through the spec",
                         "outage_s": round(outage, 1), "redeployed_during_outage": redeployed}
