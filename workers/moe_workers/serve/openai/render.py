"""How the Ingress spells its answers in OpenAI's terms: usage (with the prefix cache's hits),
finish reasons, logprobs objects, token texts; and which engine failures become which status."""

from __future__ import annotations

from moe_workers.engine import FinishReason, GenerationRequest
from moe_workers.serve.openai.protocol import RequestError
from moe_workers.transport import ExpertsUnavailable


def raise_failed(gen: GenerationRequest) -> None:
    """A choice that ended in an error answers 503 (experts unavailable: retry) or 500."""
    if gen.finish_reason is not FinishReason.ERROR:
        return
    if isinstance(gen.error, ExpertsUnavailable):
        raise RequestError(503, f"experts unavailable: {gen.error}; retry later", err_type="unavailable")
    raise RequestError(500, finish_text(gen), err_type="server_error")


def usage_object(prompt: int, completion: int, gens: list[GenerationRequest]) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache held computed (the
    first choice's, at its admission)."""
    cached = gens[0].cached_tokens if gens else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_text(gen: GenerationRequest) -> str | None:
    """The finish_reason a client sees: OpenAI's, or "error: <why>" for a failed choice."""
    if gen.finish_reason is FinishReason.ERROR:
        return f"error: {gen.error}"
    return None if gen.finish_reason is None else str(gen.finish_reason)


class Renderer:
    """Token texts, bytes and logprobs objects from the checkpoint's tokenizer (None: token ids only)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    def decode_raw(self, tokens: list[int]) -> str:
        """With the special tokens spelled out (tool-call markers are special in some vocabularies)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=False) if self.tokenizer is not None else ""

    def token_text(self, token: int) -> str:
        """A token as the vocabulary spells it (unique per id, unlike its decoded text, which is
        U+FFFD for every part of a split character)."""
        text = self.tokenizer.id_to_token(token) if self.tokenizer is not None else None
        return text if text is not None else f"token_id:{token}"

    def token_bytes(self, token: int) -> list[int] | None:
        text = self.tokenizer.decode([token]) if self.tokenizer is not None else ""
        return list(text.encode("utf-8")) if text and "\ufffd" not in text else None

    def logprobs(self, gen: GenerationRequest, chat: bool, since: int = 0, upto: int | None = None,
                  prefix: list[int] = ()) -> dict:
        """OpenAI's logprobs object for gen's tokens [since, upto) (after `prefix`, a resumed
        stream's tokens generated elsewhere)."""
        entries = list(zip(gen.produced[since:upto], gen.token_logprobs[since:upto]))
        if chat:
            def item(tok, lp):
                return {"token": self.token_text(tok), "logprob": lp, "bytes": self.token_bytes(tok)}
            return {"content": [{**item(tok, lp), "top_logprobs": [item(t, v) for t, v in alts]}
                                for tok, (lp, alts) in entries]}
        tokens = [self.token_text(tok) for tok, _ in entries]
        offsets = [len(self.decode([*prefix, *gen.produced[:k]])) for k in range(since, since + len(entries))]
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in entries],
                "top_logprobs": [{self.token_text(t): v for t, v in alts} for _, (_, alts) in entries],
                "text_offset": offsets}
