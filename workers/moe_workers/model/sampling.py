"""Next-token choice for a step's sequences: the OpenAI / vLLM sampling set, batched (pure torch).

For the rows of a step's logits, in this order (transformers' and vLLM's):
0. a grammar's mask (structured output): the tokens it does not allow now are -inf;
1. `logit_bias` added to the model's logits;
2. penalties: `repetition_penalty` over the prompt and the output (a positive logit divided by
   it, a negative one multiplied, as transformers' RepetitionPenaltyLogitsProcessor does), then
   `frequency_penalty` x the token's count in the output and `presence_penalty` once it appears
   there (OpenAI's definition: the output only), each over the ids of the sequence's History only;
   the ids that may not come yet (end of sequence and stop token ids before `min_tokens`) barred;
3. greedy rows (temperature 0) take the argmax here;
4. the others: temperature, `top_k`, `top_p` over what top_k kept, `min_p` (a token less likely
   than min_p x the most likely one goes; the ratio is the same before or after renormalising);
5. one draw a row (torch.multinomial): the unseeded rows in one call, a seeded row alone from its
   own generator, so that it draws the same tokens alone or in any batch.
Each stage runs once over a group of the rows that need it, as [rows, vocab] tensor operations
(a group's float64 logits about GROUP_BYTES: larger passes left the cache and ran slower than row
by row); penalties gather and scatter each row's own history ids (a few thousand, not the
vocabulary), and a seeded row's draw is made row by row. A step whose rows are all plain greedy
is one argmax.

Computed in float64 so that every temperature and top_p the API accepts gives a proper
distribution (a float32 top_p of 5e-324 is 0 and kept nothing; logits / 1e-5 overflowed float32);
a row the model itself made non-finite falls back to the argmax over its finite entries.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .sampling_params import GREEDY, SamplingParams  # noqa: F401 (the parameters live without torch)

TOP_P_CANDIDATES = 1024  # top_p looks at this many most likely tokens first (a partial sort)
GROUP_BYTES = 4 * 2**20  # rows sampled together: their float64 logits about this size




class History:
    """What a sequence's penalties look at: the ids of its prompt, and each id's count in its
    output, kept up to date one token at a time. Penalties touch only these ids (a gather and a
    scatter a row), not the whole vocabulary."""

    def __init__(self, vocab: int, prompt: Sequence[int], output: Sequence[int] = ()):
        self.vocab = vocab
        self.prompt_ids = torch.as_tensor(sorted(set(prompt)), dtype=torch.long)
        self.counts: dict[int, int] = {}
        self._output: tuple[torch.Tensor, torch.Tensor] | None = None
        for tok in output:
            self.add(tok)

    def add(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1
        self._output = None

    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the distinct ids of the output, their counts as float64)."""
        if self._output is None:
            self._output = (torch.tensor(list(self.counts), dtype=torch.long),
                            torch.tensor(list(self.counts.values()), dtype=torch.float64))
        return self._output


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None] | None = None,
                 histories: Sequence[History | None] | None = None,
                 barred: Sequence[Sequence[int]] | None = None,
                 allowed: Sequence[torch.Tensor | None] | None = None) -> list[int]:
    """One token id per row of (rows, vocab) `logits`; row i samples with params[i], its
    generator (None: torch's default), its history (needed when params[i].penalized), the ids
    barred for it now and the (vocab,) bool mask of the tokens its grammar allows (None: all)."""
    rows = logits.shape[0]
    barred = barred or [()] * rows
    allowed = allowed or [None] * rows
    work = [i for i, p in enumerate(params) if p.temperature > 0 or p.shaped or barred[i] or allowed[i] is not None]
    if len(work) < rows:  # plain greedy rows: the argmax as it is
        chosen = torch.argmax(logits, dim=-1)
    else:
        chosen = torch.empty(rows, dtype=torch.long, device=logits.device)
    # rows go through in groups whose float64 copy fits a core's cache: [rows, vocab] passes over
    # more than that ran slower together than row by row (bench/sampling.py)
    group = max(1, GROUP_BYTES // (8 * logits.shape[1]))
    for start in range(0, len(work), group):
        part = work[start:start + group]
        chosen[part] = _sample_rows(_rows(logits, part), [params[i] for i in part],
                                    [generators[i] if generators else None for i in part],
                                    [histories[i] if histories else None for i in part],
                                    [barred[i] for i in part], [allowed[i] for i in part])
    return chosen.tolist()


def _sample_rows(logits, ps, generators, histories, barred, allowed) -> torch.Tensor:
    x = logits.to(torch.float64, copy=True)
    _mask(x, allowed)
    _bias(x, ps)
    _penalize(x, ps, histories)
    _bar(x, barred)
    picks = torch.full((len(ps),), -1, dtype=torch.long, device=x.device)
    hot = [j for j, p in enumerate(ps) if p.temperature > 0]
    if hot:
        picks[hot] = _sample_hot(_rows(x, hot), [ps[j] for j in hot], [generators[j] for j in hot])
    cold = (picks < 0).nonzero().flatten()  # greedy rows, and rows that were no distribution
    if len(cold):
        picks[cold] = torch.argmax(torch.nan_to_num(x[cold], nan=float("-inf")), dim=-1)
    return picks


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
    for j, p in enumerate(params):
        if not p.penalized:
            continue
        h = histories[j]
        if h is None:
            raise ValueError("a penalized sequence needs its History")
        row = x[j]
        out_ids, counts = h.output()
        if p.repetition_penalty != 1.0:
            ids = torch.cat([h.prompt_ids, out_ids])  # an id in both is written twice, with one value
            v = row[ids]
            row[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(out_ids):
            row[out_ids] -= counts.to(row.device) * p.frequency_penalty + p.presence_penalty


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without a copy when that is every row in order (a step's rows are mostly alike)."""
    return t if rows == list(range(t.shape[0])) else t[rows]


def _mask(x: torch.Tensor, allowed: list[torch.Tensor | None]) -> None:
    rows = [j for j, m in enumerate(allowed) if m is not None]
    if rows:
        x[rows] = x[rows].masked_fill(~torch.stack([allowed[j] for j in rows]).to(x.device), float("-inf"))


def _bias(x: torch.Tensor, params: list[SamplingParams]) -> None:
    r, c, v = [], [], []
    for j, p in enumerate(params):
        for tok, bias in p.logit_bias:
            r.append(j), c.append(tok), v.append(bias)
    if r:
        x.index_put_((torch.as_tensor(r), torch.as_tensor(c)), torch.tensor(v, dtype=torch.float64, device=x.device),
                    accumulate=True)


def _bar(x: torch.Tensor, barred: list[Sequence[int]]) -> None:
    r = [j for j, ids in enumerate(barred) for _ in ids]
    if r:
        x[torch.as_tensor(r), torch.as_tensor([t for ids in barred for t in ids])] = float("-inf")


def _outside_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens of each row (`probs` sorted, most likely first) fall outside its top_p: those
    the more likely ones already cover; the most likely token always stays."""
    drop = torch.cumsum(probs, dim=-1) - probs >= top_p
    drop[:, 0] = False
    return drop


def _warp(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, top_p over what top_k kept, then min_p (rows that sample)."""
    dev = x.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=dev)[:, None]
    y = x / temp
    ks = [p.top_k for p in params]
    if any(k > 0 for k in ks):
        vocab = y.shape[1]
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in ks], device=dev)
        kth = torch.topk(y, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        kth[k == vocab] = float("-inf")  # the rows without top_k keep everything
        y = y.masked_fill(y < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)[:, None]
    if any(p.top_p < 1.0 for p in params):
        probs = torch.softmax(y, dim=-1)
        # the most likely TOP_P_CANDIDATES tokens, sorted, hold top_p of the mass in every row of a
        # language model's distribution: every token past them is dropped anyway; else sort all
        head, order = torch.topk(probs, min(TOP_P_CANDIDATES, probs.shape[1]), dim=-1)
        if not bool((head.sum(dim=-1, keepdim=True) >= top_p).all()):
            head, order = torch.sort(probs, dim=-1, descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, ~_outside_nucleus(head, top_p))
        y = y.masked_fill(~keep, float("-inf"))
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=dev)[:, None]
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(y, dim=-1)
        y = y.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return y


def _sample_hot(x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """A token for each row that samples (-1: no distribution). A row with top_k or top_p draws
    among its most likely tokens only (`_candidates`); the others, and any whose candidates do not
    settle it, through the whole vocabulary (`_warp`)."""
    picked = torch.full((len(params),), -1, dtype=torch.long, device=x.device)
    narrow = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    wide = [j for j, p in enumerate(params) if not (p.top_k > 0 or p.top_p < 1.0)]
    if narrow:
        probs, ids, settled = _candidates(_rows(x, narrow), [params[j] for j in narrow])
        wide = sorted(wide + [narrow[r] for r in (~settled).nonzero().flatten().tolist()])
        keep = settled.nonzero().flatten()
        if len(keep):
            drawn = _draw(probs[keep], [generators[narrow[r]] for r in keep.tolist()])
            token = ids[keep].gather(1, drawn.clamp(min=0)[:, None]).flatten()
            # -1 where the row was no distribution (no boolean indexing: it would read the device)
            picked[torch.as_tensor(narrow, device=x.device)[keep]] = torch.where(drawn >= 0, token, -1)
    if wide:
        y = _warp(_rows(x, wide), [params[j] for j in wide])
        probs = torch.exp(y - y.amax(dim=-1, keepdim=True))  # unnormalised: _draw needs no more
        picked[wide] = _draw(probs, [generators[j] for j in wide])
    return picked


def _candidates(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows that each have top_k or top_p: (rows, width) probabilities over their most likely
    tokens (unnormalised, 0 for a token filtered out), those tokens' ids, and whether that settles
    the row: the distribution `_warp` gives, with one pass over the vocabulary (the top-`width`
    selection) plus a normaliser for rows without top_k. A row is not settled when its
    TOP_P_CANDIDATES most likely tokens hold less than its top_p (without top_k), or when a tie
    straddles its k-th token (transformers keeps every tied token); it then goes through the whole
    vocabulary. Whether a row is settled, and its probabilities, depend on that row alone."""
    vocab = x.shape[1]
    ks = [min(p.top_k, vocab) if p.top_k > 0 else 0 for p in params]
    width = min(vocab, max((k + 1) if k else TOP_P_CANDIDATES for k in ks))
    dev = x.device
    vals, ids = torch.topk(x, width, dim=-1)  # sorted; dividing by a temperature keeps the order
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=dev)[:, None]
    has_k = torch.tensor([k > 0 for k in ks], device=dev)
    k = torch.tensor([k if k else min(TOP_P_CANDIDATES, vocab) for k in ks], device=dev)
    settled = torch.ones(len(params), dtype=torch.bool, device=dev)
    inner = has_k & (k < width)
    if any(0 < k_ < width for k_ in ks):
        at = k[:, None].clamp(max=width - 1)
        settled &= ~(inner & (vals.gather(1, at - 1) == vals.gather(1, at)).flatten())
    y = (vals / temp).masked_fill(torch.arange(width, device=dev)[None, :] >= k[:, None], float("-inf"))
    # probabilities within the top_k set (what top_p sees after top_k), else within the vocabulary
    lse = torch.logsumexp(y, dim=-1)
    if not all(ks):
        free = [j for j, k_ in enumerate(ks) if not k_]
        lse[free] = torch.logsumexp(_rows(x, free) / _rows(temp, free), dim=-1)
    probs = torch.exp(y - lse[:, None])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)[:, None]
    if any(p.top_p < 1.0 for p in params):
        settled &= (probs.sum(dim=-1, keepdim=True) >= top_p).flatten() | has_k
        probs = probs.masked_fill(_outside_nucleus(probs, top_p), 0.0)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=dev)[:, None]
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)  # column 0 is the most likely
    return probs, ids, settled


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One column a row of `probs` (unnormalised) by the inverse of its cumulative sum: one uniform
    number a row (a seeded row's from its own generator, so that it draws the same alone or in
    any batch; the rest in one call), not one a token as torch.multinomial's exponential race
    takes. -1 where a row is no distribution (non-finite, or nothing left)."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    bad = ~(torch.isfinite(total) & (total > 0)).flatten()
    # drawn on the host (a seeded row's generator is a CPU one), one small copy to the device
    u = torch.empty(len(generators), 1, dtype=torch.float64)
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        u[shared] = torch.rand(len(shared), 1, dtype=torch.float64)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand(1, generator=g, dtype=torch.float64)
    u = u.to(probs.device, non_blocking=True)
    # 1 - u is in (0, 1]: the first column whose cumulative sum reaches it has probability > 0
    picked = torch.searchsorted(cdf, (1.0 - u) * total).flatten().clamp_(max=probs.shape[1] - 1)
    return picked.masked_fill(bad, -1)
