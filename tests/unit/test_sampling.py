"""The batched sampler (model/sampling.py) against transformers' logits processors on the same
logits, OpenAI's definition of the presence and frequency penalties, and the distribution it
draws from; no model, no engine."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from moe_workers.model.sampling import GREEDY, History, SamplingParams, sample, sample_batch, shaped_logits

VOCAB = 300
INF = float("-inf")


def _logits(rows, seed, scale=3.0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _ids(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _transformers(row, ids, p: SamplingParams):
    """One row through transformers' processors, in generate's order."""
    scores = row[None].clone()
    input_ids = torch.tensor([ids])
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[tok], bias] for tok, bias in p.logit_bias])(input_ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
    if p.temperature > 0:
        scores = TemperatureLogitsWarper(p.temperature)(input_ids, scores)
        if p.top_k > 0:
            scores = TopKLogitsWarper(p.top_k)(input_ids, scores)
        if p.top_p < 1.0:
            scores = TopPLogitsWarper(p.top_p)(input_ids, scores)
        if p.min_p > 0:
            scores = MinPLogitsWarper(p.min_p)(input_ids, scores)
    return scores[0]


CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, temperature=0.8),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=0.6, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-9),  # only the most likely token stays
    SamplingParams(repetition_penalty=1.4, logit_bias=((3, 2.5), (17, -4.0), (250, 0.5))),
]


def test_shaped_logits_match_transformers_processors_row_by_row_and_batched():
    logits = _logits(len(CASES), 1)
    prompts = [_ids(40, 10 + i) + [3, 17] for i in range(len(CASES))]  # 3 and 17: biased and penalized
    outputs = [_ids(7 + i, 30 + i) for i in range(len(CASES))]
    histories = [History(VOCAB, p, o) for p, o in zip(prompts, outputs)]
    got = shaped_logits(logits, CASES, histories)
    for i, p in enumerate(CASES):
        want = _transformers(logits[i], prompts[i] + outputs[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), p
        finite = torch.isfinite(want)
        assert finite.any()
        torch.testing.assert_close(got[i][finite], want[finite], rtol=1e-12, atol=1e-12)
    # the penalties really changed something, and the filters removed tokens
    assert not torch.equal(got[0], logits[0]) and torch.isinf(got[2]).sum() == VOCAB - 20
    assert torch.isfinite(got[7]).sum() == 1


def test_presence_and_frequency_penalties_follow_openai_over_the_output_only():
    logits = _logits(1, 2)
    prompt, output = [5, 6, 7], [7, 7, 9, 11, 7]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25)
    got = shaped_logits(logits, [p], [History(VOCAB, prompt, output)])[0]
    want = logits[0].clone()
    for tok in set(output):
        count = output.count(tok)
        want[tok] -= count * p.frequency_penalty + p.presence_penalty
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got[5] == logits[0, 5]  # in the prompt only: no presence penalty


def test_logit_bias_adds_and_barred_ids_never_come():
    logits = _logits(2, 3)
    top = int(logits[0].argmax())
    p = SamplingParams(logit_bias=((4, 100.0), (top, -100.0)))
    got = shaped_logits(logits, [p, GREEDY], barred=[(), (int(logits[1].argmax()),)])
    assert got[0, 4] == logits[0, 4] + 100 and got[0, top] == logits[0, top] - 100
    assert got[1, int(logits[1].argmax())] == INF
    assert sample_batch(logits, [p, GREEDY], barred=[(), (int(logits[1].argmax()),)]) == [
        4, int(logits[1].topk(2).indices[1])]
    # barred also against a sampling row whose bias pushes the barred id
    hot = SamplingParams(temperature=1.0, logit_bias=((9, 100.0),))
    for seed in range(20):
        assert sample_batch(logits[:1], [hot], [torch.Generator().manual_seed(seed)], barred=[(9,)])[0] != 9


def test_neutral_values_are_plain_greedy_and_skip_all_shaping():
    logits = _logits(5, 4).float()
    neutral = SamplingParams(top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0)
    assert not neutral.shaped and not neutral.penalized
    assert sample_batch(logits, [neutral] * 5) == logits.argmax(dim=-1).tolist()
    # a penalized greedy row needs its history
    with pytest.raises(ValueError, match="History"):
        sample_batch(logits, [SamplingParams(repetition_penalty=1.5)] + [neutral] * 4)


def test_a_seeded_row_draws_the_same_alone_or_in_any_batch():
    logits = _logits(6, 5)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=30),
              SamplingParams(temperature=1.2, top_p=0.9), GREEDY, SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=1.0, repetition_penalty=1.5)]
    histories = [None] * 5 + [History(VOCAB, _ids(20, 1))]

    def draws(rows):
        gens = [torch.Generator().manual_seed(100 + i) if i != 2 else None for i in rows]  # row 2 unseeded
        out = []
        for _ in range(10):
            out.append(sample_batch(logits[rows], [params[i] for i in rows], gens, [histories[i] for i in rows]))
        return [[step[k] for step in out] for k in range(len(rows))]

    together = draws([0, 1, 2, 3, 4, 5])
    for i in (0, 1, 3, 4, 5):
        assert draws([i])[0] == together[i]
    assert draws([5, 0])[1] == together[0]
    assert len(set(together[0])) > 1  # it does sample


def test_draws_follow_the_shaped_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], dtype=torch.float64)
    p = SamplingParams(temperature=0.8, top_k=4)
    want = torch.softmax(shaped_logits(logits, [p])[0], dim=-1)
    n = 40_000
    torch.manual_seed(0)
    toks = torch.tensor(sample_batch(logits.expand(n, -1), [p] * n))  # unseeded rows: one batched draw
    freq = torch.bincount(toks, minlength=6).double() / n
    assert freq[4] == 0 and freq[5] == 0
    torch.testing.assert_close(freq, want, rtol=0, atol=0.01)


def test_sample_keeps_its_single_row_form():
    row = _logits(1, 6)[0]
    assert sample(row, 0.0) == int(row.argmax())
    a = sample(row, 1.0, 0.5, torch.Generator().manual_seed(3))
    assert a == sample(row, 1.0, 0.5, torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scale", [6.0, 0.05])  # peaked: the 1024 candidates hold top_p; flat: a full sort
def test_top_p_over_a_large_vocabulary_matches_transformers_either_way(scale):
    vocab = 20_000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * scale
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.5, 0.9, 0.99)]
    got = shaped_logits(logits, params)
    for i, p in enumerate(params):
        want = TopPLogitsWarper(p.top_p)(torch.zeros(1, 1, dtype=torch.long), logits[i:i + 1].clone())[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want))
    kept = torch.isfinite(got).sum(dim=-1)
    assert (kept < 1024).all() if scale > 1 else (kept > 1024).all()


def test_drawing_among_candidates_is_the_whole_vocabulary_distribution():
    """The narrow path (top_k / top_p rows drawn among their most likely tokens) against softmax
    of the fully shaped logits; a flat row, and a tie at the k-th token, go the whole way."""
    from moe_workers.model.sampling import _candidates, _warp

    vocab = 5000
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, vocab, generator=g, dtype=torch.float64) * torch.tensor([[6.0], [6.0], [6.0], [6.0], [0.01], [6.0]])
    x[5, :3] = x[5].max() + 1  # three tied top tokens
    params = [SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.2, top_k=2000, top_p=0.8, min_p=0.01),
              SamplingParams(temperature=0.5, top_p=0.97, min_p=0.2), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=2)]
    probs, ids, settled = _candidates(x, params)
    assert settled.tolist() == [True, True, True, True, False, False]
    want = torch.softmax(_warp(x, params), dim=-1)
    for r in range(4):
        got = torch.zeros(vocab, dtype=torch.float64).scatter_(0, ids[r], probs[r])
        torch.testing.assert_close(got / got.sum(), want[r], rtol=1e-9, atol=1e-12)
    # the unsettled rows still sample from the whole-vocabulary distribution
    toks = sample_batch(x[4:].expand(2, 2, vocab).reshape(4, vocab), params[4:] * 2)
    assert all(torch.isfinite(_warp(x[4:5], params[4:5]))[0, t] for t in toks[::2])
    assert all(t in (0, 1, 2) for t in toks[1::2])  # every tied top token stays a candidate
