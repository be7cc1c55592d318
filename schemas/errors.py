"""The wire format's errors, and the base of every error gpumeter raises on purpose.

They live here because the schema package imports nothing of gpumeter's (so any consumer can take ``schemas/``
alone); ``gpumeter.errors`` re-exports them, and every service catches them from there. ``InvalidMessage`` is the
single type for bad input: whatever raises it, the message is dead-lettered with ``reason_code`` and the service
carries on.
"""

from __future__ import annotations


class GpumeterError(Exception):
    """Base of every error gpumeter raises on purpose."""


class InvalidMessage(GpumeterError):
    """An input message that cannot be processed. ``reason_code`` is stable and machine-readable."""

    reason_code: str = "INVALID"

    def __init__(self, detail: str, *, reason_code: str | None = None) -> None:
        super().__init__(detail)
        if reason_code is not None:
            self.reason_code = reason_code

    @property
    def detail(self) -> str:
        return str(self.args[0])


class UnknownSchema(InvalidMessage):
    """The single-object header names a schema fingerprint no registry entry has."""

    reason_code = "UNKNOWN_SCHEMA"


class TruncatedMessage(InvalidMessage):
    """Fewer bytes than the header or the body needs."""

    reason_code = "TRUNCATED"


class CorruptMessage(InvalidMessage):
    """Bytes that are not a valid encoding: bad magic, undecodable body, trailing bytes."""

    reason_code = "CORRUPT"


class WrongRecordType(InvalidMessage):
    """A valid message of another record type than the consumer reads."""

    reason_code = "WRONG_RECORD_TYPE"


class SchemaEncodeError(GpumeterError):
    """A record that does not fit its schema on the way out: a bug in the producer, never input."""
