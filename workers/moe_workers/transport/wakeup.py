"""CPU wake-up latency while the expert channel is busy: a PM QoS request on /dev/cpu_dma_latency.

Each process on a decode step's path sleeps a few hundred microseconds a layer: the ingress while
the shards compute, each shard until its next request. A CPU with nothing to run enters an idle
state, and a wake-up that lands on it pays the state's exit: on the VMs this project runs on
(cpuidle's haltpoll driver with guest polling off) an idle vCPU halts, and a round trip between
two processes with 0.5 ms of compute between them took 93-113 us beyond the compute, against
21-24 us with idle states held off (docs/benchmarks.md). Linux's PM QoS interface lets a process
bound that exit latency for every CPU: it writes the bound (microseconds, a 32-bit integer) to
/dev/cpu_dma_latency and the bound holds while it keeps the file open (the kernel's
Documentation/power/pm_qos_interface.rst; tuned's latency-performance profile does the same).
0 leaves only polling, so a woken task runs at once.

An idle CPU that polls burns power, so the request is held only while the channel is busy:
`touch()` (once an exchange, a few nanoseconds) marks activity; a background thread opens the
file on the first touch after an idle spell and closes it `idle_s` after the last one. Opening
needs write access to the device (root, or the device mounted into a container); without it the
request is never held, `error` says why, and serving goes on as before.
"""

from __future__ import annotations

import os
import struct
import threading
import time

DEVICE = "/dev/cpu_dma_latency"
IDLE_S = 2.0  # no exchange for this long: the request is dropped


class WakeLatency:
    """A PM QoS request for CPU wake-up latency, held while `touch()` is called often."""

    def __init__(self, limit_us: int | None, idle_s: float = IDLE_S, device: str = DEVICE):
        """`limit_us`: the bound to ask for while busy (0: polling only), or None: never ask."""
        self.limit_us = limit_us
        self.idle_s = idle_s
        self.device = device
        self.error = ""  # why the request could not be held (it is not retried)
        self.holds = 0  # times the request was taken
        self._fd: int | None = None
        self._last = 0.0  # monotonic time of the latest touch
        self._lock = threading.Lock()
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def touch(self) -> None:
        """An exchange happens now (the hot path: a clock read, and a wake-up of the holder
        thread only when the request is not held)."""
        self._last = time.monotonic()
        if self._fd is None and self.limit_us is not None and not self.error:
            if self._thread is None:
                self._start()
            self._kick.set()

    def set_limit(self, limit_us: int | None) -> None:
        """Ask for another bound from now on (None: drop the request and stop asking)."""
        with self._lock:
            self.limit_us = limit_us
            if self._fd is not None:
                if limit_us is None:
                    self._release()
                else:
                    os.write(self._fd, struct.pack("i", limit_us))

    def status(self) -> dict:
        return {"limit_us": self.limit_us, "held": self.held, "holds": self.holds, "error": self.error}

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        with self._lock:
            self._release()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wake-latency", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(min(self.idle_s / 2, 60.0) if self._fd is not None else None)  # idle_s may be inf
            self._kick.clear()
            if self._stop.is_set():
                return
            with self._lock:
                busy = time.monotonic() - self._last < self.idle_s
                if busy and self._fd is None and self.limit_us is not None and not self.error:
                    self._take()
                elif not busy and self._fd is not None:
                    self._release()

    def _take(self) -> None:
        fd = None
        try:
            fd = os.open(self.device, os.O_WRONLY)
            os.write(fd, struct.pack("i", self.limit_us))
        except OSError as err:
            if fd is not None:
                os.close(fd)
            self.error = f"{self.device}: {err.strerror or err}"
            return
        self._fd = fd
        self.holds += 1

    def _release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass
