"""Write a random MoE checkpoint of any supported family in Hugging Face layout (config.json +
safetensors).

For quickstarts, benchmarks and tests that need a model of a chosen size without a hub: the
config keys, tensor names, shapes and file layout are those transformers writes for the family
(tests load these files with transformers itself), so the same loaders read it. Weights are drawn
with a scale that keeps activations finite through the layers; biases, sinks and DeepSeek's
score correction are random too, so a part that is read wrongly changes the output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .dtypes import torch_name
from .family import SUPPORTED, parse
from .index import read_index
from .quantization import FP8, MXFP4

# what the published checkpoints leave unquantized: mxfp4 (gpt-oss) quantizes the routed experts
# only; fp8 (DeepSeek-V3, Qwen3 -FP8) every linear projection but the routers and lm_head
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]

_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}


def random_config(family: str, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                  num_heads: int, num_kv_heads: int, num_experts: int, top_k: int, max_position_embeddings: int,
                  dtype: torch.dtype) -> dict:
    """config.json of a `family` model with these dimensions (intermediate_size: a routed expert's;
    dense MLPs and shared experts get twice that)."""
    if family not in SUPPORTED:
        raise ValueError(f"family {family!r} is not one of {', '.join(SUPPORTED)}")
    head_dim = hidden_size // num_heads
    c = {"architectures": [_ARCHITECTURES[family]], "model_type": family, "vocab_size": vocab_size,
         "hidden_size": hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
         "num_key_value_heads": num_kv_heads, "num_experts_per_tok": top_k, "hidden_act": "silu",
         "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-6,
         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
         "bos_token_id": 1, "eos_token_id": 2, "dtype": torch_name(dtype)}
    if family == "mixtral":
        c.update(intermediate_size=intermediate_size, num_local_experts=num_experts, head_dim=head_dim,
                 rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    elif family in ("qwen3_moe", "qwen2_moe"):
        c.update(intermediate_size=2 * intermediate_size, moe_intermediate_size=intermediate_size,
                 num_experts=num_experts, decoder_sparse_step=1, mlp_only_layers=[0] if num_layers > 2 else [],
                 use_sliding_window=False, sliding_window=None)
        if family == "qwen3_moe":
            c.update(head_dim=head_dim, norm_topk_prob=True, attention_bias=False)
        else:
            c.update(shared_expert_intermediate_size=2 * intermediate_size, norm_topk_prob=False, qkv_bias=True,
                     layer_types=["full_attention"] * num_layers)
    elif family == "olmoe":
        c.update(intermediate_size=intermediate_size, num_experts=num_experts, norm_topk_prob=False,
                 attention_bias=False, clip_qkv=None)
    elif family in ("deepseek_v3", "deepseek_v2"):
        groups = 2 if num_experts % 2 == 0 and num_experts >= 4 else 1
        c.update(intermediate_size=2 * intermediate_size, moe_intermediate_size=intermediate_size,
                 n_routed_experts=num_experts, n_shared_experts=1, first_k_dense_replace=1 if num_layers > 1 else 0,
                 n_group=groups, topk_group=1 if groups > 1 and top_k <= num_experts // groups else groups,
                 routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=max(8, hidden_size // 2),
                 kv_lora_rank=max(8, hidden_size // 4), qk_nope_head_dim=head_dim,
                 qk_rope_head_dim=max(2, head_dim // 2), v_head_dim=head_dim, head_dim=max(2, head_dim // 2),
                 num_key_value_heads=num_heads, rope_interleave=True, attention_bias=False)
        if family == "deepseek_v2":  # V2-Lite's routing: softmax, group-limited when there are groups
            c.update(topk_method="group_limited_greedy" if groups > 1 else "greedy", norm_topk_prob=False,
                     routed_scaling_factor=1.0 if groups == 1 else 16.0)
            c.pop("rope_interleave")
    else:  # gpt_oss (YaRN as gpt-oss ships it: 4k pretraining context stretched 32x, here scaled down)
        original = max(8, max_position_embeddings // 8)
        c.update(intermediate_size=intermediate_size, num_local_experts=num_experts, head_dim=head_dim,
                 attention_bias=True, sliding_window=min(128, max(4, max_position_embeddings // 4)),
                 layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
                 swiglu_alpha=1.702, swiglu_limit=7.0,
                 rope_parameters={"rope_theta": 150000.0, "rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "factor": max_position_embeddings / original,
                                  "original_max_position_embeddings": original})
    return c


def write_random_checkpoint(path: str | Path, family: str = "mixtral", *, vocab_size: int = 512,
                            hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                            num_heads: int = 4, num_kv_heads: int = 2, num_experts: int = 8, top_k: int = 2,
                            max_position_embeddings: int = 512, dtype: torch.dtype = torch.float32, seed: int = 0,
                            router_scale: float = 1.0, max_shard_bytes: int = 2 * 2**30, progress=None,
                            quantize: str | None = None, block: tuple[int, int] = (128, 128),
                            scale_dtype: torch.dtype = torch.float32, overrides: dict | None = None) -> Path:
    """Returns the directory. `router_scale` > 1 sharpens routing; `progress(done, total)` is
    called per layer. `overrides`: config.json fields set over the family's random config (a
    published shape: `published.overrides`); the tensors follow the merged config. `quantize`
    ("fp8" / "mxfp4"): each tensor is written in the layout the quantized release ships as it is drawn (`quantize_tensor`), so a model larger than memory is
    written in one pass: tensors are drawn, quantized and written a shard (`max_shard_bytes`) at
    a time. The same seed draws the same weights with and without `quantize`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = random_config(family, vocab_size=vocab_size, hidden_size=hidden_size,
                           intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, num_experts=num_experts, top_k=top_k,
                           max_position_embeddings=max_position_embeddings, dtype=dtype)
    config.update(overrides or {})
    num_layers = config["num_hidden_layers"]
    if quantize:
        config["quantization_config"] = quantization_config(quantize, family, block)
    arch = parse(config, "random config")
    g = torch.Generator().manual_seed(seed)

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        last = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        if last == "e_score_correction_bias":
            return (torch.rand(shape, generator=g) * 0.1).to(dtype)
        if last == "sinks":
            return torch.randn(shape, generator=g).to(dtype)
        std = 0.02 * router_scale if last in ("gate", "router") else 0.02
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    # shard like transformers: model-0000k-of-0000n.safetensors + index when more than one file;
    # each shard is written once full (its final name needs the count, so parts are renamed at the end)
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        part = path / f".part-{len(parts):05d}.safetensors"
        save_file(shard, str(part), metadata={"format": "pt"})
        parts.append((part, list(shard)))
        shard, size = {}, 0

    layer_seen = -1
    for name, shape in arch.tensor_shapes().items():
        for out_name, t in quantize_tensor(name, value(name, shape), quantize, block, scale_dtype).items():
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
            shard[out_name] = t
            size += nbytes
            total += nbytes
        if progress and name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer != layer_seen:
                if layer_seen >= 0:
                    progress(layer_seen + 1, num_layers)
                layer_seen = layer
    flush()
    if progress:
        progress(num_layers, num_layers)
    if len(parts) == 1:
        parts[0][0].replace(path / "model.safetensors")
    else:
        weight_map = {}
        for i, (part, names) in enumerate(parts, 1):
            fname = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
            part.replace(path / fname)
            weight_map.update({n: fname for n in names})
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _share(path.glob("*.safetensors"))
    return path


def _share(files) -> None:
    """safetensors writes its files owner-only (0600); a checkpoint is read by other users (the
    operator's and Ray's Pods run as non-root), so give them the modes any other file gets."""
    umask = os.umask(0)
    os.umask(umask)
    for f in files:
        f.chmod(0o666 & ~umask)


def write_random_mixtral(path: str | Path, **kwargs) -> Path:
    return write_random_checkpoint(path, "mixtral", **kwargs)


def _fp8_quantized(name: str) -> bool:
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or name.rsplit(".", 2)[-2] in ("w1", "w2", "w3")


def quantization_config(method: str, family: str, block: tuple[int, int] = (128, 128)) -> dict:
    """config.json's quantization_config as the quantized releases write it."""
    if method == FP8:
        return {"quant_method": FP8, "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if method == MXFP4:
        if family != "gpt_oss":
            raise ValueError(f"mxfp4 is the gpt_oss format (this checkpoint is {family})")
        return {"quant_method": MXFP4, "modules_to_not_convert": MXFP4_NOT_CONVERTED}
    raise ValueError(f"quantize: {method!r} is not one of fp8, mxfp4")


def quantize_tensor(name: str, t: torch.Tensor, method: str | None, block: tuple[int, int] = (128, 128),
                    scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One checkpoint tensor in the stored form of `method` (None: as it is): fp8 for every linear
    projection but the routers and lm_head (weight + `_scale_inv`), mxfp4 for gpt_oss' fused
    experts (`_blocks` + `_scales`, each expert [out, in])."""
    from .dequant import pack_mxfp4, quantize_fp8

    if method == FP8 and t.dim() == 2 and _fp8_quantized(name):
        q, scale = quantize_fp8(t, block, scale_dtype)
        return {name: q, name + "_scale_inv": scale}
    if method == MXFP4 and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        packed = [pack_mxfp4(t[e].t()) for e in range(t.shape[0])]  # stored [out, in]
        return {name + "_blocks": torch.stack([b for b, _ in packed]), name + "_scales": torch.stack([s for _, s in packed])}
    return {name: t}


def quantize_checkpoint(path: str | Path, method: str, *, block: tuple[int, int] = (128, 128),
                        scale_dtype: torch.dtype = torch.float32) -> Path:
    """Rewrite a float checkpoint directory in place into the layout the quantized releases
    ship: fp8 (`weight_block_size` blocks, `*.weight_scale_inv` in `scale_dtype`: DeepSeek
    stores F32, Qwen3 -FP8 BF16) or mxfp4 (gpt_oss experts as `*_blocks` / `*_scales`). For
    checkpoints written by others (transformers' own, in the tests); `write_random_checkpoint`
    quantizes as it writes."""
    from safetensors import safe_open

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, config.get("model_type"), block)
    files = sorted({t.file for t in read_index(path).values()})
    weight_map = {}
    for file in files:
        out = {}
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                out.update(quantize_tensor(name, f.get_tensor(name), method, block, scale_dtype))
        save_file(out, str(file), metadata={"format": "pt"})
        weight_map.update({n: file.name for n in out})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        raw = json.loads(index.read_text())
        raw["weight_map"] = weight_map
        index.write_text(json.dumps(raw, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _share(files)
    return path
