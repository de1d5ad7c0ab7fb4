"""Shard replicas' CPUs of their own (moe_workers.serve.cpus): the choice is a pure function;
the claims are exercised by real processes sharing one claims file, each checking the affinity
of all its threads from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from moe_workers.serve.cpus import CpuClaim, choose, live_claims, quota_cpus

WORKERS = os.path.join(os.path.dirname(__file__), "..", "..", "workers")

CHILD = textwrap.dedent("""
    import json, os, sys, threading
    sys.path.insert(0, sys.argv[1])
    from pathlib import Path
    from moe_workers.serve.cpus import CpuClaim
    os.sched_setaffinity(0, json.loads(sys.argv[3]))  # the CPUs this "container" may use
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()  # a thread started before the claim
    claim = CpuClaim(Path(sys.argv[2]), quota=lambda: None)  # whatever quota the test runs under
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "take":
            cpus = claim.take(1)
            threads = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
            print(json.dumps({"cpus": cpus, "reason": claim.reason, "threads": threads}), flush=True)
        elif cmd == "release":
            claim.release()
            print(json.dumps({"released": True}), flush=True)
""")


def test_the_lowest_free_cpus_are_chosen_and_none_when_too_few_are_free():
    assert choose([0, 1, 2, 3], set(), 1) == [0]
    assert choose([3, 1, 2, 0], {0, 2}, 2) == [1, 3]
    assert choose([0, 1], {0, 1}, 1) is None
    assert choose([0, 1, 2], {1}, 3) is None  # two free for three: none, not a part
    assert choose([4, 5], {0, 1}, 1) == [4]  # CPUs held outside this container's set do not count


def test_claims_of_gone_or_replaced_processes_lapse():
    running = {"10:500.00"}  # processes by tag: pid and start time
    claims = {"10:500.00": [0],  # running
              "11:599.00": [1],  # the pid now names another process (or none)
              "12:700.00": [2],  # gone
              "13:800.00": "x"}  # malformed
    assert live_claims(claims, running.__contains__) == {"10:500.00": [0]}
    with_bad = {**claims, "10:500.00": ["x"]}
    assert live_claims(with_bad, running.__contains__) == {}


def test_the_cpu_quota_is_read_from_cgroup_v2_and_v1_and_the_smallest_ancestor_wins(tmp_path):
    pod = tmp_path / "kubepods" / "pod1"
    (pod / "ctr").mkdir(parents=True)
    (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    (pod / "cpu.max").write_text("150000 100000\n")
    (pod / "ctr" / "cpu.max").write_text("400000 100000\n")
    assert quota_cpus(tmp_path, "0::/kubepods/pod1/ctr\n") == 1.5
    assert quota_cpus(tmp_path, "0::/kubepods\n") is None
    v1 = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert quota_cpus(tmp_path, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n") == 2.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert quota_cpus(tmp_path, "4:cpu,cpuacct:/docker/abc\n") is None


def test_under_a_quota_smaller_than_its_cpus_a_replica_takes_none(tmp_path):
    """A Pod with a CPU limit in the node's shared pool: its neighbours, who cannot see its claims,
    would pin the same CPUs."""
    before = os.sched_getaffinity(0)
    claim = CpuClaim(tmp_path / "claims.json", quota=lambda: len(before) - 0.5)
    assert claim.take(1) is None and "quota" in claim.reason
    assert not (tmp_path / "claims.json").exists() and os.sched_getaffinity(0) == before


@pytest.fixture
def children(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))[:2]
    assert len(allowed) == 2, "needs a machine with two CPUs or more"
    procs = []

    def spawn():
        p = subprocess.Popen([sys.executable, "-c", CHILD, WORKERS, str(tmp_path / "claims.json"), json.dumps(allowed)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    yield allowed, spawn
    for p in procs:
        p.kill()
        p.wait()


def _ask(p, cmd: str) -> dict:
    p.stdin.write(cmd + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def test_replicas_take_cpus_no_other_holds_and_every_thread_runs_there(children):
    allowed, spawn = children
    a, b, c = spawn(), spawn(), spawn()
    got_a, got_b = _ask(a, "take"), _ask(b, "take")
    assert sorted(got_a["cpus"] + got_b["cpus"]) == allowed  # one CPU each, not the same one
    for got in (got_a, got_b):
        assert len(got["threads"]) >= 2 and all(cpus == got["cpus"] for cpus in got["threads"].values())
    got_c = _ask(c, "take")  # none left: the kernel places it, on every CPU it may use
    assert got_c["cpus"] is None and "placed by the kernel" in got_c["reason"]
    assert all(cpus == allowed for cpus in got_c["threads"].values())
    a.kill()  # a replica that dies without releasing: its claim lapses with its process
    a.wait()
    assert _ask(c, "take")["cpus"] == got_a["cpus"]
    assert _ask(b, "release") == {"released": True}  # a stopping replica gives its CPU back
    d = spawn()
    assert _ask(d, "take")["cpus"] == got_b["cpus"]
