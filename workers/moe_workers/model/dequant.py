"""Quantized expert weights into the compute dtype, and our own quantizers (torch).

`decode` turns an expert's stored parts (`Arch.stored_parts()`: fp8 weights with their block
scales, or mxfp4 blocks and E8M0 scales) into its compute parts (`Arch.expert_parts()`), the
arithmetic transformers uses (products in float32, then one rounding to the compute dtype), so a
quantized checkpoint serves what transformers computes from it. `quantize_fp8` / `pack_mxfp4`
write the published layouts (nothing on CPU writes them): for `moectl init-model --quantize`,
the tests and the benches.
"""

from __future__ import annotations

import torch

from .quantization import E8M0_MAX, FP8, FP8_MAX, MXFP4_GROUP, Quantization, scale_problem

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign
_LUT = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """W[i, j] = float(q[i, j]) * scale[i // b0, j // b1] (partial edge blocks), in `dtype`."""
    rows, cols = q.shape
    b0, b1 = block
    if rows % b0 == 0 and cols % b1 == 0:  # whole blocks: the grid broadcast over each block
        s = scale.to(torch.float32)[:, None, :, None]
        w = q.to(torch.float32).view(rows // b0, b0, cols // b1, b1).mul_(s).view(rows, cols)
    else:  # partial edge blocks
        s = scale.to(torch.float32).repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
        w = q.to(torch.float32).mul_(s)
    if out is None:
        return w.to(dtype)
    out.copy_(w)
    return out


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] from blocks [out, in/32, 16] (low nibble first) and E8M0 scales [out, in/32]."""
    b = blocks.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1]).long()
    values = _LUT[codes]  # [out, in/32, 32]
    exp = scales.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(values, exp.unsqueeze(-1).to(torch.float32)).reshape(b.shape[0], -1).to(dtype)


def decode(quant: Quantization | None, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An expert's compute parts from its stored parts (a compute-form dict is returned as it
    is, cast to `dtype`)."""
    if quant is None or not any(k.endswith((".scale_inv", "_blocks")) for k in stored):
        return {k: v if v.dtype == dtype else v.to(dtype) for k, v in stored.items()}
    out = {}
    for name, t in stored.items():
        if name.endswith((".scale_inv", "_scales")):
            continue
        if name.endswith("_blocks"):  # [out, in] stored; compute layout is [in, out]
            base = name.removesuffix("_blocks")
            out[base] = decode_mxfp4(t, stored[base + "_scales"], dtype).t().contiguous()
        elif name + ".scale_inv" in stored:
            out[name] = dequantize_fp8(t, stored[name + ".scale_inv"], quant.block, dtype)
        else:
            out[name] = t if t.dtype == dtype else t.to(dtype)
    return out


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
            out[name + "_blocks"], out[name + "_scales"] = pack_mxfp4(t.t())
    return out
