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
    """[out, in] from blocks [out, in/32, 16] (low nibble first) and E8M0 scales [out, in/32], on
    the blocks' device. Each byte is looked up whole (its two values at once)."""
    b = blocks.view(torch.uint8)
    values = _pair_lut(b.device)[b.long()]  # [out, in/32, 16, 2]: low nibble, high nibble
    exp = scales.view(torch.uint8).to(torch.int32) - 127
    scale = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp.to(torch.float32))
    return values.view(b.shape[0], b.shape[1], -1).mul_(scale.unsqueeze(-1)).view(b.shape[0], -1).to(dtype)


_PAIR_LUTS: dict[torch.device, torch.Tensor] = {}


def _pair_lut(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the E2M1 values of a byte's low and high nibble, made once per device."""
    lut = _PAIR_LUTS.get(device)
    if lut is None:
        codes = torch.arange(256)
        lut = _PAIR_LUTS[device] = torch.stack((_LUT[codes & 0x0F], _LUT[codes >> 4]), dim=-1).to(device)
    return lut


def compute_names(stored: dict[str, torch.Tensor]) -> list[str]:
    """The compute parts an expert's stored parts decode to (w1, w3, w2; gate_up, gate_up_bias, ...)."""
    return [n.removesuffix("_blocks") for n in stored if not n.endswith((".scale_inv", "_scales"))]


def decode_part(quant: Quantization | None, stored: dict[str, torch.Tensor], name: str, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """One compute part of an expert from its stored parts, in `dtype` (into `out` when given:
    a hot slot's view, so the decoded weights are written once, where they are computed from)."""
    if name + "_blocks" in stored:  # [out, in] stored; compute layout is [in, out]
        w = decode_mxfp4(stored[name + "_blocks"], stored[name + "_scales"], dtype).t()
    elif quant is not None and name + ".scale_inv" in stored:
        return dequantize_fp8(stored[name], stored[name + ".scale_inv"], quant.block, dtype, out=out)
    else:
        w = stored[name]
    if out is not None:
        out.copy_(w)
        return out
    w = w if w.dtype == dtype else w.to(dtype)
    return w.contiguous() if name + "_blocks" in stored else w


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
            out[name + "_blocks"], out[name + "_scales"] = pack_mxfp4(t.t())
    return out
