"""Status timestamps: written as Kubernetes writes them, read back to the second."""

from __future__ import annotations

import re

from moe_workers.rfc3339 import format_rfc3339, parse_rfc3339


def test_a_time_is_written_in_utc_to_the_second_and_read_back():
    t = 1_796_300_645.75
    text = format_rfc3339(t)
    assert text == "2026-12-03T12:24:05Z"
    assert parse_rfc3339(text) == 1_796_300_645.0


def test_now_is_the_default():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", format_rfc3339())


def test_offsets_and_naive_times_are_read_as_the_same_instant():
    assert parse_rfc3339("2026-12-03T13:24:05+01:00") == parse_rfc3339("2026-12-03T12:24:05Z")
    assert parse_rfc3339("2026-12-03T12:24:05") == parse_rfc3339("2026-12-03T12:24:05Z")


def test_nothing_written_reads_as_none():
    assert parse_rfc3339(None) is None and parse_rfc3339("") is None
