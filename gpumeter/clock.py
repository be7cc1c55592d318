"""Clocks. Logic takes a ``Clock``; only entrypoints construct ``SystemClock``."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock time in ms since the Unix epoch (UTC)."""

    def monotonic_s(self) -> float:
        """Monotonic seconds, for measuring durations only."""


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic_s(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to; for tests, replay and the simulator."""

    def __init__(self, start_ms: int = 0) -> None:
        self._now_ms = start_ms

    def now_ms(self) -> int:
        return self._now_ms

    def monotonic_s(self) -> float:
        return self._now_ms / 1000.0

    def advance_ms(self, delta_ms: int) -> None:
        if delta_ms < 0:
            raise ValueError("a clock does not go back")
        self._now_ms += delta_ms

    def set_ms(self, now_ms: int) -> None:
        if now_ms < self._now_ms:
            raise ValueError("a clock does not go back")
        self._now_ms = now_ms


def iso_utc(unix_ms: int) -> str:
    """``2026-11-29T17:00:00Z`` (milliseconds shown only when not zero)."""
    moment = datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc)
    spec = "seconds" if unix_ms % 1000 == 0 else "milliseconds"
    return moment.isoformat(timespec=spec).replace("+00:00", "Z")
