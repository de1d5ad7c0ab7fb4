"""Request migration: a generation stream whose Ingress replica dies goes on on another one
(pure; no Ray, no HTTP server here).

When an Ingress replica dies (SIGKILL, OOM, its node gone), Serve's proxy ends each of its
streams where it was: the client gets a truncated response. The proxy's admission gate
(`gate`) keeps, for each streamed completion, what the client has been sent (a `StreamLog`
of the server-sent events it let through) and, if the stream breaks, sends the same request
again with an `x-moe-resume` header: the response's id and creation time and the token ids the
client already has. The Ingress that takes it prefills the prompt and those tokens and goes on
generating after them, under the same id, without repeating anything the client has: the client
sees one whole stream. A request whose response had not begun (every non-streamed one until it
is done) is simply sent again.

Only what the gate can hand over exactly is migrated: one choice (`n` 1) of a streamed
completion or chat completion. Greedy decoding (temperature 0) continues exactly as the first
replica would have; sampled decoding continues from the same tokens with fresh randomness.
The header comes only from the gate (which drops any a client sends); an Ingress without the
gate in front validates it like a prompt, and it gives a client nothing a longer prompt would not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from moe_workers.serve.openai.protocol import RequestError

RESUME_HEADER = b"x-moe-resume"
MAX_MIGRATIONS = 2  # sends after the first one, per request
MAX_REPLAY_BYTES = 1 << 20  # a body larger than this is not kept for a second send
_PARAM = RESUME_HEADER.decode()


@dataclass
class Resume:
    """Where a migrated stream goes on: the response's id and creation time, the tokens the
    client has, and whether it also has the choice's finish (then only usage and [DONE] are left)."""

    id: str
    created: int
    token_ids: list[int]
    finished: bool = False

    def header(self) -> tuple[bytes, bytes]:
        return RESUME_HEADER, json.dumps({"id": self.id, "created": self.created, "token_ids": self.token_ids,
                                          "finished": self.finished}, separators=(",", ":")).encode()


def parse_resume(value: str, vocab: int, max_tokens: int) -> Resume:
    """The header's value, checked like a prompt: a 400 naming the header if it is not one."""
    try:
        got = json.loads(value)
    except ValueError:
        raise RequestError(400, f"{_PARAM}: not JSON", param=_PARAM) from None
    if not (isinstance(got, dict) and isinstance(got.get("id"), str) and type(got.get("created")) is int
            and isinstance(got.get("token_ids"), list) and type(got.get("finished", False)) is bool):
        raise RequestError(400, f"{_PARAM}: expected {{id: string, created: integer, token_ids: [integer], "
                           "finished: boolean}", param=_PARAM)
    tokens = got["token_ids"]
    if len(tokens) > max_tokens:
        raise RequestError(400, f"{_PARAM}: {len(tokens)} tokens already sent, more than the request's "
                           f"{max_tokens} new tokens", param=_PARAM)
    bad = [t for t in tokens if type(t) is not int or not 0 <= t < vocab]
    if bad:
        raise RequestError(400, f"{_PARAM}: token id {bad[0]!r} is outside the vocabulary [0, {vocab})", param=_PARAM)
    return Resume(got["id"], got["created"], tokens, got.get("finished", False))


def resumable(body: bytes) -> bool:
    """Whether a request body asks for what a migration can continue: one streamed choice."""
    try:
        req = json.loads(body)
    except ValueError:
        return False
    return isinstance(req, dict) and req.get("stream") is True and req.get("n", 1) == 1


class StreamLog:
    """What the client of one streamed completion has been sent, event by event.

    `feed` takes the response body as the Ingress sends it and gives back what may go on to the
    client now: whole events only (an event cut by a dying replica is never half sent), so the
    log always says exactly what the client has."""

    def __init__(self):
        self.pending = b""
        self.id: str | None = None
        self.created: int | None = None
        self.token_ids: list[int] = []
        self.finished = False  # the choice's finish_reason has been sent
        self.usage_sent = False
        self.done = False  # "data: [DONE]" has been sent

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self.pending = data
            return b""
        whole, self.pending = data[:end + 2], data[end + 2:]
        for event in whole.split(b"\n\n"):
            self._note(event.strip())
        return whole

    def _note(self, event: bytes) -> None:
        if not event.startswith(b"data:"):
            return
        data = event[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            return
        if self.id is None:
            self.id, self.created = chunk.get("id"), chunk.get("created")
        if chunk.get("usage"):
            self.usage_sent = True
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) == 0:
                self.token_ids.extend(choice.get("token_ids") or ())
                self.finished = self.finished or bool(choice.get("finish_reason"))

    def resume(self) -> Resume | None:
        """How to go on from here; None if the client got nothing the resume could name."""
        if self.id is None or self.created is None:
            return None
        return Resume(self.id, self.created, list(self.token_ids), self.finished)
