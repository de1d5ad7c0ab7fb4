"""How the Ingress spells its answers in OpenAI's terms (pure; the models are `responses`): the
answer whole or as server-sent events (`Reply`), usage (with the prefix cache's hits), finish
reasons, logprobs objects, tool calls, token texts; and which engine failures become which status."""

from __future__ import annotations

from moe_workers.engine import FinishReason, GenerationRequest
from moe_workers.serve.openai.protocol import RequestError
from moe_workers.serve.openai.responses import (
    ChatCompletionLogProbs, ChatCompletionResponse, ChatCompletionResponseChoice, ChatCompletionStreamResponse,
    ChatMessage, CompletionLogProbs, CompletionResponse, CompletionResponseChoice, CompletionStreamResponse,
    DeltaToolCall, PromptTokensDetails, ToolCall, UsageInfo)
from moe_workers.serve.openai.tools import ToolCall as ParsedCall
from moe_workers.transport import ExpertsUnavailable

DONE = b"data: [DONE]\n\n"


def raise_failed(gen: GenerationRequest) -> None:
    """A choice that ended in an error answers 503 (experts unavailable: retry) or 500."""
    if gen.finish_reason is not FinishReason.ERROR:
        return
    if isinstance(gen.error, ExpertsUnavailable):
        raise RequestError(503, f"experts unavailable: {gen.error}; retry later", err_type="unavailable")
    raise RequestError(500, finish_text(gen), err_type="server_error")


def usage(prompt: int, completion: int, cached: int) -> UsageInfo:
    """OpenAI's usage object; cached: prompt tokens the prefix cache held computed."""
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def finish_text(gen: GenerationRequest) -> str | None:
    """The finish_reason a client sees: OpenAI's, or "error: <why>" for a failed choice."""
    if gen.finish_reason is FinishReason.ERROR:
        return f"error: {gen.error}"
    return None if gen.finish_reason is None else str(gen.finish_reason)


def tool_calls(calls: list[ParsedCall], streamed: bool = False) -> list[ToolCall] | list[DeltaToolCall]:
    """A choice's calls as OpenAI's tool_calls; in a stream's delta each says its index."""
    if streamed:
        return [DeltaToolCall.model_validate(c.openai(index=k)) for k, c in enumerate(calls)]
    return [ToolCall.model_validate(c.openai()) for c in calls]


def chat_choice(index: int, text: str, token_ids: list[int], finish: str | None,
                logprobs: ChatCompletionLogProbs | None, thinking: str | None = None,
                calls: list[ParsedCall] = ()) -> ChatCompletionResponseChoice:
    """A whole chat choice: reasoning_content only when reported (`thinking` not None); with
    calls, their tool_calls, content null if no text came before them, finish "tool_calls"
    where the model stopped by itself."""
    fields = {"role": "assistant", "content": text}
    if thinking is not None:
        fields["reasoning_content"] = thinking
    if calls:
        fields.update(content=text or None, tool_calls=tool_calls(calls))
        finish = "tool_calls" if finish == "stop" else finish
    return ChatCompletionResponseChoice(index=index, message=ChatMessage(**fields), token_ids=token_ids,
                                        finish_reason=finish, logprobs=logprobs)


def completion_choice(index: int, text: str, token_ids: list[int], finish: str | None,
                      logprobs: CompletionLogProbs | None) -> CompletionResponseChoice:
    return CompletionResponseChoice(index=index, text=text, token_ids=token_ids, finish_reason=finish,
                                    logprobs=logprobs)


class Reply:
    """One response's fixed part (its id, creation time and model; chat or text completion;
    whether a stream's chunks carry usage), and its answer whole or as server-sent events.

    A stream event is handed to its model as one mapping, which pydantic-core validates and
    builds in one call (keyword-built nested models cost about 2.5 us more per event, a
    logprobs object with 5 alternatives about 7 us more); the keys in the mapping are the
    fields set, so the keys sent."""

    def __init__(self, id: str, created: int, model: str, chat: bool, include_usage: bool = False):
        self.id, self.created, self.model, self.chat, self.include_usage = id, created, model, chat, include_usage
        # the chunk model's validator: model_validate without its 0.6 us of keyword handling
        self._chunk = (ChatCompletionStreamResponse if chat else CompletionStreamResponse).__pydantic_validator__
        # every chunk of a stream that asked for usage says "usage": null, until the usage event
        self._head = {"id": id, "created": created, "model": model,
                      "object": "chat.completion.chunk" if chat else "text_completion",
                      **({"usage": None} if include_usage else {})}

    def answer(self, choices: list, usage: UsageInfo) -> ChatCompletionResponse | CompletionResponse:
        """The whole answer (choices from `chat_choice` / `completion_choice`)."""
        if self.chat:
            return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                          object="chat.completion", choices=choices, usage=usage)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, object="text_completion",
                                  choices=choices, usage=usage)

    def event(self, index: int, text: str, token_ids: list[int], finish: str | None,
              logprobs: ChatCompletionLogProbs | CompletionLogProbs | None = None, thinking: str = "",
              first: bool = False, calls: list[ParsedCall] = ()) -> bytes:
        """One chunk of one choice as a server-sent event. A chat delta carries the role in a
        choice's first chunk, content when there is text (or first), reasoning_content when
        there is thinking, tool_calls (indexed) when there are calls; else it is {}."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
            if thinking:
                delta["reasoning_content"] = thinking
            if calls:
                delta["tool_calls"] = tool_calls(calls, streamed=True)
            choice = {"index": index, "delta": delta, "token_ids": token_ids, "finish_reason": finish,
                      "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "token_ids": token_ids, "finish_reason": finish,
                      "logprobs": logprobs}
        return b"data: " + self._chunk.validate_python({**self._head, "choices": [choice]}).wire() + b"\n\n"

    def usage_event(self, usage: UsageInfo) -> bytes:
        """A stream's last chunk before [DONE] when it asked for usage: no choices, the usage."""
        return b"data: " + self._chunk.validate_python({**self._head, "choices": [], "usage": usage}).wire() + b"\n\n"


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

    def logprobs(self, produced: list[int], token_logprobs: list, chat: bool, since: int = 0,
                 upto: int | None = None, prefix: list[int] = ()) -> ChatCompletionLogProbs | CompletionLogProbs:
        """OpenAI's logprobs object for the produced tokens [since, upto) (a request's `produced`
        and `token_logprobs`: each token's logprob and its top alternatives), after `prefix`, a
        resumed stream's tokens generated elsewhere."""
        entries = list(zip(produced[since:upto], token_logprobs[since:upto]))
        if chat:
            def item(tok, lp):
                return {"token": self.token_text(tok), "logprob": lp, "bytes": self.token_bytes(tok)}
            return ChatCompletionLogProbs.__pydantic_validator__.validate_python(
                {"content": [{**item(tok, lp), "top_logprobs": [item(t, v) for t, v in alts]}
                             for tok, (lp, alts) in entries]})
        offsets = [len(self.decode([*prefix, *produced[:k]])) for k in range(since, since + len(entries))]
        return CompletionLogProbs(tokens=[self.token_text(tok) for tok, _ in entries],
                                  token_logprobs=[lp for _, (lp, _) in entries],
                                  top_logprobs=[{self.token_text(t): v for t, v in alts} for _, (_, alts) in entries],
                                  text_offset=offsets)
