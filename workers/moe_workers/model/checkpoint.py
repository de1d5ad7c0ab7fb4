"""Lazy access to a Hugging Face layout checkpoint: only safetensors, one tensor at a time.

The ingress reads the dense part; each shard reads only its own experts. Nothing reads the whole
checkpoint into memory: `safe_open` maps the file and copies out the tensors asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, MoEConfig

EXPERT_KEY = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
EXPERT_WEIGHTS = ("w1", "w2", "w3")


def _expert_key_parts(name: str) -> tuple[int, int] | None:
    parts = name.split(".")
    # model.layers.L.block_sparse_moe.experts.E.wN.weight
    if len(parts) == 8 and parts[0] == "model" and parts[1] == "layers" and parts[4] == "experts":
        return int(parts[2]), int(parts[5])
    return None


class Checkpoint:
    """Tensor index of a checkpoint directory; tensors are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = MoEConfig.from_dir(self.path)
        self._index = self._build_index()
        self._handles: dict[Path, object] = {}

    def _build_index(self) -> dict[str, Path]:
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text()).get("weight_map", {})
            files = {name: self.path / fname for name, fname in weight_map.items()}
            for f in set(files.values()):
                if not f.is_file():
                    raise CheckpointError(f"{index_file}: names {f.name}, which does not exist")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            pickles = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
            hint = f" (found {', '.join(pickles)}: pickle files are never loaded; convert to safetensors)" if pickles else ""
            raise CheckpointError(f"{self.path}: no *.safetensors files{hint}")
        files: dict[str, Path] = {}
        for shard in shards:
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    files[name] = shard
        return files

    def _handle(self, file: Path):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(file, framework="pt")
        return h

    def names(self) -> list[str]:
        return list(self._index)

    def has(self, name: str) -> bool:
        return name in self._index

    def file_of(self, name: str) -> Path:
        try:
            return self._index[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name} is missing") from None

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self._handle(self.file_of(name)).get_tensor(name)
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    def dense_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every tensor that is not an expert weight: embeddings, attention, norms, routers, lm_head."""
        return {n: self.tensor(n, dtype) for n in self._index if _expert_key_parts(n) is None}

    def expert_names(self, layer: int, expert: int) -> list[str]:
        return [EXPERT_KEY.format(layer=layer, expert=expert, w=w) for w in EXPERT_WEIGHTS]

    def expert(self, layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """One expert's w1, w2, w3 (keys 'w1', 'w2', 'w3')."""
        cfg = self.config
        if not (0 <= layer < cfg.num_layers and 0 <= expert < cfg.num_experts):
            raise CheckpointError(
                f"expert {layer}.{expert} does not exist ({cfg.num_layers} layers x {cfg.num_experts} experts)")
        return {w: self.tensor(n, dtype) for w, n in zip(EXPERT_WEIGHTS, self.expert_names(layer, expert))}

    def close(self) -> None:
        self._handles.clear()
