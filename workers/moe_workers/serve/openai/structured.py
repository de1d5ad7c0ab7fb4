"""Structured output: a request's `response_format` compiled to a grammar once and cached, and one
matcher a sequence that says, token by token, which tokens may come next (llguidance; pure: no
Ray, no HTTP here).

Why llguidance: `bench/structured.py` measures it beside xgrammar (vLLM's default) on the same
schemas and a 152k-token vocabulary: a mask in 53-99 us (median) against 78-1,459, a schema
compiled in about 30 ms against 54-168; and it has no dependencies (xgrammar needs transformers
and triton in the worker image).

What is allowed between JSON tokens is bounded (`WHITESPACE`: one optional space, or a new line
and an indent of up to 32 spaces or tabs), so that a weak model cannot loop on whitespace until
max_tokens, while pretty-printed JSON still fits. A schema keyword llguidance does not implement
is a 400 naming it (`response_format.json_schema.schema: unsupported: Unimplemented keys: ["if"]`).
A sequence whose grammar is complete ends there (finish_reason "stop"); one cut by max_tokens
ends with what it has (finish_reason "length": not whole JSON), as in vLLM.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from moe_workers.serve.openai.protocol import RequestError, ResponseFormat

WHITESPACE = r"(\n[ \t]{0,32}|[ ]?)"
CACHE_SIZE = 256  # compiled grammars kept (least recently used goes)
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object, as OpenAI's JSON mode gives


class Constraint:
    """One sequence's grammar state: the tokens allowed next, advanced by each token chosen."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self._bits = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """A (vocab,) bool mask of the tokens that may come next."""
        # what llguidance.torch.fill_next_token_bitmask does, without importing that module
        # (it sets up torch.compile on import)
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        return unpack_bits(self._bits, self.vocab)[0]

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not fit the response format: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of sequence may follow."""
        return self.matcher.is_stopped()


def unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, words) int32 bitmasks, bit i of word w for token 32w + i, as (rows, vocab) bools."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()


class Grammars:
    """The checkpoint's tokenizer as llguidance sees it (built at the first structured request) and
    the grammars compiled from response formats, cached by their JSON."""

    def __init__(self, tokenizer_path: Path | None, vocab_size: int, eos_token_id: int | None,
                 bos_token_id: int | None = None):
        self.path, self.vocab, self.eos, self.bos = tokenizer_path, vocab_size, eos_token_id, bos_token_id
        self._tokenizer = None
        self._special_ids: dict[str, int] = {}  # the tokenizer's special added tokens (a grammar names them by id)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled since start (the rest came from the cache)

    def stats(self) -> dict:
        """Grammars compiled since start, and how many the cache holds now (at most CACHE_SIZE)."""
        return {"compiled": self.compiled, "cached": len(self._cache), "cache_size": CACHE_SIZE}

    def constraint(self, fmt: ResponseFormat | None) -> Constraint | None:
        """A fresh matcher for one sequence (None for plain text); a RequestError if the format
        cannot be served. Compiling can take milliseconds: call it off the event loop."""
        if fmt is None or fmt.type == "text":
            return None
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else ANY_OBJECT
        key = "json:" + json.dumps(schema, sort_keys=True, separators=(",", ":"))
        where = "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"

        def grammar():
            import llguidance
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})

        return self._constraint(key, grammar, where, "response_format")

    def tool_constraint(self, fmt: str, functions: list[dict], parallel: bool) -> Constraint:
        """A matcher that holds the completion to tool calls of `functions` in the family's
        convention `fmt` (serve/openai/tools.py), their arguments to each one's parameters."""
        from moe_workers.serve.openai.tools import call_grammar, markers

        key = "tools:" + json.dumps([fmt, functions, parallel], sort_keys=True, separators=(",", ":"))

        def grammar():
            import llguidance
            special = {m: self._special_ids[m] for m in markers(fmt) if m in self._special_ids}
            return llguidance.LLMatcher.grammar_from_lark(call_grammar(fmt, functions, parallel, special, WHITESPACE))

        return self._constraint(key, grammar, "tools", "tools")

    def _constraint(self, key: str, grammar, where: str, param: str) -> Constraint:
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
            else:
                proto = self._compile(grammar, where, param)
                self._cache[key] = proto
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            return Constraint(proto.deep_copy(), self.vocab)

    def _compile(self, grammar, where: str, param: str):
        import llguidance

        tokenizer = self._llg_tokenizer()
        try:
            text = grammar()
        except (ValueError, TypeError) as err:  # a value llguidance cannot read (protocol.py refuses those it knows)
            raise RequestError(400, f"{where}: unsupported: {err}", param=param) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if failed:
            raise RequestError(400, f"{where}: unsupported: {messages[0]}", param=param)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise RequestError(400, f"{where}: unsupported: {matcher.get_error()}", param=param)
        self.compiled += 1
        return matcher

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            if self.path is None or not Path(self.path).is_file():
                raise RequestError(400, "response_format: this checkpoint has no tokenizer.json, which structured "
                                   "output needs", param="response_format")
            import llguidance
            from tokenizers import AddedToken, Tokenizer

            # the model's end and start of sequence are never text inside JSON, even where the
            # tokenizer does not mark them special (then "</s>" would be five allowed characters)
            tok = Tokenizer.from_file(str(self.path))
            names = [tok.id_to_token(i) for i in (self.eos, self.bos) if i is not None]
            tok.add_special_tokens([AddedToken(n, special=True) for n in names if n is not None])
            self._tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=self.vocab, eos_token=self.eos)
            # llguidance holds every added token apart from text, special or not (Qwen's <tool_call>
            # is not): a grammar can only name such a token by its id
            self._special_ids = {t.content: i for i, t in tok.get_added_tokens_decoder().items()
                                 if self._tokenizer.is_special_token(i)}
        return self._tokenizer
