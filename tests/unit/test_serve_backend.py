"""Both Ray Serve backends implement the protocol the reconcile pass is written against
(backends/serve_backend.py): every member, with the same parameters in the same order. Plain
introspection of the real classes; no cluster."""

from __future__ import annotations

import inspect

import pytest

from moe_operator.backends.ray_rest import RayServeClient
from moe_operator.backends.render_only import RenderOnlyClient
from moe_operator.backends.serve_backend import ServeBackend

METHODS = [n for n, v in vars(ServeBackend).items() if inspect.isfunction(v) and not n.startswith("_")]


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_names_what_the_pass_calls():
    assert sorted(METHODS) == ["delete_all", "get", "nodes", "put", "wait_gone"]
    assert isinstance(vars(ServeBackend)["dashboard_url"], property)


@pytest.mark.parametrize("impl, instance", [
    (RayServeClient, RayServeClient("http://127.0.0.1:8265")),
    (RenderOnlyClient, RenderOnlyClient("/nonexistent/render-only")),
])
def test_each_backend_has_every_member_with_the_protocols_parameters(impl, instance):
    assert isinstance(instance, ServeBackend)
    for name in METHODS:
        assert _params(getattr(impl, name)) == _params(getattr(ServeBackend, name)), name
    assert isinstance(instance.dashboard_url, str) and instance.dashboard_url
    assert hasattr(instance.write_lock, "acquire")
