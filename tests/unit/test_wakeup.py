"""The CPU wake-up latency request (PM QoS) the channel holds while exchanges run: taken on the
first exchange after an idle spell, dropped after `idle_s` without one, never taken when off or
when the device cannot be opened. A plain file stands in for /dev/cpu_dma_latency (a process
holds the request by keeping the device open with the bound written to it); the channel and
server tests run real sockets."""

from __future__ import annotations

import os
import struct
import time

import torch

from moe_workers.transport import ExchangeServer, ExpertChannel, Member, Part
from moe_workers.transport.wakeup import WakeLatency
from waiting import wait_for

TOKEN = "t"


def _open_by_us(device) -> int:
    """How many descriptors of this process point at the device file."""
    fds = os.listdir("/proc/self/fd")
    n = 0
    for fd in fds:
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(device)
        except OSError:
            pass
    return n


def test_the_request_is_held_while_touched_and_dropped_when_idle(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    wake = WakeLatency(0, idle_s=0.3, device=str(device))
    assert not wake.held and _open_by_us(device) == 0  # nothing until an exchange
    wake.touch()
    wait_for(lambda: wake.held, timeout_s=5, what="the request taken", interval_s=0.01)
    assert device.read_bytes() == struct.pack("i", 0)  # the bound, as a 32-bit integer
    assert _open_by_us(device) == 1
    for _ in range(5):  # busy: kept across several idle_s/2 checks
        wake.touch()
        time.sleep(0.1)
    assert wake.held and wake.holds == 1
    wait_for(lambda: not wake.held, timeout_s=5, what="the request dropped", interval_s=0.01)
    assert _open_by_us(device) == 0
    wake.touch()  # busy again: taken again
    wait_for(lambda: wake.held, timeout_s=5, what="the request taken again", interval_s=0.01)
    assert wake.holds == 2
    wake.close()
    assert not wake.held and _open_by_us(device) == 0


def test_changing_the_bound_rewrites_it_and_none_drops_it(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    wake = WakeLatency(0, idle_s=10, device=str(device))
    wake.touch()
    wait_for(lambda: wake.held, timeout_s=5, what="the request taken", interval_s=0.01)
    wake.set_limit(20)
    assert device.read_bytes() == struct.pack("i", 0) + struct.pack("i", 20)
    wake.set_limit(None)
    assert not wake.held and _open_by_us(device) == 0
    wake.touch()
    time.sleep(0.2)
    assert not wake.held  # off: touches take nothing
    wake.set_limit(5)
    wake.touch()
    wait_for(lambda: wake.held, timeout_s=5, what="the request taken with the new bound", interval_s=0.01)
    assert device.read_bytes()[:4] == struct.pack("i", 5)  # a new open writes from the start
    wake.close()


def test_off_never_opens_the_device_nor_starts_a_thread(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    wake = WakeLatency(None, idle_s=0.1, device=str(device))
    for _ in range(3):
        wake.touch()
    time.sleep(0.2)
    assert not wake.held and wake._thread is None and _open_by_us(device) == 0
    assert wake.status() == {"limit_us": None, "held": False, "holds": 0, "error": ""}


def test_a_device_that_cannot_be_opened_is_reported_and_not_retried(tmp_path):
    missing = tmp_path / "no-such-device"
    wake = WakeLatency(0, idle_s=0.1, device=str(missing))
    wake.touch()
    wait_for(lambda: wake.error, timeout_s=5, what="the error recorded", interval_s=0.01)
    assert str(missing) in wake.error and "No such file" in wake.error
    assert not wake.held and wake.holds == 0
    missing.write_bytes(b"")  # it appears later: not retried (one error, no loop of attempts)
    wake.touch()
    time.sleep(0.2)
    assert not wake.held
    wake.close()


def _double(layer, x, experts, counts, prefetch, out, top1=None):
    out.copy_(x * 2)


def test_the_channel_and_the_server_hold_it_while_exchanges_run(tmp_path):
    devices = [tmp_path / "ingress", tmp_path / "shard"]
    for d in devices:
        d.write_bytes(b"")
    server = ExchangeServer(_double, lambda: [TOKEN], wake_latency_us=0)
    server.wake.device, server.wake.idle_s = str(devices[1]), 0.3
    ch = ExpertChannel(timeout_s=5, wake_latency_us=0)
    ch.wake.device, ch.wake.idle_s = str(devices[0]), 0.3
    ch.update([Member("g0", "r0", server.endpoint)], TOKEN)
    try:
        assert not ch.wake.held and not server.wake.held
        x = torch.randn(1, 8)
        assert torch.equal(ch.exchange(0, {"g0": Part([0], [1], x)})["g0"], x * 2)
        wait_for(lambda: ch.wake.held and server.wake.held, timeout_s=5, what="both requests taken", interval_s=0.01)
        wait_for(lambda: not ch.wake.held and not server.wake.held, timeout_s=5, what="both dropped when idle",
                 interval_s=0.01)
    finally:
        ch.close()
        server.close()
    assert _open_by_us(devices[0]) == 0 and _open_by_us(devices[1]) == 0


def test_an_endless_idle_time_holds_the_request_until_closed(tmp_path):
    """bench/floor.py --wake-latency holds it for a whole run (idle_s infinite)."""
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    wake = WakeLatency(0, idle_s=float("inf"), device=str(device))
    wake.touch()
    wait_for(lambda: wake.held, timeout_s=5, what="the request taken", interval_s=0.01)
    time.sleep(0.3)
    assert wake.held and wake._thread.is_alive()  # its wait is bounded, not an overflowing timeout
    wake.close()
    wait_for(lambda: not wake._thread.is_alive(), timeout_s=5, what="the holder thread ended", interval_s=0.01)
    assert _open_by_us(device) == 0
