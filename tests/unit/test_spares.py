"""Warm spare workers: when the board starts them, which idle workers it counts as its own, and
the runtime environment that makes a replacement replica take one (no Ray cluster here)."""

from __future__ import annotations

import os
import subprocess
import sys

from moe_workers.serve.config import RUNTIME_ENV, SETUP_HOOK_ENV
from moe_workers.serve.spares import SparePool


def test_no_spare_until_the_nodes_replicas_have_settled():
    pool = SparePool(want=1, settle_s=10)
    assert pool.step("n1", now=100.0, idle=set(), last_join=95.0) == 0  # a replica joined 5 s ago
    assert pool.step("n1", now=104.9, idle=set(), last_join=95.0) == 0
    assert pool.step("n1", now=105.0, idle=set(), last_join=95.0) == 1
    assert pool.view() == {"n1": {"spares": [], "starting": 1}}


def test_a_requested_spare_is_adopted_once_idle_and_not_asked_for_twice():
    pool = SparePool(want=1, settle_s=0)
    assert pool.step("n1", now=0.0, idle={7}, last_join=None) == 1  # pid 7 was idle before: not ours
    assert pool.step("n1", now=5.0, idle={7}, last_join=None) == 0  # starting: wait for it
    assert pool.step("n1", now=10.0, idle={7, 42}, last_join=None) == 0
    assert pool.view()["n1"] == {"spares": [42], "starting": 0}
    assert pool.step("n1", now=15.0, idle={7, 42}, last_join=None) == 0  # has its spare


def test_a_spare_taken_by_a_replacement_is_replaced_after_the_node_settles_again():
    pool = SparePool(want=1, settle_s=10)
    pool.step("n1", now=0.0, idle=set(), last_join=-20.0)
    pool.step("n1", now=5.0, idle={42}, last_join=-20.0)
    assert pool.view()["n1"]["spares"] == [42]
    # a replacement replica took pid 42 (seen at 30): no new spare while it starts there, nor
    # until 10 s after it joins (at 36)
    assert pool.step("n1", now=30.0, idle=set(), last_join=-20.0) == 0
    assert pool.view()["n1"]["spares"] == []
    assert pool.step("n1", now=35.0, idle=set(), last_join=-20.0) == 0
    assert pool.step("n1", now=40.0, idle=set(), last_join=36.0) == 0
    assert pool.step("n1", now=46.0, idle=set(), last_join=36.0) == 1


def test_a_spare_that_never_shows_up_is_asked_for_again():
    pool = SparePool(want=2, settle_s=0, pending_s=60)
    assert pool.step("n1", now=0.0, idle=set(), last_join=None) == 2
    assert pool.step("n1", now=30.0, idle={5}, last_join=None) == 0  # one came, one still starting
    assert pool.step("n1", now=61.0, idle={5}, last_join=None) == 1  # the other never did
    assert pool.view()["n1"] == {"spares": [5], "starting": 1}


def test_nodes_are_independent_and_off_means_none():
    pool = SparePool(want=1, settle_s=0)
    assert pool.step("a", now=0.0, idle=set(), last_join=None) == 1
    assert pool.step("b", now=0.0, idle={3}, last_join=None) == 1
    pool.forget({"b"})
    assert list(pool.view()) == ["b"]
    off = SparePool(want=0)
    assert off.step("a", now=100.0, idle=set(), last_join=None) == 0


def test_the_apps_runtime_env_runs_the_preload_hook_in_its_workers():
    import ray._private.ray_constants as rc

    assert SETUP_HOOK_ENV == rc.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    hook = RUNTIME_ENV["env_vars"][SETUP_HOOK_ENV]
    module, func = hook.rsplit(".", 1)
    # what Ray's worker does with the variable, in a fresh interpreter: afterwards torch and the
    # app's modules are imported
    code = (f"from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook as run\n"
            f"assert run({hook!r}) is None\n"
            "import sys; assert 'torch' in sys.modules and 'moe_workers.serve.shard' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy(), timeout=120)
    assert func == "preload" and module == "moe_workers.serve.spares"
