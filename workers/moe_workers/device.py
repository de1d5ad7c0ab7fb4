"""The device a replica computes on, and what the expert store needs from it, behind one interface.

- Which device (`replica_device`, for the Ingress' dense part and each shard's hot tier): the GPU Ray assigned to this replica (`ray.get_gpu_ids()`; Ray sets
  CUDA_VISIBLE_DEVICES to it, so it is `cuda:0` inside the process), else the CPU. A replica that
  asked Ray for no GPU never touches one, even on a GPU node.
- Host memory for the warm tier: pinned (page-locked, for asynchronous DMA) only when the hot tier
  is on a GPU, and pinned at its exact size (`cudaHostRegister` on a plain allocation) rather than
  through torch's caching host allocator, which rounds each block up to a power of two (a 336 MiB
  Mixtral-8x7B expert would hold 512 MiB) and keeps freed blocks: the budgets count real memory.
- Ordering: copies run on a copy stream of the store's own, so prefetch overlaps compute; each
  copy records an event; the compute stream waits for an expert's event before using it (a wait
  on the device, never the host); a slot goes back to its pool with the events of the last work
  that read or wrote it (a batch, a copy out of it, the copy or decode into it), and is written
  again, or freed, only once those have completed. Nothing here blocks
  the host, so the store's lock never covers a device synchronisation.

A quantized expert (fp8 blocks, mxfp4) travels to the hot tier in its stored form and is decoded
there (`decode`): on a GPU the decode runs on the copy stream after an upload of the stored bytes.

`CpuOps` does all this trivially (copies are synchronous, no events). `CudaOps` is the GPU path:
written and unit-tested through `FakeDeviceOps`-style recording in the tests, but it has not run
on a GPU (none was available where it was written).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor (a step's indices, masks) on `device` without the host waiting for the
    device: onto a GPU from pinned memory (torch's caching host allocator) by an asynchronous copy
    ordered on the current stream (a copy from pageable memory waits for the kernels before it);
    on the CPU, itself."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t
    if torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def assigned_device(gpu_ids: Sequence, cuda_available: bool) -> torch.device:
    """The device of a replica Ray gave `gpu_ids` (empty: it asked for none)."""
    if gpu_ids and cuda_available:
        return torch.device("cuda", 0)  # Ray's CUDA_VISIBLE_DEVICES makes the assigned GPU the first
    return torch.device("cpu")


def replica_device() -> torch.device:
    """This Ray replica's device: the GPU Ray assigned it (num_gpus), else the CPU (also outside
    Ray). A replica that asked for no GPU never uses one, even on a GPU node."""
    try:
        import ray

        gpu_ids = ray.get_gpu_ids()
    except Exception:  # noqa: BLE001 - outside Ray (unit use)
        gpu_ids = []
    return assigned_device(gpu_ids, torch.cuda.is_available())


class DeviceOps:
    """The store's device operations. Events are opaque (None where nothing needs ordering)."""

    device: torch.device = torch.device("cpu")

    @property
    def pinned_host(self) -> bool:
        """Whether warm slots are pinned host memory (only with a GPU hot tier)."""
        return False

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        """One slot: on the device (host=False) or in host memory (pinned when pinned_host)."""
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu" if host else self.device)

    def free(self, buf: torch.Tensor, host: bool) -> None:
        """A slot's memory goes back (unpinned first when it was pinned)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=()):
        """dst <- src (same dtype and shape), once the events in `after` have completed; returns
        the event that completes with the copy."""
        dst.copy_(src)
        return None

    def decode(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], quant, after=()):
        """A quantized expert's stored parts (`src`, host memory) decoded into the compute parts
        `dst` (views of one hot slot), once the events in `after` have completed; returns the
        event that completes with it. On the CPU the decode writes the slot directly."""
        from moe_workers.model.dequant import decode_into

        decode_into(quant, src, dst)
        return None

    def wait(self, event) -> None:
        """The compute stream waits for `event` (a copy) before its next kernels."""

    def host_wait(self, events) -> None:
        """The host waits for `events` (before the CPU itself writes a slot a DMA may still read;
        never called under the store's lock)."""

    def record(self):
        """An event on the compute stream, completing when the kernels enqueued so far have."""
        return None


class CpuOps(DeviceOps):
    pass


class CudaOps(DeviceOps):
    """The GPU path (see the module docstring). Not run on a GPU yet."""

    def __init__(self, device: torch.device, pin: bool = True):
        self.device = device
        self._pin = pin
        self.stream = torch.cuda.Stream(device=device)

    @property
    def pinned_host(self) -> bool:
        return self._pin

    def alloc(self, nbytes: int, host: bool) -> torch.Tensor:
        if not host:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self._pin:
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err})")
        return buf

    def free(self, buf: torch.Tensor, host: bool) -> None:
        if host and self._pin:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=()):
        with torch.cuda.stream(self.stream):
            for event in after or ():
                if event is not None:
                    self.stream.wait_event(event)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # the source must outlive the copy: the caller keeps it until `done` (slots are given back
        # with `done` as their `after`)
        return done

    def decode(self, dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], quant, after=()):
        """On the copy stream: the stored bytes go to the device as they are (2x / 3.8x fewer than
        the decoded ones for fp8 / mxfp4), then the device decodes them into the hot slot."""
        from moe_workers.model.dequant import decode_into

        with torch.cuda.stream(self.stream):
            for event in after or ():
                if event is not None:
                    self.stream.wait_event(event)
            staged = {k: v.to(self.device, non_blocking=True) for k, v in src.items()}
            decode_into(quant, staged, dst)
            done = torch.cuda.Event()
            done.record(self.stream)
        # `staged` is freed into the caching allocator on this stream (reused only after these
        # kernels); the host source outlives the copy as in `copy`
        return done

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, events) -> None:
        for event in events or []:
            if event is not None:
                event.synchronize()

    def record(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def ops_for(device: torch.device | str | None, pinned: bool = True) -> DeviceOps:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        return CudaOps(device, pin=pinned)
    ops = CpuOps()
    ops.device = device
    return ops
