"""A CUDA device as far as a CPU can fake one: torch's FakeTensorMode gives tensors on `cuda`
(shapes, dtypes, devices and every kernel's checks, no data), on a machine without a GPU.

Under plain `fake_cuda()` any value the host reads from a device tensor (`.tolist()`, `.item()`,
`bool(t)`, `nonzero`, `unique`: each a wait for the GPU) raises, and so does an op that mixes a
device tensor with a host one. `HostReads` inside it counts those reads instead, answering each
with zeros (every scalar 0, every mask all true), so that code that reads on purpose (sampling,
the served step's routing) runs through and the test counts how often it waits.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_VIEWS = (aten.unbind.int, aten.select.int, aten.alias.default, aten.view.default, aten.detach.default,
          torch.ops.prim.device.default)
_READS = (aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten._unique2.default,
          aten.unique_consecutive.default, aten.unique_dim.default)


@contextlib.contextmanager
def fake_cuda():
    """FakeTensorMode in which real tensors may enter: the checkpoint's reads (safetensors maps
    the file into real host tensors) run outside it, and what the code then does with them on
    `cuda` is faked."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from moe_workers.model.checkpoint import Checkpoint

    read = Checkpoint.tensor

    def real_read(self, *args, **kwargs):
        with unset_fake_temporarily():
            return read(self, *args, **kwargs)

    # no constants: torch keeps the value of a one-element tensor made from Python data and
    # computes ops on it for real, `.to("cuda")` included, which needs a driver
    limit, fake_tensor.CONSTANT_NUMEL_LIMIT = fake_tensor.CONSTANT_NUMEL_LIMIT, -1
    Checkpoint.tensor = real_read
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        Checkpoint.tensor = read
        fake_tensor.CONSTANT_NUMEL_LIMIT = limit


class HostReads(TorchDispatchMode):
    """Counts the host's reads of device data (a `.tolist()` of one tensor is one read, whatever
    its size: the reads of its elements follow each other with only views between them), and
    blocking copies of device data to the host."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.copies = 0  # blocking device -> host copies (t.cpu(), t.to("cpu"))
        self._last: int | None = None  # the storage the current run of element reads reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            t = args[0]
            if isinstance(t, FakeTensor) and t.constant is None:
                if t.device.type != "cpu":
                    key = t.untyped_storage()._cdata
                    if key != self._last:
                        self.reads += 1
                    self._last = key
                return _zeros_answer(func, t)
        if func not in _VIEWS:
            self._last = None
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            src, dst = args[0].device, torch.device(kwargs["device"])
            if src.type != "cpu" and dst.type == "cpu" and not kwargs.get("non_blocking"):
                self.copies += 1
        return func(*args, **kwargs)


def _zeros_answer(func, t: torch.Tensor):
    if func in (aten._local_scalar_dense.default, aten.item.default):
        return False if t.dtype == torch.bool else (0.0 if t.dtype.is_floating_point else 0)
    if func is aten.nonzero.default:  # every element true
        idx = torch.arange(t.numel(), device=t.device)
        return torch.stack(torch.unravel_index(idx, t.shape), dim=1)
    # unique: a single value 0 (with inverse indices and counts where asked)
    flat = t.reshape(-1)
    return (torch.zeros(1, dtype=t.dtype, device=t.device), torch.zeros_like(flat, dtype=torch.long),
            torch.full((1,), flat.numel(), dtype=torch.long, device=t.device))
