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
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="swiglu rows"):  # one row given as 1-D: 32 rows to the C code
        native.swiglu_rows([torch.zeros(32, dtype=torch.bfloat16)], [w], [w], [w.t().contiguous()],
                           [torch.empty(1, 32, dtype=torch.bfloat16)])
    too_many = native.ROWS_MAX + 1
    with pytest.raises(ValueError, match="matvec"):
        native.matvec(w, torch.zeros(too_many, 32, dtype=torch.bfloat16), torch.empty(too_many, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="matvec"):
        native.matvec(w, torch.zeros(2, 32, dtype=torch.bfloat16), torch.empty(1, 64, dtype=torch.bfloat16))


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
        native.swiglu_rows(xs, w1, w3, w2, list(out.split(1)))
        for e in range(n):
            want = expert_mlp(xs[e], w1[e], w2[e], w3[e])[0].float()
            torch.testing.assert_close(out[e].float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
        assert not out.isnan().any()


def _torch_expert(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """A SwiGLU expert through torch's F.linear alone (what the C path replaces)."""
    import torch.nn.functional as F

    return F.linear(F.silu(F.linear(x, w["w1"])) * F.linear(x, w["w3"]), w["w2"])


def test_local_experts_and_a_shard_call_take_the_c_path_for_a_few_rows_each_and_torch_beyond(cache, tmp_path):
    """The in-process model's decode step and a shard's compute_rows put every expert with up to
    ROWS_MAX rows in one C call (values within bf16 rounding of torch's), an expert with more rows
    through torch, and a row's values do not depend on how many rows share its expert (the same
    bits alone and among 16: the served and in-process batches agree whatever their grouping)."""
    from checkpoints import make_family
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.experts import LocalExperts, compute_rows, native_rows

    make_family(tmp_path, "qwen3_moe", hidden_size=256, intermediate_size=64)
    ckpt = Checkpoint(tmp_path)
    experts = LocalExperts(ckpt, torch.bfloat16)
    cfg, layer = ckpt.config, ckpt.config.sparse_layers[0]
    keys = [(layer, e) for e in range(4)]
    big = native.ROWS_MAX + 1
    x = torch.randn(3 * native.ROWS_MAX + big, cfg.hidden_size).bfloat16()
    calls = []
    real = native.swiglu_rows
    try:
        native.swiglu_rows = lambda *a: (calls.append([t.shape[0] for t in a[0]]), real(*a))[1]
        for counts in ([1, 1, 1, 1], [2, 2], [1, native.ROWS_MAX, 3], [1, big, 2]):
            calls.clear()
            n = sum(counts)
            out = torch.full((n, cfg.hidden_size), float("nan"), dtype=torch.bfloat16)
            compute_rows(experts.weights, keys[:len(counts)], counts, x[:n], out, cfg)
            assert calls == [[c for c in counts if c <= native.ROWS_MAX]], counts  # one call; `big` in torch
            at = 0
            for key, c in zip(keys, counts):
                want = _torch_expert(x[at:at + c], experts.weights[key]).float()
                torch.testing.assert_close(out[at:at + c].float(), want, rtol=2 ** -6,
                                           atol=2 ** -6 * want.abs().max().item())
                at += c
        many = torch.empty(native.ROWS_MAX, cfg.hidden_size, dtype=torch.bfloat16)
        compute_rows(experts.weights, keys[:1], [native.ROWS_MAX], x[:native.ROWS_MAX], many, cfg)
        for i in (0, 5, native.ROWS_MAX - 1):
            alone = torch.empty(1, cfg.hidden_size, dtype=torch.bfloat16)
            compute_rows(experts.weights, keys[:1], [1], x[i:i + 1], alone, cfg)
            assert torch.equal(alone.view(torch.int16), many[i:i + 1].view(torch.int16))
        calls.clear()
        experts.moe(layer, x[:1], torch.tensor([[0, 2]]), torch.tensor([[0.6, 0.4]]))
        assert calls == [[1, 1]]
        calls.clear()
        experts.forward(layer, {0: x[:2], 1: x[2:2 + big]})
        assert calls == [[2]]
    finally:
        native.swiglu_rows = real
    assert not native_rows(cfg, [x[:big]], [experts.weights[keys[0]]], [out[:big]])  # too many rows: not taken


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


def _gpt_oss_experts(g: torch.Generator, n: int, hidden: int, inter: int, out_in: bool) -> list[dict]:
    """n random gpt-oss experts as the hot tier keeps them ([out, in] or [in, out]), their gate and
    up products well beyond the clamp limit (7) for unit-variance rows, biases not zero."""
    def w(rows, cols):
        m = (torch.randn(rows, cols, generator=g) * 12 / rows ** 0.5).bfloat16()
        return m.t().contiguous() if out_in else m

    return [{"gate_up": w(hidden, 2 * inter), "gate_up_bias": torch.randn(2 * inter, generator=g).bfloat16(),
             "down": w(inter, hidden) * 0.1, "down_bias": torch.randn(hidden, generator=g).bfloat16()}
            for _ in range(n)]


def _gpt_oss_rows(ws: list[dict], xs: list[torch.Tensor], out_in: bool, limit: float = 7.0) -> list[torch.Tensor]:
    outs = [torch.full_like(x, float("nan")) for x in xs]
    native.gptoss_rows(xs, *([w[k] for w in ws] for k in ("gate_up", "gate_up_bias", "down", "down_bias")), 1.702,
                       limit, out_in, outs)
    return outs


@pytest.mark.parametrize("out_in", [True, False], ids=["out-in (mxfp4)", "in-out (bf16 release)"])
def test_gpt_oss_experts_in_c_equal_torchs_within_bf16_rounding(cache, monkeypatch, out_in):
    """gpt-oss' clamped SwiGLU with biases through the C kernels (1, 16, 3 and 7 rows of four experts
    in one call; weights split across three parts, rows of 516 / pairs of 260 that are not whole
    vectors or blocks) against `layers.expert_forward` by torch alone (MOE_NATIVE=0), in bf16.

    Tolerance: both sides round each product (gate/up, down) once to bf16 from float32 sums taken
    in different orders, so a product differs by at most a bf16 ulp or two (2^-8 relative) and the
    activation passes that on; 2^-6 (4 ulps) of the row's largest output, as for the SwiGLU
    experts. Where torch's products are the C matrix-vector kernel itself ([out, in], the library
    on), the activation rounds where torch's ops round: all but a few values in 10^3 bit-equal.
    The rows reach far past the clamp limit: without the clamp the outputs are others."""
    from types import SimpleNamespace

    from moe_workers.model.layers import expert_forward

    g = torch.Generator().manual_seed(9)
    hidden, inter, counts = 516, 260, [1, native.ROWS_MAX, 3, 7]
    ws = _gpt_oss_experts(g, len(counts), hidden, inter, out_in)
    xs = [torch.randn(c, hidden, generator=g).bfloat16() for c in counts]
    cfg = SimpleNamespace(expert_act="gpt_oss", swiglu_alpha=1.702, swiglu_limit=7.0, experts_out_in=out_in)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(native, "PARALLEL_BYTES", 1 << 16)
    assert native._parts(hidden, ws[0]["gate_up"].nbytes) == 3
    ours = _gpt_oss_rows(ws, xs, out_in)
    with_c = [expert_forward(cfg, x, w) for x, w in zip(xs, ws)]
    unclamped = _gpt_oss_rows(ws, xs, out_in, limit=float("inf"))
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.reset()
    gate_up = torch.cat([x @ (w["gate_up"].t() if out_in else w["gate_up"]) for x, w in zip(xs, ws)]).float()
    assert (gate_up.abs() > 2 * cfg.swiglu_limit).float().mean() > 0.2  # the clamp is in play
    for x, w, got, c_products, free in zip(xs, ws, ours, with_c, unclamped):
        want = expert_forward(cfg, x, w).float()
        tol = 2 ** -6 * want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=tol)
        assert (free.float() - want).abs().max() > 100 * tol
        if out_in:
            assert (got.view(torch.int16) == c_products.view(torch.int16)).float().mean() > 0.999


@pytest.mark.parametrize("out_in", [True, False], ids=["out-in (mxfp4)", "in-out (bf16 release)"])
def test_a_gpt_oss_rows_values_do_not_depend_on_the_rows_and_experts_beside_it(cache, monkeypatch, out_in):
    """A row through the C gpt-oss kernels alone gives the same bits as among ROWS_MAX rows of its
    expert and beside another expert's rows in the same call (the sums' order and their split
    across threads are fixed by the shape, not by the call)."""
    g = torch.Generator().manual_seed(10)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(native, "PARALLEL_BYTES", 1 << 16)
    ws = _gpt_oss_experts(g, 2, 300, 136, out_in)
    xs = [torch.randn(native.ROWS_MAX, 300, generator=g).bfloat16(), torch.randn(5, 300, generator=g).bfloat16()]
    together = _gpt_oss_rows(ws, xs, out_in)[0]
    for i in (0, 7, native.ROWS_MAX - 1):
        alone = _gpt_oss_rows(ws[:1], [xs[0][i:i + 1]], out_in)[0]
        assert torch.equal(alone.view(torch.int16), together[i:i + 1].view(torch.int16))


def test_a_gpt_oss_shard_call_takes_the_c_path_for_a_few_rows_each_and_torch_beyond(cache, tmp_path, monkeypatch):
    """gpt_oss' bf16 experts ([in, out], as its release stores them) in a shard's compute_rows: every
    expert with up to ROWS_MAX rows in one `native.gptoss_rows` call, within bf16 rounding of
    torch's; an expert with more rows through torch; no C kernels (MOE_NATIVE=0): torch."""
    from checkpoints import make_family
    from moe_workers.model.checkpoint import Checkpoint
    from moe_workers.model.experts import LocalExperts, compute_rows
    from moe_workers.model.layers import expert_forward

    make_family(tmp_path, "gpt_oss", hidden_size=128, intermediate_size=64)
    ckpt = Checkpoint(tmp_path)
    experts = LocalExperts(ckpt, torch.bfloat16)
    cfg, layer = ckpt.config, ckpt.config.sparse_layers[0]
    assert not cfg.experts_out_in
    keys = [(layer, e) for e in range(3)]
    calls = []
    real = native.gptoss_rows
    monkeypatch.setattr(native, "gptoss_rows", lambda *a: (calls.append([t.shape[0] for t in a[0]]), real(*a))[1])
    counts = [1, native.ROWS_MAX + 1, 5]
    x = torch.randn(sum(counts), cfg.hidden_size).bfloat16()
    out = torch.full_like(x, float("nan"))
    compute_rows(experts.weights, keys, counts, x, out, cfg)
    assert calls == [[1, 5]]
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.reset()
    at = 0
    for key, c in zip(keys, counts):
        want = expert_forward(cfg, x[at:at + c], experts.weights[key]).float()
        torch.testing.assert_close(out[at:at + c].float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
        at += c
    again = torch.empty_like(x)
    compute_rows(experts.weights, keys, counts, x, again, cfg)
    assert calls == [[1, 5]]  # torch served it
    torch.testing.assert_close(again.float(), out.float(), rtol=2 ** -6, atol=2 ** -6 * out.float().abs().max().item())


def test_a_dense_projections_decode_row_in_c_equals_torchs_within_bf16_rounding(cache, monkeypatch):
    """layers.linear on a few bf16 rows: the C product (w's rows split across torch's threads; row
    counts that are not a multiple of 4 or of the parts, a row length with a vector tail, a bias,
    1 to ROWS_MAX rows of x) against F.linear, and the same call with the C kernels off (torch)."""
    import torch.nn.functional as F

    from moe_workers.model.layers import linear

    g = torch.Generator().manual_seed(8)
    calls = []
    real = native.matvec
    monkeypatch.setattr(native, "matvec", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    for rows, n, bias, nx in ((5120, 2048, False, 1), (1030, 200, True, 1), (3, 40, False, 1), (1030, 200, True, 7),
                              (2048, 256, False, native.ROWS_MAX)):
        w = (torch.randn(rows, n, generator=g) * 0.03).bfloat16()
        x = torch.randn(nx, n, generator=g).bfloat16()
        b = torch.randn(rows, generator=g).bfloat16() if bias else None
        want = F.linear(x, w, b).float()
        got = linear(x, w, b)
        assert got.shape == (nx, rows) and calls[-1] == (rows, n)
        torch.testing.assert_close(got.float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.reset()
    n_calls = len(calls)
    torch.testing.assert_close(linear(x, w, b).float(), want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())
    assert len(calls) == n_calls  # torch served it


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
    several = native.matvec(w, x[None], torch.empty(1, 4096, dtype=torch.bfloat16))[0]
    one = torch.empty(4096, dtype=torch.bfloat16)
    assert native.library().moe_matvec_par(w.data_ptr(), 4096, 1024, x.data_ptr(), 1, one.data_ptr(), 1) == 0
    assert torch.equal(several.view(torch.int16), one.view(torch.int16))
