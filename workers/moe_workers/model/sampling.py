"""Next-token choice for a step's sequences: the OpenAI / vLLM sampling set, batched (pure torch).

For the rows of a step's logits, in this order (transformers' and vLLM's):
1. `logit_bias` added to the model's logits;
2. penalties: `repetition_penalty` over the prompt and the output (a positive logit divided by
   it, a negative one multiplied, as transformers' RepetitionPenaltyLogitsProcessor does), then
   `frequency_penalty` x the token's count in the output and `presence_penalty` once it appears
   there (OpenAI's definition: the output only); the ids that may not come yet (end of sequence
   and stop token ids before `min_tokens`) barred;
3. greedy rows (temperature 0) take the argmax here;
4. the others: temperature, `top_k`, `top_p` over what top_k kept, `min_p` (a token less likely
   than min_p x the most likely one goes; the ratio is the same before or after renormalising);
5. one draw per row by the exponential race (the argmax of p / E with E ~ Exp(1), which picks
   token i with probability p_i): a seeded row's noise comes from its own generator, the rest in
   one call.
Each stage runs once over the rows that need it, as [rows, vocab] tensor operations; only a
seeded row's noise is drawn row by row. A step whose rows are all plain greedy is one argmax.

Computed in float64 so that every temperature and top_p the API accepts gives a proper
distribution (a float32 top_p of 5e-324 is 0 and kept nothing; logits / 1e-5 overflowed float32);
a row the model itself made non-finite falls back to the argmax over its finite entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_TINY = torch.finfo(torch.float64).tiny
TOP_P_CANDIDATES = 1024  # top_p looks at this many most likely tokens first (a partial sort)


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's sampling; the defaults are neutral (plain greedy)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids in the vocabulary
    min_tokens: int = 0  # the end of sequence and the stop token ids are barred until this many

    @property
    def penalized(self) -> bool:
        """Whether the sequence's history shapes its logits (then it keeps a `History`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def shaped(self) -> bool:
        """Whether anything besides temperature changes the logits or the candidates."""
        return bool(self.penalized or self.logit_bias or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0)


GREEDY = SamplingParams()


class History:
    """What a sequence's penalties look at, as vocabulary-wide tensors kept up to date one token
    at a time: the ids seen in the prompt or the output (repetition), and each id's count in the
    output (frequency, presence)."""

    def __init__(self, vocab: int, prompt: Sequence[int], output: Sequence[int] = ()):
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        if prompt:
            self.seen[torch.as_tensor(list(prompt), dtype=torch.long)] = True
        self.counts = torch.zeros(vocab, dtype=torch.int32)
        for tok in output:
            self.add(tok)

    def add(self, token: int) -> None:
        self.seen[token] = True
        self.counts[token] += 1


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None] | None = None,
                 histories: Sequence[History | None] | None = None,
                 barred: Sequence[Sequence[int]] | None = None) -> list[int]:
    """One token id per row of (rows, vocab) `logits`; row i samples with params[i], its
    generator (None: torch's default), its history (needed when params[i].penalized) and the
    ids barred for it now."""
    rows = logits.shape[0]
    barred = barred or [()] * rows
    chosen = torch.argmax(logits, dim=-1)  # right as it is for plain greedy rows
    work = [i for i, p in enumerate(params) if p.temperature > 0 or p.shaped or barred[i]]
    if not work:
        return chosen.tolist()
    ps = [params[i] for i in work]
    x = logits[work].to(torch.float64, copy=True)  # (a list index copies already; this says so)
    _bias(x, ps)
    _penalize(x, ps, [histories[i] for i in work] if histories else [None] * len(work))
    _bar(x, [barred[i] for i in work])
    picks = torch.argmax(torch.nan_to_num(x, nan=float("-inf")), dim=-1)  # greedy rows, and the fallback
    hot = [j for j, p in enumerate(ps) if p.temperature > 0]
    if hot:
        gens = [generators[work[j]] if generators else None for j in hot]
        drawn = _draw(_warp(x[hot], [ps[j] for j in hot]), gens)
        ok = drawn >= 0  # -1: the row was not a distribution (it keeps its finite argmax)
        picks[torch.as_tensor(hot)[ok]] = drawn[ok]
    chosen[work] = picks
    return chosen.tolist()


def shaped_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[History | None] | None = None,
                  barred: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """The float64 logits each row chooses from (stages 1, 2 and 4 above): a greedy row's
    argmax, or a sampling row's softmax; a token filtered out is -inf."""
    x = logits.to(torch.float64, copy=True)
    _bias(x, list(params))
    _penalize(x, list(params), list(histories or [None] * len(params)))
    _bar(x, list(barred or [()] * len(params)))
    hot = [j for j, p in enumerate(params) if p.temperature > 0]
    if hot:
        x[hot] = _warp(x[hot], [params[j] for j in hot])
    return x


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """One token id from a (vocab,) row of logits with temperature and top_p only."""
    return sample_batch(logits[None], [SamplingParams(temperature=temperature, top_p=top_p)], [generator])[0]


def _penalize(x: torch.Tensor, params: list[SamplingParams], histories: list[History | None]) -> None:
    rows = [j for j, p in enumerate(params) if p.penalized]
    if not rows:
        return
    for j in rows:
        if histories[j] is None:
            raise ValueError("a penalized sequence needs its History")
    idx = torch.as_tensor(rows)
    sub = x[idx]
    rep = torch.tensor([params[j].repetition_penalty for j in rows], dtype=torch.float64)[:, None]
    if bool((rep != 1.0).any()):
        seen = torch.stack([histories[j].seen for j in rows])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([params[j].frequency_penalty for j in rows], dtype=torch.float64)[:, None]
    pres = torch.tensor([params[j].presence_penalty for j in rows], dtype=torch.float64)[:, None]
    if bool((freq != 0).any() or (pres != 0).any()):
        counts = torch.stack([histories[j].counts for j in rows]).double()
        sub = sub - freq * counts - pres * (counts > 0)
    x[idx] = sub


def _bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    r, c, v = [], [], []
    for j, p in enumerate(params):
        for tok, bias in p.logit_bias:
            r.append(j), c.append(tok), v.append(bias)
    if r:
        x.index_put_((torch.as_tensor(r), torch.as_tensor(c)), torch.tensor(v, dtype=torch.float64), accumulate=True)


def _bar(x: torch.Tensor, barred: list[Sequence[int]]) -> None:
    r = [j for j, ids in enumerate(barred) for _ in ids]
    if r:
        x[torch.as_tensor(r), torch.as_tensor([t for ids in barred for t in ids])] = float("-inf")


def _warp(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, top_p over what top_k kept, then min_p (rows that sample)."""
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float64)[:, None]
    y = x / temp
    ks = [p.top_k for p in params]
    if any(k > 0 for k in ks):
        vocab = y.shape[1]
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in ks])
        kth = torch.topk(y, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        kth[k == vocab] = float("-inf")  # the rows without top_k keep everything
        y = y.masked_fill(y < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)[:, None]
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(y, dim=-1)
        # the most likely TOP_P_CANDIDATES tokens, sorted, hold top_p of the mass in every row of a
        # language model's distribution: every token past them is dropped anyway; else sort all
        head, order = torch.topk(probs, min(TOP_P_CANDIDATES, probs.shape[1]), dim=-1)
        if not bool((head.sum(dim=-1, keepdim=True) >= top_p).all()):
            head, order = torch.sort(probs, dim=-1, descending=True)
        drop = torch.cumsum(head, dim=-1) - head >= top_p
        drop[:, 0] = False  # the most likely token always stays
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, ~drop)
        y = y.masked_fill(~keep, float("-inf"))
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64)[:, None]
    if bool((min_p > 0).any()):
        probs = torch.softmax(y, dim=-1)
        y = y.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return y


def _draw(y: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token a row of shaped logits `y` by the exponential race; -1 where a row is no
    distribution (non-finite, or nothing left)."""
    probs = torch.softmax(y, dim=-1)
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for j, g in enumerate(generators):
        if g is not None:
            noise[j].exponential_(generator=g)
    picked = torch.argmax(probs / noise.clamp_min_(_TINY), dim=-1)
    bad = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
    return picked.masked_fill(bad, -1)
