"""Write a random Mixtral checkpoint in Hugging Face layout (config.json + safetensors).

For quickstarts, benchmarks and tests that need a model of a chosen size without a hub: the
file layout, tensor names and config keys are those transformers writes, so the same loaders
read it. Expert weights are drawn with a scale that keeps activations finite through the layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import EXPERT_KEY

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_random_mixtral(path: str | Path, *, vocab_size: int = 512, hidden_size: int = 64,
                         intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, num_experts: int = 8, top_k: int = 2,
                         max_position_embeddings: int = 512, dtype: torch.dtype = torch.float32,
                         seed: int = 0, router_scale: float = 1.0, max_shard_bytes: int = 2 * 2**30,
                         progress=None) -> Path:
    """Returns the directory. `router_scale` > 1 sharpens routing; `progress(done, total)` is called per layer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden_size // num_heads

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab_size, hidden_size),
        "model.norm.weight": torch.ones(hidden_size, dtype=dtype),
        "lm_head.weight": rand(vocab_size, hidden_size),
    }
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.q_proj.weight"] = rand(num_heads * head_dim, hidden_size)
        tensors[p + "self_attn.k_proj.weight"] = rand(num_kv_heads * head_dim, hidden_size)
        tensors[p + "self_attn.v_proj.weight"] = rand(num_kv_heads * head_dim, hidden_size)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden_size, num_heads * head_dim)
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden_size, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden_size, dtype=dtype)
        tensors[p + "block_sparse_moe.gate.weight"] = rand(num_experts, hidden_size, std=0.02 * router_scale)
        for e in range(num_experts):
            tensors[EXPERT_KEY.format(layer=layer, expert=e, w="w1")] = rand(intermediate_size, hidden_size)
            tensors[EXPERT_KEY.format(layer=layer, expert=e, w="w2")] = rand(hidden_size, intermediate_size)
            tensors[EXPERT_KEY.format(layer=layer, expert=e, w="w3")] = rand(intermediate_size, hidden_size)
        if progress:
            progress(layer + 1, num_layers)

    # shard like transformers: model-0000k-of-0000n.safetensors + index when more than one file
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "num_local_experts": num_experts, "num_experts_per_tok": top_k, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "dtype": _DTYPE_NAMES[dtype],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
