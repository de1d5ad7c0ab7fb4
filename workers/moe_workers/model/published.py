"""The published dimensions of the models we name: the config.json fields their releases ship
that set a layer's shape (pure data, one place: `moectl init-model --shape`, the real-shape and
KV benches and the GPU kit read them here).

A truncated copy keeps every dimension of a layer and changes only what is asked: the number of
layers (every one of them a MoE layer), optionally the routed experts per layer (a DeepSeek-V3
layer of 256 experts is 22.5 GB in bf16; a step reads the same bytes with fewer of them), and
the vocabulary (the byte tokenizer's: tests and benches have no hub tokenizer).
"""

from __future__ import annotations

_GPT_OSS = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                max_position_embeddings=131072,
                rope_parameters={"rope_theta": 150000.0, "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})

# model name -> (family, published layers, config.json fields as published)
SHAPES: dict[str, tuple[str, int, dict]] = {
    "mixtral-8x7b": ("mixtral", 32, dict(
        hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})),
    "qwen3-30b-a3b": ("qwen3_moe", 48, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"})),
    "deepseek-v3": ("deepseek_v3", 61, dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64,
        first_k_dense_replace=3, max_position_embeddings=163840,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096})),
    "gpt-oss-20b": ("gpt_oss", 24, _GPT_OSS),
    "gpt-oss-120b": ("gpt_oss", 36, {**_GPT_OSS, "num_local_experts": 128}),
}

# the published vocabularies (not written by `overrides`: truncated copies keep the byte tokenizer's)
VOCAB_SIZES = {"mixtral-8x7b": 32000, "qwen3-30b-a3b": 151936, "deepseek-v3": 129280, "gpt-oss-20b": 201088,
               "gpt-oss-120b": 201088}

_EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts")


def family_of(name: str) -> str:
    return _shape(name)[0]


def published_layers(name: str) -> int:
    return _shape(name)[1]


def expert_count(name: str) -> int:
    fields = _shape(name)[2]
    return next(fields[k] for k in _EXPERT_COUNT if k in fields)


def overrides(name: str, *, num_layers: int | None = None, num_experts: int | None = None) -> dict:
    """The config.json fields of `name` at its published dimensions, for `num_layers` layers (all
    of them MoE layers when truncated; the published count and dense layers otherwise) and
    `num_experts` routed experts a layer (the published count when None). Merged over a family's
    `random_config`, which supplies the rest (vocabulary, dtype, token ids)."""
    family, layers, fields = _shape(name)
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in fields.items()}
    n = num_layers or layers
    out["num_hidden_layers"] = n
    if n < layers:
        out.pop("first_k_dense_replace", None)
        out.pop("mlp_only_layers", None)
        if family == "deepseek_v3":
            out["first_k_dense_replace"] = 0
        if family == "qwen3_moe":
            out["mlp_only_layers"] = []
    if num_experts is not None:
        key = next(k for k in _EXPERT_COUNT if k in out)
        top_k = out["num_experts_per_tok"]
        if num_experts < top_k:
            raise ValueError(f"{name}: {num_experts} experts is fewer than its top-{top_k}")
        out[key] = num_experts
        if family == "deepseek_v3" and num_experts % out["n_group"]:
            raise ValueError(f"{name}: {num_experts} experts do not divide into its {out['n_group']} groups")
    if family == "gpt_oss":
        out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return out


def _shape(name: str) -> tuple[str, int, dict]:
    if name not in SHAPES:
        raise ValueError(f"shape {name!r} is not one of {', '.join(SHAPES)}")
    return SHAPES[name]
