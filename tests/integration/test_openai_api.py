"""The OpenAI API as clients use it, with the real `openai` client against a served app on a
real Ray: chat (plain and streamed, with usage), stop sequences, n, logprobs, and the errors the
client raises on our 4xx. Greedy chat equals the in-process model on the rendered prompt."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
import requests
from tokenizers import Tokenizer

from checkpoints import make_mixtral
from flood import flood
from moe_workers.model.inprocess import InProcessModel
from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
from moe_workers.serve.auth import digests
from moe_workers.serve.openai.chat import ChatTemplate, write_tokenizer_config
from moe_workers.serve.config import AppArgs, serve_application
from moe_workers.serve.openai.protocol import ChatMessage
from serve_rest import delete_all, deploy

pytestmark = pytest.mark.ray
MAX_LEN = 2048  # room for the tools a prompt carries (byte tokens)
VOCAB = BYTE_VOCAB_SIZE + 2  # the bytes, then <think> and </think>
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
PLACEMENT = {"ExpertShard-0": ["0.0", "0.1", "1.0", "1.1"], "ExpertShard-1": ["0.2", "0.3", "1.2", "1.3"]}


def _args(path) -> AppArgs:
    return AppArgs(model_path=str(path), served_model_name="tiny", num_groups=2, max_batch_size=8,
                   kv_cache_budget_bytes=16 * 2**20, max_queued_requests=16)


@pytest.fixture(scope="module")
def app(ray_head, tmp_path_factory):
    ray = ray_head.connect_driver(namespace="openai-test")
    path = tmp_path_factory.mktemp("ckpt-openai")
    make_mixtral(path, vocab_size=VOCAB, num_local_experts=4, num_hidden_layers=2,
                 max_position_embeddings=MAX_LEN)
    tok = Tokenizer.from_file(str(write_byte_tokenizer(path)))
    tok.add_tokens(["<think>", "</think>"])  # ids 259, 260: single tokens, as in Qwen3's vocabulary
    tok.save(str(path / "tokenizer.json"))
    write_tokenizer_config(path)
    args = _args(path)
    deploy(ray_head, [serve_application("openai", "/", args, PLACEMENT)])
    url = f"http://127.0.0.1:{ray_head.serve_http_port}"
    try:
        yield url, path, InProcessModel(path, max_len=MAX_LEN)
    finally:
        delete_all(ray_head)
        ray.shutdown()


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt_ids(path, messages) -> list[int]:
    text = ChatTemplate.from_checkpoint(path).render([ChatMessage.model_validate(m) for m in messages])
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_chat_greedy_equals_the_in_process_model(app, client):
    _, path, reference = app
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and resp.object == "chat.completion"
    ids = _prompt_ids(path, MESSAGES)
    want = reference.generate([ids], 12, stop_at_eos=True)[0]
    assert choice.model_extra["token_ids"] == want
    assert choice.message.content == Tokenizer.from_file(str(path / "tokenizer.json")).decode(want)
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(want)


def test_a_chat_turn_reuses_the_cached_history_and_says_so_in_usage(app, client):
    """The second turn resends the first with its answer: the Ingress finds those blocks computed
    (usage.prompt_tokens_details.cached_tokens, as OpenAI reports it) and the answer is still the
    in-process model's on the whole rendered prompt; /moe/v1/status counts the hit."""
    url, path, reference = app
    system = [{"role": "system", "content": "You answer in one line. " * 2}]
    first = client.chat.completions.create(model="tiny", messages=system + [{"role": "user", "content": "Hi."}],
                                           max_completion_tokens=8, temperature=0)
    history = system + [{"role": "user", "content": "Hi."},
                        {"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_completion_tokens=8, temperature=0)
    ids = _prompt_ids(path, history)
    assert second.choices[0].model_extra["token_ids"] == reference.generate([ids], 8, stop_at_eos=True)[0]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (len(_prompt_ids(path, system)) // 16) > 0 and cached % 16 == 0
    kv = requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["kv"]
    assert kv["prefix_hit_tokens"] >= cached and kv["blocks_used"] == 0 < kv["blocks_total"]
    assert kv["block_size"] == 16 and kv["max_sequence_tokens"] == MAX_LEN


def test_streamed_chat_is_the_same_text_and_reports_usage(app, client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_completion_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_sequences_cut_the_text_and_end_the_choice(app, client):
    base = client.completions.create(model="tiny", prompt="The cat", max_tokens=24, temperature=0)
    text = base.choices[0].text
    # a stop that occurs inside the greedy text, not at its start
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    cut = text[:text.index(stop)]
    got = client.completions.create(model="tiny", prompt="The cat", max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt="The cat", max_tokens=24, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_are_independent_samples_and_seeded(app, client):
    kwargs = dict(model="tiny", prompt=[5, 9, 11], max_tokens=8, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    ids = [tuple(c.model_extra["token_ids"]) for c in a.choices]
    assert len(set(ids)) > 1  # different samples...
    assert ids == [tuple(c.model_extra["token_ids"]) for c in b.choices]  # ...reproducible with a seed
    assert a.usage.completion_tokens == sum(len(i) for i in ids)


def test_the_sampling_set_reaches_the_engine(app, client):
    """OpenAI's logit_bias and vLLM's extra fields (extra_body) act on the served tokens; an id
    outside the vocabulary is a 400 naming the field. (Their values against transformers'
    processors: tests/unit/test_sampling.py and test_engine_kv.py.)"""
    _, _, reference = app
    prompt = [5, 9, 11]
    base = reference.generate([prompt], 6)[0]
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=6)
    forced = client.completions.create(**kwargs, temperature=0, logit_bias={"77": 100})
    assert forced.choices[0].model_extra["token_ids"] == [77] * 6
    stop = base[1]
    stopped = client.completions.create(**kwargs, temperature=0, extra_body={"stop_token_ids": [stop],
                                                                             "ignore_eos": True})
    assert stopped.choices[0].model_extra["token_ids"] == base[:base.index(stop) + 1]
    assert stopped.choices[0].finish_reason == "stop"
    top1 = client.completions.create(**kwargs, temperature=1.5, seed=3, extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].model_extra["token_ids"] == base
    held = client.completions.create(**kwargs, temperature=0, extra_body={"stop_token_ids": [base[0]],
                                                                          "min_tokens": 6, "ignore_eos": True})
    assert base[0] not in held.choices[0].model_extra["token_ids"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs, logit_bias={str(VOCAB): 1})
    assert err.value.body["param"] == "logit_bias" and "outside the vocabulary" in err.value.message


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_holds_sampled_output_to_the_schema(app, client):
    """json_schema on chat (whole and streamed) and completions, json_object, and a schema
    keyword the grammar cannot serve: a 400 naming it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    texts = []
    for seed in (0, 100, 200):  # choice i samples with seed + i
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=120,
                                              temperature=1.0, n=8, seed=seed, response_format=fmt)
        assert all(c.finish_reason == "stop" for c in resp.choices)
        texts += [c.message.content for c in resp.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 16
    kwargs = dict(model="tiny", messages=MESSAGES, max_completion_tokens=120, temperature=1.0, seed=11,
                  response_format=fmt)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    # any object: its strings are unbounded, so a bias towards closing them (and the object) keeps a
    # random model's answer short; the grammar still decides what may come
    _, path, _ = app
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode('"}').ids
    obj = client.completions.create(model="tiny", prompt="Give JSON:", max_tokens=200, temperature=0.8, seed=1,
                                    logit_bias={str(i): 6 for i in ids},
                                    extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}, "then": {}}}})
    assert err.value.body["param"] == "response_format" and '"if"' in err.value.message


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}


def test_tool_calls_round_trip_through_the_template(app, client):
    """A forced call (required, then named) comes back as message.tool_calls whose arguments fit
    the function's parameters, the same streamed; its result goes back through the template as
    transformers renders it; with tool_choice none the answer is text."""
    from transformers import PreTrainedTokenizerFast

    _, path, _ = app
    tools = [WEATHER, ADD]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    # one call each (a random model would add calls to a parallel list until max tokens)
    kwargs = dict(model="tiny", messages=ask, tools=tools, max_completion_tokens=400, temperature=1.0,
                  parallel_tool_calls=False)
    resp = client.chat.completions.create(**kwargs, tool_choice="required", seed=3, n=4)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = client.chat.completions.create(**kwargs, seed=4, tool_choice={"type": "function",
                                                                          "function": {"name": "add"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    # streamed: the calls come whole in one chunk, then finish_reason tool_calls
    chunks = list(client.chat.completions.create(**kwargs, seed=4, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "add"}}))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "add", call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # the call and its result go back; the template renders them as transformers does
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=tools, tool_choice="none",
                                            max_completion_tokens=6, temperature=0)
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    hf.chat_template = ChatTemplate.from_checkpoint(path).template_source
    hf_history = [dict(m) for m in history]
    hf_history[1] = {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "add", "arguments": json.loads(call.function.arguments)}}]}
    text = hf.apply_chat_template(hf_history, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "[TOOL_RESULTS]" in text and answer.usage.prompt_tokens == len(
        Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ask, tools=tools, max_completion_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"


def test_a_forced_call_cut_by_max_tokens_comes_back_with_its_arguments_so_far(app, client):
    """tool_choice naming a function, max_completion_tokens ending inside the arguments: the call
    with what was generated of them (not JSON yet) and finish_reason length, as vLLM answers; it
    came back as content "" and no tool_calls. Greedy, so the cut tokens are the whole call's first."""
    _, path, _ = app
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Add."}], tools=[WEATHER, ADD], temperature=0,
                  parallel_tool_calls=False, tool_choice={"type": "function", "function": {"name": "add"}})
    whole = client.chat.completions.create(**kwargs, max_completion_tokens=400).choices[0]
    ids = whole.model_extra["token_ids"]
    text = tok.decode(ids, skip_special_tokens=False)
    k = len(tok.encode(text[:text.index("{", text.index('"arguments"')) + 3], add_special_tokens=False).ids)
    cut = client.chat.completions.create(**kwargs, max_completion_tokens=k).choices[0]
    assert cut.finish_reason == "length" and cut.model_extra["token_ids"] == ids[:k]
    [call] = cut.message.tool_calls
    assert call.function.name == "add" and call.function.arguments.startswith("{")
    assert call.function.arguments in text and json.loads(whole.message.tool_calls[0].function.arguments)
    chunks = list(client.chat.completions.create(**kwargs, max_completion_tokens=k, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("add", call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_a_thinking_model_answers_with_reasoning_content(app, client):
    """The vocabulary marks thinking (<think>, </think> single tokens): what comes before </think>
    is message.reasoning_content, the rest content, the same streamed; include_reasoning false
    drops it. The prompt ends inside thinking, as DeepSeek-R1's template leaves it."""
    _, path, _ = app
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    think, done = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Think first.<think>"}], max_completion_tokens=24,
                  temperature=1.0, seed=5, logit_bias={str(done): 3})
    message = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0]
    ids = message.model_extra["token_ids"]
    assert done in ids and think not in ids, ids
    cut = ids.index(done)
    answer = [t for t in ids[cut:] if t != done]
    assert message.message.model_extra["reasoning_content"] == tok.decode(ids[:cut])
    assert message.message.content == tok.decode(answer)
    chunks = list(client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == tok.decode(ids[:cut])
    assert "".join(d.content or "" for d in deltas) == tok.decode(answer)
    quiet = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True, "include_reasoning": False})
    assert "reasoning_content" not in quiet.choices[0].message.model_extra
    assert quiet.choices[0].message.content == tok.decode(answer)


def test_logprobs(app, client):
    resp = client.completions.create(model="tiny", prompt=[5, 9, 11], max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0 and max(top.values()) == pytest.approx(chosen)  # greedy: the top one
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].model_extra["token_ids"])
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


@pytest.mark.parametrize("kwargs,field", [
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": MESSAGES, "n": 99}, "n"),
    ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "max_completion_tokens": MAX_LEN}, "max_completion_tokens"),
])
def test_bad_chat_requests_are_4xx_naming_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", **kwargs)
    assert err.value.status_code == 400 and field in err.value.message
    assert err.value.body["param"] == field.split(".")[0]


def test_client_error_types(app, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[5], max_tokens=4, logprobs=6)
    assert "logprobs" in err.value.message
    # unknown fields are refused by name
    resp = requests.post(app[0] + "/v1/chat/completions", json={"messages": MESSAGES, "frobnicate": 1}, timeout=30)
    assert resp.status_code == 400 and "frobnicate: unknown field" in resp.json()["error"]["message"]


def test_a_template_that_refuses_gets_a_400_and_good_requests_go_on(app, client):
    """Malformed chats mixed with good ones never fail a good one."""
    _, path, reference = app
    want = reference.generate([_prompt_ids(path, MESSAGES)], 6, stop_at_eos=True)[0]
    bad = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
           {"messages": "hi"}, {"messages": [{"role": "user"}], "stream": "yes"}]
    for body in bad * 3:
        r = requests.post(app[0] + "/v1/chat/completions", data=json.dumps(body), timeout=30,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
        good = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=6, temperature=0)
        assert good.choices[0].model_extra["token_ids"] == want


def test_api_keys_apply_in_place_and_refuse_wrong_keys(ray_head, app, client):
    """Keys reach the ingress as digests in user_config: no restart; a wrong or missing key is a
    401 the client raises as AuthenticationError; /moe/v1/status stays open."""
    url, path, reference = app
    pid = requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["pid"]
    args = _args(path)
    config = serve_application("openai", "/", args, PLACEMENT, api_key_digests=digests("k-one\n# old\nk-two\n"))
    assert "k-one" not in json.dumps(config)  # only digests travel
    try:
        deploy(ray_head, [config])
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="k-two", max_retries=0, timeout=120)

        def refused():
            try:
                client.completions.create(model="tiny", prompt=[5], max_tokens=1)
            except openai.AuthenticationError as err:
                return err
            return None
        err = next(e for _ in range(120) if (e := refused()) is not None or time.sleep(0.5))
        assert err.status_code == 401 and "API key" in err.message and "unused" not in err.message
        got = keyed.completions.create(model="tiny", prompt=[5, 9, 11], max_tokens=4, temperature=0)
        assert got.choices[0].model_extra["token_ids"] == reference.generate([[5, 9, 11]], 4, stop_at_eos=True)[0]
        r = requests.get(url + "/v1/models", headers={"Authorization": "Basic k-two"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(url + "/moe/v1/status", timeout=30).json()["ingress"]["pid"] == pid  # not restarted
        name = "ray_moe_requests_rejected_total"
        rejected = _total(_metrics(ray_head, [name], lambda f: _total(f[name], 'code="401"') >= 2)[name], 'code="401"')
        assert rejected >= 2, rejected  # the refused completion and /v1/models, on Ray's metrics export
    finally:
        deploy(ray_head, [serve_application("openai", "/", args, PLACEMENT)])
    wait = time.monotonic() + 60
    while refused() is not None and time.monotonic() < wait:
        time.sleep(0.5)
    assert client.models.list().data[0].id == "tiny"


def _metrics(ray_head, names: list[str], ready, timeout_s: float = 90) -> dict[str, list[str]]:
    """The app's lines of each metric in `names` on Ray's metrics export, polled every 2 s until
    `ready(lines by name)` or the timeout passes (then the last ones)."""
    found: dict[str, list[str]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = requests.get(ray_head.metrics_url, timeout=10).text
        found = {n: [l for l in text.splitlines() if l.startswith(n + "{") and 'app="openai"' in l] for n in names}
        if ready(found):
            break
        time.sleep(2)
    return found


def _total(lines: list[str], needle: str = "") -> float:
    """The sum of the values of `lines` (those containing `needle`)."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines if needle in l)


def test_serving_metrics_reach_rays_prometheus_export(ray_head, app, client):
    """TTFT, inter-token and request latency histograms, token counters, load and KV gauges on
    Ray's metrics export (rejections: the API keys test)."""
    for _ in range(3):
        client.completions.create(model="tiny", prompt=[5, 9, 11], max_tokens=6, temperature=0)
    want = ["ray_moe_time_to_first_token_seconds_bucket", "ray_moe_inter_token_latency_seconds_bucket",
            "ray_moe_request_latency_seconds_bucket", "ray_moe_prompt_tokens_total", "ray_moe_generation_tokens_total",
            "ray_moe_requests_running", "ray_moe_requests_waiting", "ray_moe_kv_cache_used_bytes",
            "ray_moe_kv_cache_budget_bytes"]
    found = _metrics(ray_head, want, lambda f: all(f.values()))
    assert all(found.values()), [n for n, v in found.items() if not v]
    assert _total(found["ray_moe_generation_tokens_total"]) >= 18 and _total(found["ray_moe_prompt_tokens_total"]) >= 9
    assert _total(found["ray_moe_kv_cache_budget_bytes"]) > 0
    assert _total(found["ray_moe_request_latency_seconds_bucket"], 'le="+Inf"') >= 3


def test_a_full_queue_is_a_503_the_client_raises_with_retry_after(app):
    """More requests than the batch and the wait queues hold (shards stopped, so none finishes
    first): the rest get 503 + Retry-After, which the openai client raises as
    InternalServerError (status 503); the others finish."""
    flood_client = openai.OpenAI(base_url=app[0] + "/v1", api_key="unused", max_retries=0, timeout=300)

    def one(i):
        try:
            r = flood_client.completions.with_raw_response.create(model="tiny", prompt=[5 + i % 50, 9],
                                                                  max_tokens=120, temperature=0)
            return r.http_response.status_code, None
        except openai.APIStatusError as err:
            return err.status_code, err
    results = flood(app[0], one, 48)
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 503} and codes.count(503) >= 1, codes
    assert codes.count(200) >= _args(app[1]).max_batch_size, codes  # at least a batch was served
    err = next(e for c, e in results if c == 503)
    assert isinstance(err, openai.InternalServerError) and err.response.headers["retry-after"] == "1"
    # refused in the proxy by Serve's queue limit (or by the replica's own queue): no model work spent
    assert "dropped due to backpressure" in err.response.text or "overloaded" in err.message, err.response.text
