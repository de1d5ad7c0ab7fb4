"""The expert channel on real sockets (loopback), servers and channel in this process: frames,
routing to replicas, failover, draining, compute errors, a silent replica, a foreign peer."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from moe_workers.transport import ExchangeFailed, ExchangeServer, ExpertChannel, ExpertsUnavailable, Member, Part
from moe_workers.transport import wire
from waiting import wait_for

TOKEN = "secret-token"


def _scale_by_expert(layer, x, experts, counts, prefetch, out, top1=None):
    """Rows of expert e come back times (e + 1), plus the layer: checks grouping and order."""
    start = 0
    for e, n in zip(experts, counts):
        out[start:start + n] = x[start:start + n] * (e + 1) + layer
        start += n


def _expected(layer, x, experts, counts):
    out = torch.empty_like(x)
    _scale_by_expert(layer, x, experts, counts, [], out)
    return out


@pytest.fixture
def servers():
    made = []

    def make(compute=_scale_by_expert, tokens=(TOKEN,)):
        s = ExchangeServer(compute, lambda: list(tokens))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _channel(members, timeout_s=5.0, **kw):
    ch = ExpertChannel(timeout_s=timeout_s, down_s=kw.pop("down_s", 0.2), **kw)
    ch.update(members, TOKEN)
    return ch


def test_request_frames_round_trip_and_align_the_tensor_bytes():
    for n_experts, n_prefetch in [(1, 0), (2, 3), (7, 1)]:
        experts = list(range(n_experts))
        counts = [1] * n_experts
        prefetch = [(5, i) for i in range(n_prefetch)]
        frame = wire.encode_request(9, 3, n_experts, 16, torch.bfloat16, experts, counts, prefetch)
        assert len(frame) % wire.ALIGN == 0
        head = wire.REQUEST_HEADER.size
        req = wire.decode_request(frame[:head], frame[head:])
        assert (req.seq, req.layer, req.rows, req.hidden, req.dtype) == (9, 3, n_experts, 16, torch.bfloat16)
        assert req.experts == experts and req.counts == counts and req.prefetch == prefetch


def test_a_ranked_request_carries_each_experts_first_choices():
    head = wire.REQUEST_HEADER.size
    for n_experts, n_prefetch in [(1, 0), (2, 3), (7, 1)]:
        experts, counts = list(range(n_experts)), [2] * n_experts
        top1 = [i % 3 for i in range(n_experts)]
        prefetch = [(5, i) for i in range(n_prefetch)]
        frame = wire.encode_request(9, 3, 2 * n_experts, 16, torch.float32, experts, counts, prefetch, top1=top1)
        assert len(frame) % wire.ALIGN == 0
        req = wire.decode_request(frame[:head], frame[head:])
        assert req.flags & wire.RANKED and req.top1 == top1
        assert req.experts == experts and req.counts == counts and req.prefetch == prefetch
    plain = wire.encode_request(1, 0, 2, 4, torch.float32, [0], [2])
    assert wire.decode_request(plain[:head], plain[head:]).top1 is None
    with pytest.raises(wire.ProtocolError, match="top-1 counts differ"):
        wire.encode_request(1, 0, 2, 4, torch.float32, [0], [2], top1=[1, 0])
    liar = wire.encode_request(1, 0, 2, 4, torch.float32, [0], [2], top1=[3])  # more first choices than rows
    with pytest.raises(wire.ProtocolError, match="not within the counts"):
        wire.decode_request(liar[:head], liar[head:])


def test_the_server_hands_the_first_choices_to_compute(servers):
    seen = []

    def recording(layer, x, experts, counts, prefetch, out, top1=None):
        seen.append(top1)
        _scale_by_expert(layer, x, experts, counts, prefetch, out)

    a = servers(recording)
    ch = _channel([Member("g0", "r0", a.endpoint)])
    x = torch.randn(3, 8)
    assert torch.equal(ch.exchange(2, {"g0": Part([1, 4], [2, 1], x, top1=[2, 0])})["g0"], _expected(2, x, [1, 4], [2, 1]))
    ch.exchange(2, {"g0": Part([1], [3], x)})
    assert seen == [[2, 0], None]
    ch.close()


def test_bad_frames_are_protocol_errors():
    frame = wire.encode_request(1, 0, 2, 4, torch.float32, [0], [2])
    head = wire.REQUEST_HEADER.size
    with pytest.raises(wire.ProtocolError, match="magic"):
        wire.decode_request_header(b"HTTP" + frame[4:head])
    with pytest.raises(wire.ProtocolError, match="counts sum"):
        wire.encode_request(1, 0, 3, 4, torch.float32, [0], [2])
    with pytest.raises(wire.ProtocolError, match="cannot travel"):
        wire.encode_request(1, 0, 2, 4, torch.int64, [0], [2])
    huge = wire.REQUEST_HEADER.pack(wire.MAGIC, wire.EXPERTS, 1, 0, 1, 0, wire.MAX_ROWS + 1, 4, 1, 0)
    with pytest.raises(wire.ProtocolError, match="frame limits"):
        wire.decode_request_header(huge)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5000])  # 5000 x 64 rows do not fit the 64 KiB small-reply buffer
def test_exchange_returns_each_groups_outputs(servers, dtype, rows):
    a, b = servers(), servers()
    ch = _channel([Member("g0", "r0", a.endpoint), Member("g1", "r1", b.endpoint)])
    x0 = torch.randn(rows, 64).to(dtype)
    x1 = torch.randn(rows + 2, 64).to(dtype)
    parts = {"g0": Part([3], [rows], x0), "g1": Part([1, 6], [2, rows], x1)}
    out = ch.exchange(4, parts)
    assert torch.equal(out["g0"], _expected(4, x0, [3], [rows]))
    assert torch.equal(out["g1"], _expected(4, x1, [1, 6], [2, rows]))
    assert out["g0"].dtype == dtype
    # the connections are reused: a second exchange opens none
    ch.exchange(4, parts)
    assert a.connections() == 1 and b.connections() == 1
    ch.close()


def test_one_connection_carries_requests_of_changing_shapes_and_dtypes(servers):
    """The replica keeps its tensor views over its buffers while the shape repeats (decode) and
    makes new ones when it changes: each reply is its own request's rows."""
    a = servers()
    ch = _channel([Member("g0", "r0", a.endpoint)])
    for rows, hidden, dtype, experts in [(1, 64, torch.float32, [2]), (1, 64, torch.float32, [5]),
                                         (2, 64, torch.float32, [2, 5]), (3, 32, torch.bfloat16, [1]),
                                         (5000, 64, torch.float32, [7]), (1, 64, torch.float32, [2])]:
        x = torch.randn(rows, hidden).to(dtype)
        counts = [1] * (len(experts) - 1) + [rows - len(experts) + 1]
        out = ch.exchange(3, {"g0": Part(experts, counts, x)})["g0"]
        assert torch.equal(out, _expected(3, x, experts, counts)), (rows, hidden, dtype)
    assert a.connections() == 1
    ch.close()


def test_concurrent_exchanges_each_get_their_own_connection(servers):
    gate = threading.Barrier(2)

    def wait_for_both(layer, x, experts, counts, prefetch, out, top1=None):
        gate.wait(timeout=5)  # both calls must be inside the replica at once
        _scale_by_expert(layer, x, experts, counts, prefetch, out)

    s = servers(wait_for_both)
    ch = _channel([Member("g0", "r0", s.endpoint)])
    results = {}

    def run(i):
        x = torch.full((2, 8), float(i))
        results[i] = torch.equal(ch.exchange(i, {"g0": Part([0], [2], x)})["g0"], _expected(i, x, [0], [2]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {0: True, 1: True} and s.connections() == 2


def test_wrong_token_is_refused_and_the_exchange_ends_unavailable(servers):
    s = servers(tokens=("another-token",))
    ch = _channel([Member("g0", "r0", s.endpoint)], timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ExpertsUnavailable, match="g0"):
        ch.exchange(0, {"g0": Part([0], [1], torch.ones(1, 4))})
    assert time.monotonic() - t0 < 2.0 and s.requests == 0


def test_a_dead_replica_is_skipped_and_its_part_goes_to_another(servers):
    a, b = servers(), servers()
    ch = _channel([Member("g0", "ra", a.endpoint), Member("g0", "rb", b.endpoint)])
    x = torch.randn(3, 8)
    for _ in range(4):  # both replicas get traffic
        ch.exchange(0, {"g0": Part([2], [3], x)})
    assert a.requests > 0 and b.requests > 0
    a.close()  # killed: its connections drop, its port refuses
    for _ in range(5):
        out = ch.exchange(0, {"g0": Part([2], [3], x)})
        assert torch.equal(out["g0"], _expected(0, x, [2], [3]))
    assert ch.stats["unavailable"] == 0


def test_a_draining_replica_answers_nothing_and_the_other_computes(servers):
    a, b = servers(), servers()
    ch = _channel([Member("g0", "ra", a.endpoint), Member("g0", "rb", b.endpoint)])
    x = torch.randn(2, 8)
    a.drain()
    before = b.requests
    for _ in range(6):
        assert torch.equal(ch.exchange(1, {"g0": Part([0], [2], x)})["g0"], _expected(1, x, [0], [2]))
    assert a.requests == 0 and b.requests == before + 6


def test_a_group_without_replicas_waits_for_one_within_the_deadline(servers):
    s = servers()
    ch = _channel([], timeout_s=5.0)
    threading.Timer(0.3, lambda: ch.update([Member("g0", "late", s.endpoint)], TOKEN)).start()  # a restarted replica
    x = torch.randn(1, 8)
    t0 = time.monotonic()
    assert torch.equal(ch.exchange(0, {"g0": Part([1], [1], x)})["g0"], _expected(0, x, [1], [1]))
    assert 0.25 < time.monotonic() - t0 < 3.0


def test_a_silent_replica_costs_at_most_the_timeout(servers):
    release = threading.Event()

    def hang(layer, x, experts, counts, prefetch, out, top1=None):
        release.wait(10)

    s = servers(hang)
    ch = _channel([Member("g0", "r0", s.endpoint)], timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ExpertsUnavailable, match="within 0.5 s"):
        ch.exchange(0, {"g0": Part([0], [1], torch.ones(1, 4))})
    assert time.monotonic() - t0 < 1.5
    release.set()


def test_a_stalled_replica_is_hedged_to_another_and_comes_back_when_it_answers(servers):
    """r0 stops answering (a SIGSTOPped process): after the hedge delay its part goes to r1 and
    the exchange ends well before the timeout; r0 is set aside until its late reply arrives, then
    takes work again."""
    stalled = threading.Event()
    release = threading.Event()

    def stalls(layer, x, experts, counts, prefetch, out, top1=None):
        if stalled.is_set():
            release.wait(10)
        _scale_by_expert(layer, x, experts, counts, prefetch, out)

    slow, fast = servers(stalls), servers()
    ch = _channel([Member("g0", "r0", slow.endpoint), Member("g0", "r1", fast.endpoint)], timeout_s=5.0,
                  hedge_after_s=0.2, hedge_factor=4.0)
    x = torch.randn(2, 8)
    for _ in range(4):
        ch.exchange(0, {"g0": Part([1], [2], x)})
    assert slow.requests > 0 and fast.requests > 0 and ch.stats["hedged"] == 0
    stalled.set()
    t0 = time.monotonic()
    for _ in range(4):  # r0's turn comes within two exchanges; it is hedged once, then set aside
        assert torch.equal(ch.exchange(3, {"g0": Part([1], [2], x)})["g0"], _expected(3, x, [1], [2]))
    assert ch.stats["hedged"] == 1 and ch.stats["unavailable"] == 0
    assert time.monotonic() - t0 < 2.0  # the hedge delay (0.2 s or 4x a fast exchange), not 5 s
    assert [m["down"] for m in ch.members()["g0"]] == [True, False]
    before = fast.requests
    t1 = time.monotonic()
    for _ in range(5):  # set aside: no more waits on it
        ch.exchange(0, {"g0": Part([1], [2], x)})
    assert fast.requests == before + 5 and time.monotonic() - t1 < 1.0
    stalled.clear()
    release.set()  # its late reply arrives, is dropped, and the replica is live again
    wait_for(lambda: not ch.members()["g0"][0]["down"], timeout_s=5, what="r0 live again")
    served = slow.requests
    for _ in range(4):
        ch.exchange(0, {"g0": Part([1], [2], x)})
    assert slow.requests > served


def test_a_slow_replica_with_nobody_to_hedge_to_keeps_its_work(servers):
    """The group's other replica is dead: a reply slower than the hedge delay is waited for, and
    the slow replica is not set aside (it is the only one left)."""
    def slow(layer, x, experts, counts, prefetch, out, top1=None):
        time.sleep(0.5)
        _scale_by_expert(layer, x, experts, counts, prefetch, out)

    dead, alive = servers(), servers(slow)
    ch = _channel([Member("g0", "r0", dead.endpoint), Member("g0", "r1", alive.endpoint)], timeout_s=5.0,
                  hedge_after_s=0.1, hedge_factor=1.0)
    dead.close()
    x = torch.randn(1, 8)
    t0 = time.monotonic()
    for _ in range(3):
        assert torch.equal(ch.exchange(0, {"g0": Part([0], [1], x)})["g0"], _expected(0, x, [0], [1]))
    assert time.monotonic() - t0 < 4.0  # three 0.5 s replies, not a wait for r1 to come back from the side
    assert ch.stats["hedged"] == 0 and ch.stats["unavailable"] == 0
    assert not next(m for m in ch.members()["g0"] if m["replica"] == "r1")["down"]


def test_hedging_off_waits_for_the_slow_replica(servers):
    release = threading.Event()

    def slow(layer, x, experts, counts, prefetch, out, top1=None):
        release.wait(10)
        _scale_by_expert(layer, x, experts, counts, prefetch, out)

    a, b = servers(slow), servers()
    ch = _channel([Member("g0", "r0", a.endpoint), Member("g0", "r1", b.endpoint)], hedge_after_s=0)
    threading.Timer(0.6, release.set).start()
    t0 = time.monotonic()
    x = torch.randn(1, 8)
    assert torch.equal(ch.exchange(0, {"g0": Part([0], [1], x)})["g0"], _expected(0, x, [0], [1]))
    assert time.monotonic() - t0 >= 0.5 and ch.stats["hedged"] == 0 and b.requests == 0


def test_compute_errors_try_the_next_replica_then_fail_with_the_replicas_message(servers):
    def broken(layer, x, experts, counts, prefetch, out, top1=None):
        raise KeyError("this replica does not host expert(s) 0.5")

    bad, good = servers(broken), servers()
    ch = _channel([Member("g0", "bad", bad.endpoint), Member("g0", "good", good.endpoint)])
    x = torch.randn(2, 4)
    for _ in range(4):
        assert torch.equal(ch.exchange(0, {"g0": Part([5], [2], x)})["g0"], _expected(0, x, [5], [2]))
    only_bad = _channel([Member("g0", "bad", bad.endpoint)])
    with pytest.raises(ExchangeFailed, match="does not host expert"):
        only_bad.exchange(0, {"g0": Part([5], [2], x)})


def test_replicas_reporting_the_experts_are_preferred(servers):
    a, b = servers(), servers()
    ch = _channel([Member("g0", "ra", a.endpoint, frozenset({(0, 1)})),
                   Member("g0", "rb", b.endpoint, frozenset({(0, 1), (0, 2)}))])
    for _ in range(3):
        ch.exchange(0, {"g0": Part([2], [1], torch.ones(1, 4))})
    assert a.requests == 0 and b.requests == 3


def test_a_foreign_peer_does_not_disturb_the_others(servers):
    s = servers()
    ch = _channel([Member("g0", "r0", s.endpoint)])
    x = torch.randn(1, 4)
    ch.exchange(0, {"g0": Part([0], [1], x)})
    host, port = s.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as rogue:
        rogue.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
        rogue.settimeout(2)
        try:
            assert rogue.recv(16) == b""  # closed on the bad frame, nothing computed
        except ConnectionResetError:  # or reset, with our bytes unread
            pass
    assert torch.equal(ch.exchange(0, {"g0": Part([0], [1], x)})["g0"], _expected(0, x, [0], [1]))
    assert s.requests == 2


def test_membership_updates_replace_moved_replicas(servers):
    a, b = servers(), servers()
    ch = _channel([Member("g0", "r0", a.endpoint)])
    ch.exchange(0, {"g0": Part([0], [1], torch.ones(1, 4))})
    ch.update([Member("g0", "r0", b.endpoint)], TOKEN)  # same id, new endpoint: a restarted replica
    ch.exchange(0, {"g0": Part([0], [1], torch.ones(1, 4))})
    assert (a.requests, b.requests) == (1, 1)
    assert [r["endpoint"] for r in ch.members()["g0"]] == [b.endpoint]


def test_device_link_carries_the_rows_beside_the_frames(servers):
    """The GPU path's code on CPU: each connection gets a two-rank process group (gloo here,
    NCCL for CUDA rows); frames flagged LINKED carry no tensor bytes on the socket."""
    a, b = servers(), servers()
    ch = _channel([Member("g0", "r0", a.endpoint), Member("g1", "r1", b.endpoint)], device_link="gloo")
    x0, x1 = torch.randn(3, 16), torch.randn(70000, 16)  # the second one far beyond any socket buffer
    for _ in range(3):
        out = ch.exchange(2, {"g0": Part([1], [3], x0), "g1": Part([0, 4], [10, 69990], x1)})
        assert torch.equal(out["g0"], _expected(2, x0, [1], [3]))
        assert torch.equal(out["g1"], _expected(2, x1, [0, 4], [10, 69990]))
    assert a.requests == 3 and b.requests == 3
    assert all(c.link is not None for p in ch._peers.values() for c in p.idle)


def test_a_linked_frame_without_a_link_is_refused(servers):
    s = servers()
    host, port = s.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as c:
        c.sendall(wire.encode_hello(TOKEN))
        status, n = wire.decode_ack_header(c.recv(wire.ACK_HEADER.size))
        assert status == wire.OK
        c.sendall(wire.encode_request(1, 0, 1, 4, torch.float32, [0], [1], flags=wire.LINKED))
        c.settimeout(2)
        try:
            assert c.recv(16) == b""
        except ConnectionResetError:
            pass
    assert s.requests == 0


def test_an_unknown_link_backend_is_refused_at_hello(servers):
    s = servers()
    host, port = s.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as c:
        c.sendall(wire.encode_hello(TOKEN, {"backend": "carrier-pigeon", "host": "127.0.0.1", "port": 1}))
        status, n = wire.decode_ack_header(c.recv(wire.ACK_HEADER.size))
        assert status == wire.ERROR and b"unknown link backend" in c.recv(n)


def _on_node(s, node="node-1"):
    """What a replica on `node` reports: both its endpoints."""
    return dict(endpoint=s.endpoint, local_endpoint=s.local_endpoint, node=node)


@pytest.mark.parametrize("same_node", [True, False])
def test_a_replica_whose_port_refuses_is_reported_gone_and_leaves_the_membership(servers, same_node):
    """Also when it was reached on its Unix socket: the failed Unix connect falls back to TCP,
    whose refusal says the process is gone."""
    a, b = servers(), servers()
    node = "node-1" if same_node else "node-2"
    listed = [Member("g0", "ra", experts=frozenset(), **_on_node(a, node)),
              Member("g0", "rb", experts=frozenset(), **_on_node(b, node))]
    forgotten = []

    def forget(member):  # what the ingress tells the StatusBoard
        forgotten.append(member)
        listed[:] = [m for m in listed if m.replica != member.replica]

    ch = ExpertChannel(lambda: (list(listed), TOKEN), timeout_s=5.0, down_s=0.05, refresh_s=0.05, on_refused=forget,
                       node="node-1")
    try:
        wait_for(lambda: len(ch.members().get("g0", [])) == 2, timeout_s=5, what="both replicas on the channel", interval_s=0.05)
        x = torch.randn(2, 8)
        for _ in range(4):  # both replicas get traffic, on the path their node gives
            ch.exchange(0, {"g0": Part([1], [2], x)})
        assert {r["via"] for r in ch.members()["g0"]} == {"unix" if same_node else "tcp"}
        a.close()  # killed: its connections drop, its port refuses
        deadline = time.monotonic() + 5
        while not forgotten and time.monotonic() < deadline:
            out = ch.exchange(0, {"g0": Part([1], [2], x)})
            assert torch.equal(out["g0"], _expected(0, x, [1], [2]))
            time.sleep(0.06)
        assert [m.replica for m in forgotten] == ["ra"]
        wait_for(lambda: [r["replica"] for r in ch.members()["g0"]] == ["rb"], timeout_s=5,
                 what="the dead replica off the channel", interval_s=0.05)
        assert b.requests > 0
    finally:
        ch.close()


def test_endpoints_parse_to_socket_addresses_and_bad_ones_say_what_is_expected():
    assert wire.parse_endpoint("10.0.0.7:8123") == (socket.AF_INET, ("10.0.0.7", 8123))
    assert wire.parse_endpoint("[::1]:9") == (socket.AF_INET6, ("::1", 9))
    assert wire.parse_endpoint("unix:@moe-channel-ab12") == (socket.AF_UNIX, "\0moe-channel-ab12")
    for bad in ["10.0.0.7", "10.0.0.7:http", ":80", "h:0", "h:70000", "unix:@", "unix:@" + "x" * 108]:
        with pytest.raises(ValueError, match="endpoint"):
            wire.parse_endpoint(bad)


def test_a_replica_on_this_node_is_reached_on_its_unix_socket_and_others_over_tcp(servers):
    a, b = servers(), servers()
    assert a.local_endpoint.startswith(wire.UNIX_PREFIX) and a.local_endpoint != b.local_endpoint
    ch = _channel([Member("g0", "r0", experts=frozenset(), **_on_node(a, "node-1")),
                   Member("g1", "r1", experts=frozenset(), **_on_node(b, "node-2"))], node="node-1")
    x0, x1 = torch.randn(1, 64), torch.randn(5000, 64)  # the large one in pieces on the Unix socket too
    for _ in range(3):
        out = ch.exchange(1, {"g0": Part([2], [1], x0), "g1": Part([3], [5000], x1)})
        assert torch.equal(out["g0"], _expected(1, x0, [2], [1]))
        assert torch.equal(out["g1"], _expected(1, x1, [3], [5000]))
    assert {g: [r["via"] for r in rs] for g, rs in ch.members().items()} == {"g0": ["unix"], "g1": ["tcp"]}
    assert (a.requests, a.connections(), b.requests) == (3, 1, 3)
    # the Unix connection's send buffer as large as the kernel allows (it doubles what it grants)
    from moe_workers.transport.server import UNIX_SNDBUF
    wmem_max = int(open("/proc/sys/net/core/wmem_max").read())
    sock = ch._peers["r0"].idle[0].sock
    assert sock.family == socket.AF_UNIX
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * min(UNIX_SNDBUF, wmem_max)
    ch.use_local_sockets(False)  # TCP only from now on: the Unix connection closes, the next one is TCP
    assert torch.equal(ch.exchange(1, {"g0": Part([2], [1], x0)})["g0"], _expected(1, x0, [2], [1]))
    assert ch.members()["g0"][0]["via"] == "tcp"
    wait_for(lambda: a.connections() == 1, timeout_s=5, what="the Unix connection closed", interval_s=0.02)
    ch.close()


def test_an_unreachable_unix_socket_falls_back_to_tcp(servers):
    """Same node id but the name is not there (another network namespace, say): TCP serves."""
    a = servers()
    ch = _channel([Member("g0", "r0", a.endpoint, local_endpoint="unix:@moe-channel-nobody-listens", node="n")],
                  node="n")
    x = torch.randn(2, 8)
    assert torch.equal(ch.exchange(0, {"g0": Part([1], [2], x)})["g0"], _expected(0, x, [1], [2]))
    assert ch.members()["g0"][0]["via"] == "tcp"
    ch.close()


def test_the_unix_socket_checks_the_token_too(servers):
    s = servers()
    family, address = wire.parse_endpoint(s.local_endpoint)
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(5)
        c.connect(address)
        c.sendall(wire.encode_hello("not-the-token"))
        status, n = wire.decode_ack_header(c.recv(wire.ACK_HEADER.size))
        assert status == wire.DENIED and b"wrong channel token" in c.recv(n)
    ch = _channel([Member("g0", "r0", "127.0.0.1:1", local_endpoint=s.local_endpoint, node="n")], node="n",
                  timeout_s=0.5)
    ch.token = "another-token"
    with pytest.raises(ExpertsUnavailable):
        ch.exchange(0, {"g0": Part([0], [1], torch.ones(1, 4))})
    assert s.requests == 0


def _slow_compute(delay_s):
    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        time.sleep(delay_s)
        _scale_by_expert(layer, x, experts, counts, prefetch, out)
    return compute


@pytest.mark.parametrize("here,cpus,polled_ms", [(1, 2, 30), (2, 2, 20), (0, 1, 30), (1, 1, 20), (2, 1, 0)])
def test_a_small_exchange_polls_for_its_replies_only_where_the_replicas_leave_it_a_cpu(servers, here, cpus, polled_ms):
    """The poll shows as the thread's CPU time while it waits (a sleeping wait takes none). It
    runs while the parts still awaited from replicas on this node leave it a CPU: replies come
    from g0 after 10 ms, then g1 after 30, so with both on this node and 2 CPUs only the wait
    for g1, once g0 answered, polls. An exchange of more than spin_max_rows rows never polls."""
    a, b = servers(_slow_compute(0.01)), servers(_slow_compute(0.03))
    members = [Member("g0", "r0", a.endpoint, node="n" if here >= 1 else "elsewhere"),
               Member("g1", "r1", b.endpoint, node="n" if here >= 2 else "elsewhere")]
    ch = _channel(members, node="n", spin_s=0.1, spin_max_rows=8, cpus=cpus)

    def busy_s(rows):
        parts = {"g0": Part([1], [rows], torch.randn(rows, 8)), "g1": Part([2], [rows], torch.randn(rows, 8))}
        ch.exchange(0, parts)  # connections open
        c0 = time.thread_time()
        for _ in range(5):
            out = ch.exchange(0, parts)
        assert torch.equal(out["g1"], _expected(0, parts["g1"].x, [2], [rows]))
        return time.thread_time() - c0

    small, large = busy_s(2), busy_s(5)  # 4 rows may poll, 10 (over 8) never
    assert large < 0.03, large
    expected = 5 * polled_ms / 1000
    if polled_ms:
        assert 0.5 * expected < small < 1.3 * expected + 0.02, (small, expected)
    else:
        assert small < 0.03, small
    ch.close()


def test_a_cgroup_quota_caps_the_cpus_the_poll_counts_on():
    from moe_workers.transport.channel import available_cpus, cpu_quota

    assert cpu_quota("200000 100000\n") == 2.0
    assert cpu_quota("150000 100000") == 1.5
    assert cpu_quota("max 100000") is None
    assert cpu_quota(None, "50000\n", "100000\n") == 0.5
    assert cpu_quota(None, "-1", "100000") is None
    assert cpu_quota() is None
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def _voluntary_switches(tid: int) -> int:
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def test_neither_side_is_woken_when_the_other_reads_what_it_sent(servers):
    """Over a Unix socket a blocked recv() also wakes whenever the peer reads what this side
    sent (the kernel's write-space wake-up), a synchronous wake that queued a shard replica on the
    ingress' CPU. Both ends wait for data in poll(): each sleeps once an exchange, not twice."""
    tids = []

    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        if not tids:
            tids.append(threading.get_native_id())
        time.sleep(0.002)  # the ingress blocks before the reply comes
        out.copy_(x)

    a = servers(compute)
    ch = _channel([Member("g0", "r0", experts=frozenset(), **_on_node(a, "node-1"))], node="node-1")
    x = torch.randn(1, 64)
    ch.exchange(0, {"g0": Part([0], [1], x)})
    assert ch.members()["g0"][0]["via"] == "unix"
    me, n = threading.get_native_id(), 100
    server0, ingress0 = _voluntary_switches(tids[0]), _voluntary_switches(me)
    for _ in range(n):
        assert torch.equal(ch.exchange(0, {"g0": Part([0], [1], x)})["g0"], x)
        time.sleep(0.0005)  # the replica waits for the next request while its reply is read
    server, ingress = _voluntary_switches(tids[0]) - server0, _voluntary_switches(me) - ingress0
    # one sleep each per exchange (the replica's compute sleeps once more); a blocking recv made it two
    assert server <= 2.4 * n, f"replica thread: {server / n:.2f} sleeps an exchange"
    assert ingress <= 2.4 * n, f"ingress thread: {ingress / n:.2f} sleeps an exchange"
    ch.close()
