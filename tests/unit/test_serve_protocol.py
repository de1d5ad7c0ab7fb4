"""Request decoding and validation (pure), and sampling that cannot fail for accepted values."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_workers.model.sampling import SamplingParams, sample
from moe_workers.serve.openai.protocol import (MAX_JSON_DEPTH, MIN_TEMPERATURE, CompletionRequest, RequestError,
                                               check_context, decode_body, parse_chat, parse_completion)


def _error(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_completion(decode_body(raw))
    return info.value


def test_depth_counts_brackets_outside_strings_only():
    assert parse_completion(decode_body(b'{"prompt": "' + b"[" * 100 + b'"}')).prompt == "[" * 100
    ok = b'{"prompt":"x","user":"a\\"[[["}'
    assert parse_completion(decode_body(ok)).user == 'a"[[['
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    assert "more than 32 deep" in _error(deep).message
    decode_body(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)  # at the limit: fine


@pytest.mark.parametrize("raw,param,message", [
    (b'{"prompt":[1],"max_tokens":' + b"1" * 31 + b"}", "max_tokens", "max_tokens: an integer of 31 digits"),
    (b'{"prompt":[1, ' + b"1" * 25 + b"]}", "prompt", "prompt[1]: an integer of 25 digits"),
    (b'{"prompt":[1],"temperature":NaN}', "temperature", "temperature: NaN is not a JSON number"),
    (b'{"prompt":[1],"temperature":Infinity}', "temperature", "temperature: Infinity is not a JSON number"),
    (b'{"prompt":[1],"model":"a\\"[[[","user":' + b"[" * 50_000 + b"]" * 50_000 + b"}", "user",
     "user: nests arrays or objects more than 32 deep"),
    (b"[" * 40 + b"]" * 40, None, "request body nests arrays or objects more than 32 deep"),
    (b"NaN", None, "request body is not valid JSON: NaN is not a JSON number"),
])
def test_values_json_decoding_refuses_name_their_field(raw, param, message):
    err = _error(raw)
    assert (err.param, err.message[:len(message)]) == (param, message)


def test_types_are_exact():
    assert _error(b'{"prompt":[1],"max_tokens":true}').param == "max_tokens"
    assert _error(b'{"prompt":[1],"max_tokens":2.0}').param == "max_tokens"
    assert _error(b'{"prompt":[1],"stream":1}').message.startswith("stream: ")
    assert _error(b'{"prompt":[1, false]}').message == "prompt: expected a string or a list of integer token ids"
    assert parse_completion(decode_body(b'{"prompt":[1],"temperature":1}')).temperature == 1.0  # ints are numbers


def test_ranges_and_sizes():
    assert _error(b'{"prompt":[1],"temperature":1e-6}').param == "temperature"
    assert _error(b'{"prompt":[1],"top_p":0}').param == "top_p"
    assert _error(b'{"prompt":[1],"seed":9223372036854775808}').param == "seed"
    assert parse_completion(decode_body(b'{"prompt":[1],"seed":-9223372036854775808}')).seed == -(2**63)
    assert "21 digits" in _error(b'{"prompt":[1],"seed":' + b"1" * 21 + b"}").message
    assert _error(b'{"prompt":"\\ud83d"}').param == "prompt"  # half of a surrogate pair
    assert parse_completion(decode_body(b'{"prompt":"\\ud83d\\ude00"}')).prompt == "\U0001F600"  # the whole pair
    err = _error(b'{"prompt":[1],"\\udc00":1}')  # a key: named with the escape, so the answer is valid JSON
    assert err.message.startswith("\\udc00: not valid Unicode") and err.message.encode("utf-8")


@settings(max_examples=200, deadline=None)
@given(temperature=st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, 2.0)),
       top_p=st.floats(5e-324, 1.0, exclude_min=False), seed=st.integers(0, 2**32),
       scale=st.sampled_from([1.0, 1e3, 1e30]))
def test_sampling_gives_a_token_for_every_accepted_value(temperature, top_p, seed, scale):
    CompletionRequest(prompt=[1], temperature=temperature, top_p=top_p)  # the API accepts it
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed)) * scale
    tok = sample(logits, temperature, top_p, torch.Generator().manual_seed(seed))
    assert 0 <= tok < 50


def test_sampling_a_row_with_nan_or_inf_falls_back_to_the_finite_argmax():
    row = torch.tensor([0.0, float("nan"), 3.0, float("-inf")])
    assert sample(row, 1.0, 0.9, torch.Generator().manual_seed(0)) == 2


def test_error_body_shape():
    err = _error(json.dumps({"prompt": [1], "n": 17}).encode())
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": "n",
                                    "code": 400}}


@pytest.mark.parametrize("field,value,says", [
    ("top_k", -2, "top_k: Input should be greater than or equal to -1"),
    ("min_p", 1.5, "min_p: Input should be less than or equal to 1"),
    ("presence_penalty", 2.5, "presence_penalty: Input should be less than or equal to 2"),
    ("frequency_penalty", -3, "frequency_penalty: Input should be greater than or equal to -2"),
    ("repetition_penalty", 0, "repetition_penalty: Input should be greater than 0"),
    ("logit_bias", {"abc": 1}, "logit_bias: key 'abc' is not a token id"),
    ("logit_bias", {"5": 101}, "logit_bias: the bias of token 5 is 101"),
    ("logit_bias", {"5": "1"}, "logit_bias.5: Input should be a valid number"),
    ("logit_bias", {str(i): 1 for i in range(1025)}, "logit_bias: at most 1024 entries"),
    ("stop_token_ids", list(range(65)), "stop_token_ids: List should have at most 64 items"),
    ("stop_token_ids", [1.0], "stop_token_ids.0: Input should be a valid integer"),
    ("ignore_eos", 1, "ignore_eos: Input should be a valid boolean"),
    ("min_tokens", -1, "min_tokens: Input should be greater than or equal to 0"),
])
def test_the_sampling_set_is_validated_and_named(field, value, says):
    err = _error(json.dumps({"prompt": [1], field: value}).encode())
    assert err.param == field and err.message.startswith(says), err.message


def test_sampling_params_check_ids_against_the_vocabulary_and_min_tokens_against_the_limit():
    req = parse_completion(decode_body(json.dumps({
        "prompt": [1], "max_tokens": 9, "temperature": 0.5, "top_k": -1, "min_p": 0.1, "presence_penalty": 1,
        "frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 2.5},
        "stop_token_ids": [4], "ignore_eos": True, "min_tokens": 9}).encode()))
    p = req.sampling(vocab=8)
    assert (p.temperature, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
            p.logit_bias, p.min_tokens) == (0.5, 0, 0.1, 1.0, 0.5, 1.2, ((3, 2.5), (7, -100.0)), 9)
    with pytest.raises(RequestError) as info:
        req.sampling(vocab=7)
    assert (info.value.param, info.value.message) == ("logit_bias", "logit_bias: token id 7 is outside the "
                                                      "vocabulary [0, 7)")
    with pytest.raises(RequestError) as info:
        req.model_copy(update={"logit_bias": None, "stop_token_ids": [4, 8]}).sampling(vocab=8)
    assert info.value.param == "stop_token_ids"
    with pytest.raises(RequestError) as info:
        req.model_copy(update={"min_tokens": 10}).sampling(vocab=8)
    assert info.value.param == "min_tokens" and "more than the request's limit of 9" in info.value.message
    assert CompletionRequest(prompt=[1]).sampling(vocab=8) == SamplingParams(temperature=1.0)


def _chat_error(body: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_chat(decode_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode()))
    return info.value


@pytest.mark.parametrize("body,param,says", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": 5}}}}}]},
     "tools", "tools.0.function.parameters: properties.city.type: 5 is not a JSON schema type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}]},
     "tools", "tools.0.function.parameters: required: expected a list of property names"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools.0.function.name: String should"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "tools: two functions have the same"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: a call is required but no tools are given"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "tool_choice: function 'g' is not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "tool_choice: a required call and a response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": [3]}}}},
     "response_format", "response_format.json_schema.schema: anyOf.0: expected an object (a JSON schema)"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format: json_schema: required"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type: Input should be"),
    ({"include_reasoning": 1}, "include_reasoning", "include_reasoning: Input should be a valid boolean"),
])
def test_tools_and_response_formats_are_checked_and_named(body, param, says):
    err = _chat_error(body)
    assert err.param == param and err.message.startswith(says), err.message


SCHEMA_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                          "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


@pytest.mark.parametrize("keyword", SCHEMA_NUMBER_KEYWORDS)
@pytest.mark.parametrize("value", [-(2**63) - 1, 2**64, 10**20 - 1])
def test_schema_integers_past_64_bits_are_a_400_naming_the_keyword(keyword, value):
    """The grammar compiler reads int64 / uint64 only: a wider integer anywhere in a schema was a
    500 ("Value is not JSON serializable"); in a tool's parameters as in a response format."""
    schema = {"type": "object", "properties": {"a": {"type": "number", keyword: value}}}
    err = _chat_error({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert err.param == "response_format" and err.message == (
        f"response_format.json_schema.schema: properties.a.{keyword}: {value} is outside the integers a schema "
        "can hold [-2^63, 2^64)")
    err = _chat_error({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert err.param == "tools" and err.message.startswith(f"tools.0.function.parameters: properties.a.{keyword}: ")


def test_schema_integers_at_the_64_bit_ends_and_wide_ones_elsewhere():
    ends = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ends}}
    assert parse_chat(decode_body(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                              "response_format": fmt}).encode())).response_format.json_schema
    for schema, where in (({"enum": [1, 2**64]}, "enum.1"), ({"const": -(2**63) - 1}, "const"),
                          ({"anyOf": [{"default": 2**65}]}, "anyOf.0.default")):
        err = _chat_error({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert err.message.startswith(f"response_format.json_schema.schema: {where}: "), err.message


def test_a_multiple_of_that_would_compile_to_gigabytes_is_refused():
    """multipleOf 5,000,011 took llguidance 86 s and 2.4 GB to compile (a DFA state per residue),
    and each such grammar stayed in the cache: one request could hold the Ingress for minutes."""
    for step in (10_007, 5_000_011, 0, -3, 1e300):
        schema = {"type": "object", "properties": {"a": {"type": "number", "multipleOf": step}}}
        err = _chat_error({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert err.param == "response_format" and err.message.startswith(
            f"response_format.json_schema.schema: properties.a.multipleOf: {step} is not within (0, 10000]"), err.message
        err = _chat_error({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
        assert err.param == "tools" and "multipleOf" in err.message
    for step in (9973, 0.001, 2.5):
        schema = {"type": "number", "multipleOf": step}
        parse_chat(decode_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}).encode()))


def test_a_tool_call_sent_back_and_a_forced_choice_read_as_the_client_means():
    req = parse_chat(decode_body(json.dumps({
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}).encode()))
    assert req.calls_tools and [f.name for f in req.forced_functions()] == ["g"]
    assert req.messages[1].tool_calls[0].function.name == "f"
    assert req.model_copy(update={"tool_choice": "none"}).calls_tools is False
    assert req.model_copy(update={"tool_choice": "auto"}).forced_functions() is None


@pytest.mark.parametrize("prompt,new_tokens,param,says", [
    (5000, 1, "prompt", "prompt: the prompt is 5000 tokens, and the context of 2048 tokens leaves no room"),
    (2048, 1, "prompt", "prompt: the prompt is 2048 tokens, and the context of 2048"),
    (2047, 2, "max_tokens", "max_tokens: prompt (2047 tokens) + max_tokens (2) exceeds the context of 2048 tokens"),
    (1500, 1, "prompt", "prompt: the prompt is 1500 tokens, and the whole KV cache for one sequence (1024 tokens"),
    (1000, 30, "max_tokens", "max_tokens: prompt (1000 tokens) + max_tokens (30) is more than the whole KV cache"),
])
def test_a_prompt_that_alone_does_not_fit_is_refused_naming_the_prompt(prompt, new_tokens, param, says):
    """A prompt with no room for one token after it names the prompt, not the limit on new
    tokens (it named max_tokens, which no value of could fix)."""
    with pytest.raises(RequestError) as info:
        check_context(prompt, new_tokens, max_len=2048, held=1024, prompt_param="prompt", tokens_param="max_tokens")
    assert info.value.param == param and info.value.message.startswith(says), info.value.message
    with pytest.raises(RequestError) as info:  # chat without a limit: the rest of the context, none left
        check_context(2048, 0, 2048, 4096, "messages", "max_completion_tokens")
    assert info.value.param == "messages"
    check_context(1000, 24, 2048, 1024, "prompt", "max_tokens")  # exactly fits


def test_stream_options_without_stream_are_refused_as_vllm_refuses_them():
    for body in ({"prompt": [1], "stream_options": {"include_usage": True}},
                 {"prompt": [1], "stream": False, "stream_options": {}}):
        err = _error(json.dumps(body).encode())
        assert (err.param, err.message) == ("stream_options", "stream_options: only with stream: true")
    assert _chat_error({"stream_options": {"include_usage": True}}).param == "stream_options"
    ok = parse_completion(decode_body(b'{"prompt":[1],"stream":true,"stream_options":{"include_usage":true}}'))
    assert ok.include_usage
    assert parse_completion(decode_body(b'{"prompt":[1],"stream_options":null}')).stream_options is None


def test_a_key_given_twice_takes_its_last_value_as_vllm_does():
    """json.loads, which FastAPI (hence vLLM) and pydantic's own parser follow: the last one wins."""
    req = parse_completion(decode_body(b'{"prompt":[1],"max_tokens":2,"max_tokens":5}'))
    assert req.max_tokens == 5
    assert _error(b'{"prompt":[1],"max_tokens":2,"max_tokens":true}').param == "max_tokens"
