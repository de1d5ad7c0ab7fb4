"""Quantized checkpoints as they ship (pure: no torch): which `quantization_config` we read, the
tensors each format adds, and the checks of their headers and scale values.

Two formats, both as their official checkpoints store them:
  fp8    fine-grained blocks (DeepSeek-V3/R1, Qwen3 "-FP8"): a linear `X.weight` is F8_E4M3
         [out, in] beside `X.weight_scale_inv` [ceil(out/b0), ceil(in/b1)] (F32, BF16 or F16);
         W[i, j] = float(Wq[i, j]) * S[i // b0, j // b1], edge blocks partial.
  mxfp4  gpt-oss' routed experts: `*_blocks` U8 [E, out, in/32, 16] (two E2M1 codes a byte, low
         nibble first) and `*_scales` U8 [E, out, in/32] (E8M0: 2 ** (byte - 127)).
Anything else (GPTQ, AWQ, compressed-tensors, bitsandbytes, ...) is refused naming the format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP8, MXFP4 = "fp8", "mxfp4"
FP8_DTYPE = "F8_E4M3"
U8 = "U8"
SCALE_DTYPES = ("F32", "BF16", "F16")  # fp8 scales: read from the header, never assumed
FP8_MAX = 448.0  # the largest finite E4M3 value
MXFP4_GROUP = 32  # values per E8M0 scale
E8M0_MAX = 254  # 255 is E8M0's NaN
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv

_NAMED = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes",
          "hqq": "HQQ", "eetq": "EETQ", "aqlm": "AQLM", "quanto": "quanto", "torchao": "torchao",
          "fbgemm_fp8": "FBGEMM FP8 (per-channel)", "bitnet": "BitNet", "exl2": "EXL2", "gguf": "GGUF"}


class QuantizationError(ValueError):
    """A quantization_config or quantized tensor we cannot read; the message names it."""


@dataclass(frozen=True)
class Quantization:
    method: str  # FP8 | MXFP4
    block: tuple[int, int] = (128, 128)  # fp8: weight_block_size (rows, cols)

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The fp8 scale grid of a [out, in] weight: partial edge blocks count."""
        out, inp = shape[-2:]
        return math.ceil(out / self.block[0]), math.ceil(inp / self.block[1])


def parse_quantization(quant, family: str, source: str) -> Quantization | None:
    """The Quantization of a config.json's `quantization_config` (None: unquantized). Raises
    QuantizationError naming what is not supported."""
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise QuantizationError(f"{source}: quantization_config must be an object")
    method = str(quant.get("quant_method") or "unknown")
    if method == FP8:
        fmt = quant.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(f"{source}: quantization_config.fmt {fmt!r} is not supported (fp8 checkpoints "
                                    f"are read as e4m3 with block scales)")
        block = quant.get("weight_block_size")
        if block is None:
            raise QuantizationError(f"{source}: quantization_config (fp8) has no weight_block_size: per-tensor fp8 "
                                    f"is not supported, only fine-grained blocks (e.g. [128, 128])")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise QuantizationError(f"{source}: quantization_config.weight_block_size {block!r} must be two "
                                    f"positive integers")
        return Quantization(FP8, (block[0], block[1]))
    if method == MXFP4:
        if family != "gpt_oss":
            raise QuantizationError(f"{source}: mxfp4 is read for gpt_oss checkpoints only (not {family})")
        return Quantization(MXFP4)
    named = _NAMED.get(method.lower())
    what = f"{named} checkpoints (quant_method {method})" if named else f"quant_method {method!r}"
    raise QuantizationError(f"{source}: {what} are not supported; supported quantized formats: fp8 (fine-grained "
                            f"block scales, as DeepSeek-V3 and Qwen3 -FP8 ship) and mxfp4 (gpt-oss); otherwise "
                            f"serve the checkpoint in bfloat16, float16 or float32")


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def mxfp4_shapes(out: int, inp: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """(blocks, scales) shapes of one [out, in] MXFP4 matrix."""
    if inp % MXFP4_GROUP:
        raise QuantizationError(f"an mxfp4 matrix needs its input dimension a multiple of {MXFP4_GROUP} (got {inp})")
    return (out, inp // MXFP4_GROUP, 16), (out, inp // MXFP4_GROUP)


def check_fp8_weight(index: dict, name: str, quant: Quantization | None) -> None:
    """An F8_E4M3 tensor in the index: it must be a 2-D weight of an fp8 checkpoint with its
    scale grid beside it. `index`: name -> (file, dtype, shape)."""
    file, _, shape = index[name]
    if quant is None or quant.method != FP8:
        raise QuantizationError(f"{file}: tensor {name} is {FP8_DTYPE}, but config.json has no fp8 "
                                f"quantization_config")
    if len(shape) != 2:
        raise QuantizationError(f"{file}: tensor {name} is {FP8_DTYPE} with shape {tuple(shape)}; only 2-D weights "
                                f"are read as fp8")
    scale = index.get(scale_name(name))
    if scale is None:
        raise QuantizationError(f"{file}: tensor {name} is {FP8_DTYPE} without its scale {scale_name(name)}")
    sfile, sdtype, sshape = scale
    if sdtype not in SCALE_DTYPES:
        raise QuantizationError(f"{sfile}: tensor {scale_name(name)} is {sdtype}; fp8 scales are F32, BF16 or F16")
    want = quant.grid(shape)
    if tuple(sshape) != want:
        raise QuantizationError(f"{sfile}: tensor {scale_name(name)} has shape {tuple(sshape)}; a {tuple(shape)} "
                                f"weight in blocks of {list(quant.block)} needs a {want} grid")


def scale_problem(values, name: str) -> str | None:
    """Why the values of scale tensor `name` cannot be used, or None. `values`: a numpy array
    (fp8 `*_scale_inv`: the scales as floats; mxfp4 `*_scales`: the E8M0 bytes)."""
    import numpy as np

    if name.endswith("_scales"):
        bad = np.flatnonzero(values.reshape(-1) > E8M0_MAX)
        return f"E8M0 byte 255 (NaN) at flat index {int(bad[0])}" if bad.size else None
    flat = values.reshape(-1).astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(flat))
    if bad.size:
        return f"a non-finite scale ({flat[bad[0]]}) at flat index {int(bad[0])}"
    bad = np.flatnonzero(flat <= 0)
    if bad.size:
        return f"a scale <= 0 ({flat[bad[0]]}) at flat index {int(bad[0])}"
    return None


def read_scales(file, dtype: str, shape, offset: int, nbytes: int):
    """A scale tensor's values from its file, as numpy (F32/BF16/F16 as float32, U8 as bytes)."""
    import numpy as np

    with open(file, "rb") as f:
        f.seek(offset)
        raw = f.read(nbytes)
    if len(raw) != nbytes:
        raise QuantizationError(f"{file}: truncated (a scale tensor ends past the file's end)")
    if dtype == "BF16":
        values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, dtype={"F32": "<f4", "F16": "<f2", U8: "u1"}[dtype])
    return values.reshape(tuple(shape))


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX) or name.endswith("_scales")


def check_scale_values(index: dict, limit_bytes: int | None = 256 << 20) -> int:
    """Read every scale tensor of a checkpoint (`index`: name -> TensorInfo) and refuse one that
    cannot be used, naming its file and tensor. Stops after `limit_bytes` of scales (None: all):
    the replicas check the rest as they read them. Returns the bytes checked."""
    done = 0
    for name, t in sorted(index.items()):
        if not is_scale(name):
            continue
        if limit_bytes is not None and done + t.nbytes > limit_bytes:
            break
        values = read_scales(t.file, t.dtype, t.shape, t.offset, t.nbytes)
        problem = scale_problem(values, name)
        if problem:
            raise QuantizationError(f"{t.file}: tensor {name} has {problem}")
        done += t.nbytes
    return done
