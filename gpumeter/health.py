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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpumeter.clock import Clock
from gpumeter.errors import ConfigError

DEFAULT_MAX_SILENCE_SECONDS = 60.0
HEALTH_PATH = "/healthz"


@dataclass(frozen=True)
class Liveness:
    alive: bool
    silent_seconds: float
    max_silence_seconds: float

    def as_json(self) -> bytes:
        return json.dumps({"alive": self.alive, "silent_seconds": round(self.silent_seconds, 3),
                           "max_silence_seconds": self.max_silence_seconds}, sort_keys=True).encode()


class Heartbeat:
    """The time of the last ``beat()`` on ``clock``'s monotonic time. ``beat`` runs on the service's event loop and
    ``check`` on the HTTP server's thread: one float is written and read, atomically in CPython."""

    def __init__(self, clock: Clock, max_silence_seconds: float = DEFAULT_MAX_SILENCE_SECONDS) -> None:
        if not max_silence_seconds > 0:
            raise ConfigError(f"the liveness silence limit must be > 0 seconds, got {max_silence_seconds!r}")
        self._clock = clock
        self.max_silence_seconds = float(max_silence_seconds)
        self._last_beat_s = clock.monotonic_s()

    def beat(self) -> None:
        self._last_beat_s = self._clock.monotonic_s()

    def check(self) -> Liveness:
        silent = max(self._clock.monotonic_s() - self._last_beat_s, 0.0)
        return Liveness(silent <= self.max_silence_seconds, silent, self.max_silence_seconds)


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


__all__ = ["DEFAULT_MAX_SILENCE_SECONDS", "HEALTH_PATH", "Heartbeat", "Liveness", "health_wsgi_app"]
