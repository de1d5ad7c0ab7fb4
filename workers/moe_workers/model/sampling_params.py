"""One sequence's sampling parameters (pure data, no torch: the request protocol, and so the
operator, read them; model/sampling.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass


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
