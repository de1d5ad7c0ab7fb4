"""Tiny random Mixtral checkpoints written by transformers itself (the real Hugging Face layout)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_mixtral(path: Path, *, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=128, dtype=torch.float32, seed=0, max_shard_size=None,
                 tie_word_embeddings=False):
    """Write a random MixtralForCausalLM to `path`; returns the transformers model (eval, fp32 copy kept)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                        num_key_value_heads=num_key_value_heads, num_local_experts=num_local_experts,
                        num_experts_per_tok=num_experts_per_tok, max_position_embeddings=max_position_embeddings,
                        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).eval()
    # transformers' default init (std 0.02) gives near-uniform routing; widen the router so top-k
    # choices are decisive and a routing bug cannot hide behind ties
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(25.0)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def reference_greedy(model, ids, n):
    """transformers' greedy continuation of `ids`: n tokens, one full forward each (no cache)."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def add_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json over `vocab_size` ids: w3 .. w{vocab-1} plus special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(Path(path) / "tokenizer.json"))


def make_skewed_mixtral(path: Path, hot_experts=(0, 4), **kwargs):
    """A Mixtral whose routers send nearly every token to `hot_experts` in every layer: one
    embedding dimension is a large constant, and only the hot experts' router rows read it."""
    model = make_mixtral(path, **kwargs)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:
            layer.mlp.gate.weight[:, 0] = 0.0
            for e in hot_experts:
                layer.mlp.gate.weight[e, 0] = 3.0
    model.save_pretrained(path)
    return model


def make_family(path: Path, family: str, *, seed=0, router_scale=25.0, config_overrides=None, **dims):
    """A random `family` model built and saved by transformers itself (XForCausalLM(XConfig)
    .save_pretrained): its own config.json and tensor layout. Routers are widened (decisive
    top-k); biases, attention sinks and DeepSeek's score correction, which transformers
    initialises to zero, are made random so that a part read wrongly shows. Returns the model."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_workers.model.random_init import random_config

    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_layers=3, num_heads=4, num_kv_heads=2,
                 num_experts=8, top_k=2, max_position_embeddings=128, dtype=torch.float32)
    shape.update(dims)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**random_config(family, **shape), **(config_overrides or {})}))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(router_scale)
            elif name.endswith(("bias", "sinks")):
                p.copy_(torch.randn_like(p) * (1.0 if name.endswith("sinks") else 0.05))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.1)
    model = model.to(shape["dtype"])
    model.save_pretrained(path)
    return model
