"""Quantized checkpoints as they ship (fp8 block scales, mxfp4 experts): read exactly as
transformers dequantizes them, kept in their stored form in the cold tier, hot-swapped in either
form, and refused naming the file and tensor when a part is wrong. No Ray, no cluster.

The checkpoints are transformers' own (`make_family`), rewritten by our quantizer into the
published layouts (`quantize_checkpoint`, what `moectl init-model --quantize` runs: nothing on
CPU writes these formats). transformers (>= 5 with accelerate) dequantizes both on CPU; it
mis-reads grids whose dimensions are not multiples of the block, so ragged grids are checked
against the published formula instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoints import make_family, reference_greedy
from moe_operator.api.semantics import read_model_facts
from moe_workers.model import native
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.config import CheckpointError, UnsupportedModel
from moe_workers.model.dequant import decode, decode_mxfp4, dequantize_fp8, pack_mxfp4, quantize_fp8
from moe_workers.model.index import read_index
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.random_init import quantize_checkpoint
from moe_workers.store.store import TierConfig, TieredExpertStore
from moe_workers.store.versions import SwapError, load_expert_file

# block 8: every dimension of these tiny models is a whole number of blocks (transformers' oracle holds)
CASES = {"deepseek_v3-fp8": ("deepseek_v3", "fp8", torch.float32), "qwen3_moe-fp8": ("qwen3_moe", "fp8", torch.bfloat16),
         "gpt_oss-mxfp4": ("gpt_oss", "mxfp4", None), "deepseek_v2-fp8": ("deepseek_v2", "fp8", torch.float16)}


@pytest.fixture(params=["native", "torch"])
def decoder(request, monkeypatch):
    """Run the test with the C decoder (it must build wherever a C compiler is), then with torch's."""
    monkeypatch.setenv(native.ENV_SWITCH, "1" if request.param == "native" else "0")
    native.reset()
    if request.param == "native":
        if native._compiler() is None:
            pytest.skip("no C compiler here: the native decoder cannot be built")
        assert native.library() is not None, native.describe()
    else:
        assert native.library() is None
    yield request.param
    native.reset()


def _prompt(n, seed=1):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _quantized(path: Path, family: str, method: str, scale_dtype=torch.float32, block=(8, 8), **dims):
    make_family(path, family, hidden_size=64, intermediate_size=32, **dims)
    quantize_checkpoint(path, method, block=block, scale_dtype=scale_dtype or torch.float32)
    return path


def _rewrite(path: Path, edit) -> None:
    """Apply edit(tensors) to the checkpoint's one safetensors file."""
    f = path / "model.safetensors"
    with safe_open(f, framework="pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("case", list(CASES))
def test_a_quantized_checkpoint_serves_what_transformers_computes_from_it(tmp_path, case):
    from transformers import AutoModelForCausalLM

    family, method, scale_dtype = CASES[case]
    _quantized(tmp_path, family, method, scale_dtype)
    stored = {t.dtype for n, t in read_index(tmp_path).items() if ".experts." in n}
    assert stored >= ({"F8_E4M3"} if method == "fp8" else {"U8"})  # the experts really are stored quantized
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = InProcessModel(tmp_path)
    assert ours.cfg.quant.method == method
    prompt = _prompt(37)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours.prompt_logits(prompt), want, atol=1e-4, rtol=1e-4)
    assert ours.generate([prompt], max_tokens=8) == [reference_greedy(ref, prompt, 8)]


_E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _formula(q, s, block):
    """The published fp8 formula, element by element: W[i, j] = q[i, j] * S[i // b0, j // b1]."""
    i = torch.arange(q.shape[0])[:, None] // block[0]
    j = torch.arange(q.shape[1])[None, :] // block[1]
    return q.to(torch.float32) * s.to(torch.float32)[i, j]


def test_ragged_fp8_grids_follow_the_published_formula(tmp_path):
    # DeepSeek-V3's kv_a_proj_with_mqa: 576 x 7168 in blocks of 128, a 5 x 56 grid with a half last row
    w = torch.randn(576, 7168) * 0.02
    q, s = quantize_fp8(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 56)
    torch.testing.assert_close(dequantize_fp8(q, s, (128, 128), torch.float32), _formula(q, s, (128, 128)),
                               atol=0, rtol=0)
    assert (dequantize_fp8(q, s, (128, 128), torch.float32) - w).abs().max() <= w.abs().max() / 16  # E4M3: 3 bits
    # a whole model whose weights are ragged in blocks of 128 (hidden 160, experts 96 wide): every
    # dense weight and expert read back by the formula from the stored bytes
    make_family(tmp_path, "deepseek_v3", hidden_size=160, intermediate_size=96, num_heads=4, num_kv_heads=4)
    quantize_checkpoint(tmp_path, "fp8", block=(128, 128))
    ckpt = Checkpoint(tmp_path)
    raw = {n: ckpt.tensor(n) for n in ckpt.names()}
    ragged = [n for n, t in raw.items() if t.dtype == torch.float8_e4m3fn and (t.shape[0] % 128 or t.shape[1] % 128)]
    assert any("kv_a_proj_with_mqa" in n for n in ragged) and any(".experts." in n for n in ragged)
    for name, t in ckpt.dense_state().items():
        if raw[name].dtype == torch.float8_e4m3fn:
            torch.testing.assert_close(t, _formula(raw[name], raw[name + "_scale_inv"], (128, 128)), atol=0, rtol=0)
    p = "model.layers.1.mlp.experts.3."
    for part, name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        want = _formula(raw[p + name + ".weight"], raw[p + name + ".weight_scale_inv"], (128, 128))
        torch.testing.assert_close(ckpt.expert(1, 3)[part], want, atol=0, rtol=0)
    assert len(InProcessModel(tmp_path).generate([_prompt(9)], max_tokens=3)[0]) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_fp8_code_decodes_to_torchs_cast_times_its_scale_rounded_once(dtype, decoder):
    """Both decoders (the C loops, and torch's table lookups a few rows at a time): every one of
    the 256 codes (NaN included), under scales of every magnitude, whole and partial blocks,
    gives the bits of torch's own cast times the scale."""
    g = torch.Generator().manual_seed(5)
    codes = torch.arange(256, dtype=torch.uint8).repeat(300)[torch.randperm(76800, generator=g)]
    q = codes.view(200, 384).view(torch.float8_e4m3fn)
    for block in ((128, 128), (64, 96), (200, 384)):
        grid = (-(-200 // block[0]), -(-384 // block[1]))
        s = torch.exp2(torch.randint(-20, 8, grid, generator=g).float()) * torch.rand(grid, generator=g).add(0.5)
        want = _formula(q, s, block).to(dtype)
        got = dequantize_fp8(q, s, block, dtype)
        assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 2 * 300
        assert torch.equal(got[~got.isnan()], want[~want.isnan()]), block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_mxfp4_byte_under_every_scale_decodes_to_the_formula(dtype, decoder):
    """Every block byte under every one of the 256 scale bytes (the C decoder's integer path for
    bfloat16 and its float path at the extremes, where products are subnormal or infinite),
    in parts large enough to be split across threads: the published formula, bit for bit."""
    g = torch.Generator().manual_seed(3)
    rows, groups = 256, 256  # row r, group j: scale byte j; bytes cycle through all 256
    blocks = torch.randint(0, 256, (rows, groups, 16), dtype=torch.uint8, generator=g)
    blocks[0] = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(16, 1)
    scales = torch.arange(256, dtype=torch.uint8).repeat(rows, 1)
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    values = torch.stack((_E2M1_TABLE[lo], _E2M1_TABLE[hi]), dim=-1).view(rows, groups, 32)
    want = (values * torch.exp2(scales.float() - 127).unsqueeze(-1)).view(rows, -1).to(dtype)
    got = decode_mxfp4(blocks, scales, dtype)
    nan = want.isnan()  # 0 x 2^128 (scale byte 255, which checkpoint checks refuse): NaN in any payload
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert torch.equal(got[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_mxfp4_codes_decode_as_the_format_says(decoder):
    # low nibble first; codes 0-7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign; scale 2 ** (byte - 127)
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x0 | (0x7 << 4)  # elements 0, 1: 0 and 6
    blocks[0, 0, 1] = 0x9 | (0x3 << 4)  # elements 2, 3: -0.5 and 1.5
    scales = torch.tensor([[128]], dtype=torch.uint8)  # x 2
    got = decode_mxfp4(blocks, scales, torch.float32)[0]
    assert got[:4].tolist() == [0.0, 12.0, -1.0, 3.0] and not got[4:].any()
    w = torch.randn(8, 64)
    b, s = pack_mxfp4(w)
    assert b.shape == (8, 2, 16) and s.shape == (8, 2) and b.dtype == s.dtype == torch.uint8
    back = decode_mxfp4(b, s, torch.float32)
    assert ((back - w).abs() <= w.abs().reshape(8, 2, 32).amax(-1).repeat_interleave(32, 1) / 4 + 1e-6).all()
    # every byte under every scale, a few rows at a time and into a transposed view (the compute
    # layout): the published formula, value by value
    big = torch.arange(256, dtype=torch.uint8).repeat(40 * 64 // 256 * 16)[:40 * 64 * 16].view(40, 64, 16)
    exps = torch.arange(40 * 64).remainder(255).to(torch.uint8).view(40, 64)
    lo, hi = (big & 0x0F).long(), (big >> 4).long()
    values = torch.stack((_E2M1_TABLE[lo], _E2M1_TABLE[hi]), dim=-1).view(40, 64, 32)
    want = (values * torch.exp2(exps.float() - 127).unsqueeze(-1)).view(40, -1).to(torch.bfloat16)
    assert torch.equal(decode_mxfp4(big, exps, torch.bfloat16), want)
    out = torch.empty(64 * 32, 40, dtype=torch.bfloat16)
    decode_mxfp4(big, exps, torch.bfloat16, out=out.t())
    assert torch.equal(out, want.t())


def test_the_cold_tier_keeps_the_stored_form_and_the_hot_tier_serves_it_decoded(tmp_path):
    model = _quantized(tmp_path / "m", "qwen3_moe", "fp8", torch.bfloat16)
    ckpt = Checkpoint(model)
    store = TieredExpertStore(ckpt, torch.float32, TierConfig(cold_dir=str(tmp_path / "cold")))
    keys = [(1, e) for e in range(8)]
    store.configure(keys)
    stored_bytes = sum(t.nbytes for _, t in ckpt.expert_ranges(1, 0))
    assert stored_bytes < store.expert_bytes / 3  # fp8 + bf16 scales against fp32
    cold = store.residency()["cold"]
    assert (cold["experts"], cold["bytes"], cold["expert_bytes"], cold["form"]) == (8, 8 * stored_bytes, stored_bytes, "stored")
    assert cold["vs_compute"] == round(stored_bytes / store.expert_bytes, 4)
    f = next(store.cold.dir.glob("1.0-*.safetensors"))
    with safe_open(f, framework="pt") as h:
        assert {k: h.get_slice(k).get_dtype() for k in h.keys()} == {
            "w1": "F8_E4M3", "w1.scale_inv": "BF16", "w2": "F8_E4M3", "w2.scale_inv": "BF16",
            "w3": "F8_E4M3", "w3.scale_inv": "BF16"}
    for k in keys:
        store.demote(k)
        store.demote(k)
    with store.use(keys) as weights:  # read back from the cold files, decoded into hot slots
        for k in keys:
            for part, t in ckpt.expert(*k).items():
                assert torch.equal(weights[k][part], t)


@pytest.mark.parametrize("case", ["qwen3_moe-fp8", "gpt_oss-mxfp4"])
def test_the_warm_tier_holds_quantized_experts_as_stored_and_counts_them_so(tmp_path, case):
    """Warm slots are the stored form (fp8 + F32 scales, mxfp4 blocks + scales): a budget of N
    stored experts holds N of them, where the compute dtype would hold N / ratio. A warm
    expert is decoded into its hot slot on use; a hot one leaving hot goes to disk and is read
    back into warm in its stored form (a refill), never as its decoded copy."""
    family, method, scale_dtype = CASES[case]
    model = _quantized(tmp_path / "m", family, method, scale_dtype)
    ckpt = Checkpoint(model)
    probe = TieredExpertStore(ckpt, torch.float32)
    stored, compute = probe.forms.stored_bytes, probe.forms.compute_bytes
    assert stored * (6 if method == "mxfp4" else 3.7) < compute  # against fp32 (tiny: F32 scales of blocks of 8, biases)
    report = probe.forms.report()
    assert report["hot"] == {"form": "compute", "bytes": compute, "vs_compute": 1.0}
    assert report["warm"]["form"] == "stored" and report["warm"]["bytes"] == stored
    keys = [(layer, e) for layer in (1, 2) for e in range(8)]
    store = TieredExpertStore(ckpt, torch.float32, TierConfig(hot_budget=8 * compute, warm_budget=6 * stored,
                                                              cold_dir=str(tmp_path / "cold")))
    store.configure(keys)
    res = store.residency()
    assert (res["hot"]["experts"], res["warm"]["experts"]) == (8, 6)  # 6 in warm at its stored size
    assert res["hot"]["decoder"] == native.describe()  # the C decoder where a compiler is, else torch
    assert res["warm"]["bytes"] == 6 * stored <= 6 * compute // 3
    assert store.pools["warm"].slot_bytes == stored
    warm = [k for k, v in store.experts().items() if v["tier"] == "warm"]
    k = tuple(int(x) for x in warm[0].split("."))
    e = store.entries[k]
    parts = {n: t.dtype for n, t in e.tensors.items()}
    assert parts == ({"w1": torch.float8_e4m3fn, "w1.scale_inv": torch.float32, "w2": torch.float8_e4m3fn,
                      "w2.scale_inv": torch.float32, "w3": torch.float8_e4m3fn, "w3.scale_inv": torch.float32}
                     if method == "fp8" else
                     {"down_blocks": torch.uint8, "down_scales": torch.uint8, "down_bias": ckpt.config.dtype,
                      "gate_up_blocks": torch.uint8, "gate_up_scales": torch.uint8, "gate_up_bias": ckpt.config.dtype})
    for round_ in range(3):  # every expert through hot: warm ones decoded, hot victims refilled into warm
        for key in keys:
            with store.use([key]) as w:
                for part, t in ckpt.expert(*key).items():
                    assert torch.equal(w[key][part], t.to(torch.float32)), (round_, key, part)
            store.drain_prefetch()
            res = store.residency()
            assert res["hot"]["bytes"] <= 8 * compute and res["warm"]["bytes"] <= 6 * stored
            assert store.ledger.used == {"hot": res["hot"]["bytes"], "warm": res["warm"]["bytes"]}
            assert store.ledger.reserved == {"hot": 0, "warm": 0}
    assert store.residency()["warm"]["experts"] == 6  # refilled: RAM still full of stored experts
    assert store.stats.bytes_moved.get("cold->warm", 0) % stored == 0 and store.stats.bytes_moved["cold->warm"] > 0
    assert store.stats.bytes_moved["warm->hot"] % compute == 0


def test_a_compute_dtype_replacement_in_a_quantized_model_never_enters_the_warm_tier(tmp_path):
    model = _quantized(tmp_path / "m", "deepseek_v3", "fp8")
    ckpt = Checkpoint(model)
    probe = TieredExpertStore(ckpt, torch.float32)
    keys = [(layer, e) for layer in (1, 2) for e in range(2)]
    store = TieredExpertStore(ckpt, torch.float32, TierConfig(hot_budget=2 * probe.forms.compute_bytes,
                                                              warm_budget=8 * probe.forms.stored_bytes,
                                                              cold_dir=str(tmp_path / "cold")))
    store.configure(keys)
    new = {k: v * 0.25 for k, v in ckpt.expert(1, 3).items()}
    v = store.swap((1, 0), lambda: dict(new), "plain.safetensors")
    assert v.compute_only and store.experts()["1.0"]["tier"] == "hot"  # staged decoded, in hot
    for key in keys[1:]:  # push it out of hot
        with store.use([key]):
            pass
    store.drain_prefetch()
    store.promote((1, 0), "warm")
    assert store.experts()["1.0"]["tier"] in ("cold", "source")  # never warm: warm holds the stored form
    with store.use([(1, 0)]) as w:  # read back from its own cold file, in the compute dtype
        assert torch.equal(w[(1, 0)]["w2"], new["w2"])


def test_mxfp4_experts_compute_in_the_stored_out_in_layout_and_swap_in_transformers_layout(tmp_path):
    """gpt_oss mxfp4 experts are decoded straight into [out, in] (the layout a decode step's
    matrix-vector product reads in one pass); a replacement in the compute dtype comes as the
    bf16 release lays it out ([in, out], transformers'), turned on load; both compute what
    transformers' [in, out] form computes."""
    from moe_workers.model.layers import gpt_oss_expert

    model = _quantized(tmp_path / "m", "gpt_oss", "mxfp4")
    ckpt = Checkpoint(model)
    cfg = ckpt.config
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert cfg.experts_out_in and dict(cfg.expert_parts())["gate_up"] == (2 * i, h)
    assert dict(cfg.release_parts())["gate_up"] == (h, 2 * i) and dict(cfg.release_parts())["down"] == (i, h)
    w = ckpt.expert(1, 2, dtype=torch.float32)
    assert w["gate_up"].shape == (2 * i, h) and w["down"].shape == (h, i)
    release = {k: v.t().contiguous() if v.dim() == 2 else v for k, v in w.items()}  # transformers' layout
    for rows in (1, 5):
        x = torch.randn(rows, h)
        ours = gpt_oss_expert(x, w, cfg.swiglu_alpha, cfg.swiglu_limit, out_in=True)
        theirs = gpt_oss_expert(x, release, cfg.swiglu_alpha, cfg.swiglu_limit)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    names = {"down": "down_proj", "down_bias": "down_proj_bias", "gate_up": "gate_up_proj",
             "gate_up_bias": "gate_up_proj_bias"}
    save_file({names[n]: v * 0.5 for n, v in release.items()},
              str(tmp_path / "plain.safetensors"))
    raw = load_expert_file(tmp_path / "plain.safetensors", 1, 0, cfg, [str(tmp_path)])
    assert raw["gate_up"].shape == (2 * i, h) and torch.equal(raw["gate_up"], w["gate_up"] * 0.5)
    store = TieredExpertStore(ckpt, torch.float32)
    store.configure([(1, 0)])
    store.swap((1, 0), lambda: raw, "plain.safetensors")
    with store.use([(1, 0)]) as got:
        assert torch.equal(got[(1, 0)]["down"], w["down"] * 0.5)
    save_file({"gate_up_proj": w["gate_up"], "gate_up_proj_bias": w["gate_up_bias"], "down_proj": w["down"],
               "down_proj_bias": w["down_bias"]}, str(tmp_path / "ours.safetensors"))
    with pytest.raises(SwapError, match=rf"down has shape \({h}, {i}\), the model needs \({i}, {h}\)"):
        load_expert_file(tmp_path / "ours.safetensors", 1, 0, cfg, [str(tmp_path)])


def test_hot_swap_takes_the_quantized_form_or_the_compute_dtype_and_refuses_bad_scales(tmp_path):
    model = _quantized(tmp_path / "m", "deepseek_v3", "fp8")
    ckpt = Checkpoint(model)
    cfg = ckpt.config
    store = TieredExpertStore(ckpt, torch.float32, TierConfig(cold_dir=str(tmp_path / "cold")))
    key = (1, 2)
    store.configure([key])
    roots = [str(tmp_path)]
    new = {k: v * 0.5 for k, v in ckpt.expert(1, 5).items()}
    stored = {}
    for part, name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        stored[f"{name}.weight"], stored[f"{name}.weight_scale_inv"] = quantize_fp8(new[part], (8, 8))
    save_file(stored, str(tmp_path / "q.safetensors"))
    raw = load_expert_file(tmp_path / "q.safetensors", *key, cfg, roots)
    assert set(raw) == {"w1", "w1.scale_inv", "w2", "w2.scale_inv", "w3", "w3.scale_inv"}
    store.swap(key, lambda: raw, str(tmp_path / "q.safetensors"))
    with store.use([key]) as w:
        assert torch.equal(w[key]["w1"], decode(cfg.quant, raw, torch.float32)["w1"])
    save_file({f"{n}.weight": new[p] for p, n in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))},
              str(tmp_path / "plain.safetensors"))
    plain = load_expert_file(tmp_path / "plain.safetensors", *key, cfg, roots)
    store.swap(key, lambda: plain, str(tmp_path / "plain.safetensors"))
    with store.use([key]) as w:
        assert torch.equal(w[key]["w2"], new["w2"])
    serving = store.experts()["1.2"]["digest"]
    bad_cases = {
        "zero": (lambda d: d["down_proj.weight_scale_inv"].zero_(), "down_proj.weight_scale_inv|w2.scale_inv has a scale <= 0"),
        "nan": (lambda d: d["up_proj.weight_scale_inv"].fill_(float("nan")), "has a non-finite scale"),
        "grid": (lambda d: d.update({"gate_proj.weight_scale_inv": torch.ones(2, 2)}), r"w1.scale_inv has shape \(2, 2\), the model's fp8 form needs \(4, 8\)"),
        "missing": (lambda d: d.pop("gate_proj.weight_scale_inv"), "missing tensor.s. gate_proj.weight_scale_inv"),
        "nan-code": (lambda d: d["gate_proj.weight"].view(torch.uint8).fill_(0x7F), "decodes to non-finite"),
    }
    for name, (edit, message) in bad_cases.items():
        d = {k: v.clone() for k, v in stored.items()}
        edit(d)
        save_file(d, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(SwapError, match=message):
            load_expert_file(tmp_path / f"{name}.safetensors", *key, cfg, roots)
    assert store.experts()["1.2"]["digest"] == serving  # nothing committed


def _expect_refused(path, message, cls=CheckpointError):
    with pytest.raises(cls, match=message):
        read_model_facts(str(path))  # the operator's check before deploying
    with pytest.raises(cls, match=message):
        Checkpoint(path).expert(1, 0)  # a replica's


BAD_FP8 = {
    "scale-missing": (lambda t: t.pop("model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"),
                      "tensor model.layers.1.mlp.experts.0.up_proj.weight_scale_inv is missing"),
    "scale-grid": (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(3, 3)}),
                   r"o_proj.weight_scale_inv has shape \(3, 3\); a \(64, 64\) weight in blocks of \[8, 8\] needs a \(8, 8\)"),
    "scale-dtype": (lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv":
                                        t["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].to(torch.int32)}),
                    "gate_proj.weight_scale_inv is I32; fp8 scales are F32, BF16 or F16"),
    "scale-nan": (lambda t: t["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"].view(-1)[3].fill_(float("nan")),
                  "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv has a non-finite scale"),
    "scale-zero": (lambda t: t["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"].view(-1)[0].fill_(0.0),
                   "down_proj.weight_scale_inv has a scale <= 0"),
    "scale-negative": (lambda t: t["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"].view(-1)[1].fill_(-1.0),
                       r"up_proj.weight_scale_inv has a scale <= 0 \(-1.0\)"),
    "expert-not-fp8": (lambda t: t.update({"model.layers.1.mlp.experts.0.up_proj.weight":
                                           t["model.layers.1.mlp.experts.0.up_proj.weight"].to(torch.float32)}),
                       r"up_proj.weight is F32; a \(fp8\) checkpoint stores it as F8_E4M3"),
    "dense-fp8-without-scale": (lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
                                "o_proj.weight is F8_E4M3 without its scale"),
}


BAD_MXFP4 = {
    "blocks-shape": (lambda t: t.update({"model.layers.1.mlp.experts.down_proj_blocks":
                                         t["model.layers.1.mlp.experts.down_proj_blocks"][..., :8].contiguous()}),
                     r"down_proj_blocks has shape \(8, 64, 1, 8\), config.json implies \(8, 64, 1, 16\)"),
    "scales-dtype": (lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj_scales":
                                         t["model.layers.1.mlp.experts.gate_up_proj_scales"].to(torch.float32)}),
                     r"gate_up_proj_scales is F32; a \(mxfp4\) checkpoint stores it as U8"),
    "e8m0-nan": (lambda t: t["model.layers.1.mlp.experts.gate_up_proj_scales"].view(-1)[0].fill_(255),
                 "gate_up_proj_scales has E8M0 byte 255"),
    "scales-missing": (lambda t: t.pop("model.layers.0.mlp.experts.down_proj_scales"),
                       "model.layers.0.mlp.experts.down_proj_scales is missing"),
}


BROKEN = {**{f"fp8-{k}": ("qwen3_moe", "fp8", v) for k, v in BAD_FP8.items()},
          **{f"mxfp4-{k}": ("gpt_oss", "mxfp4", v) for k, v in BAD_MXFP4.items()}}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_quantized_checkpoint_is_refused_naming_the_file_and_tensor(tmp_path, case):
    family, method, (edit, message) = BROKEN[case]
    _quantized(tmp_path, family, method)
    _rewrite(tmp_path, edit)
    _expect_refused(tmp_path, message)


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "no weight_block_size: per-tensor fp8 is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size .128, 0. must be two positive"),
    ({"quant_method": "gptq", "bits": 4}, "GPTQ checkpoints .quant_method gptq. are not supported"),
    ({"quant_method": "awq"}, "AWQ checkpoints"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors checkpoints"),
    ({"quant_method": "mystery"}, "quant_method 'mystery' are not supported"),
])
def test_quantization_configs_we_do_not_read_are_refused_naming_them(tmp_path, quant, message):
    _quantized(tmp_path, "deepseek_v3", "fp8")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(config))
    _expect_refused_config(tmp_path, message)


def _expect_refused_config(path, message):
    with pytest.raises(UnsupportedModel, match=message):
        read_model_facts(str(path))
    with pytest.raises(UnsupportedModel, match=message):
        Checkpoint(path)


def test_an_fp8_tensor_in_a_checkpoint_without_quantization_config_is_refused(tmp_path):
    _quantized(tmp_path, "deepseek_v3", "fp8")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is F8_E4M3, but config.json has no fp8 quantization_config"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("case", ["deepseek_v3-fp8", "gpt_oss-mxfp4"])
def test_on_a_gpu_hot_tier_a_quantized_expert_crosses_in_its_stored_form_and_is_decoded_there(tmp_path, case):
    """The GPU path up to the device calls (RecordingOps stands in for CudaOps): a promotion from
    the pinned warm tier or the cold files hands the device the stored bytes (fp8 + scales, mxfp4
    blocks + scales: 3.7x / 6x fewer than the float32 compute form here), decoded into the hot
    slot after the slot's last readers, never under the store's lock; the batch waits for that
    decode; the weights are transformers' dequantized ones."""
    from recording_ops import RecordingOps

    family, method, scale_dtype = CASES[case]
    ckpt = Checkpoint(_quantized(tmp_path / "m", family, method, scale_dtype))
    probe = TieredExpertStore(ckpt, torch.float32)
    stored, compute = probe.forms.stored_bytes, probe.forms.compute_bytes
    ops = RecordingOps()
    keys = [(layer, e) for layer in (1, 2) for e in range(2)]
    store = TieredExpertStore(ckpt, torch.float32, TierConfig(hot_budget=2 * compute, warm_budget=1 * stored,
                                                              cold_dir=str(tmp_path / "cold")), ops=ops)
    ops.store = store
    store.configure(keys)
    for round_ in range(2):
        for pair in (keys[:2], keys[2:]):
            start = len(ops.log)
            with store.use(pair) as w:
                for k in pair:
                    for part, t in ckpt.expert(*k).items():
                        assert torch.equal(w[k][part], t.to(torch.float32)), (round_, k, part)
                log = ops.log[start:]
                decodes = [op for op in log if op[0] == "decode"]
                waits = {op[1] for op in log if op[0] == "wait"}
                assert {op[4] for op in decodes} <= waits  # the kernels wait for the decodes that brought them
            store.drain_prefetch()
    decodes = [op for op in ops.log if op[0] == "decode"]
    assert decodes and all(op[2] == stored for op in decodes)  # the stored bytes crossed, not the decoded ones
    assert not [op for op in ops.log if op[0] in ("decode", "copy") and op[5]], "a device call under the lock"
    # no expert reached hot as a host-decoded copy: every copy into a hot slot is a warm refill or demotion
    hot_copies = [op for op in ops.log if op[0] == "copy" and op[1] in {d[1] for d in decodes}]
    assert not hot_copies


@pytest.mark.parametrize("family,method", [("deepseek_v3", "fp8"), ("gpt_oss", "mxfp4")])
def test_a_random_checkpoint_written_quantized_equals_one_quantized_after(tmp_path, family, method):
    """`write_random_checkpoint(quantize=...)` quantizes each tensor as it is drawn and writes a
    shard at a time (models larger than memory: moectl init-model at real shapes): the same
    tensors, bytes and config as writing the float checkpoint and rewriting it."""
    from moe_workers.model.random_init import write_random_checkpoint

    dims = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_experts=4, top_k=2,
                num_heads=4, num_kv_heads=4 if family == "deepseek_v3" else 2, max_shard_bytes=64 << 10)
    at_once = write_random_checkpoint(tmp_path / "once", family, quantize=method, block=(16, 16), **dims)
    after = quantize_checkpoint(write_random_checkpoint(tmp_path / "after", family, **dims), method, block=(16, 16))
    assert len(list(at_once.glob("*.safetensors"))) > 1 and (at_once / "model.safetensors.index.json").is_file()
    assert not list(at_once.glob(".part-*"))
    a, b = read_index(at_once), read_index(after)
    assert sorted(a) == sorted(b)
    for name in a:
        with safe_open(a[name].file, framework="pt") as f, safe_open(b[name].file, framework="pt") as g:
            assert torch.equal(f.get_tensor(name).view(torch.uint8), g.get_tensor(name).view(torch.uint8)), name
    assert json.loads((at_once / "config.json").read_text()) == json.loads((after / "config.json").read_text())
    Checkpoint(at_once)  # reads and checks as a quantized checkpoint


def test_a_quantized_expert_promoted_from_warm_keeps_its_stored_copy_there(tmp_path):
    """Warm -> hot decodes an expert and keeps its stored form in its warm slot (counted in warm):
    evicted from hot it is warm again with no disk read and no refill; with warm short, its
    stored copy is evicted like a warm expert (by policy); budgets and counts hold."""
    family, method, scale_dtype = CASES["gpt_oss-mxfp4"]
    ckpt = Checkpoint(_quantized(tmp_path / "m", family, method, scale_dtype))
    probe = TieredExpertStore(ckpt, torch.float32)
    stored, compute = probe.forms.stored_bytes, probe.forms.compute_bytes
    keys = [(layer, e) for layer in (0, 1) for e in range(4)]
    cfg = dict(hot_budget=2 * compute, cold_dir=str(tmp_path / "cold"), prefetch=False)
    store = TieredExpertStore(ckpt, torch.float32, TierConfig(warm_budget=8 * stored, **cfg))
    store.configure(keys)  # 2 hot (read straight into hot), 6 warm

    def check(warm_budget):
        res = store.residency()
        kept = sum(e.kept is not None for e in store.entries.values())
        warm = sum(e.tier == "warm" for e in store.entries.values())
        assert store.ledger.used == {"hot": res["hot"]["bytes"], "warm": res["warm"]["bytes"]}
        assert res["warm"]["bytes"] == (kept + warm) * stored <= warm_budget and res["hot"]["bytes"] <= 2 * compute
        assert store.pools["warm"].allocated - len(store.pools["warm"].free) == kept + warm
        return kept

    in_warm = [k for k in keys if store.entries[k].tier == "warm"]
    first, second = in_warm[:2], in_warm[2:4]
    with store.use(first) as w:  # decoded into hot from their warm slots
        for k in first:
            assert torch.equal(w[k]["gate_up"], ckpt.expert(*k)["gate_up"].to(torch.float32))
    assert all(store.entries[k].tier == "hot" and store.entries[k].kept is not None for k in first)
    store.drain_prefetch()  # the two they pushed out of hot had no stored copy: read back from disk (refill)
    assert check(8 * stored) == 2
    reads = dict(store.stats.cold_reads)
    with store.use(second):  # push the first two out of hot
        pass
    store.drain_prefetch()
    assert all(store.entries[k].tier == "warm" and store.entries[k].kept is None for k in first)  # from their copies
    assert store.stats.cold_reads == reads and store.stats.bytes_moved.get("hot->warm", 0) == 0  # no disk, no copy
    assert check(8 * stored) == 2  # the second two keep theirs
    store.configure(keys, TierConfig(warm_budget=5 * stored, **cfg))  # warm short: copies evicted by policy
    check(5 * stored)
    cold = next(k for k in keys if store.entries[k].tier == "cold")
    reads = sum(store.stats.cold_reads.values())
    with store.use([cold]):  # from disk into a warm slot it keeps, decoded into hot from there
        pass
    assert store.entries[cold].tier == "hot" and store.entries[cold].kept is not None
    with store.use([k for k in keys if k != cold and store.entries[k].tier == "warm"][:2]):
        pass
    store.drain_prefetch()
    assert store.entries[cold].tier == "warm" and sum(store.stats.cold_reads.values()) == reads + 1  # read once
    check(5 * stored)
    for round_ in range(3):  # every expert through hot, warm short
        for k in keys:
            with store.use([k]) as w:
                assert torch.equal(w[k]["down"], ckpt.expert(*k)["down"].to(torch.float32)), (round_, k)
            store.drain_prefetch()
            check(5 * stored)
