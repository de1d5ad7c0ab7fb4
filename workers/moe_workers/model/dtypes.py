"""The one table of tensor dtypes (pure: no torch): safetensors' names, torch's names, bytes.

Compute dtypes are the float ones a config.json or a spec names; stored ones add what quantized
checkpoints hold (fp8 weights, the U8 of mxfp4 blocks and E8M0 scales). Torch dtypes are
looked up by name (`getattr(torch, name)`) where torch is imported."""

from __future__ import annotations

# safetensors dtype -> (torch dtype name, bytes an element)
SAFETENSORS = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2),
               "F8_E4M3": ("float8_e4m3fn", 1), "U8": ("uint8", 1)}
FLOAT_SAFETENSORS = ("F32", "BF16", "F16")  # the weights computed as they are read
COMPUTE = ("float32", "bfloat16", "float16")  # config.json's dtype / spec.model.dtype

BYTES = {name: size for name, size in SAFETENSORS.values()}  # torch name -> bytes
TORCH_NAME = {st: name for st, (name, _) in SAFETENSORS.items()}  # safetensors -> torch name
SAFETENSORS_NAME = {name: st for st, (name, _) in SAFETENSORS.items()}  # torch name -> safetensors


def torch_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 (or for the string itself)."""
    return str(dtype).removeprefix("torch.")
