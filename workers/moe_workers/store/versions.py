"""Expert versions: content digests and validation of replacement weights (hot-swap).

A version is identified by a digest of its tensors' content (names, dtypes, shapes, bytes), so
the same weights give the same digest whether they came from the checkpoint, a cold-cache file
or an override file. Replacement files are only ever safetensors, only from allowed roots.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moe_workers.model.config import MoEConfig
from moe_workers.paths import within_roots

CHECKPOINT = "checkpoint"  # version source of the checkpoint's own weights


class SwapError(ValueError):
    """Replacement weights refused; the message says what was wrong and where."""


@dataclass(frozen=True)
class Version:
    digest: str  # "sha256:<hex>" over the tensors' content
    source: str  # CHECKPOINT or the override file's path
    # a quantized model's expert replaced in the compute dtype: held hot or on disk, never in
    # the warm tier (which holds the stored form)
    compute_only: bool = False


def content_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).reshape(-1).numpy()))  # hashed in place, no copy
    return "sha256:" + h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_allowed(path: str | Path, allowed_roots: list[str]) -> Path:
    """The resolved path, if it lies under one of the allowed roots (symlinks resolved first)."""
    resolved = within_roots(path, allowed_roots)
    if resolved is not None:
        return resolved
    raise SwapError(f"{path}: outside the allowed weight roots ({', '.join(allowed_roots) or 'none configured'})")


def match_parts(cfg: MoEConfig, layer: int, expert: int, names: list[str], stored: bool = False) -> dict[str, str]:
    """{part: tensor name} for the parts of one expert found among `names`: the checkpoint's own
    per-expert name, a short alias (`cfg.swap_aliases()`, e.g. w1.weight or gate_proj.weight), or
    the part's own name (w1, gate_up: what the store's files use). `stored`: the parts of a
    quantized checkpoint's form instead (w1 and w1.scale_inv, gate_up_blocks, ...)."""
    sources = cfg.stored_sources(layer, expert) if stored else cfg.expert_sources(layer, expert)
    own = {part: name for part, name, index in sources if index is None}
    found = {}
    for part, aliases in (cfg.stored_aliases() if stored else cfg.swap_aliases()).items():
        for candidate in ((own[part],) if part in own else ()) + aliases + (part,):
            if candidate in names:
                found[part] = candidate
                break
    return found


def load_expert_file(path: str | Path, layer: int, expert: int, cfg: MoEConfig, allowed_roots: list[str],
                     sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Read and validate one routed expert's replacement weights: {part: tensor} in host memory.

    Accepted names: the checkpoint's own for that expert (e.g. model.layers.L.mlp.experts.E.gate_proj.weight)
    or a short alias (`MoEConfig.swap_aliases`: w1.weight, gate_proj.weight, gate_up_proj, ...). Checks:
    allowed root, a regular safetensors file, sha256 when given, exactly the expert's tensors,
    shapes and dtype as the model's config says, finite values."""
    problem = cfg.expert_problem(layer, expert)
    if problem:
        raise SwapError(f"{problem}; only routed experts can be swapped (shared experts and dense layers live in the ingress)")
    resolved = check_allowed(path, allowed_roots)
    if not resolved.is_file():
        raise SwapError(f"{path}: no such file")
    if resolved.suffix != ".safetensors":
        raise SwapError(f"{path}: not a .safetensors file (only safetensors are loaded, never pickle)")
    if sha256 is not None:
        actual = file_sha256(resolved)
        if actual != sha256.lower():
            raise SwapError(f"{path}: sha256 is {actual}, expected {sha256.lower()}")
    try:
        with safe_open(resolved, framework="pt") as f:
            names = list(f.keys())
            found = match_parts(cfg, layer, expert, names)
            aliases = cfg.swap_aliases()
            parts = [p for p, _ in cfg.expert_parts()]
            quantized = cfg.quant is not None and _is_stored_form(cfg, layer, expert, names)
            if quantized:  # the checkpoint's own quantized form, scales included
                found = match_parts(cfg, layer, expert, names, stored=True)
                aliases = cfg.stored_aliases()
                parts = [p for p, _, _ in cfg.stored_parts()]
            missing = [aliases[p][0] for p in parts if p not in found]
            if missing:
                raise SwapError(f"{path}: missing tensor(s) {', '.join(missing)} for expert "
                                f"{layer}.{expert} (found {', '.join(sorted(names)[:6]) or 'none'})")
            extra = sorted(set(names) - set(found.values()))
            if extra:
                raise SwapError(f"{path}: unexpected tensor(s) {', '.join(extra[:6])}; the file must hold one expert")
            tensors = {w: f.get_tensor(n).clone() for w, n in found.items()}  # clone: own memory, not the mapping
    except SafetensorError as err:
        raise SwapError(f"{path}: not a valid safetensors file ({err})") from None
    except OSError as err:
        raise SwapError(f"{path}: cannot read ({err.strerror or err})") from None
    if quantized:
        return _check_stored(path, cfg, tensors)
    shapes = dict(cfg.release_parts())  # gpt_oss mxfp4: transformers' [in, out], turned into the compute layout
    for w, t in tensors.items():
        if tuple(t.shape) != shapes[w]:
            raise SwapError(f"{path}: {w} has shape {tuple(t.shape)}, the model needs {shapes[w]}")
        if t.dtype != cfg.dtype:
            raise SwapError(f"{path}: {w} is {str(t.dtype).removeprefix('torch.')}, the model's dtype is "
                            f"{str(cfg.dtype).removeprefix('torch.')}")
        if not torch.isfinite(t).all():
            raise SwapError(f"{path}: {w} has non-finite values (NaN or inf)")
    return cfg.from_release_layout(tensors)


def _is_stored_form(cfg: MoEConfig, layer: int, expert: int, names: list[str]) -> bool:
    """A file holds an expert in its quantized form when any name is one only that form has
    (a scale, blocks): a partial one is then refused naming what it lacks."""
    plain = set(match_parts(cfg, layer, expert, names).values())
    stored = set(match_parts(cfg, layer, expert, names, stored=True).values())
    return bool(stored - plain)


def _check_stored(path, cfg: MoEConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An expert in the quantized form: shapes and dtypes as the format says, scales usable
    (fp8: finite and > 0; E8M0: no 255), and decoded weights finite (E4M3 has NaN codes)."""
    from moe_workers.model.dequant import decode, tensor_scale_problem
    from moe_workers.model.dtypes import TORCH_NAME
    from moe_workers.model.quantization import SCALE_DTYPES

    for part, dtype, shape in cfg.stored_parts():
        t = tensors[part]
        if tuple(t.shape) != tuple(shape):
            raise SwapError(f"{path}: {part} has shape {tuple(t.shape)}, the model's {cfg.quant.method} form needs "
                            f"{tuple(shape)}")
        got = str(t.dtype).removeprefix("torch.")
        if part.endswith(".scale_inv"):
            allowed = [TORCH_NAME[d] for d in SCALE_DTYPES]
        elif dtype is None:
            allowed = [str(cfg.dtype).removeprefix("torch.")]
        else:
            allowed = [TORCH_NAME[dtype]]
        if got not in allowed:
            raise SwapError(f"{path}: {part} is {got}; the model's {cfg.quant.method} form stores it as "
                            f"{' or '.join(allowed)}")
        if part.endswith((".scale_inv", "_scales")):
            problem = tensor_scale_problem(part, t)
            if problem:
                raise SwapError(f"{path}: {part} has {problem}")
    for part, t in decode(cfg.quant, tensors, torch.float32).items():
        if not torch.isfinite(t).all():
            raise SwapError(f"{path}: {part} decodes to non-finite values (NaN or inf codes)")
    return tensors
