"""Cold-file reads into a slot: from the page cache with parallel preadv2(RWF_NOWAIT), from the
disk through a populated mapping; the same bytes either way, in every range layout."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_workers.store.fileread import MIN_PART_BYTES, TruncatedFile, _parts, drop_from_page_cache, read_ranges


def _file(tmp_path, nbytes: int) -> tuple[str, bytes]:
    data = os.urandom(nbytes)
    path = tmp_path / "expert.bin"
    path.write_bytes(data)
    return str(path), data


def test_cached_bytes_are_read_with_preadv_across_threads(tmp_path):
    nbytes = 3 * MIN_PART_BYTES + 12345  # several parts, the last one short
    path, data = _file(tmp_path, nbytes + 100)
    slot = torch.zeros(nbytes, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, nbytes + 100, 0)  # in the page cache now
        assert read_ranges(fd, [(100, 0, nbytes)], slot) == "cache"
    finally:
        os.close(fd)
    assert bytes(slot.numpy()) == data[100:100 + nbytes]


def test_uncached_bytes_come_from_the_disk_through_the_mapping(tmp_path):
    path, data = _file(tmp_path, 2 * MIN_PART_BYTES)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(50):  # pages under writeback may survive a drop: until RWF_NOWAIT refuses one
            drop_from_page_cache([path])
            try:
                os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
            except BlockingIOError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"{path} stayed in the page cache after 50 drops")
        drop_from_page_cache([path])  # again: the refused read may have started the kernel's readahead
        slot = torch.zeros(len(data), dtype=torch.uint8)
        # two ranges in swapped order: each lands where the slot wants it
        half = len(data) // 2
        assert read_ranges(fd, [(half, 0, half), (0, half, half)], slot) == "disk"
    finally:
        os.close(fd)
    assert bytes(slot.numpy()) == data[half:] + data[:half]


def test_a_range_past_the_end_is_refused_before_any_read(tmp_path):
    path, _ = _file(tmp_path, 8192)
    slot = torch.full((8192,), 7, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TruncatedFile, match="8193 bytes expected, 8192 present"):
            read_ranges(fd, [(1, 0, 8192)], slot)
    finally:
        os.close(fd)
    assert int(slot.sum()) == 7 * 8192  # untouched


def test_parts_cover_every_byte_once_in_aligned_pieces():
    ranges = [(4096, 0, 10 * MIN_PART_BYTES + 7), (0, 10 * MIN_PART_BYTES + 7, 100)]
    parts = _parts(ranges, 3)
    covered = sorted((s, s + n) for _, s, n in parts)
    assert covered[0][0] == 0 and covered[-1][1] == 10 * MIN_PART_BYTES + 107
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap
    assert all(f - s == 4096 for f, s, _ in parts if s < 10 * MIN_PART_BYTES + 7)  # file and slot move together
    assert len([p for p in parts if p[1] < 10 * MIN_PART_BYTES + 7]) == 3
    assert all(n % 4096 == 0 for _, _, n in parts[:2])
    assert len(_parts([(0, 0, MIN_PART_BYTES)], 8)) == 1  # small reads stay on one thread
