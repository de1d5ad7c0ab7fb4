"""Request decoding and validation (pure), and sampling that cannot fail for accepted values."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_workers.model.sampling import sample
from moe_workers.serve.protocol import (MAX_JSON_DEPTH, MIN_TEMPERATURE, CompletionRequest, RequestError,
                                        decode_body, parse_completion)


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
