"""A generation request, in three parts: what it asks for (the caller sets it; the engine never
changes it), what it got (the engine writes it, the caller reads it), and where it stands in the
engine (its one status, `num_computed_tokens`, its KV slot: only the scheduler writes these).

A request's life, as vLLM v1's `RequestStatus` draws it: WAITING (queued, or preempted: its
tokens are computed again when admitted), RUNNING (admitted, holding KV blocks: prefilling while
more than one known token is uncomputed, decoding after), then one FINISHED_* status, which is
also its OpenAI finish reason.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from moe_workers.model.sampling import GREEDY, History, SamplingParams

if TYPE_CHECKING:
    from moe_workers.serve.openai.structured import Constraint


class FinishReason(enum.StrEnum):
    """Why a request ended (OpenAI's finish_reason, plus cancelled and error)."""

    STOP = "stop"  # end of sequence, or a stop sequence
    LENGTH = "length"  # max_tokens, or the context
    CANCELLED = "cancelled"  # the client went away
    ERROR = "error"  # the step failed: `error` says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = FinishReason.STOP
    FINISHED_LENGTH = FinishReason.LENGTH
    FINISHED_ABORTED = FinishReason.CANCELLED
    FINISHED_ERROR = FinishReason.ERROR

    @property
    def finished(self) -> bool:
        return isinstance(self.value, FinishReason)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.value if isinstance(self.value, FinishReason) else None

    @staticmethod
    def finished_by(reason: FinishReason) -> "RequestStatus":
        return RequestStatus(reason)


class Output(NamedTuple):
    """What a step hands its reader: a new token of `request`, or None: it has ended."""

    request: "GenerationRequest"
    token: int | None


@dataclass(eq=False)  # compared by identity: two equal asks are two requests
class GenerationRequest:
    # -- what it asks for --------------------------------------------------------------------
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    seed: int | None = None
    stop_at_eos: bool = True  # False: ignore_eos
    stop_token_ids: frozenset[int] = frozenset()  # each ends the sequence like the end of sequence
    resumed: int = 0  # the last `resumed` tokens of `prompt` were produced before (a resumed stream)
    logprobs: int | None = None  # also record each token's logprob and this many alternatives
    # the reader needs the end only (a whole completion, no stop strings to watch): `out` gets the
    # None and the tokens stay in `produced`, so the event loop is not woken for every token
    final_only: bool = False
    constraint: "Constraint | None" = None  # the response format's grammar state (structured output)
    key: str = "-"  # the API key id it came with (serve.auth.key_id): routing statistics per key

    # -- what it got (written by the engine thread; read by the caller once `out` gave None) ---
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None
    produced: list[int] = field(default_factory=list)
    # with logprobs: per produced token (its logprob, [(token id, logprob) of the top alternatives])
    token_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    error: Exception | None = None  # what failed the step that ended this request (FINISHED_ERROR)
    cached_tokens: int = 0  # of the prompt, found in the prefix cache at its (last) admission

    # -- where it stands in the engine (the scheduler's) --------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # of prompt + produced, in the KV cache
    slot: int | None = None  # its sequence id in the KV cache while RUNNING
    preemptions: int = 0
    ending_ids: tuple[int, ...] = ()  # the ids that end it (set on submit: `ending_ids`)
    generator: torch.Generator | None = None  # its own, when it has a seed
    history: History | None = None  # what penalties look at (penalized sampling only)
    loop: asyncio.AbstractEventLoop | None = None  # the one that reads `out` (set on submit)
    t_submit: float = 0.0  # time.perf_counter() at submit
    t_last: float = 0.0  # ... at its latest token

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.produced)

    @property
    def num_output(self) -> int:
        """Tokens of the completion so far, a resumed stream's earlier ones included."""
        return self.resumed + len(self.produced)

    @property
    def decoding(self) -> bool:
        """Running with every known token but the newest computed: one token a step."""
        return self.status is RequestStatus.RUNNING and self.num_tokens - self.num_computed_tokens == 1

    def tokens(self, start: int, end: int) -> list[int]:
        """Known tokens start..end-1 (the prompt, then what was produced)."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        return (self.prompt[start:] if start < p else []) + self.produced[max(0, start - p):end - p]

    def barred(self) -> tuple[int, ...]:
        """The ids that may not come yet: those that end the sequence, before min_tokens."""
        return self.ending_ids if self.num_output < self.sampling.min_tokens else ()


def ending_ids(cfg, stop_at_eos: bool, stop_token_ids) -> tuple[int, ...]:
    """The ids that end a sequence (finish_reason stop): the model's end-of-sequence ids (config.json
    and generation_config.json) unless ignored, and the request's stop token ids."""
    eos = cfg.eos_token_ids if stop_at_eos else ()
    return eos + tuple(sorted(set(stop_token_ids or ()) - set(eos)))
