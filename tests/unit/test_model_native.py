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
    assert native._parts(1024, split[0].nbytes) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    whole = dequantize_fp8(q, s, (128, 128), torch.bfloat16), decode_mxfp4(b, e, torch.bfloat16)
    assert all(torch.equal(a.view(torch.int16), c.view(torch.int16)) for a, c in zip(split, whole))


def test_a_decode_steps_swiglu_experts_in_c_equal_torchs_within_bf16_rounding(cache):
    """Every expert's one row through the C kernels (gate/up rows, then down rows, split across
    threads) against layers.expert_mlp on the same bf16 weights, at shapes with and without
    a vector tail (hidden 2048 / 200, intermediate 768 / 72)."""
    from moe_workers.model.layers import expert_mlp

    g = torch.Generator().manual_seed(4)
    for hidden, inter, n in ((2048, 768, 8), (200, 72, 3)):
        w1, w3 = ([(torch.randn(inter, hidden, generator=g) * 0.03).bfloat16() for _ in range(n)] for _ in range(2))
        w2 = [(torch.randn(hidden, inter, generator=g) * 0.03).bfloat16() for _ in range(n)]
        xs = [torch.randn(1, hidden, generator=g).bfloat16() for _ in range(n)]
        out = torch.full((n, hidden), float("nan"), dtype=torch.bfloat16)
        native.swiglu_rows([x[0] for x in xs], w1, w3, w2, list(out))
        for e in range(n):
            want = expert_mlp(xs[e], w1[e], w2[e], w3[e])[0].float()
            torch.testing.assert_close(out[e].float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
        assert not out.isnan().any()


def test_local_experts_and_a_shard_call_take_the_c_path_for_one_row_each_and_torch_otherwise(cache, tmp_path):
    """The in-process model's decode step and a shard's compute_rows give the torch path's
    values (within bf16 rounding) when every expert has one row, and fall back to torch for
    several rows an expert (the same numbers as before: nothing else changed)."""
    from checkpoints import make_family
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.experts import LocalExperts, compute_rows, native_rows
    from moe_workers.model.layers import expert_forward

    make_family(tmp_path, "qwen3_moe", hidden_size=256, intermediate_size=64)
    ckpt = Checkpoint(tmp_path)
    experts = LocalExperts(ckpt, torch.bfloat16)
    cfg, layer = ckpt.config, ckpt.config.sparse_layers[0]
    keys = [(layer, e) for e in range(4)]
    x = torch.randn(4, cfg.hidden_size).bfloat16()
    calls = []
    real = native.swiglu_rows
    try:
        native.swiglu_rows = lambda *a: (calls.append(len(a[0])), real(*a))[1]
        out = torch.empty_like(x)
        compute_rows(experts.weights, keys, [1, 1, 1, 1], x, out, cfg)
        assert calls == [4]
        want = torch.cat([experts.forward(layer, {e: x[e:e + 1]})[e] for e in range(4)])
        torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
        two = torch.empty_like(x)
        compute_rows(experts.weights, keys[:2], [2, 2], x, two, cfg)  # two rows an expert: torch
        assert calls == [4]
        mixed = torch.empty_like(x)
        compute_rows(experts.weights, keys[:3], [1, 2, 1], x, mixed, cfg)  # the single rows in C, the pair in torch
        assert calls == [4, 2]
        want = torch.cat([experts.forward(layer, {0: x[0:1]})[0], expert_forward(cfg, x[1:3], experts.weights[keys[1]]),
                          experts.forward(layer, {2: x[3:4]})[2]])
        torch.testing.assert_close(mixed.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
        calls.clear()
        indices = torch.tensor([[0, 2]])
        weights = torch.tensor([[0.6, 0.4]])
        experts.moe(layer, x[:1], indices, weights)
        assert calls == [2]
    finally:
        native.swiglu_rows = real
    assert not native_rows(cfg, [x[:2]], [experts.weights[keys[0]]], [out[:2]])  # two rows: not taken


def test_x_times_w_in_transformers_layout_in_c_equals_torchs_within_bf16_rounding(cache, monkeypatch):
    """gpt-oss' bf16 experts in [in, out]: one row through the C kernel (columns split across
    threads, a tail that is not a whole vector) against torch's x @ w, and a whole gpt-oss expert
    with the kernel against the same expert computed by torch alone."""
    from moe_workers.model.layers import gpt_oss_expert, in_out

    g = torch.Generator().manual_seed(6)
    for n, m in ((2880, 5760), (100, 2050)):
        w = (torch.randn(n, m, generator=g) * 0.03).bfloat16()
        x = torch.randn(1, n, generator=g).bfloat16()
        want = (x @ w).float()
        torch.testing.assert_close(in_out(x, w).float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    w = {"gate_up": (torch.randn(64, 96, generator=g) * 0.1).bfloat16(), "gate_up_bias": torch.randn(96).bfloat16(),
         "down": (torch.randn(48, 64, generator=g) * 0.1).bfloat16(), "down_bias": torch.randn(64).bfloat16()}
    x = torch.randn(1, 64, generator=g).bfloat16()
    ours = gpt_oss_expert(x, w, 1.702, 7.0).float()
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.reset()
    theirs = gpt_oss_expert(x, w, 1.702, 7.0).float()
    torch.testing.assert_close(ours, theirs, rtol=2 ** -5, atol=2 ** -5 * theirs.abs().max().item())


def test_a_dense_projections_decode_row_in_c_equals_torchs_within_bf16_rounding(cache, monkeypatch):
    """layers.linear on one bf16 row: the C matrix-vector product (rows split across torch's
    threads; row counts that are not a multiple of 4 or of the parts, a row length with a
    vector tail, a bias) against F.linear, and the same call with the C kernels off (torch.mv)."""
    import torch.nn.functional as F

    from moe_workers.model.layers import linear

    g = torch.Generator().manual_seed(8)
    calls = []
    real = native.matvec
    monkeypatch.setattr(native, "matvec", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    for rows, n, bias in ((5120, 2048, False), (1030, 200, True), (3, 40, False)):
        w = (torch.randn(rows, n, generator=g) * 0.03).bfloat16()
        x = torch.randn(1, n, generator=g).bfloat16()
        b = torch.randn(rows, generator=g).bfloat16() if bias else None
        want = F.linear(x, w, b).float()
        got = linear(x, w, b)
        assert got.shape == (1, rows) and calls[-1] == (rows, n)
        torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.reset()
    n_calls = len(calls)
    torch.testing.assert_close(linear(x, w, b).float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    assert len(calls) == n_calls  # torch.mv served it


def test_the_kernels_run_on_torchs_own_openmp_runtime(cache):
    """The library's parallel entry points run on the OpenMP runtime torch loaded (one libgomp in
    the process, so one team of threads: a second pool beside torch's left its spinning threads
    on the cores the kernels needed), and give the same bits with one part as with several."""
    assert native.library() is not None
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes
    w = (torch.randn(4096, 1024) * 0.03).bfloat16()
    x = torch.randn(1024).bfloat16()
    parts = native._parts(4096, w.nbytes)
    assert parts == min(torch.get_num_threads(), 4096)
    several = native.matvec(w, x, torch.empty(4096, dtype=torch.bfloat16))
    one = torch.empty(4096, dtype=torch.bfloat16)
    assert native.library().moe_matvec_par(w.data_ptr(), 4096, 1024, x.data_ptr(), one.data_ptr(), 1) == 0
    assert torch.equal(several.view(torch.int16), one.view(torch.int16))
