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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Hashable, Mapping

from gpumeter.clock import Clock
from gpumeter.errors import ConfigError

DEFAULT_MAX_SILENCE_SECONDS = 60.0
DEFAULT_MAX_STALL_SECONDS = 300.0
HEALTH_PATH = "/healthz"


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


def health_wsgi_app(heartbeat: Heartbeat, fallback):
    """A WSGI app answering ``/healthz`` from ``heartbeat`` (200 alive, 503 not; a JSON body either way) and handing
    every other path to ``fallback`` (the Prometheus exposition)."""

    def app(environ, start_response):
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return fallback(environ, start_response)
        liveness = heartbeat.check()
        body = liveness.as_json()
        start_response("200 OK" if liveness.alive else "503 Service Unavailable",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


__all__ = ["DEFAULT_MAX_SILENCE_SECONDS", "DEFAULT_MAX_STALL_SECONDS", "HEALTH_PATH", "Heartbeat", "Liveness",
           "health_wsgi_app"]
