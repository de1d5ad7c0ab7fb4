"""Lazy access to a Hugging Face layout checkpoint: only safetensors, one tensor at a time.

The ingress reads the dense part; each shard reads only its own experts. Nothing reads the whole
checkpoint into memory: `safe_open` maps the file and copies out the tensors asked for, and an
expert stored fused with the rest of its layer (gpt_oss) is read as its own slice of the fused
tensor. Opening a checkpoint checks every tensor its config.json implies against the headers.

Quantized checkpoints (fp8 blocks, mxfp4 experts) are read as they ship: the dense part is
dequantized to the compute dtype as it is read; an expert is read in its stored form
(`expert_stored`, what the store's warm and cold tiers keep) or decoded (`expert`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, MoEConfig
from .dequant import decode, dequantize_fp8, tensor_scale_problem
from .index import TensorInfo, read_index
from .quantization import FP8_DTYPE, is_scale, scale_name


class Checkpoint:
    """Tensor index of a checkpoint directory; tensors are read on demand."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        self.config = MoEConfig.from_dir(self.path, family)
        self._index = read_index(self.path)
        self.config.check_tensors({n: (str(t.file), t.dtype, t.shape) for n, t in self._index.items()}, str(self.path))
        self._experts = {name for layer in self.config.sparse_layers for e in range(self.config.num_experts)
                         for _, name, _ in self.config.stored_sources(layer, e)}
        scales = {t.dtype for n, t in self._index.items() if n in self._experts and n.endswith("_scale_inv")}
        if len(scales) > 1:
            raise CheckpointError(f"{self.path}: the routed experts' fp8 scales mix dtypes ({', '.join(sorted(scales))})")
        self.scale_dtype = scales.pop() if scales else "F32"
        self._handles: dict[Path, object] = {}

    def _handle(self, file: Path):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(file, framework="pt")
        return h

    def names(self) -> list[str]:
        return list(self._index)

    def has(self, name: str) -> bool:
        return name in self._index

    def info(self, name: str) -> TensorInfo:
        try:
            return self._index[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name} is missing") from None

    def file_of(self, name: str) -> Path:
        return self.info(name).file

    def tensor(self, name: str, dtype: torch.dtype | None = None, index: int | None = None) -> torch.Tensor:
        h = self._handle(self.file_of(name))
        t = h.get_tensor(name) if index is None else h.get_slice(name)[index]
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    def dense_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every tensor that is not a routed expert's: embeddings, attention, norms, routers,
        dense and shared MLPs, lm_head; fp8 weights dequantized (to `dtype`, else the config's)."""
        out = {}
        for n, t in self._index.items():
            if n in self._experts or n.endswith("_scale_inv") and n.removesuffix("_scale_inv") in self._index:
                continue
            if t.dtype == FP8_DTYPE:
                out[n] = dequantize_fp8(self.tensor(n), self._scales(scale_name(n)), self.config.quant.block,
                                        dtype or self.config.dtype)
            else:
                out[n] = self.tensor(n, dtype)
        return out

    def _check_expert(self, layer: int, expert: int) -> None:
        problem = self.config.expert_problem(layer, expert)
        if problem:
            raise CheckpointError(problem)

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[str, TensorInfo]]:
        """(stored part, where its bytes lie) for one expert, in part order: a fused tensor's
        slice. Quantized: the stored parts (fp8 weights and their scales; mxfp4 blocks, scales)."""
        self._check_expert(layer, expert)
        shapes = {part: shape for part, _, shape in self.config.stored_parts()}
        out = []
        for part, name, index in self.config.stored_sources(layer, expert):
            t = self.info(name)
            if index is not None:
                per = t.nbytes // t.shape[0]
                t = TensorInfo(t.file, t.dtype, tuple(shapes[part]), t.offset + index * per, per)
            out.append((part, t))
        return out

    def expert_stored(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One routed expert as the checkpoint stores it (`config.stored_parts()`)."""
        self._check_expert(layer, expert)
        return {part: self.tensor(name, None, index) for part, name, index in self.config.stored_sources(layer, expert)}

    def expert(self, layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """One routed expert's tensors by part name (`config.expert_parts()`), decoded from a
        quantized form (to `dtype`, else the config's)."""
        stored = self.expert_stored(layer, expert)
        for part, name, _ in self.config.stored_sources(layer, expert):
            if is_scale(name):
                self._check_scale_values(name, stored[part])
        if self.config.quant is None:
            return {k: v.to(dtype) if dtype is not None and v.dtype != dtype else v for k, v in stored.items()}
        return decode(self.config.quant, stored, dtype or self.config.dtype)

    def _scales(self, name: str) -> torch.Tensor:
        t = self.tensor(name)
        self._check_scale_values(name, t)
        return t

    def _check_scale_values(self, name: str, t: torch.Tensor) -> None:
        problem = tensor_scale_problem(name, t)
        if problem:
            raise CheckpointError(f"{self.file_of(name)}: tensor {name} has {problem}")

    def close(self) -> None:
        self._handles.clear()
