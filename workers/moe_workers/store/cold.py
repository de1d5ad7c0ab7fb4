"""The cold tier: per-expert safetensors files in a local cache directory (ColdCache)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

Key = tuple[int, int]  # (layer, expert)


class ColdCache:
    """Per-expert safetensors files under one directory, bounded in bytes.

    Files are named by expert and content digest and written atomically (temp + rename), so
    replicas sharing a node's directory never read a torn file."""

    def __init__(self, root: Path, model_path: Path, budget: int | None):
        tag = hashlib.sha256(str(model_path.resolve()).encode()).hexdigest()[:12]
        self.dir = root / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self.files: dict[Key, tuple[Path, str, int]] = {}  # key -> (file, digest, bytes)

    def used(self) -> int:
        return sum(n for _, _, n in self.files.values())

    def path_for(self, key: Key, digest: str) -> Path:
        return self.dir / f"{key[0]}.{key[1]}-{digest.removeprefix('sha256:')[:16]}.safetensors"

    def get(self, key: Key, digest: str) -> Path | None:
        f = self.files.get(key)
        return f[0] if f is not None and f[1] == digest and f[0].is_file() else None

    def put(self, key: Key, digest: str, tensors: dict[str, torch.Tensor], evict: Callable[[int], bool]) -> bool:
        """Write the file if the budget allows (after `evict(bytes needed)` made room)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.drop(key)
        if self.budget is not None and self.used() + nbytes > self.budget and not evict(nbytes):
            return False
        path = self.path_for(key, digest)
        if not path.is_file():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"digest": digest})
            os.replace(tmp, path)
        self.files[key] = (path, digest, nbytes)
        return True

    def adopt(self, key: Key, digest: str, tmp: Path, nbytes: int, evict: Callable[[int], bool]) -> bool:
        """Take a fully written temp file as the cache file of (key, digest), budget allowing."""
        self.drop(key)
        if self.budget is not None and self.used() + nbytes > self.budget and not evict(nbytes):
            return False
        path = self.path_for(key, digest)
        os.replace(tmp, path)
        self.files[key] = (path, digest, nbytes)
        return True

    def drop(self, key: Key) -> None:
        f = self.files.pop(key, None)
        if f is not None:
            with contextlib.suppress(FileNotFoundError):
                f[0].unlink()
