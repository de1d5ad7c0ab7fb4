"""Every supported family against transformers on the same random checkpoints (no Ray, no cluster).

Checkpoints are written by transformers itself (`make_family`: its config.json, its tensor
layout, fused experts included) and by our writer (`write_random_checkpoint`, which
`moectl init-model --family` uses), which transformers must load with no missing or unexpected
tensor. fp32 logits within 1e-4, greedy tokens identical, as for Mixtral (test_model_numerics).
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import make_family, reference_greedy
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.config import CheckpointError, UnsupportedModel
from moe_workers.model.dense import Chunk
from moe_workers.model.family import SUPPORTED
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.random_init import write_random_checkpoint

FAMILIES = [f for f in SUPPORTED if f != "mixtral"]  # Mixtral has its own, larger suite
SHAPES = {
    "e8-top2-gqa2-3l": dict(num_experts=8, top_k=2, num_heads=4, num_kv_heads=2, num_layers=3),
    "e16-top4-mha-4l": dict(num_experts=16, top_k=4, num_heads=4, num_kv_heads=4, num_layers=4, hidden_size=64,
                            intermediate_size=32),
}


def _prompt(n, seed=1):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(tmp_path, family, shape):
    ref = make_family(tmp_path, family, **SHAPES[shape])
    ours = InProcessModel(tmp_path)
    assert ours.cfg.family == family  # taken from config.json's model_type
    prompt = _prompt(37)  # longer than gpt_oss' sliding window (32 here)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours.prompt_logits(prompt), ref_logits, atol=1e-4, rtol=1e-4)
    assert ours.generate([prompt], max_tokens=12) == [reference_greedy(ref, prompt, 12)]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_and_chunked_steps_match_one_sequence_at_a_time(tmp_path, family):
    """Decode batched over sequences of different lengths, and a prompt fed in two chunks (the
    second attending to the cached first: windows, sinks, latent cache), equal one sequence at a time."""
    make_family(tmp_path, family)
    ours = InProcessModel(tmp_path, max_sequences=4)
    prompts = [_prompt(n, seed=n) for n in (5, 40, 2, 19)]
    together = ours.generate(prompts, max_tokens=6)
    assert together == [ours.generate([p], max_tokens=6)[0] for p in prompts]
    prompt = _prompt(45, seed=3)
    whole = ours.prompt_logits(prompt)
    slot = ours.cache.allocate()
    first = ours.step([Chunk(slot, 0, prompt[:30])], all_rows=True)
    second = ours.step([Chunk(slot, 30, prompt[30:])], all_rows=True)
    ours.cache.release(slot)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", SUPPORTED)
def test_our_writer_loads_in_transformers_with_every_tensor(tmp_path, family):
    from transformers import AutoModelForCausalLM

    write_random_checkpoint(tmp_path, family, vocab_size=96, hidden_size=32, intermediate_size=24, num_layers=3,
                            num_heads=4, num_kv_heads=2, num_experts=8, top_k=2, max_position_embeddings=64,
                            router_scale=25.0)
    ref, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = InProcessModel(tmp_path)
    prompt = _prompt(20)
    with torch.no_grad():
        torch.testing.assert_close(ours.prompt_logits(prompt), ref.eval()(torch.tensor([prompt])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    # the dense part holds every dense tensor once (fused projections included; MLA adds its
    # absorbed copies of kv_b): what the Ingress reports as its dense bytes
    dense = sum(p.numel() * 4 for n, p in ref.state_dict().items() if ".experts." not in n
                and not (n == "lm_head.weight" and ref.config.tie_word_embeddings))
    absorbed = sum(a.numel() * 4 + b.numel() * 4 for a, b in ours.dense._absorb.values())
    assert ours.dense.nbytes() == dense + absorbed


def test_written_checkpoints_are_readable_by_other_users(tmp_path):
    """safetensors writes owner-only files; the operator's and Ray's Pods read the checkpoint as
    another (non-root) user, so the writer gives its files the usual modes (one shard and several)."""
    import stat

    for sub, max_shard in (("one", 1 << 30), ("many", 20_000)):
        write_random_checkpoint(tmp_path / sub, "mixtral", vocab_size=64, hidden_size=16, intermediate_size=16,
                                num_layers=2, num_heads=2, num_kv_heads=1, num_experts=4, top_k=2,
                                max_position_embeddings=32, max_shard_bytes=max_shard)
        files = sorted((tmp_path / sub).iterdir())
        assert len(files) >= 2 and (sub == "one") == (len(files) == 2)
        for f in files:
            assert f.stat().st_mode & stat.S_IROTH, f"{f.name} not readable by others: {oct(f.stat().st_mode)}"


def test_deepseek_yarn_rope_with_mscale_matches_transformers(tmp_path):
    yarn = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    ref = make_family(tmp_path, "deepseek_v3", config_overrides={"rope_parameters": yarn})
    ours = InProcessModel(tmp_path)
    assert ours.dense.rope_scaling == 1.0 and ours.dense.scaling != (12 ** -0.5)  # the mscale moved into the softmax
    prompt = _prompt(50)
    with torch.no_grad():
        torch.testing.assert_close(ours.prompt_logits(prompt), ref(torch.tensor([prompt])).logits[0],
                                   atol=1e-4, rtol=1e-4)


def test_dense_layers_and_experts_are_where_the_config_says(tmp_path):
    make_family(tmp_path / "q", "qwen3_moe", num_layers=4)  # mlp_only_layers [0]
    make_family(tmp_path / "d", "deepseek_v3", num_layers=4)  # first_k_dense_replace 1
    make_family(tmp_path / "g", "gpt_oss", num_layers=2)
    q, d, g = Checkpoint(tmp_path / "q"), Checkpoint(tmp_path / "d"), Checkpoint(tmp_path / "g")
    assert q.config.sparse_layers == (1, 2, 3) and d.config.sparse_layers == (1, 2, 3)
    with pytest.raises(CheckpointError, match="layer 0 of this qwen3_moe model is a dense MLP layer"):
        q.expert(0, 1)
    assert set(q.expert(1, 7)) == {"w1", "w2", "w3"}
    # a fused gpt_oss expert is its own slice, read without the rest of the layer
    part = g.expert(1, 5)
    full = g.tensor("model.layers.1.mlp.experts.gate_up_proj")
    assert torch.equal(part["gate_up"], full[5]) and part["gate_up"].shape == (32, 48)
    ranges = dict(g.expert_ranges(1, 5))
    assert ranges["gate_up"].nbytes == 32 * 48 * 4
    # shared experts and dense MLPs are the ingress' (dense state), routed experts are not
    dense = Checkpoint(tmp_path / "d").dense_state()
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in dense
    assert "model.layers.0.mlp.up_proj.weight" in dense
    assert not any(".mlp.experts." in n for n in dense)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_contradicting_or_unsupported_checkpoints_are_refused_naming_file_and_tensor(tmp_path):
    make_family(tmp_path, "qwen3_moe", num_layers=2)
    _edit_config(tmp_path, moe_intermediate_size=20)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor model.layers.0.mlp.experts.0.gate_proj.weight "
                                              r"has shape \(24, 32\), config.json implies \(20, 32\)"):
        Checkpoint(tmp_path)
    _edit_config(tmp_path, moe_intermediate_size=24, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="tensor model.layers.2.input_layernorm.weight is missing"):
        Checkpoint(tmp_path)
    _edit_config(tmp_path, num_hidden_layers=2, model_type="llama4")
    with pytest.raises(UnsupportedModel, match="model_type 'llama4' is not supported .supported: mixtral, qwen3_moe"):
        Checkpoint(tmp_path)
    for method, name in (("gptq", "GPTQ"), ("awq", "AWQ"), ("compressed-tensors", "compressed-tensors")):
        _edit_config(tmp_path, model_type="mixtral", quantization_config={"quant_method": method, "bits": 4})
        with pytest.raises(UnsupportedModel, match=f"{name} checkpoints .quant_method {method}. are not supported"):
            Checkpoint(tmp_path)
    _edit_config(tmp_path, model_type="mixtral", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(UnsupportedModel, match="mxfp4 is read for gpt_oss checkpoints only"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("family,overrides", [
    ("mixtral", {"sliding_window": 8}),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None}),
    ("deepseek_v3", {"q_lora_rank": None}),  # q_proj instead of the q LoRA
    ("deepseek_v2", {"topk_method": "greedy", "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0}),
], ids=["mixtral-window", "qwen3-window", "qwen2-window-layers", "deepseek-v3-no-q-lora", "deepseek-v2-greedy"])
def test_config_options_match_transformers(tmp_path, family, overrides):
    ref = make_family(tmp_path, family, config_overrides=overrides)
    ours = InProcessModel(tmp_path)
    if "sliding_window" in overrides:
        assert 8 in [ours.cfg.sliding(layer) for layer in range(3)]  # and the prompt is longer than the window
    prompt = _prompt(30)
    with torch.no_grad():
        torch.testing.assert_close(ours.prompt_logits(prompt), ref(torch.tensor([prompt])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    assert ours.generate([prompt], max_tokens=8) == [reference_greedy(ref, prompt, 8)]


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_checkpoints_compute_in_bfloat16_close_to_transformers(tmp_path, family):
    """Every op rounds in 16 bits, so: within 2% of the logit range, the same top token at
    nearly every position (as for Mixtral in test_model_numerics)."""
    ref = make_family(tmp_path, family, dtype=torch.bfloat16)
    ref = ref.to(torch.bfloat16)
    ours = InProcessModel(tmp_path)
    assert ours.cfg.dtype == torch.bfloat16
    prompt = _prompt(24)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0].float()
    our_logits = ours.prompt_logits(prompt).float()
    span = float(ref_logits.max() - ref_logits.min())
    assert float((our_logits - ref_logits).abs().max()) < 0.02 * span
    assert (our_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.9


def test_the_api_offers_exactly_the_supported_families():
    import typing

    from moe_operator.api.models import ModelSource

    literal = next(a for a in typing.get_args(ModelSource.model_fields["family"].annotation) if a is not type(None))
    assert typing.get_args(literal) == SUPPORTED


def test_end_of_sequence_ids_come_from_config_and_generation_config(tmp_path):
    """config.json's eos_token_id (one id or a list) and generation_config.json's, as transformers'
    generate ends on them; a malformed or out-of-vocabulary one names its file."""
    from moe_workers.model.config import MoEConfig
    from moe_workers.model.random_init import random_config

    raw = random_config("gpt_oss", vocab_size=96, hidden_size=32, intermediate_size=24, num_layers=2, num_heads=4,
                        num_kv_heads=2, num_experts=4, top_k=2, max_position_embeddings=64, dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "eos_token_id": [90, 91]}))
    assert MoEConfig.from_dir(tmp_path).eos_token_ids == (90, 91)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [91, 93, 93]}))
    cfg = MoEConfig.from_dir(tmp_path)
    assert (cfg.eos_token_id, cfg.eos_token_ids) == (90, (90, 91, 93))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id must be a token id or a list"):
        MoEConfig.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 96}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id \[96\] names an id outside the "
                                              r"vocabulary of 96"):
        MoEConfig.from_dir(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**raw, "eos_token_id": None}))
    assert MoEConfig.from_dir(tmp_path).eos_token_ids == ()
    (tmp_path / "config.json").write_text(json.dumps({**raw, "eos_token_id": 200}))
    with pytest.raises(CheckpointError, match=r"config.json: eos_token_id \[200\] names an id outside"):
        MoEConfig.from_dir(tmp_path)
