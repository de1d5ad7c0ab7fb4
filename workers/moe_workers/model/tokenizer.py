"""A byte-level tokenizer.json (256 byte tokens + <unk>, <s>, </s>): any text round-trips."""

from __future__ import annotations

from pathlib import Path

BYTE_VOCAB_SIZE = 259


def write_byte_tokenizer(directory: str | Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return path
