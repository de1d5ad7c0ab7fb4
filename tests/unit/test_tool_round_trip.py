"""A tool call's round trip per family, in process (the engine, no Ray): the family's published
template (tests/templates, written from the released ones) renders the tools as transformers'
apply_chat_template does; the engine, held by the call grammar, writes a call in the family's
convention that parses and fits the function's parameters; the call and its result go back
through the template (again as transformers renders them); and the answer to that equals
transformers' greedy tokens on the same checkpoint. gpt-oss's runs on a vocabulary with harmony's
special tokens, as the published one has them, and its generation_config.json's end ids. The
mixtral round trip runs served, through the openai client (tests/integration/test_openai_api.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
from tokenizers import AddedToken, Tokenizer

from checkpoints import make_family, reference_greedy
from moe_workers.model.sampling import SamplingParams
from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
from moe_workers.serve.openai.chat import ChatTemplate, write_tokenizer_config
from moe_workers.engine import GenerationRequest
from moe_workers.serve.openai.protocol import ChatMessage
from moe_workers.serve.openai.reasoning import HARMONY, reasoning_format, split
from moe_workers.serve.openai.structured import Grammars
from moe_workers.serve.openai.tools import markers, parse, tool_format

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two digits",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a", "b"], "additionalProperties": False}}}]


def _generate(path: Path, prompt: list[int], max_tokens: int, **kw) -> GenerationRequest:
    """One request through a fresh in-process engine on the checkpoint at `path`, to its end."""
    from test_engine_kv import _engine

    async def run():
        req = _engine(path).submit(GenerationRequest(prompt=prompt, max_tokens=max_tokens, **kw))
        while await req.out.get() is not None:
            pass
        assert req.error is None, req.error
        return req

    return asyncio.run(run())


def _transformers_render(path: Path, source: str, conversation: list[dict]) -> str:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    hf.chat_template = source
    return hf.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("family,template,arguments_as", [("qwen3_moe", "qwen3_tools.jinja", "object"),
                                                         ("deepseek_v3", "deepseek_v3_tools.jinja", "text")])
def test_a_tool_call_round_trip_in_the_family_convention(tmp_path, family, template, arguments_as):
    model = make_family(tmp_path, family, vocab_size=BYTE_VOCAB_SIZE, max_position_embeddings=2048)
    write_byte_tokenizer(tmp_path)
    source = (TEMPLATES / template).read_text()
    write_tokenizer_config(tmp_path, source)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    chat = ChatTemplate.from_checkpoint(tmp_path)
    ask = [{"role": "user", "content": "What is 2 + 3?"}]

    def ids(conversation):
        return tok.encode(chat.render([ChatMessage.model_validate(m) for m in conversation], tools=TOOLS),
                          add_special_tokens=False).ids

    # (DeepSeek-V3's published template renders no tool definitions: the prompt is the question)
    assert chat.render([ChatMessage.model_validate(m) for m in ask], tools=TOOLS) == _transformers_render(
        tmp_path, source, ask)
    grammars = Grammars(tmp_path / "tokenizer.json", BYTE_VOCAB_SIZE, model.config.eos_token_id, 1)
    fmt = tool_format(family)

    def run(prompt, max_tokens, **kw):
        return _generate(tmp_path, prompt, max_tokens, **kw).produced

    produced = run(ids(ask), 300, seed=1, sampling=SamplingParams(temperature=1.0),
                   constraint=grammars.tool_constraint(fmt, [TOOLS[0]["function"]], False))
    _, calls = parse(fmt, tok.decode(produced, skip_special_tokens=False))
    assert len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0]["function"]["parameters"])

    call = {"id": calls[0].id, "type": "function", "function": {"name": "add", "arguments": calls[0].arguments}}
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "5"}]
    theirs = [dict(m) for m in history]
    if arguments_as == "object":  # as transformers' docs pass them
        theirs[1] = {**history[1], "tool_calls": [{**call, "function": {
            "name": "add", "arguments": json.loads(calls[0].arguments)}}]}
    prompt = ids(history)
    text = tok.decode(prompt, skip_special_tokens=False)
    if arguments_as == "object":
        assert text == _transformers_render(tmp_path, source, theirs)
    else:  # transformers 5.25 cannot render this template's call (content None reads as undefined there)
        assert f"function<｜tool▁sep｜>add\n```json\n{calls[0].arguments}\n```<｜tool▁call▁end｜>" in text
        assert text.endswith("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>5<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    assert run(prompt, 5, stop_at_eos=False) == reference_greedy(model, prompt, 5)


def test_gpt_oss_calls_a_tool_in_harmony_and_its_call_token_ends_the_turn(tmp_path):
    from test_engine_kv import _engine

    tok = Tokenizer.from_file(str(write_byte_tokenizer(tmp_path)))
    tok.add_special_tokens([AddedToken(m, special=True) for m in dict.fromkeys(HARMONY + tuple(markers("harmony")))])
    tok.save(str(tmp_path / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ret, call_token = tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")
    model = make_family(tmp_path, "gpt_oss", vocab_size=vocab, max_position_embeddings=2048,
                        config_overrides={"eos_token_id": ret})
    # as published: config.json ends at <|return|>; generation_config.json at a tool call's <|call|> too
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ret, call_token]}))
    source = (TEMPLATES / "gpt_oss_tools.jinja").read_text()
    write_tokenizer_config(tmp_path, source)
    chat = ChatTemplate.from_checkpoint(tmp_path)
    ask = [{"role": "system", "content": "Answer with tools."}, {"role": "user", "content": "What is 2 + 3?"}]

    def render(conversation):
        return chat.render([ChatMessage.model_validate(m) for m in conversation], tools=TOOLS)

    def ids(conversation):
        return tok.encode(render(conversation), add_special_tokens=False).ids

    assert render(ask) == _transformers_render(tmp_path, source, ask)
    assert "type add = (_: {\na: number,\nb: number,\n}) => any;" in render(ask)

    def run(prompt, max_tokens, **kw):
        return _generate(tmp_path, prompt, max_tokens, **kw)

    # the model's own choice to call: <|call|> ends the turn as <|return|> does (forced here by a bias)
    assert _engine(tmp_path).cfg.eos_token_ids == (ret, call_token)
    biased = run(ids(ask), 8, sampling=SamplingParams(logit_bias=((call_token, 100.0),)))
    assert biased.produced == [call_token] and biased.finish_reason.value == "stop"

    grammars = Grammars(tmp_path / "tokenizer.json", vocab, ret, None)
    forced = run(ids(ask), 300, seed=2, sampling=SamplingParams(temperature=1.0),
                 constraint=grammars.tool_constraint("harmony", [TOOLS[0]["function"]], False))
    raw = tok.decode(forced.produced, skip_special_tokens=False)
    assert raw.startswith("<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"), raw
    assert forced.produced[-1] == call_token
    _, calls = parse("harmony", raw)
    assert len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0]["function"]["parameters"])
    # the call is neither reasoning nor answer
    fmt = reasoning_format(tok.get_vocab(with_added_tokens=True), "gpt_oss")
    assert split(fmt, ids(ask), forced.produced, lambda t: tok.decode(t, skip_special_tokens=False)) == ([], [])

    call = {"id": calls[0].id, "type": "function", "function": {"name": "add", "arguments": calls[0].arguments}}
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "5"}]
    theirs = [*history[:2], {**history[2], "tool_calls": [{**call, "function": {
        "name": "add", "arguments": json.loads(calls[0].arguments)}}]}, history[3]]
    prompt = ids(history)
    text = tok.decode(prompt, skip_special_tokens=False)
    assert text == _transformers_render(tmp_path, source, theirs)
    assert text.endswith(f"<|start|>assistant to=functions.add<|channel|>commentary json<|message|>"
                         f"{calls[0].arguments}<|call|><|start|>functions.add to=assistant<|channel|>commentary"
                         f'<|message|>"5"<|end|><|start|>assistant')
    assert run(prompt, 5, stop_at_eos=False).produced == reference_greedy(model, prompt, 5)
