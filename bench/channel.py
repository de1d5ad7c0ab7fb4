"""The bare expert channel against a raw socket round trip, same machine, same payloads.

    python bench/channel.py            # batch 1 and 64 x hidden 1024 fp32, to 2 and 4 peers
    python bench/channel.py --quick

Peers are separate processes. Ours: `ExpertChannel.exchange` to `ExchangeServer`s whose compute
copies the rows back (transport only: framing, routing to replicas, tensors in and out), over TCP
with blocking reads, and as the app sets it up with its peers on one node ("as app": their Unix
sockets, and the poll for a small exchange's replies). The
reference: the same bytes with an 8-byte length prefix, echoed by a minimal server over a plain
TCP socket (the floor for a Python process on this machine). Both send to every peer first,
then read every reply, as one exchange per layer does. Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
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
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "channel.json"))
    return p.parse_args()


def _raw_server(ready, port_out):
    s = socket.create_server(("127.0.0.1", 0))
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


def _channel_server(ready, port_out, name_out):
    import torch

    torch.set_num_threads(1)
    from moe_workers.transport import ExchangeServer

    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        out.copy_(x)

    server = ExchangeServer(compute, lambda: ["bench"])
    port_out.value = server.port
    name_out.value = server.local_endpoint.encode()
    ready.set()
    while True:
        time.sleep(3600)


def _start(target, n, named: bool = False):
    """n peer processes: (processes, their TCP ports[, their Unix socket endpoints when `named`])."""
    ctx = mp.get_context("spawn")
    procs, ports, names = [], [], []
    for _ in range(n):
        ready, port, name = ctx.Event(), ctx.Value("i", 0), ctx.Array("c", 128)
        p = ctx.Process(target=target, args=(ready, port, *([name] if named else [])), daemon=True)
        p.start()
        ready.wait(60)
        procs.append(p)
        ports.append(port.value)
        names.append(name.value.decode())
    return (procs, ports, names) if named else (procs, ports)


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


def raw_round_trip(peers: int, nbytes: int, iters: int) -> float:
    procs, ports = _start(_raw_server, peers)
    try:
        conns = []
        for port in ports:
            c = socket.create_connection(("127.0.0.1", port))
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


def channel_round_trip(peers: int, rows: int, hidden: int, iters: int, as_app: bool = False) -> float:
    """as_app: the channel as the app sets it up with its peers on one node (their Unix sockets,
    the default poll for a small exchange's replies); else TCP, blocking reads."""
    import torch

    from moe_workers.serve.config import EXCHANGE_SPIN_US
    from moe_workers.transport import ExpertChannel, Member, Part

    procs, ports, names = _start(_channel_server, peers, named=True)
    try:
        if as_app:
            ch = ExpertChannel(node="bench", spin_s=EXCHANGE_SPIN_US / 1e6)
        else:
            ch = ExpertChannel()
        ch.update([Member(f"g{i}", f"r{i}", f"127.0.0.1:{port}", local_endpoint=name, node="bench")
                   for i, (port, name) in enumerate(zip(ports, names))], "bench")
        x = torch.randn(rows, hidden)
        parts = {f"g{i}": Part([i], [rows], x) for i in range(peers)}
        out = ch.exchange(0, parts)
        assert all(torch.equal(v, x) for v in out.values())
        t = _time(lambda: ch.exchange(0, parts), iters)
        ch.close()
        return t
    finally:
        for p in procs:
            p.kill()


def main() -> int:
    a = parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    peer_counts = [int(p) for p in a.peers.split(",")]
    iters = 200 if a.quick else a.iters
    rows_out, figures = [], {}
    print(f"{'batch':>5} {'peers':>5} {'payload':>9} {'raw socket ms':>14} {'channel ms':>11} {'ratio':>6} "
          f"{'as app ms':>10} {'ratio':>6}")
    for b in batches:
        for n in peer_counts:
            nbytes = b * a.hidden * 4
            raw = raw_round_trip(n, nbytes, iters)
            ours = channel_round_trip(n, b, a.hidden, iters)
            app = channel_round_trip(n, b, a.hidden, iters, as_app=True)
            rows_out.append({"batch": b, "peers": n, "bytes": nbytes, "raw_ms": raw * 1e3, "channel_ms": ours * 1e3,
                             "channel_as_app_ms": app * 1e3})
            print(f"{b:5} {n:5} {nbytes / 1024:7.0f} K {raw * 1e3:14.3f} {ours * 1e3:11.3f} {ours / raw:6.2f} "
                  f"{app * 1e3:10.3f} {app / raw:6.2f}")
            figures[f"channel-ms-batch{b}-{n}-peers"] = ours * 1e3
            figures[f"channel-over-raw-batch{b}-{n}-peers"] = ours / raw
            figures[f"channel-as-app-over-raw-batch{b}-{n}-peers"] = app / raw
    return report(a.out, {"hidden": a.hidden, "rows": rows_out}, figures)


if __name__ == "__main__":
    sys.exit(main())
