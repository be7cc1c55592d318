"""A dead letter always fits the producer's max request size, and says what it cut (``dead_letter_for``)."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from gpumeter.errors import CorruptMessage
from gpumeter.stream.deadletter import (
    REASON_MAX_BYTES,
    SOURCE_KEY_MAX_BYTES,
    RawMessage,
    cut_text,
    dead_letter_budget_bytes,
    dead_letter_for,
)
from schemas.records import DeadLetter
from schemas.typed import codec_for


@settings(max_examples=60, deadline=None)
@given(
    value_bytes=st.integers(0, 3 << 20),
    key_bytes=st.none() | st.integers(0, 8192),
    reason_chars=st.integers(0, 20_000),
    max_request=st.integers(64 << 10, 4 << 20),
    topic=st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=249),
)
def test_the_dead_letter_fits_keeps_a_prefix_and_identifies_the_whole(value_bytes, key_bytes, reason_chars,
                                                                     max_request, topic):
    value = bytes(i % 251 for i in range(value_bytes))
    key = None if key_bytes is None else b"k" * key_bytes
    reason = "é" * reason_chars  # two UTF-8 bytes each
    letter = dead_letter_for(RawMessage(topic, 1, 7, key, value), CorruptMessage(reason), "guard", 1,
                             max_request_size_bytes=max_request)
    encoded = codec_for(DeadLetter).encode(letter)
    assert len(encoded) + len(topic.encode()) <= dead_letter_budget_bytes(max_request)
    assert codec_for(DeadLetter).decode(encoded) == letter
    assert value.startswith(letter.raw_bytes)
    assert (letter.payload_length_bytes, letter.payload_sha256) == (value_bytes, hashlib.sha256(value).hexdigest())
    assert len(letter.reason.encode()) <= REASON_MAX_BYTES
    if key is None:
        assert (letter.source_key, letter.source_key_length_bytes) == (None, -1)
    else:
        assert (letter.source_key, letter.source_key_length_bytes) == (key[:SOURCE_KEY_MAX_BYTES], key_bytes)
    cut = (len(letter.raw_bytes) < value_bytes or (key_bytes or 0) > SOURCE_KEY_MAX_BYTES
           or 2 * reason_chars > REASON_MAX_BYTES)
    assert letter.truncated is cut
    # Only what does not fit is cut: a value that fits beside the rest is kept whole.
    if value_bytes <= dead_letter_budget_bytes(max_request) - 16 * 1024:
        assert letter.raw_bytes == value


def test_a_long_reason_is_cut_on_a_character_boundary_and_says_how_much():
    text, cut = cut_text("ab€" * 3000, 100)
    assert cut and len(text.encode()) <= 100
    assert text.endswith(f"[{9000 - len(text.split(' ... ')[0])} more characters cut]")
    assert cut_text("short", 100) == ("short", False)
