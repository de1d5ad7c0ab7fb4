"""The OpenAI-compatible request body: decoded within limits, validated strictly, with errors
that name the field (pure; no Ray, no HTTP server here).

Limits (each a 4xx with a JSON reason, before any work is spent on the request):
- the body: at most the app's `max_request_bytes` (413), JSON nested at most `MAX_JSON_DEPTH`
  deep, integers of at most `MAX_INT_DIGITS` digits, no NaN / Infinity, valid Unicode (a lone
  surrogate such as "\\ud800" is refused: it cannot be tokenized or echoed back); each named by
  the field it is in (`param`), found while decoding and reported once the field is known;
- the fields: exact JSON types (no coercion: `true` is not a number, `"5"` is not a token id,
  `0` is not a boolean), and sampling parameters in ranges that cannot make sampling fail.
"""

from __future__ import annotations

import json
import re

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from moe_workers.model.sampling_params import SamplingParams

MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 20  # int64 / uint64 need 20 at most
MIN_TEMPERATURE = 1e-5  # below this (and above 0) logits / temperature leave floating point
INT64 = (-(2**63), 2**63 - 1)
SCHEMA_INTS = (-(2**63), 2**64 - 1)  # what a JSON schema's numbers may be: int64 or uint64 (llguidance's serde_json)
# the largest multipleOf: divisibility by a number prime to 10 compiles to a DFA of about that
# many states (llguidance, measured: 9,973 6 MB / 0.03 s, 500,003 190 MB / 4 s, 5,000,011 2.4 GB / 86 s)
MAX_MULTIPLE_OF = 10_000
_STRUCTURE = re.compile(rb'\\.|["\[\]{}]', re.S)


MAX_N = 16  # choices per request
MAX_STOPS = 4  # stop sequences per request (OpenAI's limit)
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 5  # alternatives per token (OpenAI's limit for completions)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bars a token, +100 all but forces it
MAX_STOP_TOKEN_IDS = 64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def schema_problem(schema, path: str = "") -> str | None:
    """What makes `schema` not a JSON schema, with where (a dotted path), or None. Only the
    structure is checked here; what a grammar cannot enforce is refused when it is compiled."""
    if not path and (bad := _wide_integer(schema)) is not None:
        return bad
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path or 'schema'}: expected an object (a JSON schema), got {type(schema).__name__}"
    where = f"{path}." if path else ""
    kind = schema.get("type")
    for k in ([kind] if isinstance(kind, str) else kind if isinstance(kind, list) else [kind] if "type" in schema else []):
        if k not in _SCHEMA_TYPES:
            return f"{where}type: {k!r} is not a JSON schema type ({', '.join(sorted(_SCHEMA_TYPES))})"
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{where}{key}: expected an object of schemas"
            for name, sub in schema[key].items():
                if (bad := schema_problem(sub, f"{where}{key}.{name}")) is not None:
                    return bad
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                return f"{where}{key}: expected a list of schemas"
            for i, sub in enumerate(schema[key]):
                if (bad := schema_problem(sub, f"{where}{key}.{i}")) is not None:
                    return bad
    for key in ("items", "additionalProperties", "not"):
        if key in schema and (bad := schema_problem(schema[key], f"{where}{key}")) is not None:
            return bad
    if "required" in schema and not (isinstance(schema["required"], list)
                                     and all(isinstance(r, str) for r in schema["required"])):
        return f"{where}required: expected a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}enum: expected a list"
    step = schema.get("multipleOf")
    if isinstance(step, (int, float)) and not isinstance(step, bool) and not 0 < step <= MAX_MULTIPLE_OF:
        return f"{where}multipleOf: {step} is not within (0, {MAX_MULTIPLE_OF}] (a larger one compiles to a grammar " \
               "of up to gigabytes)"
    return None


def _wide_integer(value, path: str = "") -> str | None:
    """Where an integer outside int64 / uint64 stands in a schema (any keyword: minimum,
    maxLength, multipleOf, enum, const, default ...), which no grammar compiler can read, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not SCHEMA_INTS[0] <= value <= SCHEMA_INTS[1]:
            return f"{path or 'schema'}: {value} is outside the integers a schema can hold [-2^63, 2^64)"
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (bad := _wide_integer(v, f"{path}.{i}" if path else str(i))) is not None:
                return bad
    elif isinstance(value, dict):
        for k, v in value.items():
            if (bad := _wide_integer(v, f"{path}.{k}" if path else str(k))) is not None:
                return bad
    return None


class JsonSchema(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # accepted: the grammar always holds the output to the schema

    @field_validator("schema_")
    @classmethod
    def _a_schema(cls, v):
        if (bad := schema_problem(v)) is not None:
            raise ValueError(bad)
        return v


class ResponseFormat(BaseModel):
    """`{"type": "text"}`, `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
    "json_schema": {...}}` (serve/openai/structured.py enforces it token by token)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, v, info):
        if v is not None and info.data.get("type") != "json_schema":
            raise ValueError("only with type json_schema")
        return v

    def model_post_init(self, _context) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required with type json_schema")


class _Sampling(BaseModel):
    """What both endpoints take besides the prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    user: str | None = None  # accepted and ignored
    # the rest of vLLM's sampling set (model/sampling.py says what each does, and in what order)
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1)  # 0 or -1: every token
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    response_format: ResponseFormat | None = None

    def model_post_init(self, _context) -> None:
        if self.stream_options is not None and not self.stream:  # as vLLM refuses it
            raise ValueError("stream_options: only with stream: true")

    @field_validator("temperature")
    @classmethod
    def _usable_temperature(cls, v):
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences (got {len(stops)})")
        if any(not s for s in stops):
            raise ValueError("a stop sequence is empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence is longer than {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries (got {len(v)})")
        for key, bias in v.items():
            if not key.isdigit() or len(key) > MAX_INT_DIGITS:
                raise ValueError(f"key {key[:40]!r} is not a token id (a non-negative integer, as a string)")
            if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise ValueError(f"the bias of token {key} is {bias}; it must be within "
                                 f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
        return v

    def sampling(self, vocab: int) -> SamplingParams:
        """The engine's sampling parameters; a 400 naming the field for a token id outside the
        vocabulary, or a min_tokens above the request's max_tokens."""
        bias = {int(k): b for k, b in (self.logit_bias or {}).items()}
        for param, ids in (("logit_bias", bias), ("stop_token_ids", self.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                   param=param)
        cap = self.new_tokens
        if cap is not None and self.min_tokens > cap:
            raise RequestError(400, f"min_tokens: {self.min_tokens} is more than the request's limit of {cap} "
                               "new tokens", param="min_tokens")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              min_p=self.min_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              logit_bias=tuple(sorted(bias.items())), min_tokens=self.min_tokens)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(description="Text (needs tokenizer.json) or token ids.")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if len(v) == 0:
            raise ValueError("prompt is empty")
        return v

    @property
    def new_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


MAX_TOOLS = 128
_FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str  # JSON text


class ToolCallIn(BaseModel):
    """A tool call an assistant message of the conversation made (sent back with its result)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: str | None = None  # an earlier answer's, as clients send it back: not rendered

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # accepted: a forced call always follows its parameters

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, v):
        if v is not None and (bad := schema_problem(v)) is not None:
            raise ValueError(bad)
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include_reasoning: bool | None = None  # a thinking model's reasoning_content (None: the app's default)

    def model_post_init(self, _context) -> None:
        super().model_post_init(_context)
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: two functions have the same name")
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not names:
                raise ValueError("tool_choice: a call is required but no tools are given")
            if self.response_format is not None and self.response_format.type != "text":
                raise ValueError("tool_choice: a required call and a response_format cannot both hold the output")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not among the tools")

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is read for tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_functions(self) -> list[FunctionDef] | None:
        """The functions one of which must be called (tool_choice "required" or named), or None."""
        if self.tool_choice == "required":
            return [t.function for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t.function for t in self.tools if t.function.name == self.tool_choice.function.name]
        return None

    @property
    def new_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens (deprecated by OpenAI), else up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_k_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class RequestError(Exception):
    """A 4xx answer: status, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.err_type = status, message, param, err_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def check_context(prompt: int, new_tokens: int, max_len: int, held: int, prompt_param: str, tokens_param: str) -> None:
    """A 400 if a prompt of `prompt` tokens and `new_tokens` more do not fit the context
    (`max_len`) or what the whole KV cache holds for one sequence (`held`), naming the prompt
    (`prompt_param`: prompt / messages) when it alone leaves no room for a token, else the limit
    (`tokens_param`: max_tokens / max_completion_tokens)."""
    room = ((max_len, f"the context of {max_len} tokens", f"exceeds the context of {max_len} tokens"),
            (held, f"the whole KV cache for one sequence ({held} tokens: spec.ingress.kvCacheBudget)",
             f"is more than the whole KV cache holds for one sequence ({held} tokens: spec.ingress.kvCacheBudget)"))
    for limit, what, over in room:
        if prompt >= limit:
            raise RequestError(400, f"{prompt_param}: the prompt is {prompt} tokens, and {what} leaves no room "
                               "for a token after it; shorten the prompt", param=prompt_param)
        if prompt + new_tokens > limit:
            raise RequestError(400, f"{tokens_param}: prompt ({prompt} tokens) + {tokens_param} ({new_tokens}) {over}",
                               param=tokens_param)


def _json_depth(raw: bytes) -> tuple[int, str | None]:
    """How deeply arrays and objects nest in `raw` (brackets inside strings do not count), and the
    top-level key under which nesting first went past MAX_JSON_DEPTH (the last string read at
    depth 1 before it: a key, since a value that nests comes right after its key)."""
    depth = deepest = 0
    in_string = False
    start = 0
    key, deep_key = None, None
    for m in _STRUCTURE.finditer(raw):
        tok = m.group()
        if tok[:1] == b"\\":
            continue
        if tok == b'"':
            if not in_string:
                start = m.end()
            elif depth == 1:
                key = raw[start:m.start()]
            in_string = not in_string
        elif not in_string:
            if tok in (b"[", b"{"):
                depth += 1
                deepest = max(deepest, depth)
                if depth > MAX_JSON_DEPTH and deep_key is None and key is not None and raw.lstrip()[:1] == b"{":
                    deep_key = key.decode("utf-8", "replace")
            else:
                depth -= 1
    return deepest, deep_key


class _Hostile:
    """A value JSON decoding refused (a huge integer, NaN): reported once its field is known."""

    def __init__(self, message: str):
        self.message = message


def _int(text: str):
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Hostile(f"an integer of {digits} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def _constant(name: str):
    return _Hostile(f"{name} is not a JSON number")


def _first_hostile(value: object, path: str = "") -> tuple[str, str] | None:
    """(path, message) of the first value decoding refused, or None."""
    if isinstance(value, _Hostile):
        return path, value.message
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (got := _first_hostile(v, f"{path}[{i}]")) is not None:
                return got
    elif isinstance(value, dict):
        for k, v in value.items():
            if (got := _first_hostile(v, f"{path}.{k}" if path else k)) is not None:
                return got
    return None


def _bad_unicode(value: object, path: str = "") -> str | None:
    """The path of the first string (or key) that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (bad := _bad_unicode(v, f"{path}[{i}]")) is not None:
                return bad
    elif isinstance(value, dict):
        for k, v in value.items():
            name = k.encode("utf-8", "backslashreplace").decode()  # the message must be valid Unicode too
            key_path = f"{path}.{name}" if path else name
            if (bad := _bad_unicode(k, key_path)) is not None or (bad := _bad_unicode(v, key_path)) is not None:
                return bad
    return None


def decode_body(raw: bytes) -> object:
    """The JSON value of a request body, or a RequestError saying what is wrong with it."""
    deepest, deep_key = _json_depth(raw)
    if deepest > MAX_JSON_DEPTH:
        where = f"{deep_key}: " if deep_key else "request body "
        raise RequestError(400, f"{where}nests arrays or objects more than {MAX_JSON_DEPTH} deep", param=deep_key)
    try:
        body = json.loads(raw, parse_int=_int, parse_constant=_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise RequestError(400, f"request body is not valid JSON: {err}") from None
    hostile = _first_hostile(body)
    if hostile is not None:
        path, message = hostile
        field = path.split("[")[0].split(".")[0] if isinstance(body, dict) else None
        raise RequestError(400, f"{path}: {message}" if path else f"request body is not valid JSON: {message}",
                           param=field or None)
    bad = _bad_unicode(body)
    if bad is not None:
        param = bad.split("[")[0].split(".")[0] if bad != "body" else None
        raise RequestError(400, f"{bad}: not valid Unicode (a lone surrogate such as \\ud800); send UTF-8 text",
                           param=param)
    return body


def parse_completion(body: object) -> CompletionRequest:
    return _parse(CompletionRequest, body)


def parse_chat(body: object) -> ChatCompletionRequest:
    req = _parse(ChatCompletionRequest, body)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    return req


def _parse(model: type[BaseModel], body: object):
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        # union branches ("str", "list[int]") are pydantic's names, not the client's fields
        loc = ".".join(str(p) for p in first["loc"] if str(p) != "str" and not str(p).startswith("list["))
        field = str(first["loc"][0]) if first["loc"] else ""
        msg = first["msg"].removeprefix("Value error, ")
        if not first["loc"] and re.match(r"^\w+: ", msg):  # a check across fields names its field first
            field, msg = msg.split(": ", 1)
            loc = field
        if first["type"] == "extra_forbidden":
            msg = "unknown field"
        elif field == "prompt" and first["type"] in ("string_type", "int_type", "list_type"):
            loc, msg = "prompt", "expected a string or a list of integer token ids"
        elif field == "stop" and first["type"] in ("string_type", "list_type"):
            loc, msg = "stop", "expected a string or a list of strings"
        elif field == "messages" and first["type"] == "literal_error":
            msg = f"{msg} (got {first['input']!r})"
        elif field == "messages" and "content" in [str(p) for p in first["loc"]]:
            loc = ".".join(str(p) for p in first["loc"][:3])
            msg = "expected a string or a list of {\"type\": \"text\", \"text\": ...} parts"
        elif first["type"] in ("int_type", "float_type", "bool_type", "string_type"):
            got = type(first["input"]).__name__ if first["input"] is not None else "null"
            got = {"str": "a string", "bool": "a boolean", "float": "a number with a fraction", "int": "an integer",
                   "list": "a list", "dict": "an object", "null": "null"}.get(got, got)
            msg = f"{msg} (got {got})"
        raise RequestError(400, f"{loc}: {msg}", param=field or None) from None
