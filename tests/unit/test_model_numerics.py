"""Our Mixtral against transformers' on the same random checkpoints (no Ray, no cluster).

Tolerances: fp32 logits within 1e-4 absolute (different but equivalent kernels: SDPA vs eager
attention, batched vs per-expert loops); bf16/fp16 within 2% of the logit range, since every
op rounds; greedy generations must be identical in fp32.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_mixtral, reference_greedy
from moe_workers.model import native
from moe_workers.model.checkpoint import Checkpoint
from moe_workers.model.config import CheckpointError
from moe_workers.model.dense import Chunk
from moe_workers.model.inprocess import InProcessModel

SHAPES = {
    "e4-top1-mha-2l": dict(num_local_experts=4, num_experts_per_tok=1, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2),
    "e8-top2-gqa2-3l": dict(num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3),
    "e8-top4-gqa4-2l": dict(num_local_experts=8, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2, hidden_size=64),
    "e16-top2-mqa-4l": dict(num_local_experts=16, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4),
}


def _reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_logits_and_greedy_match_transformers_fp32(tmp_path, shape):
    ref = make_mixtral(tmp_path, **SHAPES[shape])
    ours = InProcessModel(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 96, (23,), generator=g).tolist()
    ref_logits = _reference_logits(ref, prompt)
    our_logits = ours.prompt_logits(prompt).float()
    assert our_logits.shape == ref_logits.shape
    torch.testing.assert_close(our_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert ours.generate([prompt], max_tokens=12) == [reference_greedy(ref, prompt, 12)]


def test_batched_decode_with_different_lengths_matches_one_by_one(tmp_path):
    ref = make_mixtral(tmp_path, **SHAPES["e8-top2-gqa2-3l"])
    ours = InProcessModel(tmp_path, max_sequences=4)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 17, 2, 30)]
    together = ours.generate(prompts, max_tokens=8)
    for p, got in zip(prompts, together):
        assert got == reference_greedy(ref, p, 8)


def test_incremental_prefill_matches_single_prefill(tmp_path):
    make_mixtral(tmp_path, **SHAPES["e8-top2-gqa2-3l"])
    ours = InProcessModel(tmp_path)
    prompt = list(range(3, 40))
    whole = ours.prompt_logits(prompt)[-1]
    slot = ours.cache.allocate()
    ours.step([Chunk(slot, 0, prompt[:20])])
    split = ours.step([Chunk(slot, 20, prompt[20:])])[0]
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_checkpoints(tmp_path, dtype):
    ref = make_mixtral(tmp_path, dtype=dtype, **SHAPES["e8-top2-gqa2-3l"])
    ours = InProcessModel(tmp_path)
    assert ours.cfg.dtype == dtype
    prompt = list(range(5, 25))
    ref_logits = _reference_logits(ref, prompt)
    our_logits = ours.prompt_logits(prompt).float()
    span = float(ref_logits.max() - ref_logits.min())
    assert float((our_logits - ref_logits).abs().max()) < 0.02 * span
    # agreement on the top token at nearly every position
    agree = (our_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
    assert agree >= 0.9


def test_sharded_checkpoint_with_index(tmp_path):
    ref = make_mixtral(tmp_path, max_shard_size="20KB", **SHAPES["e4-top1-mha-2l"])
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    ours = InProcessModel(tmp_path)
    prompt = list(range(3, 19))
    torch.testing.assert_close(ours.prompt_logits(prompt).float(), _reference_logits(ref, prompt), atol=1e-4, rtol=1e-4)


def test_tied_embeddings(tmp_path):
    ref = make_mixtral(tmp_path, tie_word_embeddings=True, **SHAPES["e4-top1-mha-2l"])
    ours = InProcessModel(tmp_path)
    prompt = list(range(3, 19))
    torch.testing.assert_close(ours.prompt_logits(prompt).float(), _reference_logits(ref, prompt), atol=1e-4, rtol=1e-4)


def test_expert_read_alone_matches_reference_weights(tmp_path):
    ref = make_mixtral(tmp_path, **SHAPES["e8-top2-gqa2-3l"])
    ckpt = Checkpoint(tmp_path)
    w = ckpt.expert(2, 5)
    fused = ref.model.layers[2].mlp.experts
    gate, up = fused.gate_up_proj[5].chunk(2, dim=0)
    torch.testing.assert_close(w["w1"], gate.detach())
    torch.testing.assert_close(w["w3"], up.detach())
    torch.testing.assert_close(w["w2"], fused.down_proj[5].detach())
    with pytest.raises(CheckpointError, match="expert 3.0 does not exist"):
        ckpt.expert(3, 0)


def test_refuses_pickle_only_checkpoint(tmp_path):
    make_mixtral(tmp_path, **SHAPES["e4-top1-mha-2l"])
    for f in tmp_path.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(CheckpointError, match="pickle files are never loaded"):
        Checkpoint(tmp_path)


def test_refuses_other_families(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        Checkpoint(tmp_path)


def test_our_random_checkpoint_loads_in_transformers_identically(tmp_path):
    """write_random_mixtral (used by moectl init-model and the benchmarks) writes a layout
    transformers reads, and both compute the same logits from it."""
    from transformers import MixtralForCausalLM

    from moe_workers.model.random_init import write_random_mixtral

    write_random_mixtral(tmp_path, vocab_size=80, hidden_size=32, intermediate_size=40, num_layers=2,
                         num_experts=4, top_k=2, router_scale=20, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    ref = MixtralForCausalLM.from_pretrained(tmp_path).eval()
    ours = InProcessModel(tmp_path)
    prompt = list(range(3, 30))
    torch.testing.assert_close(ours.prompt_logits(prompt).float(), _reference_logits(ref, prompt), atol=1e-4, rtol=1e-4)


def test_dense_state_holds_no_expert_weights(tmp_path):
    """What the ingress loads: every tensor except the experts (it never holds expert weights)."""
    make_mixtral(tmp_path, **SHAPES["e8-top2-gqa2-3l"])
    ckpt = Checkpoint(tmp_path)
    dense = ckpt.dense_state()
    assert not [n for n in dense if ".experts." in n]
    expert_names = [n for n in ckpt.names() if ".experts." in n]
    assert len(expert_names) == 3 * 8 * 3 and set(dense) | set(expert_names) == set(ckpt.names())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_mlp_into_a_slice_equals_the_out_of_place_form(dtype):
    """The shard writes each expert's rows straight into its slice of the reply: same values as
    transformers' act(w1 x) * w3 x -> w2 form, and nothing outside the slice is touched."""
    import torch.nn.functional as F
    from moe_workers.model.layers import expert_mlp

    g = torch.Generator().manual_seed(0)
    hidden, inter = 64, 160
    w1, w3 = (torch.randn(inter, hidden, generator=g).to(dtype) for _ in range(2))
    w2 = torch.randn(hidden, inter, generator=g).to(dtype)
    rows = native.ROWS_MAX + 4  # a prefill's rows: torch's GEMM (a decode's few rows: the next test)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    reference = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    reply = torch.full((rows + 8, hidden), 7.0, dtype=dtype)
    returned = expert_mlp(x, w1, w2, w3, out=reply[5:5 + rows])
    assert torch.equal(reply[5:5 + rows], reference)
    assert returned.data_ptr() == reply[5:5 + rows].data_ptr()
    assert torch.all(reply[:5] == 7.0) and torch.all(reply[5 + rows:] == 7.0)
    assert torch.equal(expert_mlp(x, w1, w2, w3), reference)


@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (1, torch.float32), (3, torch.bfloat16)])
def test_linear_of_a_decode_row_stays_within_rounding_of_the_exact_product(rows, dtype):
    """`linear` takes the C product for a few bf16 rows (a decode step's, 1.5-2x the read rate of
    F.linear there): every output within bf16's rounding of the float64 product, as F.linear's
    is; bias added; other inputs are F.linear's own result."""
    import torch.nn.functional as F
    from moe_workers.model.layers import expert_mlp, linear

    g = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 1000, generator=g) * 0.05).to(dtype)
    b = torch.randn(300, generator=g).to(dtype)
    x = torch.randn(rows, 1000, generator=g).to(dtype)
    exact = F.linear(x.double(), w.double(), b.double())
    ours, theirs = linear(x, w, b), F.linear(x, w, b)
    assert ours.shape == theirs.shape == (rows, 300) and ours.dtype == dtype
    tolerance = 2 * float((theirs.double() - exact).abs().max()) + 1e-12
    assert float((ours.double() - exact).abs().max()) <= tolerance
    if dtype != torch.bfloat16:
        assert torch.equal(ours, theirs)
    w1, w3 = (torch.randn(64, 1000, generator=g).to(dtype) * 0.05 for _ in range(2))
    w2 = torch.randn(1000, 64, generator=g).to(dtype) * 0.05
    reply = torch.full((rows + 2, 1000), 7.0, dtype=dtype)
    expert_mlp(x, w1, w2, w3, out=reply[1:1 + rows])
    assert torch.equal(reply[1:1 + rows], expert_mlp(x, w1, w2, w3))
    assert torch.all(reply[0] == 7.0) and torch.all(reply[-1] == 7.0)


def _teacher_forced(model, ids, one_a_step):
    """Each position's logits: one prefill of every token, or the tokens fed one a decode step."""
    if not one_a_step:
        return model.prompt_logits(ids).float()
    seq = model.cache.allocate()
    try:
        return torch.cat([model.step([Chunk(seq, i, [t])]).float() for i, t in enumerate(ids)])
    finally:
        model.cache.release(seq)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_bf16_decode_and_prompt_paths_are_as_close_to_fp32_as_each_other(tmp_path, family):
    """bf16 self-consistency (bench/consistency.py): the decode path (a token a step: the C kernels,
    paged decode attention, routes' combine) and the prompt path (40 tokens in one prefill: torch's
    GEMMs, SDPA, layers' combine) round the same ops once each, in another summation order, so
    neither drifts from the same weights in fp32 further than the other, and they differ from each
    other no more than each differs from fp32. Routing sharpened (router_scale): a near tie
    between experts flips on any rounding, which would measure the tie, not the paths."""
    from moe_workers.model.random_init import write_random_checkpoint

    write_random_checkpoint(tmp_path, family, vocab_size=512, hidden_size=128, intermediate_size=128, num_layers=4,
                            num_experts=8, top_k=2, dtype=torch.bfloat16, router_scale=10.0, seed=3)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    bf16 = InProcessModel(tmp_path, dtype="bfloat16", max_sequences=1)
    ref = _teacher_forced(InProcessModel(tmp_path, dtype="float32", max_sequences=1), ids, False)
    prompt, decode = _teacher_forced(bf16, ids, False), _teacher_forced(bf16, ids, True)
    p, d = float((prompt - ref).abs().mean()), float((decode - ref).abs().mean())
    between = float((decode - prompt).abs().mean())
    assert 0 < p < 0.05 * float(ref.std()) and 0 < d < 0.05 * float(ref.std())
    assert max(p, d) <= 1.5 * min(p, d), (p, d)
    assert between <= 1.5 * max(p, d), (between, p, d)
    agree = int((decode.argmax(-1) == prompt.argmax(-1)).sum())
    assert agree >= min(int((prompt.argmax(-1) == ref.argmax(-1)).sum()),
                        int((decode.argmax(-1) == ref.argmax(-1)).sum())) - 2, agree
