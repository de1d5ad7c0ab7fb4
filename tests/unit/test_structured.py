"""Structured output (serve/openai/structured.py): response formats compiled to grammars with llguidance,
the mask applied in the batched sampling step, and what the engine produces on a random-weight
model: every sampled completion parses and validates against its schema (jsonschema)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
from tokenizers import pre_tokenizers

from checkpoints import make_family
from moe_workers.model.sampling import SamplingParams, sample_batch
from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
from moe_workers.engine import FinishReason, GenerationRequest
from moe_workers.serve.openai.protocol import JsonSchema, RequestError, ResponseFormat
from moe_workers.serve.openai import structured
from moe_workers.serve.openai.structured import Grammars, unpack_bits

EOS = 2
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "mood": {"enum": ["calm", "glad", "odd"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["name", "age", "mood"], "additionalProperties": False}


def _fmt(schema=None, kind="json_schema") -> ResponseFormat:
    if kind != "json_schema":
        return ResponseFormat(type=kind)
    return ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})


@pytest.fixture
def grammars(tmp_path):
    return Grammars(write_byte_tokenizer(tmp_path), BYTE_VOCAB_SIZE, EOS, 1)


def test_unpack_bits_reads_bit_i_of_word_w_as_token_32w_plus_i():
    bits = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    got = unpack_bits(bits, 64)[0]
    assert got.nonzero().flatten().tolist() == [0, 2, 63]
    assert unpack_bits(bits, 40).shape == (1, 40)


def test_sampled_tokens_under_the_mask_always_make_valid_json(grammars):
    """200 draws at temperature 1.3 over random logits, every row of a batch its own matcher."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(grammars.path))
    gen = torch.Generator().manual_seed(0)
    texts = []
    for batch in range(10):
        cons = [grammars.constraint(_fmt(SCHEMA)) for _ in range(20)]
        live = list(range(20))
        out = [[] for _ in range(20)]
        p = SamplingParams(temperature=1.3, top_p=0.95)
        while live:
            logits = torch.randn(len(live), BYTE_VOCAB_SIZE, generator=gen) * 3
            toks = sample_batch(logits, [p] * len(live), [None] * len(live),
                                allowed=[cons[i].allowed() for i in live])
            for i, t in zip(list(live), toks):
                assert t != EOS or cons[i].matcher.is_accepting()
                cons[i].advance(t)
                out[i].append(t)
                if cons[i].done or t == EOS:
                    live.remove(i)
        texts += [tok.decode([t for t in o if t != EOS]) for o in out]
    assert grammars.compiled == 1  # compiled once, 200 matchers from the cache
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert not re.search(r"\s{34,}", text)  # whitespace between tokens is bounded
    assert len(set(texts)) > 150  # they are samples, not one answer


def test_json_object_is_any_object_and_unsupported_keywords_are_named(grammars):
    c = grammars.constraint(_fmt(kind="json_object"))
    allowed = c.allowed()
    assert allowed[3 + sorted(pre_tokenizers.ByteLevel.alphabet()).index("{")]  # the byte tokenizer's id of "{"
    assert allowed.sum() <= 6  # "{" and a little whitespace: an object must start
    assert grammars.constraint(_fmt(kind="text")) is None and grammars.constraint(None) is None
    with pytest.raises(RequestError) as info:
        grammars.constraint(_fmt({"type": "object", "if": {"required": ["a"]}, "then": {}}))
    assert info.value.param == "response_format" and "if" in info.value.message
    assert info.value.message.startswith("response_format.json_schema.schema: unsupported")


def test_a_schema_value_the_compiler_cannot_read_is_a_400_not_a_crash(grammars):
    """protocol.py refuses integers past 64 bits in a schema; one that gets past it (a format built
    without validation) is still a 400 naming response_format, not llguidance's ValueError."""
    fmt = ResponseFormat.model_construct(type="json_schema", json_schema=JsonSchema.model_construct(
        name="t", schema_={"type": "number", "minimum": -(2**63) - 1}))
    with pytest.raises(RequestError) as info:
        grammars.constraint(fmt)
    assert info.value.status == 400 and info.value.param == "response_format"
    assert info.value.message.startswith("response_format.json_schema.schema: unsupported")


def test_the_grammar_cache_keeps_the_most_recently_used_and_no_more(grammars, monkeypatch):
    """Every new schema a client sends is a compiled grammar (megabytes for some): the cache holds
    CACHE_SIZE of them whatever the traffic, the least recently used going first."""
    monkeypatch.setattr(structured, "CACHE_SIZE", 4)
    fmts = [_fmt({"type": "string", "maxLength": n}) for n in range(1, 11)]
    for fmt in fmts[:4]:
        grammars.constraint(fmt)
    grammars.constraint(fmts[0])  # used again: now the most recent
    for fmt in fmts[4:]:
        grammars.constraint(fmt)
        assert grammars.stats()["cached"] <= 4
    assert grammars.stats() == {"compiled": 10, "cached": 4, "cache_size": 4}
    grammars.constraint(fmts[9])  # still cached
    assert grammars.compiled == 10
    grammars.constraint(fmts[0])  # went when six newer ones came
    assert grammars.compiled == 11


def test_a_checkpoint_without_tokenizer_json_says_so(tmp_path):
    with pytest.raises(RequestError, match="no tokenizer.json"):
        Grammars(None, BYTE_VOCAB_SIZE, EOS).constraint(_fmt(SCHEMA))


def test_the_engine_holds_random_weight_models_to_the_schema_in_a_mixed_batch(tmp_path):
    """A random qwen3_moe with the byte vocabulary: 200 sampled completions under the schema beside
    unconstrained ones in the same steps; each ends when its JSON is whole, and validates."""
    from tokenizers import Tokenizer

    from test_engine_kv import _engine
    make_family(tmp_path, "qwen3_moe", vocab_size=BYTE_VOCAB_SIZE)
    grammars = Grammars(write_byte_tokenizer(tmp_path), BYTE_VOCAB_SIZE, EOS)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))

    async def main():
        engine = _engine(tmp_path)
        reqs, plain = [], []
        for wave in range(4):  # 50 at a time: the engine's wait queue holds 64
            batch = []
            with engine.scheduler.lock:
                for i in range(50 * wave, 50 * (wave + 1)):
                    batch.append(engine.submit(GenerationRequest(
                        prompt=[5 + i % 7, 40, 41], max_tokens=200, seed=i, sampling=SamplingParams(temperature=1.0),
                        constraint=grammars.constraint(_fmt(SCHEMA)))))
                batch.append(engine.submit(GenerationRequest(prompt=[9, 9], max_tokens=30, stop_at_eos=False,
                                                             seed=wave, sampling=SamplingParams(temperature=1.0))))
            for r in batch:
                while await r.out.get() is not None:
                    pass
            reqs += batch[:-1]
            plain.append(batch[-1])
        return reqs, plain

    reqs, plain = asyncio.run(main())
    for r in reqs:
        assert r.error is None and r.finish_reason is FinishReason.STOP, (r.error, r.finish_reason)
        jsonschema.validate(json.loads(tok.decode(r.produced)), SCHEMA)
    assert all(len(r.produced) == 30 for r in plain)
    assert len({tuple(r.produced) for r in reqs}) > 190
