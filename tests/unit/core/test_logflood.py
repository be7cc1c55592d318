"""The log-flood guard: repeats of one message template are capped per window, on the records' own times."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from gpumeter.logflood import RepeatedMessageFilter

REPO = Path(__file__).resolve().parents[3]


def _record(msg: str, created: float, *, name: str = "aiokafka", level: int = logging.ERROR,
            args: tuple = ()) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, msg, args, None)
    record.created = created
    return record


def test_repeats_beyond_the_burst_are_dropped_until_the_window_ends_then_counted():
    guard = RepeatedMessageFilter(burst=3, window_seconds=60.0)
    template = "Unable connect to node with id %s: %s"
    passed = [guard.filter(_record(template, 1000.0 + i * 0.01, args=(1, f"port {i}"))) for i in range(500)]
    assert passed == [True] * 3 + [False] * 497

    # Still inside the window (59.9 s after its start): dropped.
    assert not guard.filter(_record(template, 1059.9, args=(1, "x")))
    # The window is over: the next one passes and says how many were dropped; args are untouched.
    late = _record(template, 1060.0, args=(1, "refused"))
    assert guard.filter(late)
    assert late.getMessage() == "Unable connect to node with id 1: refused [498 more like this suppressed in the last 60 s]"
    # A fresh window: the burst is available again, without a note.
    again = _record(template, 1060.5, args=(1, "refused"))
    assert guard.filter(again) and again.getMessage() == "Unable connect to node with id 1: refused"


def test_templates_loggers_and_levels_are_counted_apart():
    guard = RepeatedMessageFilter(burst=1, window_seconds=10.0)
    assert guard.filter(_record("a %s", 0.0, args=(1,)))
    assert not guard.filter(_record("a %s", 0.1, args=(2,)))
    assert guard.filter(_record("b %s", 0.2, args=(1,)))
    assert guard.filter(_record("a %s", 0.3, args=(1,), name="aiokafka.producer.sender"))
    assert guard.filter(_record("a %s", 0.4, args=(1,), level=logging.WARNING))


def test_bookkeeping_stays_bounded_when_every_message_is_distinct():
    guard = RepeatedMessageFilter(burst=1, window_seconds=60.0, max_templates=100)
    for i in range(10_000):
        assert guard.filter(_record(f"preformatted message {i}", float(i) / 1000))
    assert len(guard._windows) <= 100


def test_expired_templates_are_forgotten_before_live_ones():
    guard = RepeatedMessageFilter(burst=1, window_seconds=1.0, max_templates=2)
    guard.filter(_record("old", 0.0))
    guard.filter(_record("live", 5.0))
    guard.filter(_record("new", 5.5))  # the table is full: "old" (expired) goes, "live" stays
    assert not guard.filter(_record("live", 5.6))


@pytest.mark.parametrize("burst,window", [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_nonsense_limits_are_refused(burst, window):
    with pytest.raises(ValueError):
        RepeatedMessageFilter(burst=burst, window_seconds=window)


FLOOD = (
    "log = logging.getLogger('aiokafka')\n"
    "for i in range(5000):\n"
    "    log.error('Unable connect to node with id %s: %s', 1, i)\n"
    "logging.getLogger('gpumeter').warning('a different message')\n"
)


def _stderr_lines_of_a_flood(logging_setup: str) -> list[str]:
    """Run ``logging_setup`` and then 5,000 identical aiokafka errors in a fresh interpreter; its stderr lines."""
    code = "import logging\n" + logging_setup + FLOOD
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()


def test_a_service_started_with_start_logging_caps_a_flood():
    """The entrypoint's logging set-up installs the guard: 5,000 identical errors print as 10 lines."""
    lines = _stderr_lines_of_a_flood(
        "from gpumeter.entrypoint import start_logging\n"
        "start_logging('collector', 'INFO', {})\n"
    )
    assert sum("Unable connect to node" in line for line in lines) == 10
    assert "a different message" in lines[-1]


def test_the_attributors_faust_worker_caps_a_flood_too():
    """Faust sets up its own logging; the attributor's worker puts the guard on the handlers Faust made."""
    lines = _stderr_lines_of_a_flood(
        "import asyncio, faust\n"
        "from services.attributor.app import AttributorWorker\n"
        "asyncio.set_event_loop(asyncio.new_event_loop())\n"
        "app = faust.App('flood-test', broker='kafka://127.0.0.1:9')\n"
        "AttributorWorker(app, loglevel='info', quiet=True, redirect_stdouts=False)._setup_logging()\n"
    )
    assert sum("Unable connect to node" in line for line in lines) == 10
    assert "a different message" in lines[-1]
