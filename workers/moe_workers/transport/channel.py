"""The ingress' end of the expert channel: one exchange per layer with every shard group at once.

`ExpertChannel.exchange(layer, parts)` sends each group's rows to one replica of that group
(all sends first, then all receives: the groups compute concurrently) and returns each group's
outputs. It keeps connections open (one per exchange in flight per replica) and knows the
replicas from a membership source, polled in the background: each shard replica reports its
endpoint and hosted experts to the app's StatusBoard, so replicas that Serve adds, restarts or
removes join and leave the channel without a restart of the ingress. A replica on the ingress'
own node (the same Ray node id: the same host or Pod, so the same network namespace) is reached
on its Unix socket when it has one, and over TCP when that connect fails.

Failures never hang a step. A replica that refuses the connection, drops it, answers DRAINING
or does not answer within `timeout_s` is set aside for `down_s` and its part is sent to another
replica of the group, or, when the group has none, again once membership brings one (a restarted
replica), until the exchange's deadline: then `ExpertsUnavailable` (the ingress answers 503).
A replica that answers with a compute error is not retried on the same replica; when every
replica of the group failed so, `ExchangeFailed` carries the replica's message.

Waiting for a small exchange's replies (a small decode step's), the ingress polls its connections
without sleeping for up to `spin_s` before it blocks: a blocked thread's wake-up, when the reply
arrives, costs a sleeping CPU's wake (on a VM, the hypervisor's: about 0.1 ms here), which is a
third of a bare round trip, and a thread that slept resumes on cold caches. The poll is one
non-blocking syscall at a time, with the GIL released in it and the CPU offered to others
(sched_yield) between them. It only runs where it takes no CPU from the replicas computing the
exchange: when the parts still awaited from replicas on this node, plus the polling thread, fit
this process' CPUs (on 2 CPUs: a part for one replica polls at once; parts for two, once the
first reply is in). Larger exchanges, which take longer than a wake-up by far, block at once.

A slow replica is hedged: when its group has another live replica and no reply came within the
hedge delay (`hedge_factor` x the slowest recent exchange, at least `hedge_after_s`), the same
part goes to another replica and the first reply wins. The straggler is set aside until its late
reply arrives (read and dropped in the background, then the replica is back); a stalled process
(SIGSTOP, a long pause) costs the steps in flight the hedge delay, not the exchange timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moe_workers.expert_ids import expert_key

from . import shm, wire
from .link import LinkError, LinkOffer, PairLink
from .server import _recv_at_least, readable_poller, recv_bytes, recv_exact, send_all, tune
from .wakeup import WakeLatency

log = logging.getLogger(__name__)


class ExpertsUnavailable(RuntimeError):
    """No replica of a shard group answered within the exchange's deadline (HTTP 503)."""


class ExchangeFailed(RuntimeError):
    """Every replica of a shard group tried answered this exchange with an error."""


@dataclass(frozen=True)
class Member:
    """One shard replica on the channel, as it reports itself."""

    group: str
    replica: str
    endpoint: str  # host:port
    experts: frozenset[tuple[int, int]] = frozenset()
    local_endpoint: str = ""  # unix:@name, reachable from the same node only
    node: str = ""  # the Ray node id the replica runs on

    @staticmethod
    def from_report(report: dict) -> "Member":
        experts = frozenset(expert_key(eid) for eid in report.get("experts", []))
        return Member(report["group"], report["replica"], report["endpoint"], experts,  # type: ignore[arg-type]
                      report.get("local_endpoint") or "", report.get("node_id") or "")


@dataclass
class Part:
    """One group's share of a layer: rows grouped by expert (`counts[i]` rows for `experts[i]`)."""

    experts: list[int]
    counts: list[int]
    x: torch.Tensor
    prefetch: list[tuple[int, int]] = field(default_factory=list)
    top1: list[int] | None = None  # per expert, the rows that chose it first (the router's ranking)


MembershipSource = Callable[[], tuple[list[Member], str]]

SPIN_MAX_ROWS = wire.SMALL_ROWS  # a larger exchange never polls


class _Conn:
    """A connection to a replica, with the buffer its small replies are read into, and its
    device link or its shared-memory segment when it has one."""

    def __init__(self, sock: socket.socket, link: PairLink | None = None, seg: shm.Segment | None = None):
        self.sock = sock
        self.link = link
        self.seg = seg
        self.in_area = False  # the request in flight went through the segment (its reply comes there)
        self.arrived = False  # ... and its reply was seen posted (by `ready`)
        self.peer_closed = False  # ... or the peer closed the socket meanwhile
        self.view = memoryview(bytearray(1 << 16))
        self.poller = readable_poller(sock)  # the reply (or the peer's close) arrived
        self.wait_s = 0.0  # the kernel's limit on one send or receive (SO_SNDTIMEO / SO_RCVTIMEO); 0: none

    def ready(self, until: float, spin: bool = False) -> bool:
        """Whether the reply (or the peer's close) arrives before `until` (monotonic); `spin`:
        poll without sleeping meanwhile."""
        if not self.in_area:
            if spin:
                return _spin_until_readable(self, until)
            try:
                return bool(self.poller.poll(max(0.0, until - time.monotonic()) * 1000.0))
            except OSError:
                return True  # the receive finds out what is wrong
        if self.arrived or self.peer_closed:
            return True
        try:
            where = shm.wait_for(self.seg.reply_box, self.sock, until,  # type: ignore[union-attr]
                                 max(0.0, until - time.monotonic()) if spin else 0.0)
        except (ConnectionError, OSError):
            self.peer_closed = True
            return True
        self.arrived = where is not None
        return self.arrived

    def set_wait(self, seconds: float) -> None:
        """Bound each send and receive in the kernel. The socket stays blocking: a Python
        timeout would put a poll() before every send and every read of a reply (a reply's first
        read waits in a poll of its own, which takes the deadline: readable_poller). A bound that
        passes is an OSError (EAGAIN)."""
        seconds = max(0.001, seconds)  # 0 would mean no limit
        tv = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.wait_s = seconds

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        self.link = None  # the process group goes with its last reference
        if self.seg is not None:
            self.seg.close()  # the segment's memory goes back once the peer unmaps it too
            self.seg = None


def cpu_quota(cpu_max: str | None = None, cfs_quota_us: str | None = None, cfs_period_us: str | None = None) -> float | None:
    """CPUs a cgroup's quota allows (a container's CPU limit): from cgroup v2's `cpu.max`
    ("200000 100000": 2.0; "max 100000": None) or v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`
    (-1: None)."""
    if cpu_max is not None:
        quota, _, period = cpu_max.strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    if cfs_quota_us is not None and int(cfs_quota_us) > 0:
        return int(cfs_quota_us) / int(cfs_period_us or 100000)
    return None


def available_cpus() -> int:
    """CPUs this process may run on at once: its affinity, capped by its cgroup's CPU quota."""
    n = len(os.sched_getaffinity(0))
    sources = [("/sys/fs/cgroup/cpu.max",), ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")]
    for files in sources:
        try:
            texts = [open(f).read() for f in files]
            quota = cpu_quota(*texts) if len(texts) == 1 else cpu_quota(None, *texts)
        except (OSError, ValueError):
            continue
        if quota is not None:
            n = min(n, max(1, int(quota)))
        break
    return n


def _spin_until_readable(conn: _Conn, until: float) -> bool:
    """Poll without sleeping until the connection is readable (True) or `until` (monotonic)
    passes (False)."""
    poll = conn.poller.poll
    while True:
        try:
            if poll(0):
                return True
        except OSError:
            return True  # the receive finds out what is wrong
        if time.monotonic() >= until:
            return False
        os.sched_yield()


class _Peer:
    """Open connections to one replica, and how it has been doing."""

    def __init__(self, member: Member):
        self.member = member
        self.idle: list[_Conn] = []
        self.in_flight = 0
        self.sent = 0
        self.down_until = 0.0
        self.retired = False
        self.via = ""  # "shm", "unix" or "tcp": how the last connection was made
        self.no_shm = False  # it refused a segment offer outright: offer it none

    def close_idle(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()


class ExpertChannel:
    def __init__(self, source: MembershipSource | None = None, timeout_s: float = 60.0, connect_timeout_s: float = 2.0,
                 refresh_s: float = 1.0, down_s: float = 2.0, device_link: str | None = None,
                 link_host: str = "127.0.0.1", on_refused: Callable[[Member], None] | None = None,
                 hedge_after_s: float = 0.25, hedge_factor: float = 4.0, node: str = "", local_sockets: bool = True,
                 spin_s: float = 0.0, spin_max_rows: int = SPIN_MAX_ROWS, cpus: int | None = None,
                 wake_latency_us: int | None = None, shared_memory: bool = False,
                 shm_area_bytes: int = shm.AREA_BYTES):
        """`device_link`: None (tensor bytes on the socket), or a backend ("nccl" for CUDA rows,
        "gloo") for a device link per connection, its store on `link_host` (this side's address).
        `on_refused(member)`: called from the membership thread for a replica whose port refused
        a connection (its process is gone), so the membership source can drop it before its
        reports age out; the channel leaves it once the source no longer lists it.
        `hedge_after_s`, `hedge_factor`: a group with two or more live replicas sends a part again
        to another one when no reply came within max(hedge_after_s, hedge_factor x the slowest
        recent exchange); `hedge_after_s` 0 turns hedging off. `node`: this side's Ray node id
        ("" when unknown); replicas reporting the same one share this node's CPUs, and are reached
        on their Unix socket when `local_sockets`. `spin_s`: how long to poll for the replies of
        an exchange of at most `spin_max_rows` rows before blocking (0: block at once), while the
        parts still awaited from this node's replicas are fewer than `cpus` (default: this
        process' CPUs, capped by its cgroup's quota). `wake_latency_us`: the CPU wake-up latency
        to ask the kernel for while exchanges run (`WakeLatency`; None: never ask).
        `shared_memory`: frames to a replica reached on its Unix socket travel through a segment
        of shared memory (shm.py) with areas of `shm_area_bytes` each way; where one cannot be
        made the connection stays on the socket, counted in stats["shm_fallbacks"]."""
        self.wake = WakeLatency(wake_latency_us)
        self.shared_memory = shared_memory
        self.shm_area_bytes = shm_area_bytes
        self.shm_error = ""  # why the last segment could not be used ("" when none failed)
        if shared_memory:
            shm.library()  # built (once per machine) now, not on a step's first exchange
        self.node = node
        self.local_sockets = local_sockets
        self.cpus = cpus or available_cpus()
        self.spin_s = spin_s
        self.spin_max_rows = spin_max_rows
        self.on_refused = on_refused
        self.hedge_after_s = hedge_after_s
        self.hedge_factor = hedge_factor
        self._recent_max_s = 0.0  # the slowest recent exchange, decaying by 1% an exchange
        self._group_sizes: dict[str, int] = {}  # group -> replicas on the channel
        self._refused: dict[str, Member] = {}
        self.timeout_s = timeout_s
        self.device_link = device_link
        self.link_host = link_host
        self.connect_timeout_s = connect_timeout_s
        self.down_s = down_s
        self.token = ""
        self._source = source
        self._peers: dict[str, _Peer] = {}  # replica id -> peer
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._changed = threading.Condition(self._lock)
        self._nudge = threading.Event()
        self._stop = threading.Event()
        self.stats = {"exchanges": 0, "retries": 0, "unavailable": 0, "failed": 0, "membership_errors": 0,
                      "hedged": 0, "exchange_s": 0.0, "shm_connections": 0, "shm_fallbacks": 0}
        self.last_membership_error = ""
        if source is not None:
            self._refresh_s = refresh_s
            threading.Thread(target=self._poll, name="expert-channel-membership", daemon=True).start()

    # -- membership ---------------------------------------------------------------------------

    def update(self, members: list[Member], token: str) -> None:
        """Replace the membership: new replicas join; gone ones leave once their calls end."""
        with self._lock:
            self.token = token
            wanted = {m.replica: m for m in members}
            for rid, peer in list(self._peers.items()):
                m = wanted.get(rid)
                if m is None or m.endpoint != peer.member.endpoint:
                    peer.retired = True
                    peer.close_idle()
                    del self._peers[rid]
                elif m != peer.member:
                    peer.member = m  # hosted experts changed (reconfigure)
            for rid, m in wanted.items():
                if rid not in self._peers:
                    self._peers[rid] = _Peer(m)
            sizes: dict[str, int] = {}
            for p in self._peers.values():
                sizes[p.member.group] = sizes.get(p.member.group, 0) + 1
            self._group_sizes = sizes
            self._changed.notify_all()

    def use_local_sockets(self, on: bool, shared_memory: bool | None = None) -> None:
        """Reach this node's replicas on their Unix sockets (True) or over TCP from now on, and
        through shared memory over the Unix socket or not (None: as before); idle connections
        close, so the next exchanges connect the new way."""
        with self._lock:
            self.local_sockets = on
            if shared_memory is not None:
                self.shared_memory = shared_memory
            for p in self._peers.values():
                p.close_idle()

    def members(self) -> dict[str, list[dict]]:
        """group -> its replicas on the channel (for status)."""
        now = time.monotonic()
        with self._lock:
            out: dict[str, list[dict]] = {}
            for p in sorted(self._peers.values(), key=lambda p: (p.member.group, p.member.replica)):
                out.setdefault(p.member.group, []).append({
                    "replica": p.member.replica, "endpoint": p.member.endpoint, "in_flight": p.in_flight,
                    "sent": p.sent, "connections": len(p.idle) + p.in_flight, "down": p.down_until > now,
                    "via": p.via})
            return out

    def _poll(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                refused, self._refused = list(self._refused.values()), {}
            for member in refused:
                try:
                    self.on_refused(member)  # type: ignore[misc] - recorded only when set
                except Exception:  # noqa: BLE001 - only a shortcut: the source ages the replica out anyway
                    pass
            try:
                members, token = self._source()  # type: ignore[misc]
                self.update(members, token)
            except Exception as err:  # noqa: BLE001 - the board may restart; keep the last membership
                self.stats["membership_errors"] += 1
                self.last_membership_error = f"{type(err).__name__}: {err}"
            self._nudge.wait(self._refresh_s)
            self._nudge.clear()

    def close(self) -> None:
        self._stop.set()
        self._nudge.set()
        self.wake.close()
        with self._lock:
            for p in self._peers.values():
                p.retired = True
                p.close_idle()
            self._peers.clear()

    # -- the exchange -------------------------------------------------------------------------

    def exchange(self, layer: int, parts: dict[str, Part]) -> dict[str, torch.Tensor]:
        """Each group's outputs for its part (rows in the order sent)."""
        t0 = time.perf_counter()
        self.wake.touch()
        try:
            return self._exchange(layer, parts, time.monotonic() + self.timeout_s)
        finally:
            took = time.perf_counter() - t0
            self.stats["exchange_s"] += took
            self._recent_max_s = max(took, self._recent_max_s * 0.99)

    def hedge_delay_s(self) -> float:
        """How long a reply may take before its part goes to another replica of the group."""
        return max(self.hedge_after_s, self.hedge_factor * self._recent_max_s)

    def _exchange(self, layer: int, parts: dict[str, Part], deadline: float) -> dict[str, torch.Tensor]:
        pending = dict(parts)
        results: dict[str, torch.Tensor] = {}
        failed: dict[str, set[str]] = {g: set() for g in parts}  # replicas that answered with an error
        errors: dict[str, str] = {}
        self.stats["exchanges"] += 1
        passes = 0
        while pending:
            self.stats["retries"] += passes > 0
            passes += 1
            sent = []
            for group, part in pending.items():
                got = self._checkout(layer, group, part, failed[group])
                if got is None:
                    continue
                peer, conn = got
                seq = next(self._seq)
                try:
                    self._send(conn, seq, layer, part)
                except (OSError, RuntimeError):
                    self._checkin(peer, conn, ok=False)
                    continue
                sent.append((group, peer, conn, seq))
            hedge_at = time.monotonic() + self.hedge_delay_s() if self.hedge_after_s > 0 else 0.0
            spin_until = 0.0
            if self.spin_s > 0 and sum(pending[g].x.shape[0] for g, *_ in sent) <= self.spin_max_rows:
                spin_until = time.monotonic() + self.spin_s
                here = [bool(self.node) and peer.member.node == self.node for _, peer, *_ in sent]
            for i, (group, peer, conn, seq) in enumerate(sent):
                if spin_until and sum(here[i:]) < self.cpus:  # the parts still awaited here leave a CPU
                    conn.ready(spin_until, spin=True)
                if hedge_at and self._group_sizes.get(group, 0) > 1 and not conn.ready(hedge_at):
                    peer, conn, seq = self._hedge(layer, group, pending[group], peer, conn, seq, failed[group],
                                                  deadline)
                outcome = self._receive(conn, seq, deadline)
                if isinstance(outcome, torch.Tensor):
                    self._checkin(peer, conn, ok=True)
                    results[group] = outcome
                    pending.pop(group)
                elif outcome is None:  # connection trouble, timeout or draining: set the replica aside
                    self._checkin(peer, conn, ok=False)
                else:  # the replica computed and failed: try another one of the group
                    self._checkin(peer, conn, ok=True)
                    failed[group].add(peer.member.replica)
                    errors[group] = f"{group} replica {peer.member.replica}: {outcome}"
            if not pending:
                break
            hopeless = [g for g in pending if g in errors and not self._candidates(g, failed[g], only_live=False)]
            if hopeless:
                self.stats["failed"] += 1
                raise ExchangeFailed("; ".join(errors[g] for g in hopeless))
            if time.monotonic() >= deadline:
                self.stats["unavailable"] += 1
                raise ExpertsUnavailable(f"layer {layer}: no replica of {', '.join(sorted(pending))} answered within "
                                         f"{self.timeout_s:g} s")
            if not sent:
                self._wait_for_members(min(deadline, time.monotonic() + 0.1))
        return results

    def _hedge(self, layer: int, group: str, part: Part, peer: _Peer, conn: _Conn, seq: int, exclude: set[str],
               deadline: float) -> tuple[_Peer, _Conn, int]:
        """No reply from `peer` within the hedge delay: send the part to another live replica of
        the group too and wait for whichever answers first; the other one's reply is read and
        dropped in the background. Returns the connection to receive from."""
        got = self._checkout(layer, group, part, exclude | {peer.member.replica})
        if got is None:  # nobody else to ask: wait for this one
            return peer, conn, seq
        peer2, conn2 = got
        seq2 = next(self._seq)
        try:
            self._send(conn2, seq2, layer, part)
        except (OSError, RuntimeError):
            self._checkin(peer2, conn2, ok=False)
            return peer, conn, seq
        self.stats["hedged"] += 1
        with self._lock:
            peer.down_until = max(peer.down_until, deadline)  # no new work until its late reply arrives
        if conn.in_area or conn2.in_area:  # a reply in shared memory: no fd says it came; ask each in turn,
            # sleeping on the new replica's (the likelier first), the straggler's asked without waiting
            while not conn2.ready(min(deadline, time.monotonic() + 0.002)) and not conn.ready(time.monotonic()) \
                    and time.monotonic() < deadline:
                pass
            first_ready = (conn.arrived or conn.peer_closed) if conn.in_area else conn.ready(time.monotonic())
            ready_two = (conn2.arrived or conn2.peer_closed) if conn2.in_area else conn2.ready(time.monotonic())
        else:
            poller = select.poll()
            poller.register(conn.sock, select.POLLIN)
            poller.register(conn2.sock, select.POLLIN)
            try:
                ready = {fd for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000.0)}
            except OSError:
                ready = set()
            first_ready, ready_two = conn.sock.fileno() in ready, conn2.sock.fileno() in ready
        if first_ready and not ready_two:
            first, late = (peer, conn, seq), (peer2, conn2, seq2)
            with self._lock:
                peer.down_until = 0.0  # it answered after all
        else:
            first, late = (peer2, conn2, seq2), (peer, conn, seq)
        threading.Thread(target=self._reap, args=(*late, deadline), name="expert-channel-straggler",
                         daemon=True).start()
        return first

    def _reap(self, peer: _Peer, conn: _Conn, seq: int, deadline: float) -> None:
        """Read and drop a hedged exchange's losing reply; a replica that answers is live again."""
        ok = isinstance(self._receive(conn, seq, deadline), torch.Tensor)
        if ok:
            with self._lock:
                peer.down_until = 0.0
        self._checkin(peer, conn, ok=ok)

    def _send(self, conn: _Conn, seq: int, layer: int, part: Part) -> None:
        conn.in_area = conn.arrived = conn.peer_closed = False
        if conn.seg is not None:
            frame = wire.encode_request(seq, layer, part.x.shape[0], part.x.shape[1], part.x.dtype, part.experts,
                                        part.counts, part.prefetch, top1=part.top1)
            rows = wire.as_bytes(part.x)
            end = len(frame) + len(rows)
            if end <= conn.seg.area and shm.REPLY_TENSOR_AT + len(rows) <= conn.seg.area:
                view = conn.seg.request_view
                view[:len(frame)] = frame
                view[len(frame):end] = rows
                conn.in_area = True
                conn.seg.request_box.post()
            else:  # too large for the segment: on the socket, once the mailbox said so (the replica
                conn.seg.request_box.post(shm.ON_SOCKET)  # reads as it arrives: a full socket waits for it)
                send_all(conn.sock, [frame, rows])
        elif conn.link is not None:
            conn.sock.sendall(wire.encode_request(seq, layer, part.x.shape[0], part.x.shape[1], part.x.dtype,
                                                  part.experts, part.counts, part.prefetch, wire.LINKED, part.top1))
            conn.link.send(part.x.to(conn.link.device))
        else:
            send_all(conn.sock, [wire.encode_request(seq, layer, part.x.shape[0], part.x.shape[1], part.x.dtype,
                                                     part.experts, part.counts, part.prefetch, top1=part.top1),
                                 wire.as_bytes(part.x)])

    def _candidates(self, group: str, exclude: set[str], only_live: bool = True) -> list[_Peer]:
        now = time.monotonic()
        return [p for p in self._peers.values() if p.member.group == group and p.member.replica not in exclude
                and (not only_live or p.down_until <= now)]

    def _checkout(self, layer: int, group: str, part: Part,
                  exclude: set[str]) -> tuple[_Peer, _Conn] | None:
        """A connection to the least busy live replica of the group (among those that report
        hosting the part's experts, when any does), or None when the group has no live replica."""
        while True:
            with self._lock:
                peers = self._candidates(group, exclude)
                if not peers:
                    return None
                if len(peers) > 1:
                    keys = {(layer, e) for e in part.experts}
                    peers = [p for p in peers if keys <= p.member.experts] or peers
                    peer = min(peers, key=lambda p: (p.in_flight, p.sent, p.member.replica))
                else:
                    peer = peers[0]
                peer.in_flight += 1
                peer.sent += 1
                conn = peer.idle.pop() if peer.idle else None
                token = self.token
            if conn is not None:
                return peer, conn
            try:
                return peer, self._connect(peer, token)
            except (OSError, ValueError, LinkError) as err:  # ValueError: a bad endpoint, a foreign peer
                with self._lock:
                    peer.in_flight -= 1
                    peer.down_until = time.monotonic() + self.down_s
                    if isinstance(err, ConnectionRefusedError) and self.on_refused is not None:
                        self._refused[peer.member.replica] = peer.member
                self._nudge.set()

    def _open(self, peer: _Peer) -> socket.socket:
        """A socket to the replica: its Unix socket when it is on this node, else (or when that
        fails) TCP. A replica whose TCP port refuses raises ConnectionRefusedError (it is gone)."""
        member = peer.member
        if self.local_sockets and self.node and member.node == self.node and member.local_endpoint:
            try:
                family, address = wire.parse_endpoint(member.local_endpoint)
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.connect_timeout_s)
                    sock.connect(address)
                except BaseException:
                    sock.close()
                    raise
                peer.via = "unix"
                return sock
            except (OSError, ValueError):
                pass  # another network namespace after all, or the socket is gone: TCP tells
        family, address = wire.parse_endpoint(member.endpoint)
        sock = socket.create_connection(address, timeout=self.connect_timeout_s)
        peer.via = "tcp"
        return sock

    def _connect(self, peer: _Peer, token: str) -> _Conn:
        member = peer.member
        sock = self._open(peer)
        seg = None
        try:
            tune(sock)
            link = None
            if self.device_link:
                store, port = PairLink.host_store(self.link_host, self.timeout_s)
                sock.sendall(wire.encode_hello(token, LinkOffer(self.device_link, self.link_host, port).as_dict()))
                link = PairLink(self.device_link, 0, store, self.timeout_s)  # meets the replica's rank 1
            elif self.shared_memory and sock.family == socket.AF_UNIX and not peer.no_shm:
                try:
                    seg, fd = shm.Segment.create(self.shm_area_bytes)
                except shm.ShmUnavailable as err:
                    self._shm_fallback(str(err))
                    sock.sendall(wire.encode_hello(token))
                else:
                    try:
                        shm.send_hello(sock, wire.encode_hello(token, {shm.OFFER: seg.size}), fd)
                    finally:
                        os.close(fd)  # the mapping holds the memory; the replica got its own fd
            else:
                sock.sendall(wire.encode_hello(token))
            status, n = wire.decode_ack_header(recv_bytes(sock, wire.ACK_HEADER.size))
            message = recv_bytes(sock, n).decode(errors="replace")
            if status == wire.ERROR and seg is not None:  # a replica that does not know the offer (an
                peer.no_shm = True  # older version, mid-upgrade): the next connection offers none
                self._shm_fallback(f"replica {member.replica}: {message}")
            if status != wire.OK:
                raise wire.ProtocolError(f"{member.endpoint} refused the channel: {message}")
            if seg is not None and message != shm.ACCEPTED:
                self._shm_fallback(f"replica {member.replica}: {message or 'did not take the segment'}")
                seg.close()
                seg = None
            sock.settimeout(None)
            conn = _Conn(sock, link, seg)
            conn.set_wait(self.timeout_s)
            if seg is not None:
                peer.via = "shm"
                self.stats["shm_connections"] += 1
            return conn
        except BaseException:
            sock.close()
            if seg is not None:
                seg.close()
            raise

    def _shm_fallback(self, why: str) -> None:
        """A connection that could have used shared memory stays on its socket: counted, and
        logged once per reason."""
        self.stats["shm_fallbacks"] += 1
        if why != self.shm_error:
            log.warning("expert channel: shared memory not used, the Unix socket carries the frames: %s", why)
        self.shm_error = why

    def _checkin(self, peer: _Peer, conn: _Conn, ok: bool) -> None:
        with self._lock:
            peer.in_flight -= 1
            if ok and not peer.retired:
                peer.idle.append(conn)
                return
            if not ok:
                peer.down_until = time.monotonic() + self.down_s
        conn.close()
        if not ok:
            self._nudge.set()  # membership may know better (a replacement replica)

    def _receive(self, conn: "_Conn", seq: int, deadline: float) -> torch.Tensor | str | None:
        """The outputs; or the replica's error message (str); or None for connection trouble,
        a timeout (the exchange's deadline) or a draining replica. A small reply is one recv into
        the connection's buffer; a large one goes straight into the output tensor."""
        sock, view, head = conn.sock, conn.view, wire.REPLY_HEADER.size
        if conn.in_area:
            return self._receive_shared(conn, seq, deadline)
        try:
            left = deadline - time.monotonic()
            if abs(conn.wait_s - left) > min(0.05, self.timeout_s / 10):  # a retry pass, or a long step
                conn.set_wait(left)
            if not conn.poller.poll(max(0.0, left) * 1000.0):  # woken by the reply only (readable_poller)
                return None
            got = _recv_at_least(sock, view, 0, head)
            reply, n = wire.decode_reply_header(view)
            if reply.seq != seq:
                raise wire.ProtocolError(f"reply {reply.seq} to request {seq}")
            if reply.status != wire.OK:
                got = _recv_at_least(sock, view, got, head + n)
                message = bytes(view[head:head + n]).decode(errors="replace")
                return (message or "error") if reply.status == wire.ERROR else None
            if reply.flags & wire.LINKED:
                if conn.link is None:
                    raise wire.ProtocolError("a linked reply on a connection without a device link")
                out = torch.empty(reply.rows, reply.hidden, dtype=reply.dtype, device=conn.link.device)
                conn.link.recv_into(out)
                return out
            out, raw = wire.empty_rows(reply.rows, reply.hidden, reply.dtype)
            total = head + len(raw)
            if total <= len(view):
                _recv_at_least(sock, view, got, total)
                raw[:] = view[head:total]
            else:
                raw[:got - head] = view[head:got]
                recv_exact(sock, raw[got - head:])
            return out
        except (OSError, ConnectionError, wire.ProtocolError, RuntimeError):  # RuntimeError: the link broke
            return None

    @staticmethod
    def _receive_shared(conn: _Conn, seq: int, deadline: float) -> torch.Tensor | str | None:
        """`_receive` for a request sent through the segment: its reply is in the reply area."""
        if not conn.ready(deadline) or conn.peer_closed:
            return None
        conn.in_area = conn.arrived = False
        area = conn.seg.reply_view  # type: ignore[union-attr]
        try:
            reply, n = wire.decode_reply_header(area[shm.REPLY_AT:])
            if reply.seq != seq:
                raise wire.ProtocolError(f"reply {reply.seq} to request {seq}")
            if reply.status != wire.OK:
                message = bytes(area[shm.REPLY_TENSOR_AT:shm.REPLY_TENSOR_AT + n]).decode(errors="replace")
                return (message or "error") if reply.status == wire.ERROR else None
            if shm.REPLY_TENSOR_AT + reply.rows * reply.hidden * reply.dtype.itemsize > len(area):
                raise wire.ProtocolError("reply larger than the segment")
            out, raw = wire.empty_rows(reply.rows, reply.hidden, reply.dtype)
            raw[:] = area[shm.REPLY_TENSOR_AT:shm.REPLY_TENSOR_AT + len(raw)]
            return out
        except wire.ProtocolError:
            conn.peer_closed = True  # not ours: the connection is dropped
            return None

    def _wait_for_members(self, until: float) -> None:
        self._nudge.set()
        with self._lock:
            self._changed.wait(max(0.0, until - time.monotonic()))
