"""Quantized expert weights into the compute dtype, and our own quantizers (torch).

`decode` turns an expert's stored parts (`Arch.stored_parts()`: fp8 weights with their block
scales, or mxfp4 blocks and E8M0 scales) into its compute parts (`Arch.expert_parts()`), the
arithmetic transformers uses (products in float32, then one rounding to the compute dtype), so a
quantized checkpoint serves what transformers computes from it. On a CPU the C decoder
(`native.py`) does it where a C compiler is at hand; the torch table lookups below give the
same bits everywhere else (an accelerator, no compiler, MOE_NATIVE=0). `quantize_fp8` / `pack_mxfp4`
write the published layouts (nothing on CPU writes them): for `moectl init-model --quantize`,
the tests and the benches.
"""

from __future__ import annotations

import torch

from . import native
from .quantization import E8M0_MAX, FP8, FP8_MAX, MXFP4_GROUP, Quantization, scale_problem

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign
_LUT = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
# every F8_E4M3 code's value (NaN codes included), exact in float32: a table lookup per byte
# (index_select) is 5x faster on these CPUs than torch's float8 -> float32 conversion
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
CHUNK = 1 << 16  # values decoded at a time on a CPU: the lookup's index and the float32 values stay in cache
MXFP4_CHUNK = 1 << 21  # mxfp4 values decoded at a time (one lookup a byte: larger runs amortise the call)
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """A lookup table made once per device: "e4m3" [256] float32; "e2m1x2" [256, 2] float32 (the
    E2M1 values of a byte's low and high nibble)."""
    t = _TABLES.get((kind, device))
    if t is None:
        if kind == "e4m3":
            t = _E4M3
        else:
            codes = torch.arange(256)
            t = torch.stack((_LUT[codes & 0x0F], _LUT[codes >> 4]), dim=-1)
        t = _TABLES[(kind, device)] = t.to(device)
    return t


def _scaled_pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65536]: for (E8M0 scale byte << 8 | block byte), the byte's two E2M1 values times
    2^(scale - 127), each product in float32 rounded once to `dtype` (as transformers computes
    them), the pair held as one integer of twice the dtype's width. 256 KiB for bf16: a block
    byte decodes in one lookup, its scale applied with it."""
    key = (f"e2m1x2-scaled-{dtype}", device)
    t = _TABLES.get(key)
    if t is None:
        scale = torch.ldexp(torch.ones(256), torch.arange(-127, 129, dtype=torch.float32))
        pairs = (scale[:, None, None] * _table("e2m1x2", torch.device("cpu"))[None]).to(dtype).contiguous()
        wide = {2: torch.int32, 4: torch.int64}[pairs.element_size()]
        t = _TABLES[key] = pairs.view(wide).view(-1).to(device)
    return t


def _row_chunks(rows: int, per_row: int, device: torch.device, align: int | None = None, chunk: int = CHUNK):
    """(start, end) row ranges covering `rows`, each within one `align`-row band (a scale row;
    None: one band) and about `chunk` values; the whole band at once on an accelerator (one
    kernel per op)."""
    align = align or rows
    step = align if device.type != "cpu" else max(1, min(align, chunk // max(1, per_row)))
    for band in range(0, rows, align):
        end = min(band + align, rows)
        for r0 in range(band, end, step):
            yield r0, min(r0 + step, end)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """W[i, j] = float(q[i, j]) * scale[i // b0, j // b1] (partial edge blocks), in `dtype`: the
    float32 product rounded once, as transformers computes it. Decoded a few rows at a time."""
    rows, cols = q.shape
    b0, b1 = block
    if out is None:
        out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    if native.usable(q, out=out):
        return native.fp8(q.view(torch.uint8), scale, block, out)
    s = scale.to(device=q.device, dtype=torch.float32)
    if cols % b1:  # a partial edge block of columns: one scale per column
        s, b1 = s.repeat_interleave(b1, 1)[:, :cols], 1
    codes, table = q.view(torch.uint8), _table("e4m3", q.device)
    for r0, r1 in _row_chunks(rows, cols, q.device, b0):
        v = torch.index_select(table, 0, codes[r0:r1].reshape(-1).long())
        v.view(r1 - r0, cols // b1, b1).mul_(s[r0 // b0][None, :, None])
        out[r0:r1].copy_(v.view(r1 - r0, cols))
    return out


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """[out, in] from blocks [out, in/32, 16] (low nibble first) and E8M0 scales [out, in/32], on
    the blocks' device: each byte, with its group's scale, looked up whole (both values, scaled:
    `_scaled_pairs`), a run of rows at a time, into `out` when given (a hot slot's part: the
    compute layout is the same [out, in], so each row is written in one pass)."""
    b, s = blocks.view(torch.uint8), scales.view(torch.uint8)
    rows, groups = b.shape[0], b.shape[1]
    if out is None:
        out = torch.empty(rows, groups * 32, dtype=dtype, device=b.device)
    if not out.is_contiguous():
        out.copy_(decode_mxfp4(blocks, scales, out.dtype))
        return out
    if native.usable(b, s, out=out):
        return native.mxfp4(b, s, out)
    table = _scaled_pairs(out.dtype, b.device)
    pairs = out.view(table.dtype).view(rows, groups * 16)
    for r0, r1 in _row_chunks(rows, groups * 32, b.device, chunk=MXFP4_CHUNK):
        index = (s[r0:r1].to(torch.int32).unsqueeze(-1) << 8) | b[r0:r1].to(torch.int32)
        torch.index_select(table, 0, index.view(-1), out=pairs[r0:r1].view(-1))
    return out


def compute_names(stored: dict[str, torch.Tensor]) -> list[str]:
    """The compute parts an expert's stored parts decode to (w1, w3, w2; gate_up, gate_up_bias, ...)."""
    return [n.removesuffix("_blocks") for n in stored if not n.endswith((".scale_inv", "_scales"))]


def decode_part(quant: Quantization | None, stored: dict[str, torch.Tensor], name: str, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """One compute part of an expert from its stored parts, in `dtype` (into `out` when given:
    a hot slot's view, so the decoded weights are written once, where they are computed from)."""
    if name + "_blocks" in stored:  # [out, in] as stored, the compute layout (`Arch.experts_out_in`)
        return decode_mxfp4(stored[name + "_blocks"], stored[name + "_scales"], dtype, out=out)
    if quant is not None and name + ".scale_inv" in stored:
        return dequantize_fp8(stored[name], stored[name + ".scale_inv"], quant.block, dtype, out=out)
    w = stored[name]
    if out is not None:
        out.copy_(w)
        return out
    return w if w.dtype == dtype else w.to(dtype)


def decode(quant: Quantization | None, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An expert's compute parts from its stored parts (a compute-form dict is returned as it
    is, cast to `dtype`)."""
    return {name: decode_part(quant, stored, name, dtype) for name in compute_names(stored)}


def decode_into(quant: Quantization | None, stored: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    """`decode` written into `out` (the compute parts' views of one hot slot, in their dtype)."""
    for name, dst in out.items():
        decode_part(quant, stored, name, dst.dtype, out=dst)


def tensor_scale_problem(name: str, t: torch.Tensor) -> str | None:
    """`scale_problem` of a scale tensor already in memory."""
    return scale_problem(t.to(torch.float32).numpy() if t.is_floating_point() else t.numpy(), name)


# -- our quantizers ------------------------------------------------------------------------------

def quantize_fp8(w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 weight, scale grid) of a [out, in] weight: amax over each (padded) block / 448 is
    its scale, rounded to `scale_dtype` before the weight is divided by it."""
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(gr * block[0], gc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = w.to(torch.float32)
    amax = padded.view(gr, block[0], gc, block[1]).abs().amax(dim=(1, 3))
    scale = (amax.clamp_min(1e-12) / FP8_MAX).to(scale_dtype)
    s = scale.to(torch.float32).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    q = (w.to(torch.float32) / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks U8 [out, in/32, 16], scales U8 [out, in/32]) of a [out, in] weight: per 32 values
    the exponent floor(log2(amax)) - 2, the nearest E2M1 code, low nibble first."""
    rows, cols = w.shape
    g = w.to(torch.float32).contiguous().reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, E8M0_MAX - 127)
    x = g / torch.ldexp(torch.ones_like(exp), exp).unsqueeze(-1)
    mags = torch.tensor(E2M1)
    mid = (mags[1:] + mags[:-1]) / 2
    code = torch.bucketize(x.abs(), mid)  # nearest magnitude (ties to the lower code)
    code = code | ((x < 0) & (code > 0)).to(code.dtype) << 3
    code = code.to(torch.uint8).reshape(rows, cols // MXFP4_GROUP, 16, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def quantize_parts(quant: Quantization, parts: dict[str, torch.Tensor], scale_dtype: torch.dtype = torch.float32
                   ) -> dict[str, torch.Tensor]:
    """An expert's compute parts into the stored form of `quant` (`Arch.stored_parts()`)."""
    out = {}
    for name, t in parts.items():
        if quant.method == FP8:
            out[name], out[name + ".scale_inv"] = quantize_fp8(t, quant.block, scale_dtype)
        elif name.endswith("_bias"):
            out[name] = t
        else:
            out[name + "_blocks"], out[name + "_scales"] = pack_mxfp4(t)
    return out
