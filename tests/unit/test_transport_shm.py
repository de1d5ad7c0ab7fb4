"""The expert channel's shared-memory path (transport/shm.py) on real memfds, futexes and Unix
sockets: frames in both areas and on the socket beside them, the mailboxes' wake-ups, a peer killed
mid-exchange, segments freed with their connection, the token checked before a segment is mapped,
and the fallbacks to the socket."""

from __future__ import annotations

import fcntl
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import torch

from moe_workers.transport import ExchangeFailed, ExchangeServer, ExpertChannel, Member, Part, shm, wire
from waiting import wait_for

TOKEN = "secret-token"
NODE = "node-1"

pytestmark = pytest.mark.skipif(shm.library() is None, reason=f"no mailboxes here: {shm.why()}")


def _scale_by_expert(layer, x, experts, counts, prefetch, out, top1=None):
    """Rows of expert e come back times (e + 1), plus the layer."""
    start = 0
    for e, n in zip(experts, counts):
        out[start:start + n] = x[start:start + n] * (e + 1) + layer
        start += n


def _expected(layer, x, experts, counts):
    out = torch.empty_like(x)
    _scale_by_expert(layer, x, experts, counts, [], out)
    return out


def _segments() -> int:
    """Shared-memory segments this process has mapped now."""
    with open("/proc/self/maps") as f:
        return sum("memfd:moe-exchange" in line for line in f)


def _segment_fds() -> int:
    """Open fds of this process that are segments."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:moe-exchange")
        except OSError:
            pass
    return count


@pytest.fixture
def unmapped():
    """Start from no segment mapped in this process: earlier tests' replica threads unmap theirs
    once they notice their ingress gone (within `shm.IDLE_SLICE_S`)."""
    gc.collect()
    wait_for(lambda: _segments() == 0 and _segment_fds() == 0, timeout_s=10,
             what="earlier tests' segments released", interval_s=0.02)


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


def _member(s, group="g0", replica="r0"):
    return Member(group, replica, s.endpoint, local_endpoint=s.local_endpoint, node=NODE)


def _channel(members, **kw):
    ch = ExpertChannel(timeout_s=kw.pop("timeout_s", 5.0), down_s=0.2, node=NODE, shared_memory=True, **kw)
    ch.update(members, TOKEN)
    return ch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_frames_go_through_the_segment_and_large_ones_on_the_socket_beside_it(servers, dtype):
    s = servers()
    ch = _channel([_member(s)], shm_area_bytes=1 << 16)
    small, large = torch.randn(3, 64).to(dtype), torch.randn(600, 64).to(dtype)  # 600 x 64 rows exceed 64 KiB
    for x, experts, counts in [(small, [1, 4], [2, 1]), (large, [2], [600]), (small, [0], [3]), (large, [5], [600])]:
        out = ch.exchange(2, {"g0": Part(experts, counts, x)})["g0"]
        assert out.dtype == dtype and torch.equal(out, _expected(2, x, experts, counts))
    assert ch.members()["g0"][0]["via"] == "shm"
    assert (ch.stats["shm_connections"], ch.stats["shm_fallbacks"], s.shm_connections, s.requests) == (1, 0, 1, 4)
    assert s.connections() == 1  # one connection carried both kinds
    ch.close()


def test_a_compute_error_comes_back_through_the_segment(servers):
    def fails(layer, x, experts, counts, prefetch, out, top1=None):
        raise ValueError(f"expert {experts[0]} is broken")

    s = servers(fails)
    ch = _channel([_member(s)])
    with pytest.raises(ExchangeFailed, match="expert 3 is broken"):
        ch.exchange(0, {"g0": Part([3], [1], torch.ones(1, 8))})
    assert ch.members()["g0"][0]["via"] == "shm"
    ch.close()


def test_a_draining_replica_answers_through_the_segment_and_the_other_computes(servers):
    a, b = servers(), servers()
    ch = _channel([_member(a, replica="ra"), _member(b, replica="rb")])
    x = torch.randn(2, 8)
    for _ in range(4):
        ch.exchange(0, {"g0": Part([1], [2], x)})
    a.drain()
    before = b.requests
    for _ in range(6):
        assert torch.equal(ch.exchange(1, {"g0": Part([0], [2], x)})["g0"], _expected(1, x, [0], [2]))
    assert b.requests >= before + 6 - 1  # at most the first one went to the draining replica first
    assert a.shm_connections == 1 and b.shm_connections == 1
    ch.close()


def test_a_post_wakes_a_sleeping_waiter_with_a_syscall_and_a_spinning_one_without():
    seg, fd = shm.Segment.create()
    os.close(fd)
    box = seg.request_box
    peer = shm.Mailbox(shm.library(), seg.bytes[:shm.HEAD].view("uint32"), shm.REQUEST_BOX)  # the waiter's end
    got = []

    def wait(spin_s):
        got.append(peer.wait(spin_s, 5.0))

    t = threading.Thread(target=wait, args=(0.0,))  # sleeps on the futex at once
    t.start()
    wait_for(lambda: int(seg.bytes[:8].view("uint32")[1]) == 1, timeout_s=5, what="the waiter asleep", interval_s=0.001)
    box.post()
    t.join(5)
    assert got == [shm.IN_AREA] and box.wakes == 1
    t = threading.Thread(target=wait, args=(5.0,))  # polls: the post needs no wake-up
    t.start()
    time.sleep(0.05)
    box.post(shm.ON_SOCKET)
    t.join(5)
    assert got == [shm.IN_AREA, shm.ON_SOCKET] and box.wakes == 1
    assert peer.wait(0.0, 0.01) is None  # nothing new: the wait times out
    seg.close()


@pytest.mark.parametrize("spin_s", [0.0, 0.0002])
def test_no_wake_up_is_lost_in_a_long_ping_pong(spin_s):
    """Two threads hand a counter back and forth through the two mailboxes, their sequence words
    wrapping past 2^32 halfway; a lost wake-up would leave one asleep until the 5 s wait runs out."""
    seg, fd = shm.Segment.create()
    os.close(fd)
    rounds, misses = 3000, []
    words = seg.bytes[:shm.HEAD].view("uint32")
    words[shm.REQUEST_BOX // 4] = words[shm.REPLY_BOX // 4] = 0xFFFFFFFF - rounds // 2
    lib = shm.library()
    ping_out, ping_in = (shm.Mailbox(lib, words, shm.REQUEST_BOX) for _ in range(2))  # each end's view
    pong_out, pong_in = (shm.Mailbox(lib, words, shm.REPLY_BOX) for _ in range(2))

    def pong():
        for _ in range(rounds):
            if ping_in.wait(spin_s, 5.0) is None:
                misses.append("pong")
                return
            pong_out.post()

    t = threading.Thread(target=pong)
    t.start()
    t0 = time.monotonic()
    for _ in range(rounds):
        ping_out.post()
        if pong_in.wait(spin_s, 5.0) is None:
            misses.append("ping")
            break
    t.join(10)
    assert misses == [] and time.monotonic() - t0 < 20
    assert ping_in.seen == (0xFFFFFFFF - rounds // 2 + rounds) & 0xFFFFFFFF < rounds  # it wrapped
    seg.close()


def test_a_frame_sent_on_the_socket_is_not_taken_for_a_close():
    """The replica's sleep ran out just before the ingress posted ON_SOCKET and sent a large frame:
    the readable socket is the frame, not the ingress' close."""
    seg, fd = shm.Segment.create()
    os.close(fd)
    replica_end, ingress_end = socket.socketpair()
    real = seg.request_box

    class SliceRanOut:  # the first wait returns empty-handed, as a slice that ends before the post
        calls = 0

        def wait(self, spin_s, wait_s):
            self.calls += 1
            return None if self.calls == 1 else real.wait(spin_s, wait_s)

    poster = shm.Mailbox(shm.library(), seg.bytes[:shm.HEAD].view("uint32"), shm.REQUEST_BOX)
    poster.post(shm.ON_SOCKET)
    ingress_end.sendall(b"a large frame")
    assert shm.wait_for(SliceRanOut(), replica_end, time.monotonic() + 5) == shm.ON_SOCKET
    ingress_end.close()  # now a readable socket with nothing posted is the close
    with pytest.raises(ConnectionError):
        shm.wait_for(real, replica_end, time.monotonic() + 5)
    replica_end.close()
    seg.close()


def _replica_process(ready, endpoints, stall):
    """A shard replica in its own process: computes, except that a request for expert 7 stalls
    (the test kills it meanwhile)."""
    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        if 7 in experts:
            stall.set()
            time.sleep(60)
        _scale_by_expert(layer, x, experts, counts, prefetch, out)

    s = ExchangeServer(compute, lambda: [TOKEN])
    endpoints.put((s.endpoint, s.local_endpoint))
    ready.set()
    time.sleep(120)


def test_a_replica_killed_mid_exchange_fails_over_and_its_segment_is_freed(unmapped, servers):
    ctx = mp.get_context("spawn")
    ready, endpoints, stall = ctx.Event(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_replica_process, args=(ready, endpoints, stall), daemon=True)
    proc.start()
    try:
        assert ready.wait(60)
        endpoint, local = endpoints.get(timeout=5)
        other = servers()
        ch = _channel([Member("g0", "dying", endpoint, local_endpoint=local, node=NODE), _member(other, replica="ok")],
                      hedge_after_s=0)
        x = torch.randn(2, 16)
        for _ in range(4):  # both replicas connected, through shared memory
            ch.exchange(0, {"g0": Part([1], [2], x)})
        assert {r["via"] for r in ch.members()["g0"]} == {"shm"} and _segments() == 2 * 1 + 1
        # (this process maps the ingress' end of both segments, and the in-process replica's end of one)
        result = {}

        def exchange():
            result["out"] = ch.exchange(1, {"g0": Part([7], [2], x)})

        # expert 7 stalls on whichever replica gets it; make it the dying one
        ch._peers["ok"].down_until = time.monotonic() + 0.3
        t = threading.Thread(target=exchange)
        t.start()
        assert stall.wait(5)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        t.join(10)
        assert torch.equal(result["out"]["g0"], _expected(1, x, [7], [2]))  # the other replica computed it
        assert time.monotonic() - t0 < 2.0  # noticed within a wait's slice, not at the 5 s timeout
        assert ch.stats["unavailable"] == 0 and other.requests >= 3
        wait_for(lambda: _segments() == 2, timeout_s=5, what="the dead replica's segment unmapped", interval_s=0.02)
        ch.close()
        wait_for(lambda: _segments() == 0, timeout_s=5, what="every segment unmapped once the channel closed",
                 interval_s=0.02)
    finally:
        proc.kill()
        proc.join(5)


def test_the_token_is_checked_before_a_segment_is_mapped(unmapped, servers):
    s = servers()
    seg, fd = shm.Segment.create()
    ours = _segment_fds()  # the fd and the mapping's own
    family, address = wire.parse_endpoint(s.local_endpoint)
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(5)
        c.connect(address)
        shm.send_hello(c, wire.encode_hello("not-the-token", {shm.OFFER: seg.size}), fd)
        status, n = wire.decode_ack_header(c.recv(wire.ACK_HEADER.size))
        assert status == wire.DENIED and b"wrong channel token" in c.recv(n)
    wait_for(lambda: _segment_fds() == ours, timeout_s=5, what="the replica's copy of the fd closed",
             interval_s=0.01)
    os.close(fd)
    assert _segments() == 1 and s.shm_connections == 0  # only ours: it never mapped it
    seg.close()
    assert _segments() == 0


def test_an_unsealed_segment_is_refused_and_the_connection_stays_on_the_socket(servers):
    s = servers()
    fd = os.memfd_create("moe-exchange", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, shm.HEAD + 2 * shm.AREA_BYTES)  # a peer could shrink it under the replica's mapping
    family, address = wire.parse_endpoint(s.local_endpoint)
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(5)
        c.connect(address)
        shm.send_hello(c, wire.encode_hello(TOKEN, {shm.OFFER: shm.HEAD + 2 * shm.AREA_BYTES}), fd)
        status, n = wire.decode_ack_header(c.recv(wire.ACK_HEADER.size))
        message = c.recv(n).decode()
        assert status == wire.OK and "not sealed" in message
        x = torch.randn(2, 8)  # the same connection carries frames on the socket
        c.sendall(wire.encode_request(1, 0, 2, 8, x.dtype, [1], [2]) + bytes(wire.as_bytes(x)))
        head = c.recv(wire.REPLY_HEADER.size, socket.MSG_WAITALL)
        reply, _ = wire.decode_reply_header(head)
        assert (reply.seq, reply.status, reply.rows) == (1, wire.OK, 2)
    assert fcntl.fcntl(fd, shm.F_GET_SEALS) & shm.SEALS == 0
    os.close(fd)
    assert s.shm_connections == 0 and "not sealed" in s.shm_refused


def test_without_mailboxes_the_channel_stays_on_the_unix_socket_and_says_why(servers, monkeypatch, caplog):
    monkeypatch.setattr(shm, "_state", {"lib": None, "why": "no C compiler (cc) on this machine"})
    s = servers()
    ch = _channel([_member(s)])
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="moe_workers.transport.channel"):
        for _ in range(2):
            assert torch.equal(ch.exchange(0, {"g0": Part([1], [2], x)})["g0"], _expected(0, x, [1], [2]))
    assert ch.members()["g0"][0]["via"] == "unix"
    assert ch.stats["shm_fallbacks"] == 1 and "no C compiler" in ch.shm_error
    assert [r.message for r in caplog.records if "shared memory not used" in r.message]
    ch.close()


def test_a_stalled_replica_on_shared_memory_is_hedged_to_another(servers):
    stalled, release = threading.Event(), threading.Event()

    def stalls(layer, x, experts, counts, prefetch, out, top1=None):
        if stalled.is_set():
            release.wait(10)
        _scale_by_expert(layer, x, experts, counts, prefetch, out)

    slow, fast = servers(stalls), servers()
    ch = _channel([_member(slow, replica="r0"), _member(fast, replica="r1")], hedge_after_s=0.2, hedge_factor=0.0)
    x = torch.randn(2, 8)
    for _ in range(4):
        ch.exchange(0, {"g0": Part([1], [2], x)})
    assert {r["via"] for r in ch.members()["g0"]} == {"shm"}
    stalled.set()
    t0 = time.monotonic()
    for _ in range(4):
        assert torch.equal(ch.exchange(3, {"g0": Part([1], [2], x)})["g0"], _expected(3, x, [1], [2]))
    assert ch.stats["hedged"] == 1 and time.monotonic() - t0 < 2.0
    stalled.clear()
    release.set()  # the late reply is read from the segment and dropped; r0 is live again
    wait_for(lambda: not ch.members()["g0"][0]["down"], timeout_s=5, what="r0 live again")
    served = slow.requests
    for _ in range(4):
        ch.exchange(0, {"g0": Part([1], [2], x)})
    assert slow.requests > served
    ch.close()


def test_a_segment_that_cannot_be_made_leaves_the_connection_on_the_socket(servers, monkeypatch):
    """memfd_create refused (a seccomp profile, no memory): the Unix socket carries the frames,
    the channel counts the fallback and says why."""
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "memfd_create", refuse)
    s = servers()
    ch = _channel([_member(s)])
    x = torch.randn(2, 8)
    assert torch.equal(ch.exchange(0, {"g0": Part([1], [2], x)})["g0"], _expected(0, x, [1], [2]))
    assert ch.members()["g0"][0]["via"] == "unix" and s.shm_connections == 0
    assert ch.stats["shm_fallbacks"] == 1 and "memfd_create: Cannot allocate memory" in ch.shm_error
    ch.close()
