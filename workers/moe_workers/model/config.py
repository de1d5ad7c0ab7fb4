"""The model configuration, read from a Hugging Face config.json (Mixtral family)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is; the message says what is wrong and where."""


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (w1, w3: intermediate x hidden; w2: hidden x intermediate)."""
        return 3 * self.hidden_size * self.intermediate_size * torch.tensor([], dtype=self.dtype).element_size()

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "MoEConfig":
        model_type = raw.get("model_type")
        if model_type != "mixtral":
            raise CheckpointError(f"{source}: model_type {model_type!r} is not supported (supported: mixtral)")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            rope = raw.get("rope_parameters") or {}
            rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 1e6)))
            dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
            eos = raw.get("eos_token_id")
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                num_experts=int(raw["num_local_experts"]),
                top_k=int(raw["num_experts_per_tok"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                dtype=_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except KeyError as err:
            raise CheckpointError(f"{source}: missing {err.args[0]}") from None
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"{source}: rope_type {rope['rope_type']!r} is not supported (supported: default)")
        if cfg.top_k > cfg.num_experts or cfg.top_k < 1:
            raise CheckpointError(
                f"{source}: num_experts_per_tok ({cfg.top_k}) must be between 1 and num_local_experts ({cfg.num_experts})")
        if cfg.num_heads % cfg.num_kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads")
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> "MoEConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{path}: no config.json (expected a Hugging Face layout directory)")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{config_file}: not valid JSON ({err})") from None
        return cls.from_dict(raw, str(config_file))

    def with_dtype(self, dtype: str | torch.dtype | None) -> "MoEConfig":
        if dtype in (None, "auto"):
            return self
        resolved = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        return MoEConfig(**{**self.__dict__, "dtype": resolved})
