"""The answers as sent (serve/openai/render.py building serve/openai/responses.py's models): a chat
completion and its stream events, a text completion and its events, with reasoning, tool calls,
logprobs and usage, compared byte for byte. Real parts: the models, the renderer and a real
word-level tokenizer.json (tests/checkpoints.add_tokenizer); no engine, no Ray."""

from __future__ import annotations

import json

import pytest

from checkpoints import add_tokenizer
from moe_workers.serve.openai.render import DONE, Renderer, Reply, chat_choice, completion_choice, usage
from moe_workers.serve.openai.responses import ModelCard, ModelList
from moe_workers.serve.openai.tools import ToolCall

# two produced tokens (w5, w6): each one's logprob and its top alternatives
LOGPROBS = [(-0.5, [(5, -0.5), (7, -1.5)]), (-0.25, [(6, -0.25)])]
CHAT_LOGPROBS = (b'{"content":[{"token":"w5","logprob":-0.5,"bytes":[119,53],"top_logprobs":['
                 b'{"token":"w5","logprob":-0.5,"bytes":[119,53]},{"token":"w7","logprob":-1.5,"bytes":[119,55]}]},'
                 b'{"token":"w6","logprob":-0.25,"bytes":[119,54],"top_logprobs":['
                 b'{"token":"w6","logprob":-0.25,"bytes":[119,54]}]}]}')
USAGE = b'{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":4}}'


@pytest.fixture(scope="module")
def render(tmp_path_factory) -> Renderer:
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("tok")
    add_tokenizer(path, 16)
    return Renderer(Tokenizer.from_file(str(path / "tokenizer.json")))


def _call(name: str, arguments: str, id: str) -> ToolCall:
    return ToolCall(name, arguments, id=id)


def test_a_whole_chat_answer_has_reasoning_only_when_reported_and_tool_calls_only_when_made(render):
    reply = Reply("chatcmpl-1", 1700000000, "tiny", chat=True)
    lp = render.logprobs([5, 6], LOGPROBS, chat=True)
    choices = [chat_choice(0, "", [5, 6], "stop", lp, thinking="hmm", calls=[_call("add", '{"a": 1}', "call_1")]),
               chat_choice(1, "w5", [5], "length", None, thinking=""),
               chat_choice(2, "w5 w6", [5, 6], "stop", None),
               chat_choice(3, "w5", [5, 7], "length", None, calls=[_call("add", "{", "call_2")])]
    assert reply.answer(choices, usage(10, 3, 4)).wire() == (
        b'{"id":"chatcmpl-1","created":1700000000,"model":"tiny","object":"chat.completion","choices":['
        b'{"index":0,"message":{"role":"assistant","content":null,"reasoning_content":"hmm","tool_calls":['
        b'{"id":"call_1","type":"function","function":{"name":"add","arguments":"{\\"a\\": 1}"}}]},'
        b'"token_ids":[5,6],"finish_reason":"tool_calls","logprobs":' + CHAT_LOGPROBS + b'},'
        b'{"index":1,"message":{"role":"assistant","content":"w5","reasoning_content":""},'
        b'"token_ids":[5],"finish_reason":"length","logprobs":null},'
        b'{"index":2,"message":{"role":"assistant","content":"w5 w6"},"token_ids":[5,6],"finish_reason":"stop",'
        b'"logprobs":null},'
        b'{"index":3,"message":{"role":"assistant","content":"w5","tool_calls":['
        b'{"id":"call_2","type":"function","function":{"name":"add","arguments":"{"}}]},'
        b'"token_ids":[5,7],"finish_reason":"length","logprobs":null}],'
        b'"usage":' + USAGE + b'}')


def test_chat_stream_events_carry_usage_null_until_the_usage_event(render):
    reply = Reply("chatcmpl-2", 5, "tiny", chat=True, include_usage=True)
    head = b'data: {"id":"chatcmpl-2","created":5,"model":"tiny","object":"chat.completion.chunk","choices":['
    one = render.logprobs([5, 6], LOGPROBS, chat=True, since=1, upto=2)
    calls = [_call("add", '{"a":1}', "call_1"), _call("sub", "{}", "call_2")]
    events = [reply.event(0, "", [], None, first=True),
              reply.event(1, "", [7], None, thinking="hm"),
              reply.event(0, "w6", [6], None, one),
              reply.event(0, "w5", [], None, calls=calls),
              reply.event(0, "", [], "tool_calls"),
              reply.usage_event(usage(10, 3, 4)),
              DONE]
    assert events == [
        head + b'{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[],"finish_reason":null,'
        b'"logprobs":null}],"usage":null}\n\n',
        head + b'{"index":1,"delta":{"reasoning_content":"hm"},"token_ids":[7],"finish_reason":null,'
        b'"logprobs":null}],"usage":null}\n\n',
        head + b'{"index":0,"delta":{"content":"w6"},"token_ids":[6],"finish_reason":null,"logprobs":'
        b'{"content":[{"token":"w6","logprob":-0.25,"bytes":[119,54],"top_logprobs":['
        b'{"token":"w6","logprob":-0.25,"bytes":[119,54]}]}]}}],"usage":null}\n\n',
        head + b'{"index":0,"delta":{"content":"w5","tool_calls":['
        b'{"index":0,"id":"call_1","type":"function","function":{"name":"add","arguments":"{\\"a\\":1}"}},'
        b'{"index":1,"id":"call_2","type":"function","function":{"name":"sub","arguments":"{}"}}]},'
        b'"token_ids":[],"finish_reason":null,"logprobs":null}],"usage":null}\n\n',
        head + b'{"index":0,"delta":{},"token_ids":[],"finish_reason":"tool_calls","logprobs":null}],'
        b'"usage":null}\n\n',
        head + b'],"usage":' + USAGE + b'}\n\n',
        b"data: [DONE]\n\n"]
    for event in events[:-1]:  # each is one whole server-sent event of JSON
        assert event.startswith(b"data: ") and event.endswith(b"\n\n") and json.loads(event[6:])


def test_a_stream_that_did_not_ask_for_usage_sends_no_usage_key():
    reply = Reply("chatcmpl-3", 5, "tiny", chat=True)
    assert reply.event(0, "w5", [5], "stop") == (
        b'data: {"id":"chatcmpl-3","created":5,"model":"tiny","object":"chat.completion.chunk","choices":['
        b'{"index":0,"delta":{"content":"w5"},"token_ids":[5],"finish_reason":"stop","logprobs":null}]}\n\n')
    text = Reply("cmpl-3", 5, "tiny", chat=False)
    assert text.event(0, "w5", [5], None) == (
        b'data: {"id":"cmpl-3","created":5,"model":"tiny","object":"text_completion","choices":['
        b'{"index":0,"text":"w5","token_ids":[5],"finish_reason":null,"logprobs":null}]}\n\n')


def test_a_text_completion_whole_and_streamed(render):
    reply = Reply("cmpl-4", 7, "tiny", chat=False, include_usage=True)
    lp = render.logprobs([5, 6], LOGPROBS, chat=False)
    choices = [completion_choice(0, "w5 w6", [5, 6], "length", lp), completion_choice(1, "", [], "error: boom", None)]
    assert reply.answer(choices, usage(10, 3, 4)).wire() == (
        b'{"id":"cmpl-4","created":7,"model":"tiny","object":"text_completion","choices":['
        b'{"index":0,"text":"w5 w6","token_ids":[5,6],"finish_reason":"length","logprobs":'
        b'{"tokens":["w5","w6"],"token_logprobs":[-0.5,-0.25],"top_logprobs":[{"w5":-0.5,"w7":-1.5},{"w6":-0.25}],'
        b'"text_offset":[0,2]}},'
        b'{"index":1,"text":"","token_ids":[],"finish_reason":"error: boom","logprobs":null}],'
        b'"usage":' + USAGE + b'}')
    # a resumed stream's token: its offset counts the text of the tokens generated elsewhere (w3)
    one = render.logprobs([5, 6], LOGPROBS, chat=False, since=1, upto=2, prefix=[3])
    head = b'data: {"id":"cmpl-4","created":7,"model":"tiny","object":"text_completion","choices":['
    assert reply.event(0, " w6", [6], None, one) == (
        head + b'{"index":0,"text":" w6","token_ids":[6],"finish_reason":null,"logprobs":'
        b'{"tokens":["w6"],"token_logprobs":[-0.25],"top_logprobs":[{"w6":-0.25}],"text_offset":[5]}}],'
        b'"usage":null}\n\n')
    assert reply.usage_event(usage(10, 3, 4)) == head + b'],"usage":' + USAGE + b'}\n\n'


def test_token_texts_without_a_tokenizer_and_an_infinite_logprob_as_json_dumps_spelt_it():
    lp = Renderer(None).logprobs([9], [(float("-inf"), [(9, float("-inf"))])], chat=True)
    assert lp.wire() == (b'{"content":[{"token":"token_id:9","logprob":-Infinity,"bytes":null,"top_logprobs":['
                         b'{"token":"token_id:9","logprob":-Infinity,"bytes":null}]}]}')


def test_the_model_list():
    card = ModelCard(id="tiny", object="model", owned_by="moe-operator", max_model_len=64, vocab_size=16)
    assert ModelList(object="list", data=[card]).wire() == (
        b'{"object":"list","data":[{"id":"tiny","object":"model","owned_by":"moe-operator","max_model_len":64,'
        b'"vocab_size":16}]}')
