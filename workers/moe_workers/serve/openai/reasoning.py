"""A reasoning model's thinking apart from its answer, token by token (pure: no engine, no HTTP).

Two conventions, both marked by single tokens of the vocabulary, so the split is made on token
ids as they come (a stream needs no look-ahead, and text that merely looks like a tag is text):
- think tags (Qwen3, DeepSeek-R1, QwQ): what lies between `<think>` and `</think>` is reasoning.
  A chat template that opens the tag itself (DeepSeek-R1's ends the generation prompt with
  `<think>\\n`) leaves the prompt inside thinking: the completion starts as reasoning.
- harmony (gpt-oss): messages `<|start|>{header}<|channel|>{channel}<|message|>{body}<|end|>`,
  ended by `<|return|>` or `<|call|>`; the `analysis` channel is reasoning, `final` the answer,
  `commentary` (a preamble) the answer too; a message addressed to a function (`to=functions.f`)
  is a tool call, which serve/openai/tools.py reads: neither side. Headers and channel names are neither.

The markers themselves are dropped; everything else goes to exactly one side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class ReasoningFormat:
    kind: str  # "think" or "harmony"
    ids: dict[str, int]  # marker -> token id


def reasoning_format(vocab: dict[str, int], family: str | None) -> ReasoningFormat | None:
    """The convention a checkpoint's vocabulary (with its added tokens) marks, or None."""
    if family == "gpt_oss" and all(m in vocab for m in HARMONY):
        return ReasoningFormat("harmony", {m: vocab[m] for m in HARMONY})
    if THINK_OPEN in vocab and THINK_CLOSE in vocab:
        return ReasoningFormat("think", {THINK_OPEN: vocab[THINK_OPEN], THINK_CLOSE: vocab[THINK_CLOSE]})
    return None


class Splitter:
    """Routes one choice's tokens: `route(token)` is REASONING, CONTENT, or None for a marker
    or a header token (dropped)."""

    def __init__(self, fmt: ReasoningFormat, prompt: list[int], decode: Callable[[list[int]], str]):
        self.fmt, self.decode = fmt, decode
        self._by_id = {i: m for m, i in fmt.ids.items()}
        if fmt.kind == "think":
            opened = [t for t in prompt if t in self._by_id]
            self.side = REASONING if opened and self._by_id[opened[-1]] == THINK_OPEN else CONTENT
        else:
            # the generation prompt ends with "<|start|>assistant": the model writes a header next
            last = max((k for k, t in enumerate(prompt) if t in self._by_id), default=None)
            self.state = "header" if last is not None and self._by_id[prompt[last]] == "<|start|>" else "body"
            self.header: list[int] = []  # the current message's role header ("assistant to=functions.f")
            self.channel: list[int] = []  # and its channel ("commentary to=functions.f json")
            self.side: str | None = CONTENT

    def route(self, token: int) -> str | None:
        marker = self._by_id.get(token)
        if self.fmt.kind == "think":
            if marker == THINK_OPEN:
                self.side = REASONING
                return None
            if marker == THINK_CLOSE:
                self.side = CONTENT
                return None
            return self.side
        if marker is None:
            if self.state == "header":
                self.header.append(token)
            elif self.state == "channel":
                self.channel.append(token)
            return self.side if self.state == "body" else None
        if marker == "<|channel|>":
            self.state = "channel"
        elif marker == "<|message|>":
            channel = self.decode(self.channel).split()  # e.g. "commentary to=functions.f json"
            addressed = "to=" in self.decode(self.header) or any(w.startswith("to=") for w in channel)
            # a message to a function is a tool call (serve/openai/tools.py reads it), neither side
            self.side = None if addressed else REASONING if channel[:1] == ["analysis"] else CONTENT
            self.state = "body"
        elif marker == "<|start|>":
            self.state, self.header, self.channel = "header", [], []
        else:  # <|end|>, <|return|>, <|call|>
            self.state = "between"
        return None


def split(fmt: ReasoningFormat, prompt: list[int], tokens: list[int],
          decode: Callable[[list[int]], str]) -> tuple[list[int], list[int]]:
    """(reasoning tokens, content tokens) of a whole completion."""
    splitter = Splitter(fmt, prompt, decode)
    sides: dict[str | None, list[int]] = {REASONING: [], CONTENT: [], None: []}
    for tok in tokens:
        sides[splitter.route(tok)].append(tok)
    return sides[REASONING], sides[CONTENT]
