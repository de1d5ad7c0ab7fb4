"""Generated tokens to text, with stop sequences (pure; no HTTP, no engine here).

A `TextStream` takes one choice's tokens as they come and gives the text to send: decoded from
all tokens so far (a multi-byte character split across tokens is sent once it is whole), cut at
the first stop sequence (which is not sent), and holding back the end of the text while it could
still be the start of a stop sequence, so a stream never sends text that a stop later removes.
"""

from __future__ import annotations

from typing import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text already given out
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; the new text that is safe to send now ("" while it may still be a stop)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest of it
            return ""
        self.text = text
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            self.text = text[:cut]
            return self._take(cut)
        return self._take(len(text) - self._held_back(text))

    def finish(self) -> str:
        """At the end of generation: whatever was held back (no stop can complete any more)."""
        if self.stopped:
            return ""
        self.text = self.decode(self.tokens)  # an incomplete sequence at the end stays as U+FFFD
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def _first_stop(self) -> int | None:
        # only text after what was sent can hold a new stop; a stop may start inside held-back text
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        found = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """How many characters at the end of `text` could begin a stop sequence."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


class ChoiceText:
    """One chat choice's text as it comes: a reasoning model's thinking (serve/reasoning.py's
    Splitter decides, token by token) in one stream, the answer, where stop sequences apply, in
    another; without a splitter, everything is the answer."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], splitter=None):
        self.content = TextStream(decode, stops)
        self.reasoning = TextStream(decode, []) if splitter is not None else None
        self.splitter = splitter
        self.count = 0  # tokens pushed, markers included

    @property
    def stopped(self) -> bool:
        return self.content.stopped

    def push(self, token: int) -> tuple[str, str]:
        """(new answer text, new reasoning text) safe to send now."""
        self.count += 1
        side = self.splitter.route(token) if self.splitter is not None else "content"
        if side == "content":
            return self.content.push(token), ""
        if side == "reasoning" and not self.content.stopped:
            return "", self.reasoning.push(token)
        return "", ""

    def finish(self) -> tuple[str, str]:
        return self.content.finish(), self.reasoning.finish() if self.reasoning is not None else ""
