"""The published shapes (`moe_workers.model.published`, what `moectl init-model --shape` writes):
pure config data checked against the parser, and one real write through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_workers.model import published
from moe_workers.model.config import MoEConfig
from moe_workers.model.random_init import random_config

REPO = Path(__file__).resolve().parents[2]


def _config(name: str, **kw) -> MoEConfig:
    raw = random_config(published.family_of(name), vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=512,
                        dtype=torch.bfloat16)
    raw.update(published.overrides(name, **kw))
    return MoEConfig.from_dict(raw)


@pytest.mark.parametrize("name", list(published.SHAPES))
def test_a_truncated_published_shape_keeps_the_layer_dimensions_and_makes_every_layer_moe(name):
    cfg = _config(name, num_layers=2)
    fields = published.SHAPES[name][2]
    assert cfg.hidden_size == fields["hidden_size"]
    assert cfg.intermediate_size == fields.get("moe_intermediate_size", fields["intermediate_size"])
    assert cfg.num_experts == published.expert_count(name) and cfg.top_k == fields["num_experts_per_tok"]
    assert cfg.num_layers == 2 and list(cfg.sparse_layers) == [0, 1]


def test_the_whole_published_depth_keeps_deepseeks_dense_layers():
    cfg = _config("deepseek-v3")
    assert cfg.num_layers == 61 and cfg.sparse_layers[0] == 3 and len(cfg.sparse_layers) == 58
    assert (cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.kv_lora_rank, cfg.q_lora_rank) == (256, 8, 4, 512, 1536)


def test_fewer_experts_must_still_fit_the_top_k_and_the_groups():
    assert _config("deepseek-v3", num_layers=1, num_experts=32).num_experts == 32
    with pytest.raises(ValueError, match="fewer than its top-8"):
        published.overrides("deepseek-v3", num_experts=4)
    with pytest.raises(ValueError, match="8 groups"):
        published.overrides("deepseek-v3", num_experts=36)
    with pytest.raises(ValueError, match="not one of"):
        published.overrides("llama-70b")


def test_moectl_init_model_writes_a_published_shape(tmp_path):
    """Qwen3-30B-A3B's layer at 4 experts (2 MiB an expert): config and tensors at published dims."""
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'workers'}"}
    moectl = str(Path(sys.executable).with_name("moectl"))
    out = subprocess.run([moectl, "init-model", str(tmp_path / "m"), "--shape", "qwen3-30b-a3b", "--layers", "1",
                          "--experts", "8", "--dtype", "bfloat16"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "qwen3-30b-a3b dimensions" in out.stdout
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (raw["hidden_size"], raw["moe_intermediate_size"], raw["num_experts"], raw["head_dim"]) == (2048, 768, 8, 128)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert list(f.get_slice("model.layers.0.mlp.experts.7.down_proj.weight").get_shape()) == [2048, 768]
        assert list(f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()) == [4096, 2048]
    bad = subprocess.run([moectl, "init-model", str(tmp_path / "b"), "--shape", "qwen3-30b-a3b", "--experts", "4"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "fewer than its top-8" in bad.stderr
