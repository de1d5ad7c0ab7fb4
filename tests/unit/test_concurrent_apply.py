"""Concurrent reconciles of many MoEDeployments onto one Ray cluster lose no application
(render-only backend: a real file-backed Serve config, no Ray needed)."""

from __future__ import annotations

import concurrent.futures
import json

from moe_operator.backends.render_only import RenderOnlyClient
from moe_operator.reconcile import apply_application, remove_application


def _app(i):
    return {"name": f"ns.m{i}", "route_prefix": f"/m{i}", "import_path": "x:y", "args": {}, "deployments": []}


def test_parallel_writers_keep_every_application(tmp_path):
    client = RenderOnlyClient(str(tmp_path))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: apply_application(client, _app(i), 8000), range(40)))
    names = {a["name"] for a in json.loads((tmp_path / "serve-config.json").read_text())["applications"]}
    assert names == {f"ns.m{i}" for i in range(40)}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        removed = list(pool.map(lambda i: remove_application(client, f"ns.m{i}", 8000, wait_s=5), range(0, 40, 2)))
    assert all(removed)
    names = {a["name"] for a in json.loads((tmp_path / "serve-config.json").read_text())["applications"]}
    assert names == {f"ns.m{i}" for i in range(1, 40, 2)}


def test_the_operators_clients_of_one_cluster_share_one_write_lock():
    """Each pass asks for a client (a Secret's token may have rotated in between): every client of
    one dashboard holds the same write lock, so their read-merge-writes never interleave."""
    from moe_operator.backends.ray_rest import RayClients

    clients = RayClients()
    a = clients.get("http://ray-a:8265", "t1")
    assert clients.get("http://ray-a:8265", "t1") is a
    rotated = clients.get("http://ray-a:8265/", "t2")
    assert rotated is not a and rotated.token == "t2" and rotated.write_lock is a.write_lock
    other = clients.get("http://ray-b:8265", "t1")
    assert other.write_lock is not a.write_lock
