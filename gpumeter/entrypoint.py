"""What the service entrypoints (``services/*/main.py``) do the same way: logging set up and the effective settings
printed once at start, and the ways a running service is asked to stop."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import signal
from typing import Any, Mapping

from gpumeter.logflood import guard_root_handlers

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def start_logging(service: str, log_level: str, description: Mapping[str, Any]) -> None:
    """Configure the root logger at ``log_level`` and print ``gpumeter <service> {settings}`` (secrets already
    masked by the settings' ``describe()``) as the first line of output. Repeated messages are rate-limited
    (``gpumeter.logflood``), control characters escaped and secrets masked (``gpumeter.safetext``), and a fatal
    signal dumps the Python stack to stderr (``faulthandler``)."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    guard_root_handlers()
    # A fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) still leaves a line and the Python stack on stderr
    # (a SQLite mapping that lost its file dies of SIGBUS inside C, past every exception handler).
    if not faulthandler.is_enabled():
        faulthandler.enable()
    print(f"gpumeter {service} " + json.dumps(description, sort_keys=True), flush=True)


def stop_on(stop: asyncio.Event, *, handle_signals: bool, duration_seconds: float | None) -> None:
    """Set ``stop`` on SIGINT/SIGTERM (``handle_signals``) and after ``duration_seconds`` (None: never). Call from
    the running event loop."""
    loop = asyncio.get_running_loop()
    if handle_signals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
    if duration_seconds is not None:
        loop.call_later(duration_seconds, stop.set)


__all__ = ["LOG_FORMAT", "start_logging", "stop_on"]
