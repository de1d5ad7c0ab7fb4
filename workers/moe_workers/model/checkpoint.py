"""Lazy access to a Hugging Face layout checkpoint: only safetensors, one tensor at a time.

The ingress reads the dense part; each shard reads only its own experts. Nothing reads the whole
checkpoint into memory: `safe_open` maps the file and copies out the tensors asked for, and an
expert stored fused with the rest of its layer (gpt_oss) is read as its own slice of the fused
tensor. Opening a checkpoint checks every tensor its config.json implies against the headers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, MoEConfig
from .index import TensorInfo, read_index


class Checkpoint:
    """Tensor index of a checkpoint directory; tensors are read on demand."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        self.config = MoEConfig.from_dir(self.path, family)
        self._index = read_index(self.path)
        self.config.check_tensors({n: (str(t.file), t.dtype, t.shape) for n, t in self._index.items()}, str(self.path))
        self._experts = {name for layer in self.config.sparse_layers for e in range(self.config.num_experts)
                         for _, name, _ in self.config.expert_sources(layer, e)}
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
        dense and shared MLPs, lm_head."""
        return {n: self.tensor(n, dtype) for n in self._index if n not in self._experts}

    def _check_expert(self, layer: int, expert: int) -> None:
        problem = self.config.expert_problem(layer, expert)
        if problem:
            raise CheckpointError(problem)

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[str, TensorInfo]]:
        """(part, where its bytes lie) for one expert, in part order: a fused tensor's slice."""
        self._check_expert(layer, expert)
        shapes = dict(self.config.expert_parts())
        out = []
        for part, name, index in self.config.expert_sources(layer, expert):
            t = self.info(name)
            if index is not None:
                per = t.nbytes // t.shape[0]
                t = TensorInfo(t.file, t.dtype, tuple(shapes[part]), t.offset + index * per, per)
            out.append((part, t))
        return out

    def expert(self, layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """One routed expert's tensors by part name (`config.expert_parts()`)."""
        self._check_expert(layer, expert)
        return {part: self.tensor(name, dtype, index) for part, name, index in self.config.expert_sources(layer, expert)}

    def close(self) -> None:
        self._handles.clear()
