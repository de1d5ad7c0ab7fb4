"""`moectl up` stops fast in every state and leaves nothing behind: SIGTERM while serving and
while Ray is still starting, SIGKILL (the head's watchdog ends it), then a new `moectl up` on the
same port serves its own model; a port another process listens on is refused, naming it. Status
never lies: a stopped or killed `moectl up`'s app shows Stopped, one Ray cannot place Unschedulable."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
import yaml

from moe_operator.standalone.local_ray import free_port, head_tree, live_group_members
from moectl_proc import MOECTL, moectl
from waiting import wait_for

pytestmark = pytest.mark.ray


def _manifest(tmp_path, name, seed):
    moectl("init-model", str(tmp_path / "models" / name), "--layers", "2", "--experts", "4", "--seed", str(seed),
           env=os.environ)
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump({
        "apiVersion": "serving.moe.io/v1alpha1", "kind": "MoEDeployment", "metadata": {"name": name},
        "spec": {"model": {"path": f"models/{name}"}, "ingress": {"numCpus": 0.25, "kvCacheBudget": "16Mi"},
                 "experts": {"groups": 2, "numCpus": 0.25,
                             "tiers": {"hot": {"budget": "16Mi"}, "warm": {"budget": "16Mi"}}}}}))
    return f


def _up(f, port, env, log):
    return subprocess.Popen([MOECTL, "up", "-f", str(f), "--port", str(port), "--num-cpus", "2"], env=env,
                            stdout=open(log, "w+"), stderr=subprocess.STDOUT, start_new_session=True)


def _alive(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _head_group(state, pid):
    return int((state / f"ray-{pid}" / "head.pgid").read_text())


def _serving(proc, log):
    def check():
        assert proc.poll() is None, log.read_text()
        return "is serving at" in log.read_text()
    wait_for(check, what="moectl up to serve")


def _ready(env, name):
    import json

    doc = json.loads(moectl("get", name, "--local", "-o", "json", env=env).stdout)
    return next(c for c in doc["status"]["conditions"] if c["type"] == "Ready")


def test_stop_kill_and_restart_on_the_same_port(tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "MOE_STATE_DIR": str(state)}
    first, second = _manifest(tmp_path, "first", 1), _manifest(tmp_path, "second", 2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    # SIGTERM while serving: gone within 5 s, with its head
    proc = _up(first, port, env, tmp_path / "a.log")
    _serving(proc, tmp_path / "a.log")
    group = _head_group(state, proc.pid)
    tree = head_tree(group)  # the Serve proxy and replicas included
    assert len(tree) > 3
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, (tmp_path / "a.log").read_text()
    assert time.monotonic() - t0 < 5.0
    assert not live_group_members(group) and not [p for p in tree if _alive(p)]
    assert _ready(env, "first")["reason"] == "Stopped"  # status never says a stopped app serves

    # SIGTERM while the local Ray head is still starting
    proc = _up(first, port, env, tmp_path / "b.log")
    wait_for(lambda: (state / f"ray-{proc.pid}" / "head.pgid").exists(), interval_s=0.05, what="the head starting")
    group = _head_group(state, proc.pid)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert time.monotonic() - t0 < 5.0, (tmp_path / "b.log").read_text()
    wait_for(lambda: not live_group_members(group), timeout_s=5, what="the starting head gone")

    # SIGKILL while serving: nothing can clean up, the watchdog ends the head
    proc = _up(first, port, env, tmp_path / "c.log")
    _serving(proc, tmp_path / "c.log")
    assert requests.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60).ok
    group = _head_group(state, proc.pid)
    tree = head_tree(group)
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: not live_group_members(group) and not [p for p in tree if _alive(p)], timeout_s=10,
             what="the orphaned head and its workers ended by the watchdog")
    killed = _ready(env, "first")  # the file still says Serving; moectl sees its writer is gone
    assert killed["status"] == "False" and killed["reason"] == "Stopped" and f"pid {proc.pid}" in killed["message"]
    assert "True" not in moectl("get", "--local", env=env).stdout.split("\n", 1)[1]

    # a new moectl up on the same port serves its own model (not the old app)
    proc = _up(second, port, env, tmp_path / "d.log")
    try:
        _serving(proc, tmp_path / "d.log")
        models = requests.get(url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["second"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_head_that_dies_under_a_serving_moectl_up_ends_it_naming_the_heads_log(tmp_path):
    """Ray's head gone (here killed; once its runtime-env agent could not bind its port): nothing
    is left to serve from, so `moectl up` says so and exits instead of retrying forever."""
    state = tmp_path / "state"
    env = {**os.environ, "MOE_STATE_DIR": str(state)}
    f = _manifest(tmp_path, "first", 1)
    log = tmp_path / "up.log"
    proc = _up(f, free_port(), env, log)
    try:
        _serving(proc, log)
        os.killpg(_head_group(state, proc.pid), signal.SIGKILL)
        assert proc.wait(timeout=30) == 1, log.read_text()
        text = " ".join(log.read_text().split())
        assert "the local Ray head exited" in text and "ray-head.log" in text, text
        assert _ready(env, "first")["reason"] == "Stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_port_someone_else_listens_on_is_refused_naming_them(tmp_path):
    env = {**os.environ, "MOE_STATE_DIR": str(tmp_path / "state")}
    f = _manifest(tmp_path, "tiny", 0)
    port = free_port()
    other = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening():
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_for(listening, timeout_s=30, what="the other server")
        r = moectl("up", "-f", str(f), "--port", str(port), env=env, check=False)
        assert r.returncode == 1
        assert f"127.0.0.1:{port} is already in use by pid {other.pid}" in r.stderr and "http.server" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert not list((tmp_path / "state").glob("ray-*/head.pgid"))  # no head was started
    finally:
        other.kill()
        other.wait()


def test_a_leftover_head_of_a_dead_moectl_is_ended(tmp_path):
    """A head whose watchdog is gone too (killed with its whole group's leader) is found by the
    next moectl up through the state directory and ended."""
    state = tmp_path / "state"
    fake_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    fake_owner.wait()  # a moectl pid that no longer exists
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (state / f"ray-{fake_owner.pid}").mkdir(parents=True)
    (state / f"ray-{fake_owner.pid}" / "head.pgid").write_text(str(leftover.pid))
    from moe_operator.standalone.local_ray import end_leftover_heads

    said = []
    assert end_leftover_heads(state, log=said.append) == [leftover.pid]
    assert leftover.wait(timeout=10) == -signal.SIGKILL
    assert f"pid {fake_owner.pid}" in said[0]
    # a head whose moectl still runs is left alone
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (state / f"ray-{os.getpid()}").mkdir()
    (state / f"ray-{os.getpid()}" / "head.pgid").write_text(str(mine.pid))
    try:
        assert end_leftover_heads(state, log=said.append) == []
        assert mine.poll() is None
    finally:
        mine.kill()
        mine.wait()


def test_an_app_ray_cannot_place_is_unschedulable_then_serves_when_it_fits(tmp_path):
    """An ingress asking for the whole 2-CPU head beside 2 shard groups. `moectl up` prints
    Unschedulable with Ray's message (what a replica needs, what the cluster has), `moectl get`
    shows it, it stops on SIGTERM, and an edit that fits serves."""
    import json

    env = {**os.environ, "MOE_STATE_DIR": str(tmp_path / "state")}
    f = _manifest(tmp_path, "big", seed=3)
    raw = yaml.safe_load(f.read_text())
    raw["spec"]["ingress"]["numCpus"] = 2.0
    f.write_text(yaml.safe_dump(raw))
    log = tmp_path / "up.log"
    proc = _up(f, free_port(), env, log)
    try:
        def ready():
            s = json.loads(moectl("get", "big", "--local", "-o", "json", env=env, check=False).stdout or "{}")
            return next((c for c in (s.get("status") or {}).get("conditions", []) if c["type"] == "Ready"), None)

        stuck = wait_for(lambda: (r := ready()) and r["reason"] == "Unschedulable" and r, timeout_s=180,
                         what="Unschedulable")
        assert stuck["status"] == "False" and "Resources required for each replica" in stuck["message"]
        assert "total resources available" in stuck["message"]
        printed = " ".join(log.read_text().split())  # rich wraps at the terminal width
        assert "Unschedulable" in printed and "Resources required for each replica" in printed
        assert "Unschedulable" in moectl("get", "big", "--local", env=env).stdout
        raw["spec"]["ingress"]["numCpus"] = 0.25
        f.write_text(yaml.safe_dump(raw))
        wait_for(lambda: (r := ready()) and r["reason"] == "Serving", timeout_s=240, what="serving after the fix")
    finally:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0 and time.monotonic() - t0 < 10, log.read_text()
