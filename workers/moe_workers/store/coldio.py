"""The tiered store's disk side: an expert's bytes streamed from the checkpoint into a cold
file (and its digest) at registration, cold files and version sources read into a tier's slot,
cold files written after a swap, the cold cache's evictions by policy. A collaborator of
`TieredExpertStore` (its `disk`), working over the store's public part; it holds the store's
lock only around the cache index, the pools and the counters, never across a read."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from moe_workers.model.dtypes import SAFETENSORS_NAME, TORCH_NAME, torch_name
from moe_workers.model.index import safetensors_header as _safetensors_header
from moe_workers.model.quantization import read_scales, scale_problem

from .config import TierConfigError
from .entry import Key
from .ledger import COMPUTE, STORED
from .fileread import TruncatedFile, read_ranges
from .versions import CHECKPOINT, SwapError, Version, match_parts

if TYPE_CHECKING:
    from .store import TieredExpertStore


class ColdIO:
    """TieredExpertStore's reads and writes of expert files."""

    def __init__(self, store: TieredExpertStore):
        """Over `store`'s cold cache, checkpoint, slot pools and lock (held only around them)."""
        self.store = store

    def register(self, key: Key) -> str:
        """The checkpoint version's digest, and its cold file, in one sequential pass over the
        bytes with a small buffer: registering hundreds of experts never maps them into memory
        (the digest equals content_digest of the same tensors)."""
        ranges = self.store.ckpt.expert_ranges(*key)  # sorted by part: the order of a slot and a cache file
        h = hashlib.sha256()
        tmp = None
        out = None
        if self.store.cold is not None:
            tmp = self.store.cold.dir / f".register-{key[0]}.{key[1]}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            chunks = 4 << 20
            if tmp is not None:
                out = open(tmp, "wb")
                layout, offset = {}, 0
                for part, t in ranges:
                    layout[part] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
                    offset += t.nbytes
                head = json.dumps(layout, separators=(",", ":")).encode()
                head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as safetensors writes it
                out.write(len(head).to_bytes(8, "little") + head)
            for part, t in ranges:
                if self.store.model.quant is not None and part.endswith((".scale_inv", "_scales")):
                    self._check_scales(key, part, t)  # tiny: read twice rather than parsed from the stream
                h.update(f"{part}|{TORCH_NAME[t.dtype]}|{tuple(t.shape)}|".encode())
                with open(t.file, "rb", buffering=0) as f:
                    f.seek(t.offset)
                    left = t.nbytes
                    while left:
                        chunk = f.read(min(chunks, left))
                        if not chunk:
                            raise TierConfigError(f"{t.file}: truncated while reading expert {key[0]}.{key[1]} ({part})")
                        h.update(chunk)
                        if out is not None:
                            out.write(chunk)
                        left -= len(chunk)
            digest = "sha256:" + h.hexdigest()
            if out is not None:
                out.close()
                out = None
                with self.store.cv:
                    self.store.cold.adopt(key, digest, tmp, sum(t.nbytes for _, t in ranges), self._cold_evictor(key))
            return digest
        finally:
            if out is not None:
                out.close()
            if tmp is not None and tmp.exists():
                tmp.unlink()

    def _check_scales(self, key: Key, part: str, t) -> None:
        values = read_scales(t.file, t.dtype, t.shape, t.offset, t.nbytes)
        problem = scale_problem(values, part)
        if problem:
            raise TierConfigError(f"{t.file}: expert {key[0]}.{key[1]} ({part}) has {problem}")

    def read(self, key: Key, version: Version, target: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Read from the cold file, else from the version's source (filling the cold cache)."""
        with self.store.cv:
            path = self.store.cold.get(key, version.digest) if self.store.cold is not None else None
        if path is not None:
            try:
                if self.store.pools[target].device.type == "cpu":
                    return self._read_file_into(target, path)
                with safe_open(path, framework="pt") as f:  # to the device: through the mapping
                    raw = {k: f.get_tensor(k) for k in f.keys()}
                return self.store.fill(target, raw)
            except FileNotFoundError:  # replaced by a swap meanwhile: read the source instead
                pass
        raw = self._read_source(key, version)
        try:
            self._write_cold(key, version, raw)
            return self.store.fill(target, raw)
        finally:
            del raw
            self.store.ckpt.close()  # unmap: pages read through the mapping would otherwise stay in RSS

    def _read_file_into(self, tier: str, path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor, object]:
        """Read a cold file straight into a host slot. When the file's data region is w1, w2, w3
        back to back, as the slot lays them out (cache files are written so), it is read in one
        piece, otherwise tensor by tensor (fileread: from the page cache with parallel preadv2,
        from the disk through a populated mapping; no pages stay mapped beyond the slot). A
        quantized expert bound for a compute slot is read so into a staging buffer in its stored
        form, then decoded into the slot. Falls back to safetensors' mapping (with dtype
        conversion) when the file holds another form or dtype."""
        header_len, header = _safetensors_header(path)
        form = self.store.forms.form(tier)
        with open(path, "rb", buffering=0) as f:
            if self._holds(header, form):
                with self.store.cv:
                    buf, slot_after = self.store.pools[tier].take()
                try:
                    self.store.ops.host_wait(slot_after)  # (outside the lock) a DMA may still read this pinned slot
                    views = self._read_layout(f.fileno(), path, header_len, header, form, buf)
                except BaseException:
                    with self.store.cv:
                        self.store.pools[tier].give(buf, slot_after)
                    raise
                return views, buf, None  # written by the CPU: ready now
            if form == COMPUTE and self.store.forms.quantized and self._holds(header, STORED):
                with self.store.cv:
                    staging, staging_after = self.store.staging.take()
                ready = None
                try:
                    self.store.ops.host_wait(staging_after)  # the last decode out of it
                    stored = self._read_layout(f.fileno(), path, header_len, header, STORED, staging)
                    views, buf, ready = self.store.fill(tier, stored)
                finally:
                    with self.store.cv:
                        self.store.staging.give(staging, [ready])
                return views, buf, ready
        with safe_open(path, framework="pt") as g:  # another form or dtype: converted by _fill
            return self.store.fill(tier, {k: g.get_tensor(k) for k in g.keys()})

    def _holds(self, header: dict, form: str) -> bool:
        """Whether a safetensors header holds exactly the parts of `form`, in their dtypes."""
        want = {name: SAFETENSORS_NAME.get(torch_name(dtype)) for name, dtype, _ in self.store.parts[form]}
        return set(header) - {"__metadata__"} == set(want) and all(header[w]["dtype"] == d for w, d in want.items())

    def _read_layout(self, fd: int, path: Path, header_len: int, header: dict, form: str,
                     buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts of `form` read from the file into `buf`, laid out as a slot of that form."""
        views = self.store.views(buf, form)
        ranges, offset = [], 0  # (file offset, slot offset, bytes) per tensor
        for w, dst in views.items():
            begin, end = header[w]["data_offsets"]
            nbytes = dst.numel() * dst.element_size()
            if list(header[w]["shape"]) != list(dst.shape) or end - begin != nbytes:
                raise SwapError(f"{path}: cache file does not match the model ({w})")
            ranges.append((8 + header_len + begin, offset, nbytes))
            offset += nbytes
        if all(r[0] - ranges[0][0] == r[1] for r in ranges):  # one contiguous region: one copy
            ranges = [(ranges[0][0], 0, offset)]
        try:
            where = read_ranges(fd, ranges, buf)  # checks the file holds every range first
        except TruncatedFile as err:
            raise SwapError(f"{path}: {err}") from None
        with self.store.cv:
            self.store.stats.cold_reads[where] += 1
        return views

    def _read_source(self, key: Key, version: Version) -> dict[str, torch.Tensor]:
        if version.source == CHECKPOINT:
            return self.store.ckpt.expert_stored(*key)
        with safe_open(version.source, framework="pt") as f:  # validated when the swap was accepted
            names = list(f.keys())
            stored = match_parts(self.store.model, *key, names, stored=True) if self.store.model.quant is not None else {}
            if len(stored) == len(self.store.model.stored_parts()):  # the quantized form
                return {part: f.get_tensor(name) for part, name in stored.items()}
            return {part: f.get_tensor(name) for part, name in match_parts(self.store.model, *key, names).items()}

    def write_if_current(self, key: Key, version: Version, raw: dict[str, torch.Tensor]) -> None:
        with self.store.cv:
            e = self.store.entries.get(key)
            if e is None or e.version != version:
                return  # superseded by a later swap meanwhile
        try:
            self._write_cold(key, version, raw)
        except OSError:
            pass  # the cache is an optimisation: the version's source still serves reads

    def _write_cold(self, key: Key, version: Version, raw: dict[str, torch.Tensor]) -> None:
        if self.store.cold is None or self.store.cold.get(key, version.digest) is not None:
            return

        with self.store.cv:  # the cache index is shared with the prefetch thread
            self.store.cold.put(key, version.digest, raw, self._cold_evictor(key))

    def _cold_evictor(self, key: Key) -> Callable[[int], bool]:
        def evict(nbytes: int) -> bool:
            budget = self.store.cold.budget or 0
            with self.store.cv:
                while self.store.cold.used() + nbytes > budget:
                    cands = [k for k in self.store.cold.files if k != key and not (k in self.store.entries and self.store.entries[k].busy)]
                    victim = self.store.policy.victim(cands)
                    if victim is None:
                        return False
                    self.store.cold.drop(victim)
            return True

        return evict
