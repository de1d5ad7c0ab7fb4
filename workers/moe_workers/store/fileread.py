"""Reading byte ranges of a cold file into a host slot, at the speed of where the bytes are.

From the page cache: `preadv2(RWF_NOWAIT)` straight into the slot, split over the intra-op
threads (the kernel's copy, no mapping to set up: a MAP_POPULATE mapping spent about a fifth of
a cached promotion filling page tables). RWF_NOWAIT refuses (EAGAIN, or a short read) as soon as
a page is not cached, and then the file is read from the disk through a populated mapping (the
kernel reads it in with readahead, several requests in flight: faster than O_DIRECT or buffered
reads on the disks measured, see bench/tiering.py)."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
import warnings

import torch

Range = tuple[int, int, int]  # (file offset, slot offset, bytes)

# pieces below this are read by one thread: the hand-off would cost more than it saves
MIN_PART_BYTES = 4 << 20
_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class TruncatedFile(OSError):
    """The file ends before a range the header promised."""


def read_ranges(fd: int, ranges: list[Range], slot: torch.Tensor) -> str:
    """slot[s:s + n] <- file[f:f + n] for each (f, s, n). Returns where the bytes came from:
    "cache" (all of them were in the page cache) or "disk"."""
    size = os.fstat(fd).st_size
    for f, _, n in ranges:
        if f + n > size:
            raise TruncatedFile(f"truncated cache file: {f + n} bytes expected, {size} present")
    if _NOWAIT is not None and _read_cached(fd, ranges, slot):
        return "cache"
    _copy_mapped(fd, ranges, slot)
    return "disk"


def _parts(ranges: list[Range], pieces: int) -> list[Range]:
    """The ranges cut into about `pieces` parts of similar size (4 KiB-aligned cuts)."""
    total = sum(n for _, _, n in ranges)
    share = -(-total // max(1, pieces))  # rounded up, then up to a page
    step = max(MIN_PART_BYTES, -(-share // 4096) * 4096)
    out = []
    for f, s, n in ranges:
        for off in range(0, n, step):
            out.append((f + off, s + off, min(step, n - off)))
    return out


def _read_cached(fd: int, ranges: list[Range], slot: torch.Tensor) -> bool:
    """All of the ranges from the page cache, or False as soon as one page is not there (what
    was read by then is overwritten by the caller's next read)."""
    view = memoryview(slot.numpy()).cast("B")

    def part(r: Range) -> bool:
        f, s, n = r
        done = 0
        while done < n:
            try:
                got = os.preadv(fd, [view[s + done:s + n]], f + done, _NOWAIT)
            except BlockingIOError:
                return False
            except OSError as err:
                if err.errno in (95, 22):  # EOPNOTSUPP / EINVAL: this file system has no RWF_NOWAIT
                    return False
                raise
            if got <= 0:
                return False
            done += got
        return True

    parts = _parts(ranges, torch.get_num_threads())
    try:
        if len(parts) == 1:
            return part(parts[0])
        return all(_threads().map(part, parts))
    finally:
        view.release()


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max(2, torch.get_num_threads()),
                                                          thread_name_prefix="cold-read")
        return _pool


def _copy_mapped(fd: int, ranges: list[Range], slot: torch.Tensor) -> None:
    """The ranges through one populated mapping of the file that is gone when this returns."""
    m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    try:
        for file_offset, slot_offset, nbytes in ranges:
            with warnings.catch_warnings():  # a read-only buffer: nothing writes it, torch only reads it
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=file_offset)
            slot[slot_offset:slot_offset + nbytes].copy_(src)  # torch's copy, on the thread's intra-op threads
            del src
    finally:
        m.close()


def drop_from_page_cache(paths) -> None:
    """Evict these files' pages from the page cache, written back first (dirty pages stay);
    what benchmarks and tests use to read a cold file from the disk again."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
