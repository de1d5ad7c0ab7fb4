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
        self.stop_found: str | None = None  # the stop sequence that ended it

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
        found = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not found:
            return None
        cut, self.stop_found = min(found)
        return cut

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
    """One chat choice's text as it comes: a reasoning model's thinking (serve/openai/reasoning.py's
    Splitter decides, token by token) in one stream, the answer, where stop sequences apply, in
    another; without a splitter, everything is the answer. With tools, the answer's text stops
    where a tool call begins (`tool_marker`, as text or as its single token id): the tokens after
    it are kept for serve/openai/tools.py to read at the end, and generation goes on."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], splitter=None,
                 tool_marker: str | None = None, tool_marker_id: int | None = None):
        self.content = TextStream(decode, stops + ([tool_marker] if tool_marker else []))
        self.reasoning = TextStream(decode, []) if splitter is not None else None
        self.splitter = splitter
        self.tool_marker, self.tool_marker_id = tool_marker, tool_marker_id
        self.calling = False  # a tool call has begun
        self.tokens: list[int] = []  # every token pushed, markers included

    @property
    def stopped(self) -> bool:
        """A stop sequence ended the answer (not a tool call's start)."""
        return self.content.stopped and not self.calling

    def push(self, token: int) -> tuple[str, str]:
        """(new answer text, new reasoning text) safe to send now."""
        self.tokens.append(token)
        side = self.splitter.route(token) if self.splitter is not None else "content"
        if self.calling or side is None:
            return "", ""
        if side == "reasoning":
            return ("", self.reasoning.push(token)) if not self.content.stopped else ("", "")
        if token == self.tool_marker_id:
            self.calling = True
            return self.content.finish(), ""
        text = self.content.push(token)
        if self.content.stopped and self.content.stop_found == self.tool_marker:
            self.calling = True
        return text, ""

    def finish(self) -> tuple[str, str]:
        return self.content.finish(), self.reasoning.finish() if self.reasoning is not None else ""
