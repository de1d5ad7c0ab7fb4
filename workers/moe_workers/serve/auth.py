"""API keys for the OpenAI API (pure; no HTTP server here).

Keys reach the Ingress as SHA-256 digests in its user_config, never in clear (the Serve config
is readable on the Ray dashboard), so a changed set of keys applies in place, without a restart.
A request's `Authorization: Bearer <key>` is hashed and compared with every digest in constant
time. The key itself is never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


ANONYMOUS = "-"  # the key id of a request that sent no key


def key_id(authorization: str | None) -> str:
    """A short id for the key an Authorization header carries (the first 8 hex of its digest, which
    the operator's Secret digests begin with too; never the key), ANONYMOUS without one: what
    routing statistics and anomaly alerts attribute expert-tokens to."""
    scheme, _, key = (authorization or "").partition(" ")
    return key_digest(key.strip())[:8] if scheme.lower() == "bearer" and key.strip() else ANONYMOUS


def parse_keys(text: str) -> list[str]:
    """Keys from a file or a Secret value: one per line; blank lines and `#` comments skipped."""
    keys = [line.strip() for line in text.splitlines()]
    return [k for k in keys if k and not k.startswith("#")]


def digests(text: str) -> list[str]:
    return sorted({key_digest(k) for k in parse_keys(text)})


def authorized(authorization: str | None, allowed: list[str]) -> bool:
    """Whether an Authorization header carries one of the keys whose digests are `allowed`."""
    scheme, _, key = (authorization or "").partition(" ")
    presented = key_digest(key.strip()) if scheme.lower() == "bearer" and key.strip() else "-"
    match = False
    for d in allowed:  # every digest compared, whatever matched
        match |= hmac.compare_digest(presented, d)
    return match
