"""The model configuration, read from a Hugging Face config.json: a family's `Arch` plus the
torch dtype the weights are computed in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .dtypes import COMPUTE
from .family import Arch, CheckpointError, UnsupportedModel, eos_outside_vocabulary, parse, token_ids

__all__ = ["CheckpointError", "MoEConfig", "UnsupportedModel"]

_DTYPES = {name: getattr(torch, name) for name in COMPUTE}


@dataclass(frozen=True)
class MoEConfig(Arch):
    dtype: torch.dtype = torch.float32

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert in the compute dtype (every part of `expert_parts()`)."""
        return self.expert_numel() * torch.tensor([], dtype=self.dtype).element_size()

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", family: str | None = None) -> "MoEConfig":
        arch = parse(raw, source, family)
        return cls(**arch.__dict__, dtype=_DTYPES[arch.dtype_name])

    @classmethod
    def from_dir(cls, path: str | Path, family: str | None = None) -> "MoEConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{path}: no config.json (expected a Hugging Face layout directory)")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{config_file}: not valid JSON ({err})") from None
        config = cls.from_dict(raw, str(config_file), family)
        return config.with_generation_config(Path(path) / "generation_config.json")

    def with_generation_config(self, path: Path) -> "MoEConfig":
        """With the end-of-sequence ids of generation_config.json added, where there is one
        (transformers' generate reads its eos_token_id, one id or a list: gpt-oss ends a turn at
        <|return|> and at a tool call's <|call|>, only the first being config.json's)."""
        if not path.is_file():
            return self
        try:
            raw = json.loads(path.read_text())
            extra = token_ids(raw.get("eos_token_id") if isinstance(raw, dict) else None, "eos_token_id")
        except (json.JSONDecodeError, ValueError) as err:
            raise CheckpointError(f"{path}: {err}") from None
        problem = eos_outside_vocabulary(extra, self.vocab_size)
        if problem:
            raise CheckpointError(f"{path}: {problem}")
        ids = self.eos_token_ids + tuple(i for i in dict.fromkeys(extra) if i not in self.eos_token_ids)
        return MoEConfig(**{**self.__dict__, "eos_token_ids": ids,
                            "eos_token_id": self.eos_token_id if self.eos_token_id is not None else ids[0] if ids else None})

    def with_dtype(self, dtype: str | torch.dtype | None) -> "MoEConfig":
        if dtype in (None, "auto"):
            return self
        resolved = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        return MoEConfig(**{**self.__dict__, "dtype": resolved})
