"""The shard replica's end of the expert channel: a server computing requests as they come.

Each connection gets its own thread, which reads a request into a buffer it reuses, calls the
replica's `compute(layer, x, experts, counts, prefetch, out, top1)` and writes the reply; the ingress
opens one connection per exchange it runs at once (micro-batches), so concurrent exchanges
compute concurrently, as Serve's thread pool did. The server binds Ray's address for this node
(127.0.0.1 for a local head): nothing listens where Ray itself does not. On Linux it also listens
on a Unix socket in the abstract namespace (`local_endpoint`, "unix:@name", a random name): an
ingress on the same node, hence in the same network namespace, connects there (a round trip costs
less than over TCP loopback, most at batch 64: bench/channel.py); the same token is checked on both.

A compute error is a reply with the error's text (the ingress tries another replica, then fails
the step). Once `drain()` is called (the replica is being stopped), requests are answered
DRAINING without computing, and the ingress sends them elsewhere.
"""

from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from . import shm, wire
from .link import LinkError, LinkOffer, PairLink
from .realtime import Realtime
from .wakeup import WakeLatency

# (layer, x, experts, counts, prefetch, out, top-1 counts per expert or None)
Compute = Callable[[int, torch.Tensor, list[int], list[int], list[tuple[int, int]], torch.Tensor, list[int] | None],
                   None]


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ConnectionError if the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_all(sock: socket.socket, parts: list) -> None:
    """sendmsg until every byte of `parts` (bytes, or 1-D byte memoryviews) is out (a small send
    is one call; a large one may go out in pieces)."""
    sent = sock.sendmsg(parts)
    if sent == sum(len(p) for p in parts):
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while True:
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if not views:
            return
        views[0] = views[0][sent:]
        sent = sock.sendmsg(views)


UNIX_SNDBUF = 4 << 20  # asked for; the kernel caps it at net.core.wmem_max


def tune(sock: socket.socket) -> None:
    """TCP: no Nagle delay. Unix: a send buffer as large as the kernel allows (a Unix stream
    socket's default, 208 KiB, splits a batch-64 exchange's 256 KiB into two wake-ups: 0.51
    against 0.31 ms a round trip to 2 peers over TCP, whose buffers grow on their own)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    elif sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SNDBUF)


class ExchangeServer:
    def __init__(self, compute: Compute, tokens: Callable[[], list[str]], host: str = "127.0.0.1", port: int = 0,
                 hello_timeout_s: float = 10.0, torch_threads: int | None = None, local: bool = True,
                 wake_latency_us: int | None = None, realtime_priority: int = 0, shm_spin_s: float = 0.0):
        """`tokens()`: the channel tokens accepted now (the current one, and the previous one for
        a while after it changes). `torch_threads`: intra-op threads of the connection threads
        (torch's setting is per thread under OpenMP: a new thread would otherwise use every core).
        `local`: listen on an abstract Unix socket too (Linux only). `wake_latency_us`: the CPU
        wake-up latency to ask the kernel for while requests come (`WakeLatency`; None: never ask).
        `realtime_priority`: the SCHED_RR priority connection threads compute small requests at
        (`Realtime`; 0: never ask). `shm_spin_s`: on a connection with a shared-memory segment
        (shm.py), how long a connection thread polls for the next request before it sleeps."""
        self.wake = WakeLatency(wake_latency_us)
        self.realtime = Realtime(realtime_priority, torch_threads=torch_threads or torch.get_num_threads())
        self.compute = compute
        self.torch_threads = torch_threads
        self.tokens = tokens
        self.hello_timeout_s = hello_timeout_s
        self.draining = False
        self.shm_spin_s = shm_spin_s
        if local:
            shm.library()  # the mailboxes, built (once per machine) before an ingress offers a segment
        self.shm_connections = 0  # connections that took a segment
        self.shm_refused = ""  # why the last offered segment was not taken
        self.requests = 0
        self.errors = 0
        self.busy = 0  # requests being computed now
        self.handle_s = 0.0  # wall time from a request fully received to its reply sent, summed
        self.last_error = ""
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=64)
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._listeners = [self._listener]
        self.local_endpoint = ""  # "unix:@name" when listening on an abstract Unix socket
        if local and sys.platform.startswith("linux"):
            endpoint = f"{wire.UNIX_PREFIX}moe-channel-{secrets.token_hex(12)}"
            family, address = wire.parse_endpoint(endpoint)
            unix = socket.socket(family, socket.SOCK_STREAM)
            unix.bind(address)
            unix.listen(64)
            self._listeners.append(unix)
            self.local_endpoint = endpoint
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept_loop, args=(ls,), name="expert-channel-accept",
                                          daemon=True) for ls in self._listeners]
        for t in self._threads:
            t.start()

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and not self._closed.is_set()

    def drain(self) -> None:
        self.draining = True

    def close(self) -> None:
        self._closed.set()
        self.wake.close()
        for ls in self._listeners:
            try:
                ls.shutdown(socket.SHUT_RDWR)  # wakes the accept thread: a bare close leaves the port open
            except OSError:
                pass
            try:
                ls.close()
            except OSError:
                pass
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="expert-channel-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        seg = None
        try:
            ok, link, seg = self._hello(conn)
            if ok:
                self._loop(conn, link, seg)
        except (OSError, ConnectionError, wire.ProtocolError):
            pass  # a broken or foreign peer: drop the connection, keep serving the others
        except Exception as err:  # noqa: BLE001 - a bug must not take the other connections down
            self.last_error = f"{type(err).__name__}: {err}"
        finally:
            self.realtime.leave()
            if seg is not None:
                seg.close()
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _hello(self, conn: socket.socket) -> tuple[bool, PairLink | None, shm.Segment | None]:
        """Check the token; join the device link the ingress offers, or map the shared-memory
        segment whose fd came with the hello (only once the token is right; an fd not taken is
        closed unmapped)."""
        conn.settimeout(self.hello_timeout_s)  # a silent connection does not keep a thread forever
        head, fds = shm.receive_hello_header(conn)
        try:
            n, m = wire.decode_hello_header(head + recv_bytes(conn, wire.HELLO_HEADER.size - len(head)))
            token = recv_bytes(conn, n)
            offer = wire.decode_link_offer(recv_bytes(conn, m))
            accepted = [t.encode() for t in self.tokens() if t]
            if not any(hmac.compare_digest(token, t) for t in accepted):
                conn.sendall(wire.encode_ack(wire.DENIED, "wrong channel token"))
                return False, None, None
            link, seg, note = None, None, ""
            if offer is not None and shm.OFFER in offer:
                try:
                    if not fds:
                        raise shm.ShmUnavailable("no segment came with the hello")
                    seg = shm.Segment.attach(fds[0])
                    note = shm.ACCEPTED
                except shm.ShmUnavailable as err:
                    note = self.shm_refused = f"shared memory refused: {err}"
            elif offer is not None:
                try:
                    parsed = LinkOffer.from_dict(offer)
                    link = PairLink(parsed.backend, 1, PairLink.join_store(parsed, self.hello_timeout_s),
                                    self.hello_timeout_s)
                except (LinkError, RuntimeError, KeyError, ValueError) as err:
                    conn.sendall(wire.encode_ack(wire.ERROR, f"device link refused: {err}"))
                    return False, None, None
            try:
                conn.sendall(wire.encode_ack(wire.OK, note))
            except BaseException:
                if seg is not None:
                    seg.close()
                raise
            if seg is not None:
                with self._lock:
                    self.shm_connections += 1
            conn.settimeout(None)
            return True, link, seg
        finally:
            for fd in fds:
                os.close(fd)  # a mapped segment needs no fd

    def _loop(self, conn: socket.socket, link: PairLink | None = None, seg: shm.Segment | None = None) -> None:
        """Requests one at a time (the ingress never pipelines on a connection). Each read takes
        what has arrived into one reused buffer: a small request is one recv, not four. The rows
        are computed where they arrived and the outputs written to a reused buffer (numpy views:
        a torch view costs several microseconds, a numpy one a fraction of that). With a segment,
        requests arrive in it (`_shared_frame`) unless its mailbox says the socket has this one."""
        head = wire.REQUEST_HEADER.size
        buf = np.empty(1 << 16, dtype=np.uint8)
        view = memoryview(buf)
        outbuf = np.empty(1 << 16, dtype=np.uint8)
        view_shape = None  # (offset, rows, hidden, dtype) of the tensor views x and out over buf and outbuf
        shared: dict = {}  # the tensor views over the segment, by shape
        poller = readable_poller(conn)
        while True:
            if seg is not None:
                if self._next_shared(conn, seg, shared.get("rows", 0) <= wire.SMALL_ROWS) == shm.IN_AREA:
                    self._shared_frame(seg, shared)
                    continue
                shared["rows"] = 0  # a socket frame is a large one
            else:
                poller.poll()  # the next request (not the ingress reading the last reply: readable_poller)
            got = _recv_at_least(conn, view, 0, head)
            seq, layer, rows, hidden, dtype, n_experts, n_prefetch, size, flags = wire.decode_request_header(view)
            linked = bool(flags & wire.LINKED)
            if linked and link is None:
                raise wire.ProtocolError("a linked frame on a connection without a device link")
            nbytes = 0 if linked else rows * hidden * dtype.itemsize
            total = head + size + nbytes
            if len(view) < total:  # grow, keeping what already arrived
                bigger = np.empty(total, dtype=np.uint8)
                bigger[:got] = buf[:got]
                buf, view = bigger, memoryview(bigger)
                view_shape = None  # the tensor views were over the old buffer
            _recv_at_least(conn, view, got, total)
            t0 = time.perf_counter()
            self.wake.touch()
            self.realtime.enter(rows)
            experts, counts, prefetch, top1 = wire.decode_request_body(view, head, n_experts, n_prefetch, rows, flags)
            if linked:  # the rows come on the link, in frame order; take them even when draining
                x = torch.empty(rows, hidden, dtype=dtype, device=link.device)
                link.recv_into(x)
                out = torch.empty_like(x)
                view_shape = None
            if self.draining:
                conn.sendall(wire.encode_reply(seq, wire.DRAINING, message="replica is stopping"))
                continue
            if not linked:
                shape = (head + size, rows, hidden, dtype)
                if shape != view_shape or len(outbuf) < nbytes:  # decode steps repeat one shape
                    if len(outbuf) < nbytes:
                        outbuf = np.empty(nbytes, dtype=np.uint8)
                    x = wire.tensor_view(buf, head + size, rows, hidden, dtype)
                    out = wire.tensor_view(outbuf, 0, rows, hidden, dtype)
                    view_shape = shape
            with self._lock:
                self.busy += 1
            try:
                self.compute(layer, x, experts, counts, prefetch, out, top1)
            except Exception as err:  # noqa: BLE001 - the ingress decides; this replica keeps serving
                self.errors += 1
                conn.sendall(wire.encode_reply(seq, wire.ERROR, message=f"{type(err).__name__}: {err}"))
                continue
            finally:
                with self._lock:
                    self.busy -= 1
            self.requests += 1
            if linked:
                conn.sendall(wire.encode_reply(seq, wire.OK, rows, hidden, dtype, flags=wire.LINKED))
                link.send(out)
            else:
                send_all(conn, [wire.encode_reply(seq, wire.OK, rows, hidden, dtype), memoryview(outbuf[:nbytes])])
            self.handle_s += time.perf_counter() - t0


    def _next_shared(self, conn: socket.socket, seg: shm.Segment, small: bool) -> int:
        """Where the next request is (shm.IN_AREA or ON_SOCKET), polling for `shm_spin_s` first
        after a `small` request (a decode step's: the next layer's comes within a layer's dense
        compute); ConnectionError once the ingress closed the connection or the server closes."""
        spin = self.shm_spin_s if small else 0.0
        while True:
            where = shm.wait_for(seg.request_box, conn, time.monotonic() + 1.0, spin, shm.IDLE_SLICE_S)
            if where is not None:
                return where
            if self._closed.is_set():
                raise ConnectionError("server closed")

    def _shared_frame(self, seg: shm.Segment, views: dict) -> None:
        """Compute the request in the segment's request area into its reply area, and post the
        reply. A frame that breaks the segment's bounds drops the connection (ProtocolError)."""
        head = wire.REQUEST_HEADER.size
        seq, layer, rows, hidden, dtype, n_experts, n_prefetch, size, flags = wire.decode_request_header(
            seg.request_view)
        nbytes = rows * hidden * dtype.itemsize
        if flags & wire.LINKED or head + size + nbytes > seg.area or shm.REPLY_TENSOR_AT + nbytes > seg.area:
            raise wire.ProtocolError(f"a {rows} x {hidden} frame does not fit the segment's {seg.area} bytes")
        t0 = time.perf_counter()
        self.wake.touch()
        self.realtime.enter(rows)
        experts, counts, prefetch, top1 = wire.decode_request_body(seg.request_view, head, n_experts, n_prefetch,
                                                                   rows, flags)
        if self.draining:
            self._shared_reply(seg, wire.encode_reply(seq, wire.DRAINING, message="replica is stopping"))
            return
        views["rows"] = rows
        shape = (head + size, rows, hidden, dtype)
        if views.get("shape") != shape:  # decode steps repeat one shape
            views.update(shape=shape, x=wire.tensor_view(seg.request, head + size, rows, hidden, dtype),
                         out=wire.tensor_view(seg.reply, shm.REPLY_TENSOR_AT, rows, hidden, dtype))
        with self._lock:
            self.busy += 1
        try:
            self.compute(layer, views["x"], experts, counts, prefetch, views["out"], top1)
        except Exception as err:  # noqa: BLE001 - the ingress decides; this replica keeps serving
            self.errors += 1
            self._shared_reply(seg, wire.encode_reply(seq, wire.ERROR, message=f"{type(err).__name__}: {err}"))
            return
        finally:
            with self._lock:
                self.busy -= 1
        self.requests += 1
        self._shared_reply(seg, wire.encode_reply(seq, wire.OK, rows, hidden, dtype))
        self.handle_s += time.perf_counter() - t0

    @staticmethod
    def _shared_reply(seg: shm.Segment, frame: bytes) -> None:
        """A reply frame placed so that its rows (already computed in place) follow its header."""
        seg.reply_view[shm.REPLY_AT:shm.REPLY_AT + len(frame)] = frame
        seg.reply_box.post()


def readable_poller(sock: socket.socket) -> select.poll:
    """A poller for `sock`'s data (or its peer's close), to block on before a receive.

    A blocking recv() on a Unix socket is also woken each time the peer reads what this side
    sent: the kernel wakes every waiter of the socket when write space frees, whatever it waits
    for, and synchronously (the waker's CPU is preferred). A shard replica blocked for its next
    request was so woken when the ingress read its reply, queued on the ingress' CPU, and was
    still queued there behind the ingress' dense compute when the request came (a scheduler
    trace of a 16-layer decode: 5% of the wall time, a shard waiting 0.6 ms on average beside an
    idle CPU). poll() for POLLIN is woken by data or the peer's close only."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return poller


def _recv_at_least(sock: socket.socket, view: memoryview, got: int, n: int) -> int:
    """Read into view[got:] until at least n bytes are there; the count there now."""
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return got
