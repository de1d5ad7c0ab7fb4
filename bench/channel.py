"""The bare expert channel against a raw socket round trip, same machine, same payloads.

    python bench/channel.py            # batch 1 and 64 x hidden 1024 fp32, to 2 and 4 peers
    python bench/channel.py --quick
    python bench/channel.py --netns    # and across nodes: the peers in their own network
                                       # namespace behind a veth pair, as a Pod on the node's
                                       # bridge is (needs root and `ip`)

--netns adds, per batch and peer count, the channel over TCP to peers in another network
namespace (their ExchangeServers bound to that namespace's address only, token checked, as in a
Pod) against the raw TCP round trip between the same namespaces. Figures:
`cross-node-dispatch-ms-per-layer-batch{1,64}` (one exchange a layer to 2 peers) and
`cross-node-over-raw-tcp-batch{1,64}`.

Peers are separate processes. Ours: `ExpertChannel.exchange` to `ExchangeServer`s whose compute
copies the rows back (transport only: framing, routing to replicas, tensors in and out), over TCP
with blocking reads, and as the app sets it up with its peers on one node ("as app": their Unix
sockets, and the poll for a small exchange's replies), and as the app now runs it ("shm": the
frames through a shared-memory segment set up over the Unix socket), also with the peers polling
for their next request (`--shard-spin-us`, AppArgs.shard_spin_us: peers with CPUs to spare). The
references: the same
bytes with an 8-byte length prefix, echoed by a minimal server over a plain TCP socket (the floor
for a Python process on this machine); and for shm, the same bytes through raw shared-memory
mailboxes (copy in, post, the peer copies them to its reply area and posts; no framing, no
channel), waiting as the ingress does. All send to every peer first, then read every reply, as
one exchange per layer does. Figures: `channel-shm-ms-batch{1,64}-{2,4}-peers` and
`channel-shm-over-raw-shm-...` besides the socket ones. Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from figures import report  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--peers", default="2,4")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--shard-spin-us", type=int, default=1000,
                   help="the 'peers poll' column: how long the peers poll for the next request (AppArgs.shard_spin_us)")
    p.add_argument("--netns", action="store_true", help="also across a veth pair into another network namespace")
    p.add_argument("--serve", choices=["raw", "channel"], help=argparse.SUPPRESS)  # a peer (inside the namespace)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "channel.json"))
    return p.parse_args()


def _raw_server(ready, port_out, host="127.0.0.1"):
    s = socket.create_server((host, 0))
    port_out.value = s.getsockname()[1]
    ready.set()
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    while True:
        h = c.recv(8, socket.MSG_WAITALL)
        if len(h) < 8:
            return
        n, = struct.unpack("<Q", h)
        got = 0
        while got < n:
            got += c.recv_into(mv[got:n], n - got)
        c.sendmsg([h, mv[:n]])


def _channel_server(ready, port_out, name_out, host="127.0.0.1", spin_us=0):
    import torch

    torch.set_num_threads(1)
    from moe_workers.transport import ExchangeServer

    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        out.copy_(x)

    server = ExchangeServer(compute, lambda: ["bench"], host=host, shm_spin_s=spin_us / 1e6)
    port_out.value = server.port
    name_out.value = (server.local_endpoint or "").encode()
    ready.set()
    while True:
        time.sleep(3600)


def _start(target, n, named: bool = False, extra: tuple = ()):
    """n peer processes: (processes, their TCP ports[, their Unix socket endpoints when `named`])."""
    ctx = mp.get_context("spawn")
    procs, ports, names = [], [], []
    for _ in range(n):
        ready, port, name = ctx.Event(), ctx.Value("i", 0), ctx.Array("c", 128)
        p = ctx.Process(target=target, args=(ready, port, *([name] if named else []), *extra), daemon=True)
        p.start()
        ready.wait(60)
        procs.append(p)
        ports.append(port.value)
        names.append(name.value.decode())
    return (procs, ports, names) if named else (procs, ports)


class _Value:  # what a peer in another namespace reports, as mp.Value / mp.Array would hold it
    def __init__(self, value=None):
        self.value = value


def _serve_here(kind: str, host: str) -> None:
    """A peer started inside the namespace: say its port, then serve until killed."""
    port, name = _Value(0), _Value(b"")

    class Ready:
        def set(self):
            print(f"PORT {port.value}", flush=True)

    if kind == "raw":
        _raw_server(Ready(), port, host)
    else:
        _channel_server(Ready(), port, name, host)


class Namespace:
    """A network namespace joined to this one by a veth pair: this side .1, the other .2 of a /30
    (as a Pod's interface on the node's bridge). Peers run inside it through `ip netns exec`."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.name, self.here, self.there = f"moe-bench-{tag}", f"mbv{tag}a", f"mbv{tag}b"
        octet = os.getpid() % 250 + 1
        self.local, self.remote = f"10.231.{octet}.1", f"10.231.{octet}.2"

    def __enter__(self):
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "link", "add", self.here, "type", "veth", "peer", "name", self.there],
                    ["ip", "link", "set", self.there, "netns", self.name],
                    ["ip", "addr", "add", f"{self.local}/30", "dev", self.here],
                    ["ip", "link", "set", self.here, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.remote}/30", "dev", self.there],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", self.there, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "link", "del", self.here], capture_output=True)  # takes its peer along
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def start(self, kind: str, n: int) -> tuple[list[subprocess.Popen], list[int]]:
        procs, ports = [], []
        for _ in range(n):
            p = subprocess.Popen(["ip", "netns", "exec", self.name, sys.executable, __file__, "--serve", kind,
                                  "--host", self.remote], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO / "workers")})
            line = p.stdout.readline()
            if not line.startswith("PORT "):
                p.kill()
                raise RuntimeError(f"a {kind} peer in {self.name} did not start")
            procs.append(p)
            ports.append(int(line.split()[1]))
        return procs, ports


def _shm_echo(ready, fd_out, nbytes):
    """The floor of a shared-memory exchange: a peer that waits on its mailbox (polling as the
    ingress does, then a futex), copies the request area's bytes to the reply area, and posts."""
    from moe_workers.transport import shm

    seg = shm.Segment.attach(fd_out)
    ready.set()
    req, rep_ = seg.request_view, seg.reply_view
    while True:
        if seg.request_box.wait(0.0005, 1.0) is None:
            continue
        rep_[:nbytes] = req[:nbytes]
        seg.reply_box.post()


def raw_shm_round_trip(peers: int, nbytes: int, iters: int, spin_s: float) -> float:
    """The same bytes to `peers` processes through raw shared-memory mailboxes (no framing, no
    channel): post to every peer, then wait for every reply, as one exchange per layer does."""
    from moe_workers.transport import shm

    ctx = mp.get_context("fork")  # the segment's fd is inherited
    segs, procs = [], []
    try:
        for _ in range(peers):
            seg, fd = shm.Segment.create(max(nbytes, shm.MIN_AREA))
            ready = ctx.Event()
            p = ctx.Process(target=_shm_echo, args=(ready, fd, nbytes), daemon=True)
            p.start()
            os.close(fd)
            ready.wait(60)
            segs.append(seg)
            procs.append(p)
        payload = bytes(nbytes)

        def once():
            for seg in segs:
                seg.request_view[:nbytes] = payload
                seg.request_box.post()
            for seg in segs:
                while seg.reply_box.wait(spin_s, 1.0) is None:
                    pass
                bytes(seg.reply_view[:nbytes])

        return _time(once, iters)
    finally:
        for p in procs:
            p.kill()


def _time(fn, iters: int) -> float:
    for _ in range(max(10, iters // 20)):
        fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters // 5):
            fn()
        samples.append((time.perf_counter() - t0) / (iters // 5))
    return statistics.median(samples)


def raw_round_trip(peers: int, nbytes: int, iters: int, ns: Namespace | None = None) -> float:
    procs, ports = _start(_raw_server, peers) if ns is None else ns.start("raw", peers)
    host = "127.0.0.1" if ns is None else ns.remote
    try:
        conns = []
        for port in ports:
            c = socket.create_connection((host, port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns.append(c)
        payload = bytes(nbytes)
        head = struct.pack("<Q", nbytes)
        buf = bytearray(nbytes + 8)
        mv = memoryview(buf)

        def once():
            for c in conns:
                c.sendmsg([head, payload])
            for c in conns:
                got = 0
                while got < nbytes + 8:
                    got += c.recv_into(mv[got:], nbytes + 8 - got)

        return _time(once, iters)
    finally:
        for p in procs:
            p.kill()


def channel_round_trip(peers: int, rows: int, hidden: int, iters: int, as_app: bool = False,
                       ns: Namespace | None = None, shared_memory: bool = False, shard_spin_us: int = 0) -> float:
    """as_app: the channel as the app sets it up with its peers on one node (their Unix sockets,
    the default poll for a small exchange's replies), with the frames on the socket, or through
    shared memory (`shared_memory`, the app's default); else TCP, blocking reads. `ns`: the peers
    in that namespace (another node: TCP across the veth, with the app's poll). `shard_spin_us`: the
    peers poll a shared-memory connection this long for the next request (AppArgs.shard_spin_us)."""
    import torch

    from moe_workers.serve.config import EXCHANGE_SPIN_US
    from moe_workers.transport import ExpertChannel, Member, Part

    if ns is None:
        procs, ports, names = _start(_channel_server, peers, named=True, extra=("127.0.0.1", shard_spin_us))
        host, node = "127.0.0.1", "bench"
    else:
        (procs, ports), names, host, node = ns.start("channel", peers), [""] * peers, ns.remote, "other"
    try:
        if as_app or ns is not None:
            ch = ExpertChannel(node="bench", spin_s=EXCHANGE_SPIN_US / 1e6, shared_memory=shared_memory)
        else:
            ch = ExpertChannel()
        ch.update([Member(f"g{i}", f"r{i}", f"{host}:{port}", local_endpoint=name, node=node)
                   for i, (port, name) in enumerate(zip(ports, names))], "bench")
        x = torch.randn(rows, hidden)
        parts = {f"g{i}": Part([i], [rows], x) for i in range(peers)}
        out = ch.exchange(0, parts)
        assert all(torch.equal(v, x) for v in out.values())
        if shared_memory:
            assert ch.stats["shm_connections"] == peers, (ch.stats, ch.shm_error)
        t = _time(lambda: ch.exchange(0, parts), iters)
        ch.close()
        return t
    finally:
        for p in procs:
            p.kill()


def main() -> int:
    a = parse_args()
    if a.serve:
        _serve_here(a.serve, a.host)
        return 0
    batches = [int(b) for b in a.batches.split(",")]
    peer_counts = [int(p) for p in a.peers.split(",")]
    iters = 200 if a.quick else a.iters
    rows_out, figures = [], {}
    from moe_workers.serve.config import EXCHANGE_SPIN_US

    print(f"{'batch':>5} {'peers':>5} {'payload':>9} {'raw socket ms':>14} {'channel ms':>11} {'ratio':>6} "
          f"{'as app ms':>10} {'ratio':>6} {'raw shm ms':>11} {'shm ms':>7} {'ratio':>6} {'shm, peers poll':>16} {'ratio':>6}")
    for b in batches:
        for n in peer_counts:
            nbytes = b * a.hidden * 4
            raw = raw_round_trip(n, nbytes, iters)
            ours = channel_round_trip(n, b, a.hidden, iters)
            app = channel_round_trip(n, b, a.hidden, iters, as_app=True)
            raw_shm = raw_shm_round_trip(n, nbytes, iters, EXCHANGE_SPIN_US / 1e6)
            shared = channel_round_trip(n, b, a.hidden, iters, as_app=True, shared_memory=True)
            polled = channel_round_trip(n, b, a.hidden, iters, as_app=True, shared_memory=True,
                                        shard_spin_us=a.shard_spin_us)
            rows_out.append({"batch": b, "peers": n, "bytes": nbytes, "raw_ms": raw * 1e3, "channel_ms": ours * 1e3,
                             "channel_as_app_ms": app * 1e3, "raw_shm_ms": raw_shm * 1e3,
                             "channel_shm_ms": shared * 1e3, "channel_shm_peers_poll_ms": polled * 1e3})
            print(f"{b:5} {n:5} {nbytes / 1024:7.0f} K {raw * 1e3:14.3f} {ours * 1e3:11.3f} {ours / raw:6.2f} "
                  f"{app * 1e3:10.3f} {app / raw:6.2f} {raw_shm * 1e3:11.3f} {shared * 1e3:7.3f} "
                  f"{shared / raw_shm:6.2f} {polled * 1e3:16.3f} {polled / raw_shm:6.2f}")
            figures[f"channel-shm-ms-batch{b}-{n}-peers"] = shared * 1e3
            figures[f"raw-shm-ms-batch{b}-{n}-peers"] = raw_shm * 1e3
            figures[f"channel-shm-over-raw-shm-batch{b}-{n}-peers"] = shared / raw_shm
            figures[f"channel-shm-peers-poll-ms-batch{b}-{n}-peers"] = polled * 1e3
            figures[f"channel-shm-peers-poll-over-raw-shm-batch{b}-{n}-peers"] = polled / raw_shm
            figures[f"channel-ms-batch{b}-{n}-peers"] = ours * 1e3
            figures[f"channel-over-raw-batch{b}-{n}-peers"] = ours / raw
            figures[f"channel-as-app-over-raw-batch{b}-{n}-peers"] = app / raw
    cross = []
    if a.netns:
        print("\nacross a veth pair into another network namespace (TCP; the same node over Unix sockets beside it)")
        print(f"{'batch':>5} {'peers':>5} {'raw TCP ms':>11} {'channel ms':>11} {'ratio':>6} {'same node ms':>13}")
        with Namespace() as ns:
            for b in batches:
                for n in peer_counts:
                    nbytes = b * a.hidden * 4
                    raw = raw_round_trip(n, nbytes, iters, ns)
                    ours = channel_round_trip(n, b, a.hidden, iters, ns=ns)
                    local = next(r["channel_as_app_ms"] for r in rows_out if r["batch"] == b and r["peers"] == n)
                    cross.append({"batch": b, "peers": n, "bytes": nbytes, "raw_tcp_ms": raw * 1e3,
                                  "channel_ms": ours * 1e3, "same_node_ms": local})
                    print(f"{b:5} {n:5} {raw * 1e3:11.3f} {ours * 1e3:11.3f} {ours / raw:6.2f} {local:13.3f}")
                    if n == min(peer_counts):
                        figures[f"cross-node-dispatch-ms-per-layer-batch{b}"] = ours * 1e3
                        figures[f"cross-node-over-raw-tcp-batch{b}"] = ours / raw
    return report(a.out, {"hidden": a.hidden, "rows": rows_out, "cross_node": cross}, figures)


if __name__ == "__main__":
    sys.exit(main())
