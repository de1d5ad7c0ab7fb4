"""API keys: parsing, digests, the Bearer check, and what the rendered Serve config carries."""

from __future__ import annotations

import json

import pytest

from moe_workers.serve.auth import authorized, digests, key_digest, parse_keys


def test_keys_one_per_line_comments_and_blanks_skipped():
    assert parse_keys("a\n\n  b  \n# c\n") == ["a", "b"]
    assert digests("a\na\nb") == sorted({key_digest("a"), key_digest("b")})


@pytest.mark.parametrize("header,ok", [
    ("Bearer k1", True), ("bearer k2", True), ("Bearer  k1 ", True),
    ("Bearer k3", False), ("Basic k1", False), ("k1", False), ("Bearer ", False), (None, False), ("", False),
])
def test_bearer_check(header, ok):
    assert authorized(header, digests("k1\nk2")) is ok


def test_no_digest_authorizes_nothing():
    assert not authorized("Bearer x", [])


def test_the_rendered_application_carries_digests_only(tmp_path):
    from invalid_manifests import VALID
    from moe_operator.api.validation import parse_spec
    from moe_operator.planner.initial import initial_placement
    from moe_operator.render.serve_app import render_application

    spec = parse_spec(VALID["spec"])
    app = render_application("ns", "m", spec, initial_placement(2, 4, spec.experts.groups),
                             api_key_digests=digests("secret-key"))
    ingress = next(d for d in app["deployments"] if d["name"] == "Ingress")
    assert ingress["user_config"]["api_keys_sha256"] == [key_digest("secret-key")]
    assert "secret-key" not in json.dumps(app)
    open_app = render_application("ns", "m", spec, initial_placement(2, 4, spec.experts.groups))
    assert "api_keys_sha256" not in next(d for d in open_app["deployments"] if d["name"] == "Ingress")["user_config"]
