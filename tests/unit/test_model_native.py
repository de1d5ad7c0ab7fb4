"""The C decoder's build and load (moe_workers/model/native.py): compiled once per source, compiler
and CPU into a private cache, refused from a directory others may write, and replaced by the
torch decoder (same bits, tests/unit/test_quantized.py) wherever it cannot be built. Real
compiler, real shared object, no mocks."""

from __future__ import annotations

import os

import pytest
import torch

from moe_workers.model import native
from moe_workers.model.dequant import decode_mxfp4, dequantize_fp8, pack_mxfp4, quantize_fp8

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler here")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "native"
    monkeypatch.setenv(native.ENV_DIR, str(d))
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    native.reset()
    yield d
    native.reset()


def test_the_library_is_built_once_into_a_private_directory_and_reused(cache):
    assert native.library() is not None and native.describe().startswith("native (")
    (built,) = list(cache.glob("moe_decode-*.so"))
    assert cache.stat().st_mode & 0o777 == 0o700
    assert not list(cache.glob("*.tmp"))  # compiled under a temporary name, then renamed
    mtime = built.stat().st_mtime_ns
    native.reset()
    assert native.library() is not None
    assert [p.name for p in cache.glob("moe_decode-*.so")] == [built.name] and built.stat().st_mtime_ns == mtime


def test_a_cache_directory_others_may_write_is_refused_and_torch_decodes(cache):
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    assert native.library() is None
    assert "not private" in native.describe() and native.describe().startswith("torch (")
    assert not list(cache.glob("*.so"))
    w = torch.randn(64, 64)
    q, s = quantize_fp8(w, (32, 32))
    assert dequantize_fp8(q, s, (32, 32), torch.bfloat16).shape == (64, 64)  # the torch decoder serves


def test_a_compiler_that_fails_leaves_the_torch_decoder_with_its_message(cache, monkeypatch, tmp_path):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo broken-cc 1.0; exit 0; }\necho 'cc: out of luck' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    assert native.library() is None
    assert "out of luck" in native.describe()
    assert not list(cache.glob("*"))  # no half-written library left behind


def test_switched_off_by_the_environment(cache, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.library() is None and native.describe() == f"torch ({native.ENV_SWITCH}=0)"


def test_shapes_that_do_not_agree_are_refused_before_the_c_code_reads_memory(cache):
    q, s = quantize_fp8(torch.randn(256, 256), (128, 128))
    out = torch.empty(256, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scales \(2, 1\) \(want \(2, 2\)\)"):
        native.fp8(q.view(torch.uint8), s[:, :1].contiguous(), (128, 128), out)
    b, e = pack_mxfp4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="mxfp4 decode"):
        native.mxfp4(b, e, torch.empty(8, 32, dtype=torch.bfloat16))


def test_large_parts_split_across_threads_give_the_same_bits_as_one_call(cache, monkeypatch):
    w = torch.randn(1024, 2048) * 0.02  # 4 MiB of bfloat16: decoded by two threads
    q, s = quantize_fp8(w, (128, 128))
    b, e = pack_mxfp4(w)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    split = dequantize_fp8(q, s, (128, 128), torch.bfloat16), decode_mxfp4(b, e, torch.bfloat16)
    assert len(native._parts(1024, split[0].nbytes)) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    whole = dequantize_fp8(q, s, (128, 128), torch.bfloat16), decode_mxfp4(b, e, torch.bfloat16)
    assert all(torch.equal(a.view(torch.int16), c.view(torch.int16)) for a, c in zip(split, whole))
