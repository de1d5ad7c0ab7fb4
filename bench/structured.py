"""Structured output's grammar engines side by side: llguidance (what the Ingress uses,
serve/openai/structured.py) and xgrammar (vLLM's default), on the same schemas and the same
vocabulary, against the sampling step they sit in.

    python bench/structured.py                     # vocabulary 151,936 (Qwen3's size), 3 schemas
    python bench/structured.py --vocab 32000

No hub tokenizer can be downloaded here, so the vocabulary is synthetic and byte-level, of the
published size: the 256 byte tokens, then tokens of 2-10 characters drawn from English-like text,
digits and JSON punctuation (a space prefix on a third of them), seeded. What a mask costs grows
with the vocabulary and with how many tokens a grammar state allows, so the walk is a
schema-valid answer written one byte token at a time (strings included, where nearly every token
is allowed). Each engine compiles each schema afresh (its cache off), then walks the same
tokens: a mask for the state, the token consumed. Reference: the batched sampling step of one
row at this vocabulary (temperature and top_p), the work a mask is added to.

Figures: mask-us-<engine>-<schema> (median microseconds a mask), compile-ms-<engine>-<schema>,
xgrammar-over-llguidance-mask-<schema>, mask-over-sampling-<schema> (llguidance's mask over the
sampling step). xgrammar is not a dependency: without it installed, only llguidance runs
(pip install xgrammar).

`--only engine`: what the agent features cost a decode step, in the engine (in process, no
Ray) on one Qwen3-30B-A3B layer at its published dimensions (hidden 2048, 128 experts of 768,
top-8, bf16) with the published vocabulary (151,936: embeddings and lm_head at full size; the
synthetic tokenizer above): batch-16 decode of 32 tokens, each side in turn over 3 rounds,
medians. structured-tps-ratio: tokens/s with every sequence held to a JSON schema (the order
schema; temperature 1) over the same sampling without; penalties-tps-ratio: repetition,
presence and frequency penalties on (2,048-token prompts) over off. schema-compile-ms-first /
-cached: a 20-property schema's first constraint and a cached one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from figures import report

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workers"))

from moe_workers.model.sampling import SamplingParams, sample_batch  # noqa: E402
from moe_workers.serve.openai.protocol import ResponseFormat  # noqa: E402
from moe_workers.serve.openai.structured import WHITESPACE, Grammars  # noqa: E402

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                                 "email": {"type": "string", "format": "email"}},
                "required": ["name", "age"], "additionalProperties": False},
               {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}, "note": {"type": ["string", "null"]}},
        "required": ["id", "items", "status"], "additionalProperties": False},
              {"id": "ABC-1234", "items": [{"sku": "kettle", "qty": 2, "price": 19.5},
                                           {"sku": "mug", "qty": 6, "price": 4.25}],
               "status": "paid", "note": None}),
    "json-object": ({"type": "object"}, {"tool": "search", "args": {"q": "mixture of experts", "k": 5}}),
}
EOS = 2


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["masks", "engine"], default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "structured.json"))
    return ap.parse_args()


def byte_vocab(size: int) -> list[str]:
    """GPT-2 byte-level token strings: <unk> <s> </s>, the 256 bytes, then synthetic words."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    space = alphabet[sorted(pre_tokenizers.ByteLevel.alphabet()).index("Ġ")] if "Ġ" in alphabet else "Ġ"
    rng = random.Random(0)
    pieces = list("etaoinshrdlucmfwypvbgkjqxz") * 4 + list("ETAOINSHR0123456789") + list('{}[]":,._-/ ')
    seen = {"<unk>", "<s>", "</s>", *alphabet}
    vocab = ["<unk>", "<s>", "</s>", *alphabet]
    while len(vocab) < size:
        word = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 10))).replace(" ", space)
        if rng.random() < 0.33:
            word = space + word
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    return vocab


def write_tokenizer(directory: Path, vocab: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def walk_tokens(tokenizer_path: Path, answer: dict) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path)).encode(json.dumps(answer, separators=(",", ":"))).ids


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def run_llguidance(path: Path, vocab: int, schema: dict, tokens: list[int], compiles: int) -> dict:
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "b", "schema": schema}})
    compile_s = []
    for _ in range(compiles):
        grammars = Grammars(path, vocab, EOS, 1)
        grammars._llg_tokenizer()  # the tokenizer is built once per replica, not per schema
        t0 = time.perf_counter()
        c = grammars.constraint(fmt)
        compile_s.append(time.perf_counter() - t0)
    masks = []
    for tok in tokens:
        t0 = time.perf_counter()
        allowed = c.allowed()
        masks.append(time.perf_counter() - t0)
        assert allowed[tok], f"llguidance refused token {tok}"
        c.advance(tok)
    return {"compile_ms": statistics.median(compile_s) * 1e3, "mask_us": median_us(masks),
            "mask_p90_us": sorted(masks)[int(0.9 * len(masks))] * 1e6}


def run_xgrammar(vocab_strings: list[str], schema: dict, tokens: list[int], compiles: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    from moe_workers.serve.openai.structured import unpack_bits

    info = xgr.TokenizerInfo(vocab_strings, xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab_strings),
                             stop_token_ids=[EOS])
    compile_s = []
    for _ in range(compiles):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=32)
        compile_s.append(time.perf_counter() - t0)
    matcher = xgr.GrammarMatcher(compiled)
    bits = xgr.allocate_token_bitmask(1, len(vocab_strings))
    masks = []
    for tok in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bits)
        allowed = unpack_bits(bits, len(vocab_strings))[0]  # to the same bool mask the sampler takes
        masks.append(time.perf_counter() - t0)
        assert allowed[tok], f"xgrammar refused token {tok}"
        assert matcher.accept_token(tok)
    return {"compile_ms": statistics.median(compile_s) * 1e3, "mask_us": median_us(masks),
            "mask_p90_us": sorted(masks)[int(0.9 * len(masks))] * 1e6}


def sampling_step_us(vocab: int) -> float:
    logits = torch.randn(1, vocab) * 4  # peaked like a model's (bench/sampling.py's): top_p settles among candidates
    p = [SamplingParams(temperature=0.8, top_p=0.95)]
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        sample_batch(logits, p)
        times.append(time.perf_counter() - t0)
    return median_us(times[5:])


TWENTY = {"type": "object", "additionalProperties": False, "required": [f"f{i}" for i in range(0, 20, 2)],
          "properties": {f"f{i}": [{"type": "string", "maxLength": 16}, {"type": "integer", "minimum": 0},
                                   {"enum": ["a", "b", "c"]}, {"type": "boolean"},
                                   {"type": "array", "items": {"type": "number"}, "maxItems": 4}][i % 5]
                         for i in range(20)}}


def engine_figures(tmp: Path, rounds: int) -> tuple[dict, dict]:
    """structured-tps-ratio, penalties-tps-ratio, schema-compile-ms at one Qwen3-30B-A3B layer."""
    import asyncio

    from engine import engine_for
    from moe_workers.model import published
    from moe_workers.model.random_init import write_random_checkpoint
    from moe_workers.model.sampling import SamplingParams
    from moe_workers.engine import GenerationRequest

    vocab = published.VOCAB_SIZES["qwen3-30b-a3b"]
    model = tmp / "qwen3"
    write_random_checkpoint(model, "qwen3_moe", vocab_size=vocab, dtype=torch.bfloat16, max_position_embeddings=4096,
                            overrides=published.overrides("qwen3-30b-a3b", num_layers=1))
    write_tokenizer(model, byte_vocab(vocab))
    grammars = Grammars(model / "tokenizer.json", vocab, EOS, 1)
    grammars._llg_tokenizer()  # built once a replica, at its first structured request
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "o", "schema":
                                                                                  SCHEMAS["order"][0]}})
    twenty = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "t", "schema": TWENTY}})
    t0 = time.perf_counter()
    grammars.constraint(twenty)
    first = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    grammars.constraint(twenty)
    cached = (time.perf_counter() - t0) * 1e3
    engine = engine_for(model, blocks=16 * 2200 // 16 + 64, max_batch=16, budget=4096)
    g = torch.Generator().manual_seed(0)
    long = [torch.randint(300, vocab, (2048,), generator=g).tolist() for _ in range(16)]
    short = [torch.randint(300, vocab, (8,), generator=g).tolist() for _ in range(16)]
    hot = SamplingParams(temperature=1.0)
    pen = SamplingParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)

    async def decode(prompts, params, constrained=False) -> float:
        """Tokens a second of a batch-16 decode, from the step after every prompt is in."""
        reqs = [engine.submit(GenerationRequest(prompt=p, max_tokens=33, stop_at_eos=False, seed=i, sampling=params,
                                                constraint=grammars.constraint(fmt) if constrained else None))
                for i, p in enumerate(prompts)]
        firsts = [await r.out.get() for r in reqs]
        assert None not in firsts
        t0 = time.perf_counter()
        n = 0
        for r in reqs:
            while await r.out.get() is not None:
                n += 1
        return n / (time.perf_counter() - t0)

    runs = {"plain": [], "structured": [], "no-penalties": [], "penalties": []}
    for _ in range(rounds):
        runs["plain"].append(asyncio.run(decode(short, hot)))
        runs["structured"].append(asyncio.run(decode(short, hot, constrained=True)))
        runs["no-penalties"].append(asyncio.run(decode(long, hot)))
        runs["penalties"].append(asyncio.run(decode(long, pen)))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"decode b16 tokens/s: plain {med['plain']:.1f}, structured {med['structured']:.1f}; "
          f"2k prompts: penalties off {med['no-penalties']:.1f}, on {med['penalties']:.1f}")
    return ({"engine_tps": runs, "schema_compile_ms": {"first": first, "cached": cached}},
            {"structured-tps-ratio": med["structured"] / med["plain"],
             "penalties-tps-ratio": med["penalties"] / med["no-penalties"],
             "schema-compile-ms-first": first, "schema-compile-ms-cached": cached})


def main() -> int:
    a = parse_args()
    vocab_strings = byte_vocab(a.vocab)
    results, figures = {"vocab": a.vocab, "whitespace": WHITESPACE, "schemas": {}}, {}
    with tempfile.TemporaryDirectory(prefix="moe-bench-structured-") as tmp:
        path = write_tokenizer(Path(tmp), vocab_strings)
        if a.only != "engine":  # first: torch's threads, busy after the engine's steps, slowed the masks 3x
            masks(a, path, vocab_strings, results, figures)
        if a.only != "masks":
            got, figs = engine_figures(Path(tmp), a.rounds)
            results.update(got)
            figures.update(figs)
    return report(a.out if a.only is None else a.out.replace(".json", f"-{a.only}.json"), results, figures, digits=3)


def masks(a, path: Path, vocab_strings: list[str], results: dict, figures: dict) -> None:
    step = sampling_step_us(a.vocab)
    results["sampling_step_us"] = step
    print(f"sampling step (1 row, temperature + top_p, vocab {a.vocab}): {step:.0f} us")
    for name, (schema, answer) in SCHEMAS.items():
        tokens = walk_tokens(path, answer)
        llg = run_llguidance(path, a.vocab, schema, tokens, a.compiles)
        xg = run_xgrammar(vocab_strings, schema, tokens, a.compiles)
        results["schemas"][name] = {"tokens": len(tokens), "llguidance": llg, "xgrammar": xg}
        figures[f"mask-us-llguidance-{name}"] = llg["mask_us"]
        figures[f"compile-ms-llguidance-{name}"] = llg["compile_ms"]
        figures[f"mask-over-sampling-{name}"] = llg["mask_us"] / step
        line = (f"{name:>12} ({len(tokens)} tokens): llguidance mask {llg['mask_us']:7.0f} us "
                f"(p90 {llg['mask_p90_us']:.0f}), compile {llg['compile_ms']:7.2f} ms")
        if xg is not None:
            figures[f"mask-us-xgrammar-{name}"] = xg["mask_us"]
            figures[f"compile-ms-xgrammar-{name}"] = xg["compile_ms"]
            figures[f"xgrammar-over-llguidance-mask-{name}"] = xg["mask_us"] / llg["mask_us"]
            line += (f"; xgrammar mask {xg['mask_us']:7.0f} us (p90 {xg['mask_p90_us']:.0f}), "
                     f"compile {xg['compile_ms']:7.2f} ms")
        print(line, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
