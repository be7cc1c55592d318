"""Liveness: whether a service's main loop is still going round.

A process that answers HTTP is not necessarily alive: its event loop can be blocked, or its consumer loop stuck
on a call that never returns, while the metrics server (a thread of its own) keeps answering. Each service's loop
calls ``Heartbeat.beat()`` every time it goes round — a collector tick, a consumer fetch (empty ones included), a
retry pause (waiting for Kafka or the ledger on purpose is alive), the attributor's one-second timer — and
``/healthz``, served next to ``/metrics`` by ``gpumeter.metrics.ServiceMetrics.serve``, answers 200 while the last
beat is younger than ``max_silence_seconds`` and 503 with the silence otherwise. A Kubernetes liveness probe on
``/healthz`` then restarts a stuck process, not merely a dead one.

The start counts as a beat, so a service is alive while it starts (Faust's table recovery can take a while; the
attributor's timer beats during it).

A loop that beats is not necessarily getting anywhere: one that retries the same record forever (a record the
producer refuses, an outbox that is never acknowledged) beats on every retry pause. So each loop also reports its
**progress**: ``Heartbeat.progress(name, position, waiting)`` with where it is on its input (the oldest
unacknowledged record of an outbox, the offsets a consumer has taken) and whether anything is waiting behind that
position (records unacknowledged, input not yet read). A position that has not moved while something was waiting,
for longer than ``max_stall_seconds``, is a stall: ``/healthz`` answers 503 and names it. Retrying is not progress;
a quiet topic (nothing waiting) is not a stall. The stall limit is longer than the silence limit because an outage
of a dependency (a broker restart, a database failover) is waited out on purpose for a while; beyond
``DEFAULT_MAX_STALL_SECONDS`` a restart is what an operator wants to see (and what a liveness probe does).

A loop that makes progress is not necessarily doing its job either: one whose input has turned bad (a producer
writing another schema, a clock far off) dead-letters most of it and carries on. That is no reason to restart it
(the restarted process would dead-letter the same input), so it does not touch liveness; but ``/healthz`` says
so: each consumer counts its recent inputs and how many of them were dead-lettered (``DeadLetterWindow``, the
runner reports every message, ``gpumeter.stream.runner``), and when more than ``max_ratio`` of the inputs of the
last ``window_seconds`` were dead-lettered, at least ``min_inputs`` of them, the body's ``status`` is
``degraded`` with the ratio -- as arroyo's ``DlqLimit`` judges a consumer by its invalid-message ratio. The HTTP
status stays 200 while the loop is alive: the liveness probe restarts only a process that is stuck.
"""

from __future__ import annotations

import json
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Mapping

from gpumeter.clock import Clock
from gpumeter.errors import ConfigError

DEFAULT_MAX_SILENCE_SECONDS = 60.0
DEFAULT_MAX_STALL_SECONDS = 300.0
DEFAULT_DEAD_LETTER_WINDOW_SECONDS = 300.0
DEFAULT_DEAD_LETTER_MAX_RATIO = 0.1
DEFAULT_DEAD_LETTER_MIN_INPUTS = 100
HEALTH_PATH = "/healthz"
STATUS_OK = "ok"
STATUS_DEGRADED = "degraded"
STATUS_UNHEALTHY = "unhealthy"
# The window is kept as this many buckets of window_seconds / _BUCKETS each: memory and work per input are constant
# whatever the input rate, and the window's edge is exact to one bucket.
_BUCKETS = 60


@dataclass(frozen=True)
class Liveness:
    """``stalled``: each loop whose position has not moved while input waited longer than the limit, with for how
    long (seconds)."""

    alive: bool
    silent_seconds: float
    max_silence_seconds: float
    stalled: Mapping[str, float] = field(default_factory=dict)
    max_stall_seconds: float = DEFAULT_MAX_STALL_SECONDS

    def as_json(self) -> bytes:
        return json.dumps({"alive": self.alive, "silent_seconds": round(self.silent_seconds, 3),
                           "max_silence_seconds": self.max_silence_seconds,
                           "stalled": {name: round(seconds, 3) for name, seconds in sorted(self.stalled.items())},
                           "max_stall_seconds": self.max_stall_seconds}, sort_keys=True).encode()


@dataclass(frozen=True)
class DeadLetterRate:
    """The recent inputs of a consumer and how many were dead-lettered: ``ratio`` is ``dead_letters /
    inputs`` (0 without input, at most 1); ``degraded`` when it is above ``max_ratio`` over at least
    ``min_inputs`` inputs of the last ``window_seconds``."""

    inputs: int
    dead_letters: int
    window_seconds: float
    max_ratio: float
    min_inputs: int

    @property
    def ratio(self) -> float:
        return min(self.dead_letters / self.inputs, 1.0) if self.inputs else 0.0

    @property
    def degraded(self) -> bool:
        return self.inputs >= self.min_inputs and self.ratio > self.max_ratio

    def as_dict(self) -> dict:
        return {"ratio": round(self.ratio, 6), "inputs_count": self.inputs, "dead_letters_count": self.dead_letters,
                "window_seconds": self.window_seconds, "max_ratio": self.max_ratio, "min_inputs": self.min_inputs}


class DeadLetterWindow:
    """Inputs and dead letters of the last ``window_seconds`` on ``clock``'s monotonic time (module doc).
    ``record`` runs on the service's loop and ``rate`` on the HTTP server's thread (and at a scrape): a lock keeps
    the buckets whole between them."""

    def __init__(self, clock: Clock, window_seconds: float = DEFAULT_DEAD_LETTER_WINDOW_SECONDS,
                 max_ratio: float = DEFAULT_DEAD_LETTER_MAX_RATIO,
                 min_inputs: int = DEFAULT_DEAD_LETTER_MIN_INPUTS) -> None:
        if not (isinstance(window_seconds, (int, float)) and math.isfinite(window_seconds) and window_seconds > 0):
            raise ConfigError(f"the dead-letter window must be > 0 seconds, got {window_seconds!r}")
        if not (isinstance(max_ratio, (int, float)) and 0 <= max_ratio < 1):
            raise ConfigError(f"the dead-letter ratio limit must be >= 0 and < 1, got {max_ratio!r}")
        if isinstance(min_inputs, bool) or not isinstance(min_inputs, int) or min_inputs < 1:
            raise ConfigError(f"the dead-letter minimum input count must be an integer >= 1, got {min_inputs!r}")
        self._clock = clock
        self.window_seconds = float(window_seconds)
        self.max_ratio = float(max_ratio)
        self.min_inputs = min_inputs
        self._bucket_s = self.window_seconds / _BUCKETS
        self._buckets: deque[list[int]] = deque()  # [bucket number, inputs, dead letters], oldest first
        self._lock = threading.Lock()

    def _expire(self, now_bucket: int) -> None:
        while self._buckets and self._buckets[0][0] <= now_bucket - _BUCKETS:
            self._buckets.popleft()

    def record(self, inputs: int = 1, dead_letters: int = 0) -> None:
        """``inputs`` messages came in now, ``dead_letters`` of those seen (now or before) were dead-lettered."""
        bucket = math.floor(self._clock.monotonic_s() / self._bucket_s)
        with self._lock:
            if self._buckets and self._buckets[-1][0] == bucket:
                last = self._buckets[-1]
                last[1] += inputs
                last[2] += dead_letters
            else:
                self._buckets.append([bucket, inputs, dead_letters])
                self._expire(bucket)

    def rate(self) -> DeadLetterRate:
        bucket = math.floor(self._clock.monotonic_s() / self._bucket_s)
        with self._lock:
            self._expire(bucket)
            inputs = sum(b[1] for b in self._buckets)
            dead = sum(b[2] for b in self._buckets)
        return DeadLetterRate(inputs, dead, self.window_seconds, self.max_ratio, self.min_inputs)


@dataclass(frozen=True)
class _Progress:
    position: Hashable
    # Since when the position has stood still with input waiting (monotonic seconds); None: nothing waiting.
    waiting_since_s: float | None


class Heartbeat:
    """The time of the last ``beat()`` on ``clock``'s monotonic time. ``beat`` runs on the service's event loop and
    ``check`` on the HTTP server's thread: one float is written and read, atomically in CPython."""

    def __init__(self, clock: Clock, max_silence_seconds: float = DEFAULT_MAX_SILENCE_SECONDS,
                 max_stall_seconds: float = DEFAULT_MAX_STALL_SECONDS) -> None:
        if not max_silence_seconds > 0:
            raise ConfigError(f"the liveness silence limit must be > 0 seconds, got {max_silence_seconds!r}")
        if not max_stall_seconds > 0:
            raise ConfigError(f"the liveness stall limit must be > 0 seconds, got {max_stall_seconds!r}")
        self._clock = clock
        self.max_silence_seconds = float(max_silence_seconds)
        self.max_stall_seconds = float(max_stall_seconds)
        self._last_beat_s = clock.monotonic_s()
        self._progress: dict[str, _Progress] = {}

    def beat(self) -> None:
        self._last_beat_s = self._clock.monotonic_s()

    def progress(self, name: str, position: Hashable, waiting: bool) -> None:
        """Loop ``name`` is at ``position`` on its input (any value that changes when it moves on) and ``waiting``
        says whether input is waiting behind that position. Call it as often as the loop goes round (and from its
        retry pauses): a stall is measured from the first report of a position with input waiting."""
        previous = self._progress.get(name)
        if not waiting:
            since = None
        elif previous is not None and previous.waiting_since_s is not None and previous.position == position:
            since = previous.waiting_since_s
        else:
            since = self._clock.monotonic_s()
        self._progress[name] = _Progress(position, since)

    def check(self) -> Liveness:
        now = self._clock.monotonic_s()
        silent = max(now - self._last_beat_s, 0.0)
        stalled = {name: now - p.waiting_since_s for name, p in list(self._progress.items())
                   if p.waiting_since_s is not None and now - p.waiting_since_s > self.max_stall_seconds}
        return Liveness(silent <= self.max_silence_seconds and not stalled, silent, self.max_silence_seconds,
                        stalled, self.max_stall_seconds)


def health_body(liveness: Liveness, dead_letters: DeadLetterRate | None) -> bytes:
    """The ``/healthz`` JSON: the liveness fields, ``status`` (``ok``, ``degraded``: alive but dead-lettering
    more than the limit of its recent input, ``unhealthy``: not alive) and, with a window, ``dead_letters``."""
    document = json.loads(liveness.as_json())
    status = STATUS_OK if liveness.alive else STATUS_UNHEALTHY
    if dead_letters is not None:
        document["dead_letters"] = dead_letters.as_dict()
        if liveness.alive and dead_letters.degraded:
            status = STATUS_DEGRADED
    document["status"] = status
    return json.dumps(document, sort_keys=True).encode()


def health_wsgi_app(heartbeat: Heartbeat, fallback, dead_letters: DeadLetterWindow | None = None):
    """A WSGI app answering ``/healthz`` from ``heartbeat`` (200 alive, 503 not; a JSON body either way, with the
    recent dead-letter rate of ``dead_letters``: degraded is said in the body, the HTTP status is liveness's) and
    handing every other path to ``fallback`` (the Prometheus exposition)."""

    def app(environ, start_response):
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return fallback(environ, start_response)
        liveness = heartbeat.check()
        body = health_body(liveness, None if dead_letters is None else dead_letters.rate())
        start_response("200 OK" if liveness.alive else "503 Service Unavailable",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


__all__ = ["DEFAULT_DEAD_LETTER_MAX_RATIO", "DEFAULT_DEAD_LETTER_MIN_INPUTS", "DEFAULT_DEAD_LETTER_WINDOW_SECONDS",
           "DEFAULT_MAX_SILENCE_SECONDS", "DEFAULT_MAX_STALL_SECONDS", "DeadLetterRate", "DeadLetterWindow",
           "HEALTH_PATH", "Heartbeat", "Liveness", "STATUS_DEGRADED", "STATUS_OK", "STATUS_UNHEALTHY", "health_body",
           "health_wsgi_app"]
