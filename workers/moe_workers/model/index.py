"""Where each tensor of a Hugging Face safetensors checkpoint lies, from the file headers only
(pure: JSON and byte offsets, no torch): what the store reads an expert's bytes by, and what the
operator checks a checkpoint's tensors against its config.json with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .family import CheckpointError


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file: JSON only, no tensor is loaded."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 100 << 20:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        try:
            return n, json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: not a safetensors file ({err})") from None


def file_index(path: Path) -> dict[str, TensorInfo]:
    header_len, header = safetensors_header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = TensorInfo(path, info["dtype"], tuple(info["shape"]), 8 + header_len + begin, end - begin)
    return out


def read_index(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint directory: through model.safetensors.index.json when there
    is one, else every *.safetensors file. Pickle files are never read."""
    path = Path(path)
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index_file}: names {f.name}, which does not exist")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
            hint = f" (found {', '.join(pickles)}: pickle files are never loaded; convert to safetensors)" if pickles else ""
            raise CheckpointError(f"{path}: no *.safetensors files{hint}")
    out: dict[str, TensorInfo] = {}
    for f in files:
        out.update(file_index(f))
    return out
