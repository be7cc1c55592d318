"""Typed errors. Every library error that crosses a gpumeter boundary is wrapped in one of these.

``InvalidMessage`` is the single type for bad input: whatever raises it, the message is dead-lettered by
``gpumeter.deadletter`` with ``reason_code`` and the service carries on.
"""

from __future__ import annotations


from schemas.errors import (  # noqa: F401 - re-exported: the one place services import errors from
    CorruptMessage,
    GpumeterError,
    InvalidMessage,
    SchemaEncodeError,
    TruncatedMessage,
    UnknownSchema,
    WrongRecordType,
)


class ConfigError(GpumeterError):
    """Settings that cannot be used: a bad flag, env value or file."""


class OutOfRange(InvalidMessage):
    """A decodable record whose values cannot be true (negative memory, used > total, ...)."""

    reason_code = "OUT_OF_RANGE"


class InvalidName(InvalidMessage):
    """A name, namespace, label, resource name or id whose syntax Kubernetes (or NVML) never produces: forged or
    broken input, refused before it reaches a ledger, a report, a log line or an alert."""

    reason_code = "INVALID_NAME"


class LateMessage(InvalidMessage):
    """A record for a window that has already been closed and emitted."""

    reason_code = "LATE"


