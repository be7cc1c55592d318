"""What the service entrypoints (``services/*/main.py``) do the same way: logging set up and the effective settings
printed once at start, and the ways a running service is asked to stop."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import logging
import signal
from typing import Any, Mapping

from gpumeter.logflood import guard_root_handlers

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

GC_GEN0_THRESHOLD = 10_000
"""Net allocations of container objects between two young-generation collections in a service process (CPython's
default: 700). A stream service holds a large long-lived state (the attributor's pods and open windows, the
guard's pods, billing's series) and allocates a few hundred objects per message; at 700 the young collections come
so often that the full collections they lead to, each a walk over all of that state, add up: taking in one
window of 250 nodes' ticks with 64,000 pods known, the attributor's engine spent 18 % of its CPU in the collector
at 700 and 6 % at 10,000 (docs/performance.md). The older generations keep CPython's thresholds: a full
collection still follows from enough young ones."""


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


def tune_garbage_collector() -> None:
    """Set the young generation's threshold to ``GC_GEN0_THRESHOLD`` (the others as they are). Call once, at start."""
    _gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def stop_on(stop: asyncio.Event, *, handle_signals: bool, duration_seconds: float | None) -> None:
    """Set ``stop`` on SIGINT/SIGTERM (``handle_signals``) and after ``duration_seconds`` (None: never). Call from
    the running event loop."""
    loop = asyncio.get_running_loop()
    if handle_signals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
    if duration_seconds is not None:
        loop.call_later(duration_seconds, stop.set)


__all__ = ["GC_GEN0_THRESHOLD", "LOG_FORMAT", "start_logging", "stop_on", "tune_garbage_collector"]
