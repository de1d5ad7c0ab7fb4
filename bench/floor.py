"""Batch-1 decode of a deep model split across processes with nothing else in the way: the floor
that the served decode of bench/serving.py (the depth sweep) is measured against.

    python bench/floor.py                  # 32 layers, the depth sweep's shape
    python bench/floor.py --layers 4,16,32 --rounds 7
    python bench/floor.py --keep-awake     # idle CPUs kept from halting, for all sides
    python bench/floor.py --wake-latency   # the served app's CPU wake-up latency request held, for all sides
    python bench/floor.py --beside-app     # the same, with the served bench app idle beside it

Three sides decode the same greedy tokens from the same checkpoint, alternating in rounds in one
window (this machine's speed drifts by 20-50% over minutes), with medians reported:
- in-process: `InProcessModel`, the reference of bench/serving.py;
- raw: the same model with each layer's experts in 2 plain child processes (half the experts
  each, as the served app's 2 groups), reached over TCP loopback with a 12-byte header and
  blocking reads: the least a process boundary costs here; raw-unix: the same over Unix sockets;
- channel: the same split through our `ExpertChannel` and `ExchangeServer` as the app sets them
  up on one node (Unix sockets, the default poll for replies), and the ingress'
  decode routing (`routes`): the transport without Ray Serve, its HTTP path or its engine.
served - channel is then what the served app adds on top (its replicas' code and processes),
channel - raw our protocol's share, net of the poll for replies (the raw sides block on their
reads). Dispatch per layer = (side - in-process) step time / layers, as in bench/serving.py.
With --beside-app, bench/serving.py's app (a local Ray head, its daemons, Serve and the app's
replicas) runs idle beside the sides, and every round measures them twice: with its processes
running and with all of them stopped (SIGSTOP, for the length of the measurement): what an idle
Ray cluster on the same CPUs costs a process boundary per layer. Ends with `figure: value` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))
sys.path.insert(0, str(REPO / "bench"))

from figures import report  # noqa: E402

HEADER = struct.Struct("<iii")  # layer, experts in the part, rows


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=33)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--family", default="mixtral")
    p.add_argument("--cache-dir", default="/tmp/moe-bench")
    p.add_argument("--keep-awake", action="store_true",
                   help="a SCHED_IDLE busy loop on every CPU for the whole run (all sides): what the machine's "
                        "idle-CPU wake-ups cost the split sides")
    p.add_argument("--wake-latency", action="store_true",
                   help="hold the CPU wake-up latency request the served app holds while it decodes "
                        "(cpu_wake_latency_us, /dev/cpu_dma_latency) for the whole run (all sides): the floor "
                        "under the app's default")
    p.add_argument("--beside-app", action="store_true",
                   help="bench/serving.py's app idle beside the sides; each round measured with its processes "
                        "running and stopped")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "floor.json"))
    return p.parse_args()


def group_experts(num_experts: int, groups: int) -> list[list[int]]:
    """Expert e in group e % groups, as bench/serving.py places them."""
    return [[e for e in range(num_experts) if e % groups == g] for g in range(groups)]


def _load(path: str, experts: list[int]):
    import torch

    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.experts import LocalExperts

    torch.set_num_threads(1)
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    return cfg, LocalExperts(ckpt, cfg.dtype, [(layer, e) for layer in cfg.sparse_layers for e in experts])


def _raw_shard(path: str, experts: list[int], ready, port_out, unix: str = "") -> None:
    """Listens on TCP loopback, or on the Unix socket `unix` when one is given."""
    import torch

    from moe_workers.model.experts import compute_rows

    cfg, local = _load(path, experts)
    if unix:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(unix)
        listener.listen(1)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        port_out.value = listener.getsockname()[1]
    ready.set()
    conn, _ = listener.accept()
    if not unix:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    row_bytes = cfg.hidden_size * torch.finfo(cfg.dtype).bits // 8
    with torch.inference_mode():
        while True:
            head = conn.recv(HEADER.size, socket.MSG_WAITALL)
            if len(head) < HEADER.size:
                return
            layer, n, rows = HEADER.unpack(head)
            body = conn.recv(8 * n + rows * row_bytes, socket.MSG_WAITALL)
            pairs = struct.unpack(f"<{2 * n}i", body[:8 * n])
            x = torch.frombuffer(bytearray(body[8 * n:]), dtype=cfg.dtype).view(rows, cfg.hidden_size)
            out = torch.empty_like(x)
            compute_rows(local.weights, [(layer, e) for e in pairs[::2]], list(pairs[1::2]), x, out, cfg)
            conn.sendall(out.numpy().tobytes())


def _channel_shard(path: str, experts: list[int], ready, port_out, local_out) -> None:
    from moe_workers.model.experts import compute_rows
    from moe_workers.transport import ExchangeServer

    cfg, local = _load(path, experts)

    def compute(layer, x, experts, counts, prefetch, out, top1=None):
        compute_rows(local.weights, [(layer, e) for e in experts], counts, x, out, cfg)

    server = ExchangeServer(compute, lambda: ["floor"], torch_threads=1)
    port_out.value = server.port
    local_out.value = server.local_endpoint.encode()
    ready.set()
    while True:
        time.sleep(3600)


def _spin(cpu: int) -> None:
    """Runs only when nothing else wants this CPU: it never halts, so a wake-up there is a
    preemption, not an idle CPU's wake (on a VM, the hypervisor's)."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def _hold_app(path: str, started, done) -> None:
    """bench/serving.py's app (2 groups) on its own local Ray head, idle until `done` is set."""
    from serving import served_app

    with served_app(Path(path), 2, 1, 1, 0, 8, 1, {}, 8):
        started.set()
        done.wait()


class AppBeside:
    """The served bench app, idle in a child process; `stopped()` stops every process of it
    (the child, its Ray head's daemons, Serve, the replicas) for the length of a block."""

    def __init__(self, path: Path):
        ctx = mp.get_context("spawn")
        self.started, self.done = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_hold_app, args=(str(path), self.started, self.done), daemon=False)
        self.proc.start()
        deadline = time.monotonic() + 900
        while not self.started.wait(1.0):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the app beside did not start (exit code {self.proc.exitcode})")
        time.sleep(10)  # its start-up settles (warm spares, first reports)

    def processes(self) -> list[int]:
        """The child and every process below it (its Ray head runs in a session of its own, but
        is still its descendant)."""
        import psutil

        return [self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children(recursive=True))]

    @contextlib.contextmanager
    def stopped(self):
        pids = self.processes()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.5)  # the stop reaches them all
            yield
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self.done.set()
        self.proc.join(300)
        if self.proc.is_alive():
            self.proc.kill()


def keep_awake() -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spin, args=(cpu,), daemon=True) for cpu in sorted(os.sched_getaffinity(0))]
    for p in procs:
        p.start()
    return procs


def _start(target, path: Path, blocks: list[list[int]], unix: list[str] | None = None, local: bool = False):
    """Each block's shard process: (processes, TCP ports[, their Unix socket endpoints when `local`])."""
    ctx = mp.get_context("spawn")
    procs, ports, names = [], [], []
    for i, experts in enumerate(blocks):
        ready, port, name = ctx.Event(), ctx.Value("i", 0), ctx.Array("c", 128)
        extra = [unix[i]] if unix else [name] if local else []
        p = ctx.Process(target=target, args=(str(path), experts, ready, port, *extra), daemon=True)
        p.start()
        if not ready.wait(120):
            raise RuntimeError("a shard process did not start")
        procs.append(p)
        ports.append(port.value)
        names.append(name.value.decode())
    return (procs, ports, names) if local else (procs, ports)


class _SplitExperts:
    """`LocalExperts.moe` for a decode step with each group's experts elsewhere: the ingress'
    decode routing (`routes`), each group's rows sent at once, the outputs combined."""

    group_of: dict[int, object]

    def moe(self, layer, x, indices, weights):
        import torch

        from moe_workers.model import routes

        r = routes.route(indices)
        counts = r.counts()
        by_group: dict[object, list[int]] = {}
        for e in sorted(r.by_expert):
            by_group.setdefault(self.group_of[e], []).append(e)
        parts = {g: (experts, [counts[e] for e in experts], routes.gather(x, r, experts))
                 for g, experts in by_group.items()}
        outputs = self.exchange(layer, parts)
        order = [pair for experts, _, _ in parts.values() for pair in r.order(experts)]
        return routes.combine(r, order, torch.cat(outputs) if len(outputs) > 1 else outputs[0], weights, x.dtype)

    def exchange(self, layer: int, parts: dict) -> list:
        """{group: (experts, counts, rows)} -> each group's outputs, in the parts' order."""
        raise NotImplementedError


class RawExperts(_SplitExperts):
    """Each group's rows to its process over a bare socket."""

    def __init__(self, addresses: list, blocks: list[list[int]]):
        """addresses: TCP loopback ports, or Unix socket paths."""
        self.conns = []
        for address in addresses:
            if isinstance(address, str):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(address)
            else:
                c = socket.create_connection(("127.0.0.1", address))
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.append(c)
        self.group_of = {e: g for g, block in enumerate(blocks) for e in block}

    def exchange(self, layer: int, parts: dict) -> list:
        import torch

        for g, (experts, counts, payload) in parts.items():
            pairs = [v for e, n in zip(experts, counts) for v in (e, n)]
            self.conns[g].sendall(HEADER.pack(layer, len(experts), payload.shape[0])
                                  + struct.pack(f"<{len(pairs)}i", *pairs) + payload.numpy().tobytes())
        outputs = []
        for g, (_, _, payload) in parts.items():
            data = self.conns[g].recv(payload.numel() * payload.element_size(), socket.MSG_WAITALL)
            outputs.append(torch.frombuffer(bytearray(data), dtype=payload.dtype).view(payload.shape))
        return outputs


class ChannelExperts(_SplitExperts):
    """The ingress' decode `_dispatch` without the ingress: one Part per group, one exchange,
    the channel set up as the app sets it (the shards on this node: their Unix sockets; the
    app's default poll for replies)."""

    def __init__(self, ports: list[int], locals_: list[str], blocks: list[list[int]]):
        from moe_workers.serve.config import EXCHANGE_SPIN_US
        from moe_workers.transport import ExpertChannel, Member

        self.channel = ExpertChannel(node="floor", spin_s=EXCHANGE_SPIN_US / 1e6)
        self.channel.update([Member(f"g{g}", f"r{g}", f"127.0.0.1:{port}", local_endpoint=name, node="floor")
                             for g, (port, name) in enumerate(zip(ports, locals_))], "floor")
        self.group_of = {e: f"g{g}" for g, block in enumerate(blocks) for e in block}

    def exchange(self, layer: int, parts: dict) -> list:
        from moe_workers.transport import Part

        results = self.channel.exchange(layer, {g: Part(*part) for g, part in parts.items()})
        return [results[g] for g in parts]


def depth(a, n: int, beside: AppBeside | None = None) -> dict[str, dict]:
    """The sides' medians at n layers, by state of the app beside ("" without one)."""
    import torch

    from moe_workers.model.inprocess import InProcessModel
    from serving import ensure_checkpoint

    shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=n, num_heads=8,
                 num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=512)
    path = ensure_checkpoint(a.cache_dir, shape, a.family)
    torch.set_num_threads(1)
    model = InProcessModel(path, max_len=512, max_sequences=2)
    local = model.experts
    blocks = group_experts(shape["num_experts"], a.groups)
    raw_procs, raw_ports = _start(_raw_shard, path, blocks)
    unix_dir = tempfile.mkdtemp(prefix="moe-floor-")
    unix_paths = [os.path.join(unix_dir, f"g{g}.sock") for g in range(len(blocks))]
    unix_procs, _ = _start(_raw_shard, path, blocks, unix_paths)
    ch_procs, ch_ports, ch_names = _start(_channel_shard, path, blocks, local=True)
    sides = {"in-process": local, "raw": RawExperts(raw_ports, blocks), "raw-unix": RawExperts(unix_paths, blocks),
             "channel": ChannelExperts(ch_ports, ch_names, blocks)}
    prompt = [5, 6, 7]
    try:
        tokens = {}
        for name, experts in sides.items():
            model.experts = experts
            tokens[name] = model.generate([prompt], max_tokens=a.tokens)[0]
        if len({tuple(t) for t in tokens.values()}) != 1:
            raise AssertionError(f"the sides decoded different tokens: {tokens}")
        states = ["app running", "app stopped"] if beside else [""]
        ms: dict[str, dict[str, list[float]]] = {state: {name: [] for name in sides} for state in states}
        for i in range(a.rounds):
            for state in states[i % 2:] + states[:i % 2]:  # which state goes first alternates
                with beside.stopped() if state == "app stopped" else contextlib.nullcontext():
                    for name, experts in sides.items():
                        model.experts = experts
                        t0 = time.perf_counter()
                        model.generate([prompt], max_tokens=1)
                        t1 = time.perf_counter()
                        model.generate([prompt], max_tokens=a.tokens)
                        ms[state][name].append(((time.perf_counter() - t1) - (t1 - t0)) / (a.tokens - 1) * 1000)
    finally:
        model.experts = local
        sides["channel"].channel.close()
        for p in raw_procs + unix_procs + ch_procs:
            p.kill()
        shutil.rmtree(unix_dir, ignore_errors=True)
    out = {}
    for state, by_side in ms.items():
        med = {name: statistics.median(v) for name, v in by_side.items()}
        out[state] = {"layers": n, "state": state, "ms_per_token": med, "rounds_ms": by_side,
                      "ratio": {k: med["in-process"] / v for k, v in med.items() if k != "in-process"},
                      "dispatch_ms_per_layer": {k: (v - med["in-process"]) / n for k, v in med.items()
                                                if k != "in-process"}}
    return out


def main() -> int:
    a = parse_args()
    rows, figures = [], {}
    spinners = keep_awake() if a.keep_awake else []
    tag = ("-keep-awake" if a.keep_awake else "") + ("-wake-latency" if a.wake_latency else "")
    wake = None
    if a.wake_latency:
        from moe_workers.serve.config import CPU_WAKE_LATENCY_US
        from moe_workers.transport.wakeup import WakeLatency

        wake = WakeLatency(CPU_WAKE_LATENCY_US, idle_s=float("inf"))  # held until the end
        wake.touch()
        deadline = time.monotonic() + 5
        while not (wake.held or wake.error) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not wake.held:
            raise SystemExit(f"--wake-latency: the request could not be taken: {wake.error or 'timed out'}")
    split = ("raw", "raw-unix", "channel")
    print(f"{'layers':>6} {'in-process ms':>13}" + "".join(f" {s + ' ms':>11} {'ratio':>6} {'ms/layer':>8}" for s in split),
          flush=True)
    layer_counts = [int(v) for v in a.layers.split(",")]
    beside = None
    if a.beside_app:
        from serving import ensure_checkpoint

        shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=layer_counts[0], num_heads=8,
                     num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=512)
        beside = AppBeside(ensure_checkpoint(a.cache_dir, shape, a.family))
    try:
        for n in layer_counts:
            for state, r in depth(a, n, beside).items():
                rows.append(r)
                m, q, d = r["ms_per_token"], r["ratio"], r["dispatch_ms_per_layer"]
                print(f"{n:6} {m['in-process']:13.2f}" + "".join(f" {m[s]:11.2f} {q[s]:6.2f} {d[s]:8.3f}" for s in split)
                      + (f"  ({state})" if state else ""), flush=True)
                state_tag = "-" + state.replace(" ", "-") if state else ""
                for side in split:
                    figures[f"floor-{side}{tag}{state_tag}-decode1-ratio-{n}-layers"] = q[side]
                    figures[f"floor-{side}{tag}{state_tag}-dispatch-ms-per-layer-{n}-layers"] = d[side]
    finally:
        if beside is not None:
            beside.close()
        for p in spinners:
            p.kill()
        if wake is not None:
            wake.close()
    return report(a.out, {"keep_awake": a.keep_awake, "wake_latency": a.wake_latency, "beside_app": a.beside_app,
                          "rows": rows}, figures)


if __name__ == "__main__":
    sys.exit(main())
