"""A stand-in for the CUDA device operations of the expert store (`moe_workers.device.CudaOps`):
host memory behind a "device", every operation logged in order with whether the store's lock was
held, so the GPU path is tested up to the device calls on a machine without a GPU."""

from __future__ import annotations

import torch

from moe_workers.device import DeviceOps


class Ev:
    """A recorded device event (completes when the test says so)."""

    def __init__(self, n: int, what: str):
        self.n, self.what, self.done = n, what, True

    def query(self) -> bool:
        return self.done

    def __repr__(self):
        return f"Ev{self.n}({self.what})"


class RecordingOps(DeviceOps):
    """A stand-in for CudaOps: the hot tier on a "device" (host memory behind it, so the weights
    can still be checked), pinned warm memory, and every device operation logged in order with
    whether the store's lock was held."""

    def __init__(self):
        self.device = torch.device("meta")  # anything but the CPU: hot and warm are different memory
        self.log: list[tuple] = []
        self.store = None
        self._n = 0

    @property
    def pinned_host(self) -> bool:
        return True

    def _event(self, what):
        self._n += 1
        return Ev(self._n, what)

    def _locked(self) -> bool:
        return self.store is not None and self.store.cv._is_owned()

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.log.append(("alloc", buf.untyped_storage().data_ptr(), "host" if host else "device"))
        return buf

    def copy(self, dst, src, after=()):
        assert src.dtype == dst.dtype, "dtype converted during the DMA"
        dst.copy_(src)
        ev = self._event("copy")
        self.log.append(("copy", dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr(),
                         [e for e in after if e is not None], ev, self._locked()))
        return ev

    def decode(self, dst, src, quant, after=()):
        """A quantized expert decoded on the "device": logged with the bytes that crossed to it."""
        super().decode(dst, src, quant)
        ev = self._event("decode")
        self.log.append(("decode", next(iter(dst.values())).untyped_storage().data_ptr(),
                         sum(t.numel() * t.element_size() for t in src.values()),
                         [e for e in after if e is not None], ev, self._locked()))
        return ev

    def wait(self, event) -> None:
        self.log.append(("wait", event, self._locked()))

    def host_wait(self, events) -> None:
        self.log.append(("host_wait", list(events or []), self._locked()))

    def record(self):
        ev = self._event("batch")
        self.log.append(("record", ev, self._locked()))
        return ev
