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


class SettingError(ConfigError):
    """One setting's value cannot be used (or a required one is missing). Names the setting's flag and environment
    variable(s), the value (already redacted when the setting is secret) and, when known, where it came from."""

    def __init__(self, *, setting: str, flag: str | None, env: tuple[str, ...], value: object, reason: str,
                 source: str | None = None) -> None:
        self.setting = setting
        self.flag = flag
        self.env = env
        self.value = value
        self.reason = reason
        self.source = source
        named = [*([flag] if flag else []), *env]
        names = " / ".join(named) or setting
        where = f" (from {source})" if source and len(named) > 1 else ""
        shown = "" if value is None else f" = {value!r}"
        super().__init__(f"{names}{shown}{where}: {reason}")


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




class ClockSkew(InvalidMessage):
    """A record refused because of its node's clock rather than of its contents: stamped by a clock that
    disagrees with the broker's in a way the attributor could not correct (``gpumeter.clockskew``: the node's
    clock moved and its new offset is not confirmed yet)."""

    reason_code = "CLOCK_SKEW"
