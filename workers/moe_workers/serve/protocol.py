"""The OpenAI-compatible request body, validated with errors that name the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] = Field(description="Text (needs tokenizer.json) or token ids.")
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1, description="Only one choice per request is supported.")
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if len(v) == 0:
            raise ValueError("prompt is empty")
        return v


class RequestError(Exception):
    """A 4xx answer: status, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.err_type = status, message, param, err_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def parse_completion(body: object) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("list[", "str")))
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = "unknown field"
        raise RequestError(400, f"{loc}: {msg}", param=loc or None) from None
