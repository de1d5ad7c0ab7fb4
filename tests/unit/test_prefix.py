"""Prefix chains of requests and the affinity memory of the Ingress' request router (pure)."""

from __future__ import annotations

import json

from hypothesis import given, strategies as st

from moe_workers.serve.proxy.prefix import (PREFIX_BLOCK_BYTES, PREFIX_HEADER, PREFIX_MAX_BLOCKS, PrefixAffinity,
                                            parse_chain, prefix_chain, prefix_header, prompt_text)

SYSTEM = "You are the support assistant of a hardware shop. " * 12  # ~600 characters


def _chat(*messages: tuple[str, str], tools=None) -> bytes:
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    if tools is not None:
        body["tools"] = tools
    return json.dumps(body).encode()


def test_a_conversation_extends_the_chain_of_its_earlier_turns():
    first = prompt_text("/v1/chat/completions", _chat(("system", SYSTEM), ("user", "Do you sell GPUs?")))
    later = prompt_text("/v1/chat/completions", _chat(("system", SYSTEM), ("user", "Do you sell GPUs?"),
                                                      ("assistant", "Yes."), ("user", "Which ones? " * 20)))
    a, b = prefix_chain(first), prefix_chain(later)
    assert len(a) == len(first.encode()) // PREFIX_BLOCK_BYTES and len(b) > len(a)
    assert b[:len(a)] == a
    other = prefix_chain(prompt_text("/v1/chat/completions", _chat(("system", SYSTEM.upper()), ("user", "x"))))
    assert other[0] != a[0]  # another tenant's system prompt: another chain from its first block


def test_tools_and_key_order_are_part_of_the_prefix_and_spelling_is_not():
    plain = prompt_text("/v1/chat/completions", _chat(("system", SYSTEM)))
    tools = prompt_text("/v1/chat/completions", _chat(("system", SYSTEM), tools=[{"type": "function"}]))
    assert prefix_chain(plain)[0] != prefix_chain(tools)[0]
    respelt = json.dumps({"messages": [{"content": SYSTEM, "role": "system"}]}, indent=2).encode()
    assert prompt_text("/v1/chat/completions", respelt) == plain


def test_completion_prompts_strings_token_lists_and_batches():
    assert prompt_text("/v1/completions", json.dumps({"prompt": "abc"}).encode()) == "abc"
    assert prompt_text("/m/v1/completions", json.dumps({"prompt": ["first", "second"]}).encode()) == "first"
    assert prompt_text("/v1/completions", json.dumps({"prompt": [1, 22, 333]}).encode()) == "1,22,333,"
    for path, body in (("/v1/models", b"{}"), ("/v1/completions", b"not json"), ("/v1/completions", b"[1]"),
                       ("/v1/chat/completions", b'{"messages": "hi"}'), ("/v1/completions", b'{"prompt": 5}')):
        assert prompt_text(path, body) is None, (path, body)


def test_the_header_is_capped_and_round_trips():
    assert prefix_header("/v1/completions", json.dumps({"prompt": "short"}).encode()) is None
    name, value = prefix_header("/v1/completions", json.dumps({"prompt": "y" * 100_000}).encode())
    chain = parse_chain(value)
    assert name == PREFIX_HEADER and len(chain) == PREFIX_MAX_BLOCKS and len(value) < 1000
    assert parse_chain(b"zz,abc," + value) == chain  # malformed entries dropped


@given(st.text(min_size=0, max_size=2000), st.text(min_size=0, max_size=600))
def test_chains_share_the_whole_blocks_their_texts_share_and_differ_after(a, b):
    x, y = prefix_chain(a), prefix_chain(a + b)
    assert y[:len(x)] == x
    assert len(x) == min(len(a.encode()) // PREFIX_BLOCK_BYTES, PREFIX_MAX_BLOCKS)
    if b and len(x) < PREFIX_MAX_BLOCKS and len(y) > len(x):  # a changed block changes its hash
        z = prefix_chain(a + chr(ord(b[0]) ^ 1) + b[1:])
        assert z[:len(x)] == x and z[len(x)] != y[len(x)]


def test_a_request_goes_where_its_longest_prefix_went_unless_that_replica_is_much_busier():
    aff = PrefixAffinity(imbalance_threshold=4)
    tenant_a = prefix_chain("a" * 128 * 6)
    tenant_a_longer = prefix_chain("a" * 128 * 9)
    tenant_b = prefix_chain("b" * 128 * 6)
    idle = {"r1": 0, "r2": 0}
    first = aff.choose(tenant_a, ["r1", "r2"], idle)
    aff.record(tenant_a, first)
    other = aff.choose(tenant_b, ["r1", "r2"], idle)
    assert other != first  # a new prefix goes to the replica holding fewer
    aff.record(tenant_b, other)
    assert aff.choose(tenant_a_longer, ["r1", "r2"], idle) == first
    assert aff.choose(tenant_b, ["r1", "r2"], {first: 9, other: 3}) == other  # its own replica, the idler
    assert aff.choose(tenant_a, ["r1", "r2"], {first: 9, other: 3}) is None  # busier by 6 > 4: by load
    assert aff.choose(tenant_a, ["r1", "r2"], {first: 7, other: 3}) == first  # by 4: still affinity
    assert aff.choose(tenant_a, ["r1", "r2"], {first: None, other: 3}) == first  # unknown load: affinity
    assert aff.choose([], ["r1", "r2"], idle) is None and aff.choose(tenant_a, [], {}) is None


def test_a_longer_run_on_another_replica_wins_and_gone_replicas_are_forgotten():
    aff = PrefixAffinity()
    short, long = prefix_chain("s" * 128 * 2), prefix_chain("s" * 128 * 8)
    aff.record(short, "r1")
    aff.record(long, "r2")  # the shared blocks now belong to r2, the longer run too
    assert aff.choose(long, ["r1", "r2"], {}) == "r2"
    assert aff.held == {"r1": 0, "r2": 8}
    assert aff.choose(long, ["r1", "r3"], {}) in ("r1", "r3")  # r2 not live: a new home
    aff.forget("r2")
    assert not aff.owner and "r2" not in aff.held


def test_the_memory_is_bounded_least_recently_routed_first():
    aff = PrefixAffinity(max_prefixes=10)
    old, new = prefix_chain("o" * 128 * 6), prefix_chain("n" * 128 * 6)
    aff.record(old, "r1")
    aff.record(new, "r2")
    assert len(aff.owner) == 10 and sum(aff.held.values()) == 10
    assert all(h in aff.owner for h in new) and old[0] not in aff.owner


def test_hostile_bodies_are_routed_by_load_and_never_raise():
    """The gate computes the header in Serve's proxy for every generation request: a body the
    Ingress will refuse with a 400 (tests/integration/test_hostile_input) must reach it."""
    long_surrogate = json.dumps({"prompt": "\ud800" * 200}).encode()
    assert len(prefix_chain(prompt_text("/v1/completions", long_surrogate))) == 600 // 128  # routed, not raised
    for body in (b"[" * 60_000, b'{"prompt":' + b"[" * 2000 + b"]" * 2000 + b"}",
                 b'{"prompt":"hi","user":' + b"[" * 30_000 + b"]" * 30_000 + b"}", b"\xff\xfe{}",
                 b'{"messages": [' + b"[" * 50_000 + b"]}"):
        assert prefix_header("/v1/completions", body) is None
        assert prefix_header("/v1/chat/completions", body) is None
