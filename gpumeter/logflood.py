"""Flood protection for the services' log output.

Why: while Kafka is unreachable, aiokafka logs the same "Unable connect to node" error hundreds of times a
second. That buries the lines an operator needs, costs log storage, and — once the reader of stderr falls behind
(a full pipe) — blocks the process's event loop inside ``write``. Collectors tick through an outage only if
their logging cannot stall them.

Contract: per (logger name, level, message template), at most ``burst`` records pass in each window of
``window_seconds``, measured on the records' own ``created`` times (no clock is read here). The first record of a
template that passes after a suppression says how many were dropped. Different templates never suppress each
other; the bookkeeping is bounded to ``max_templates`` entries.
"""

from __future__ import annotations

import logging
import threading

DEFAULT_BURST = 10
DEFAULT_WINDOW_SECONDS = 60.0
DEFAULT_MAX_TEMPLATES = 2048


class RepeatedMessageFilter(logging.Filter):
    """A handler filter implementing the module's contract. One instance per handler."""

    def __init__(self, burst: int = DEFAULT_BURST, window_seconds: float = DEFAULT_WINDOW_SECONDS,
                 max_templates: int = DEFAULT_MAX_TEMPLATES) -> None:
        super().__init__()
        if burst < 1 or window_seconds <= 0 or max_templates < 1:
            raise ValueError("burst, window_seconds and max_templates must be positive")
        self.burst = burst
        self.window_seconds = window_seconds
        self.max_templates = max_templates
        # template key -> [window start (record.created), records passed in the window, records suppressed]
        self._windows: dict[tuple[str, int, str], list] = {}
        self._lock = threading.Lock()  # Faust's consumer thread logs too

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        with self._lock:
            window = self._windows.get(key)
            if window is None or record.created - window[0] >= self.window_seconds:
                suppressed = window[2] if window is not None else 0
                if window is None and len(self._windows) >= self.max_templates:
                    self._forget_expired(record.created)
                self._windows[key] = [record.created, 1, 0]
                if suppressed:
                    record.msg = (f"{record.msg} [{suppressed} more like this suppressed in the last "
                                  f"{self.window_seconds:g} s]")
                return True
            if window[1] < self.burst:
                window[1] += 1
                return True
            window[2] += 1
            return False

    def _forget_expired(self, now_created: float) -> None:
        expired = [key for key, window in self._windows.items() if now_created - window[0] >= self.window_seconds]
        for key in expired:
            del self._windows[key]
        if len(self._windows) >= self.max_templates:
            # Every template is live (a library logging preformatted strings): start over rather than grow.
            self._windows.clear()


def guard_root_handlers(burst: int = DEFAULT_BURST, window_seconds: float = DEFAULT_WINDOW_SECONDS) -> None:
    """Give every handler of the root logger its own ``RepeatedMessageFilter`` and, after it (it needs the message
    template), a ``gpumeter.safetext.SafeTextFilter``: no flood, no secret, no control character in any service's
    log output. Once; calling again is a no-op."""
    from gpumeter.safetext import SafeTextFilter

    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RepeatedMessageFilter) for f in handler.filters):
            handler.addFilter(RepeatedMessageFilter(burst, window_seconds))
        if not any(isinstance(f, SafeTextFilter) for f in handler.filters):
            handler.addFilter(SafeTextFilter())


__all__ = ["RepeatedMessageFilter", "guard_root_handlers"]
