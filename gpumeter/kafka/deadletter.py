"""Moved: the dead letter of a bad message and the ``RawMessage`` a consumer received are transport-free and live in
``gpumeter.stream.deadletter``. This name stays for code written against the old place; new code imports from
there."""

from gpumeter.stream.deadletter import (  # noqa: F401
    REASON_MAX_BYTES,
    SOURCE_KEY_MAX_BYTES,
    RawMessage,
    cut_text,
    dead_letter_budget_bytes,
    dead_letter_for,
)

__all__ = ["REASON_MAX_BYTES", "SOURCE_KEY_MAX_BYTES", "RawMessage", "cut_text", "dead_letter_budget_bytes",
           "dead_letter_for"]
