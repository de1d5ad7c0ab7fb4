"""Tool calls (serve/openai/tools.py): each family's convention read back from recorded completions, and
the grammar that forces a call, sampled over random logits under its mask for every convention
(markers as single special tokens, as in the published vocabularies, as added tokens that are not
special, as Qwen's <tool_call> is, and spelled out in text)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tokenizers import AddedToken, Tokenizer

from moe_workers.model.sampling import SamplingParams, sample_batch
from moe_workers.model.tokenizer import write_byte_tokenizer
from moe_workers.serve.openai.structured import Grammars
from moe_workers.serve.openai.text import ChoiceText
from moe_workers.serve.openai.tools import DS, cut_calls, markers, parse, start_marker, tool_format

FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}},
]
SCHEMAS = {f["name"]: f["parameters"] for f in FUNCTIONS}

RECORDED = {  # what each family's model writes (as its published template shows it), and the calls in it
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
               "Let me check.\n"),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]</s>', None),
    "deepseek": (f'{DS["calls_begin"]}{DS["call_begin"]}function{DS["sep"]}get_weather\n```json\n{{"city": "Paris"}}\n'
                 f'```{DS["call_end"]}\n{DS["call_begin"]}function{DS["sep"]}add\n```json\n{{"a": 1, "b": 2}}\n```'
                 f'{DS["call_end"]}{DS["calls_end"]}<｜end▁of▁sentence｜>', None),
    "harmony": ('<|channel|>analysis<|message|>Weather, then a sum.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
                '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a":1,"b":2}<|call|>', None),
}


@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_each_convention_reads_back_as_openai_tool_calls(fmt):
    raw, before = RECORDED[fmt]
    content, calls = parse(fmt, raw)
    assert content == before
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("add", {"a": 1, "b": 2})]
    out = calls[0].openai(index=0)
    assert out["type"] == "function" and out["id"].startswith("call_") and out["index"] == 0
    assert isinstance(out["function"]["arguments"], str)


def test_text_without_calls_or_with_broken_ones_stays_text():
    assert parse("hermes", "Just an answer.") == ("Just an answer.", [])
    assert parse("hermes", "<tool_call>\n{not json}\n</tool_call>") == ("<tool_call>\n{not json}\n</tool_call>", [])
    assert parse("mistral", "[TOOL_CALLS] [{") == ("[TOOL_CALLS] [{", [])
    assert parse("harmony", "<|channel|>final<|message|>Hi<|return|>") == (None, [])
    assert [tool_format(f) for f in ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe")] == [
        "hermes", "mistral", "deepseek", "harmony", "hermes"]


def _grammars(tmp_path, special: bool | str, eos="</s>"):
    """The byte tokenizer, with the convention's markers as added special tokens, as added tokens
    ("added": not special), or as text (False)."""
    tok = Tokenizer.from_file(str(write_byte_tokenizer(tmp_path)))
    if special:
        tok.add_tokens([AddedToken(m, special=special is True) for f in RECORDED for m in markers(f)])
    tok.save(str(tmp_path / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return tok, Grammars(tmp_path / "tokenizer.json", vocab, tok.token_to_id(eos), 1), vocab


@pytest.mark.parametrize("special", [True, "added", False], ids=["marker-tokens", "marker-added", "marker-text"])
@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_a_forced_call_is_always_one_that_parses_and_fits_its_parameters(tmp_path, fmt, special):
    tok, grammars, vocab = _grammars(tmp_path, special)
    gen = torch.Generator().manual_seed(0)
    for trial in range(6):
        parallel = trial % 2 == 0 and fmt != "harmony"
        c = grammars.tool_constraint(fmt, FUNCTIONS if trial < 4 else FUNCTIONS[1:], parallel)
        out = []
        while not c.done and len(out) < 600:
            logits = torch.randn(1, vocab, generator=gen) * 2
            t = sample_batch(logits, [SamplingParams(temperature=1.0)], allowed=[c.allowed()])[0]
            if t == grammars.eos:
                break
            c.advance(t)
            out.append(t)
        raw = tok.decode(out, skip_special_tokens=False)
        _, calls = parse(fmt, raw)
        assert calls, raw
        assert parallel or len(calls) == 1
        for call in calls:
            assert trial < 4 or call.name == "add"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert grammars.compiled == (2 if fmt == "harmony" else 4)  # per function set and parallel: compiled once


@pytest.mark.parametrize("special", [True, False], ids=["marker-token", "marker-text"])
def test_the_answer_stops_at_a_call_and_the_call_is_kept(tmp_path, special):
    tok, _, _ = _grammars(tmp_path, special)
    raw = "Sure.[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}]"
    ids = tok.encode(raw, add_special_tokens=False).ids
    marker = start_marker("mistral")
    marker_id = tok.token_to_id(marker)
    assert (marker_id is not None) == special  # the ingress passes the id when the vocabulary has one
    choice = ChoiceText(tok.decode, ["STOP"], None, marker, marker_id)
    text = "".join(choice.push(t)[0] for t in ids) + choice.finish()[0]
    assert text == "Sure." and choice.calling and not choice.stopped
    assert parse("mistral", tok.decode(choice.tokens, skip_special_tokens=False))[1][0].name == "add"


@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_a_call_cut_anywhere_keeps_the_whole_calls_and_the_arguments_written_so_far(fmt):
    """max_tokens cut a forced call: the calls before it whole, then the one being written with
    its arguments so far, never the markers that close it; nothing is dropped (it all was)."""
    raw, _ = RECORDED[fmt]
    raw = raw.split("<|im_end|>")[0].split("</s>")[0]
    _, calls = parse(fmt, raw)
    for n in range(len(raw) + 1):
        got = cut_calls(fmt, raw[:n], "add")
        assert got, raw[:n]
        for whole, want in zip(got[:-1], calls):  # the calls already written are whole
            assert (whole.name, json.loads(whole.arguments)) == (want.name, json.loads(want.arguments))
        last = got[-1]
        assert last.arguments in raw[:n] or any(_same_json(last.arguments, c.arguments) for c in calls), raw[:n]
        assert not any(m in last.arguments for m in markers(fmt) + ["```"]), (raw[:n], last.arguments)
        if last.arguments and len(got) <= len(calls):
            written = json.loads(calls[len(got) - 1].arguments)
            assert last.name in (calls[len(got) - 1].name, "add")
            try:
                assert json.loads(last.arguments) == written
            except ValueError:  # cut inside: a prefix of what the model wrote
                assert last.arguments.startswith("{")
    assert [(c.name, c.arguments) for c in cut_calls(fmt, "", "add")] == [("add", "")]  # cut before its marker
    assert cut_calls(fmt, "", None) == []  # tool_choice "required": no name to give


@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_a_forced_call_cut_at_every_token_reads_back_as_that_call(tmp_path, fmt):
    """The grammar's own output, cut after each token: one call of the named function, whose
    arguments only grow, and once whole fit its parameters."""
    tok, grammars, vocab = _grammars(tmp_path, True)
    gen = torch.Generator().manual_seed(1)
    c = grammars.tool_constraint(fmt, FUNCTIONS[1:], False)
    out = []
    while not c.done and len(out) < 600:
        t = sample_batch(torch.randn(1, vocab, generator=gen) * 2, [SamplingParams(temperature=1.0)],
                         allowed=[c.allowed()])[0]
        if t == grammars.eos:
            break
        c.advance(t)
        out.append(t)
    seen = ""
    for k in range(len(out) + 1):
        calls = cut_calls(fmt, tok.decode(out[:k], skip_special_tokens=False), "add")
        assert len(calls) == 1 and calls[0].name == "add"
        assert calls[0].arguments.startswith(seen) or _same_json(calls[0].arguments, seen), (seen, calls[0].arguments)
        seen = calls[0].arguments
    jsonschema.validate(json.loads(seen), SCHEMAS["add"])


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False
