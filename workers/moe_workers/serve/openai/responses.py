"""The OpenAI answers as typed models (pure; pydantic, as `protocol` is for requests): a chat
completion and its stream chunks, a text completion and its chunks, usage, logprobs, tool calls,
the model list. vLLM's `entrypoints/openai/protocol.py` is the model; names follow it.

What goes on the wire is `Wire.wire()`: every required field, and a field with a default only
when it was set. That is how the keys that come and go do so: `reasoning_content` (only when
reported), `tool_calls` (only with calls), a delta's `role` / `content` (an empty delta is `{}`),
a chunk's `usage` (null in every chunk when include_usage asked for it, else absent). Fields are
declared in the order they are sent. The serializer is pydantic-core's (Rust); built as
`render.Reply` builds it, a stream chunk costs about 1 us more than `json.dumps` of the same dict.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Wire(BaseModel):
    # a logprob of -inf is sent as json.dumps spelt it (-Infinity), not as null
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    def wire(self) -> bytes:
        """The JSON sent: required fields always, a defaulted one only when it was set."""
        return self.__pydantic_serializer__.to_json(self, exclude_unset=True)


# -- usage -------------------------------------------------------------------------------------

class PromptTokensDetails(Wire):
    cached_tokens: int  # prompt tokens the prefix cache held computed


class UsageInfo(Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# -- logprobs ----------------------------------------------------------------------------------

class ChatCompletionLogProb(Wire):
    token: str
    logprob: float
    bytes: list[int] | None  # None: the token alone is not whole UTF-8


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb]


class ChatCompletionLogProbs(Wire):
    content: list[ChatCompletionLogProbsContent]


class CompletionLogProbs(Wire):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


# -- tool calls --------------------------------------------------------------------------------

class FunctionCall(Wire):
    name: str
    arguments: str  # JSON text


class ToolCall(Wire):
    id: str
    type: Literal["function"]
    function: FunctionCall


class DeltaToolCall(Wire):
    index: int
    id: str
    type: Literal["function"]
    function: FunctionCall


# -- chat completions --------------------------------------------------------------------------

class ChatMessage(Wire):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionResponseChoice(Wire):
    index: int
    message: ChatMessage
    token_ids: list[int]
    finish_reason: str | None
    logprobs: ChatCompletionLogProbs | None


class ChatCompletionResponse(Wire):
    id: str
    created: int
    model: str
    object: Literal["chat.completion"]
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(Wire):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(Wire):
    index: int
    delta: DeltaMessage
    token_ids: list[int]
    finish_reason: str | None
    logprobs: ChatCompletionLogProbs | None


class ChatCompletionStreamResponse(Wire):
    id: str
    created: int
    model: str
    object: Literal["chat.completion.chunk"]
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -- text completions (a stream's chunks are text_completion objects too, as OpenAI's) -----------

class CompletionResponseChoice(Wire):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: CompletionLogProbs | None


CompletionResponseStreamChoice = CompletionResponseChoice  # a chunk's choice: the same fields


class CompletionResponse(Wire):
    id: str
    created: int
    model: str
    object: Literal["text_completion"]
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(Wire):
    id: str
    created: int
    model: str
    object: Literal["text_completion"]
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -- /v1/models --------------------------------------------------------------------------------

class ModelCard(Wire):
    id: str
    object: Literal["model"]
    owned_by: str
    max_model_len: int
    vocab_size: int


class ModelList(Wire):
    object: Literal["list"]
    data: list[ModelCard]
