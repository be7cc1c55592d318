"""``gpumeter api``: a read-only HTTP API over the ledger, OpenCost-compatible ``GET /allocation``.

A role of its own, beside the billing service rather than in it: billing is a Kafka consumer whose loop must not
wait on queries, the API scales (and restarts) on its own, and it holds no Kafka client. It opens the ledger
read-only (the database refuses writes on its connections: ``Ledger(read_only=True)``), never migrates it (it
waits, with backoff, until billing has), and serves on one port -- one HTTP server per process -- ``/allocation``
(also at ``/model/allocation``, where OpenCost's UI asks), ``/healthz`` and ``/metrics``. The query and the answer
are ``services.billing.allocation``'s; ``gpumeter report`` and this API read the same ledger lines, so
``/allocation?aggregate=label:team&includeIdle=true`` adds up to ``gpumeter report --by label:team`` of the same
windows.

Answers: 200 with OpenCost's envelope; 400 ``{"code": 400, "message": ...}`` for a bad parameter (what is wrong and
what is allowed); 405 for anything but GET and HEAD; 404 for other paths; 503 while the ledger cannot be read. Query
windows are bounded (``max_window_days``, ``max_steps``). Exit codes: 0 after SIGTERM/SIGINT or ``--duration``, 2 for
unusable settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs

from gpumeter.clock import Clock, SystemClock
from gpumeter.entrypoint import start_logging, stop_on
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.metrics import ServiceMetrics
from gpumeter.redact import mask_url
from gpumeter.settings import (
    DEFAULT_METRICS_ADDRESS,
    METRICS_ADDRESS_ENV,
    add_metrics_address_argument,
    check_metrics_address,
)
from services.billing.allocation import (
    DEFAULT_MAX_STEPS,
    BadQuery,
    allocation_sets,
    error_response,
    parse_query,
    response,
)
from services.billing.ledger import DEFAULT_LEDGER_URL, LEDGER_URL_ENV, Ledger, LedgerError

log = logging.getLogger("gpumeter.api")

SERVICE_NAME = "api"
API_METRICS = ("gpumeter_api_requests_total", "gpumeter_api_request_seconds")
DEFAULT_PORT = 9003  # OpenCost's API port
DEFAULT_MAX_WINDOW_DAYS = 93
ALLOCATION_PATHS = ("/allocation", "/model/allocation")
_JSON = [("Content-Type", "application/json")]


@dataclass(frozen=True)
class ApiSettings:
    """Everything ``gpumeter api`` needs, validated once.

    * ``ledger_url`` (``GPUMETER_LEDGER_URL``): the ledger to read (read-only).
    * ``metrics_port`` (``GPUMETER_METRICS_PORT``, ``--port``; default 9003, OpenCost's) and ``address``
      (``GPUMETER_METRICS_ADDRESS``): where ``/allocation``, ``/healthz`` and ``/metrics`` are served, one port as
      every role serves its ``/metrics``.
    * ``max_window_days`` (``GPUMETER_API_MAX_WINDOW_DAYS``, default 93) and ``max_steps``
      (``GPUMETER_API_MAX_STEPS``, default 1000): the largest query window and number of allocation sets.
    * ``ledger_retry_max_seconds``: the longest wait between tries while the ledger is not ready.
    """

    ledger_url: str = field(default=DEFAULT_LEDGER_URL, repr=False)
    metrics_port: int = DEFAULT_PORT
    address: str = DEFAULT_METRICS_ADDRESS
    max_window_days: int = DEFAULT_MAX_WINDOW_DAYS
    max_steps: int = DEFAULT_MAX_STEPS
    ledger_retry_max_seconds: float = 30.0
    duration_seconds: float | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.ledger_url:
            raise ConfigError("the ledger URL is empty")
        if not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"API port {self.metrics_port} is not a TCP port (the API cannot be disabled)")
        object.__setattr__(self, "address", check_metrics_address(self.address))
        if not 1 <= self.max_window_days <= 3660:
            raise ConfigError("the API's largest query window must be 1 to 3660 days")
        if not 1 <= self.max_steps <= 100_000:
            raise ConfigError("the API's largest number of steps must be 1 to 100000")
        if self.ledger_retry_max_seconds <= 0:
            raise ConfigError("the ledger retry backoff must be > 0 seconds")
        if self.duration_seconds is not None and self.duration_seconds <= 0:
            raise ConfigError("duration must be > 0 seconds")

    def describe(self) -> dict[str, Any]:
        view = {f.name: getattr(self, f.name) for f in fields(self)}
        view["ledger_url"] = mask_url(self.ledger_url)
        return view


_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "ledger_url": (LEDGER_URL_ENV, str),
    "metrics_port": ("GPUMETER_METRICS_PORT", int),
    "address": (METRICS_ADDRESS_ENV, str),
    "max_window_days": ("GPUMETER_API_MAX_WINDOW_DAYS", int),
    "max_steps": ("GPUMETER_API_MAX_STEPS", int),
    "log_level": ("GPUMETER_LOG_LEVEL", str),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ledger-url", help=f"SQLAlchemy URL of the ledger (env {LEDGER_URL_ENV}, default "
                                             f"{DEFAULT_LEDGER_URL})")
    parser.add_argument("--port", "--metrics-port", dest="metrics_port", type=int,
                        help=f"HTTP port of /allocation, /healthz and /metrics (env GPUMETER_METRICS_PORT, default "
                             f"{DEFAULT_PORT})")
    add_metrics_address_argument(parser)
    parser.add_argument("--max-window-days", type=int, help="the longest query window (env "
                                                            f"GPUMETER_API_MAX_WINDOW_DAYS, default "
                                                            f"{DEFAULT_MAX_WINDOW_DAYS})")
    parser.add_argument("--max-steps", type=int, help="the most allocation sets per query (env GPUMETER_API_MAX_STEPS, "
                                                      f"default {DEFAULT_MAX_STEPS})")
    parser.add_argument("--duration", dest="duration_seconds", type=float, help="stop after this many seconds")
    parser.add_argument("--log-level", help="DEBUG | INFO | WARNING | ERROR")


def api_settings(args: argparse.Namespace, env: Mapping[str, str]) -> ApiSettings:
    """Settings from ``env`` with the flags in ``args`` on top; ``ConfigError`` for anything unusable."""
    values: dict[str, Any] = {}
    for name, (variable, convert) in _ENV.items():
        raw = env.get(variable)
        if raw:
            try:
                values[name] = convert(raw.strip())
            except ValueError as exc:
                raise ConfigError(f"{variable}={raw!r}: {exc}") from exc
    flags = {"ledger_url": "ledger_url", "metrics_port": "metrics_port", "address": "metrics_address",
             "max_window_days": "max_window_days", "max_steps": "max_steps", "duration_seconds": "duration_seconds",
             "log_level": "log_level"}
    for name, attribute in flags.items():
        value = getattr(args, attribute, None)
        if value is not None:
            values[name] = value
    return ApiSettings(**values)


# -- the WSGI app ---------------------------------------------------------------------------------------------


class AllocationApi:
    """The WSGI app: ``/allocation`` (and ``/model/allocation``) from ``ledger``, everything else to ``fallback``
    (the service's ``/healthz`` and ``/metrics``). Thread-safe: the ledger's engine pools connections."""

    def __init__(self, ledger: Ledger, fallback, *, clock: Clock, max_window_seconds: int, max_steps: int,
                 metrics: ServiceMetrics | None = None) -> None:
        self.ledger = ledger
        self.fallback = fallback
        self.clock = clock
        self.max_window_seconds = max_window_seconds
        self.max_steps = max_steps
        self.metrics = metrics

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO") or "/"
        if path not in ALLOCATION_PATHS:
            if path in ("/healthz", "/metrics"):
                return self.fallback(environ, start_response)
            return self._send(start_response, 404, error_response(404, f"no such path {path!r}; the API serves "
                                                                      "/allocation, /healthz and /metrics"), path)
        began = time.perf_counter()
        try:
            method = environ.get("REQUEST_METHOD", "GET")
            if method not in ("GET", "HEAD"):
                return self._send(start_response, 405, error_response(405, f"{method} is not allowed: the API is "
                                                                           "read-only (GET)"), path,
                                  [("Allow", "GET, HEAD")])
            try:
                params = _single_params(environ.get("QUERY_STRING", ""))
                query = parse_query(params, self.clock.now_ms(), max_window_seconds=self.max_window_seconds,
                                    max_steps=self.max_steps)
            except BadQuery as exc:
                return self._send(start_response, 400, error_response(400, str(exc)), path)
            try:
                body = self.answer(query)
            except LedgerError as exc:
                log.warning("cannot read the ledger: %s", exc)
                return self._send(start_response, 503, error_response(503, "the ledger cannot be read now"), path)
            return self._send(start_response, 200, body, path, head=method == "HEAD")
        finally:
            if self.metrics is not None:
                self.metrics.get("gpumeter_api_request_seconds").labels("/allocation").observe(
                    time.perf_counter() - began)

    def answer(self, query) -> dict[str, Any]:
        pods, buckets = self.ledger.allocation_sums(query)
        sets = allocation_sets(query, pods, buckets)
        policies = self.ledger.sharing_policies(start_ms=query.start_ms, end_ms=query.end_ms, cluster=query.cluster)
        bills = self.ledger.totals(start_ms=query.start_ms, end_ms=query.end_ms, cluster=query.cluster)
        return response(query, sets, policies=policies, bills_micro_usd=bills.bill_micro_usd)

    def _send(self, start_response, code: int, body: Mapping[str, Any], path: str, extra_headers=(), *,
              head: bool = False):
        payload = json.dumps(body, separators=(",", ":")).encode()
        status = {200: "200 OK", 400: "400 Bad Request", 404: "404 Not Found", 405: "405 Method Not Allowed",
                  503: "503 Service Unavailable"}[code]
        start_response(status, [*_JSON, ("Content-Length", str(len(payload))), *extra_headers])
        if self.metrics is not None:
            known = path if path in ALLOCATION_PATHS else "other"
            self.metrics.get("gpumeter_api_requests_total").labels(known, str(code)).inc()
        return [] if head else [payload]


def _single_params(query_string: str) -> dict[str, str]:
    parsed = parse_qs(query_string, keep_blank_values=True, strict_parsing=False, max_num_fields=50)
    repeated = sorted(name for name, values in parsed.items() if len(values) > 1)
    if repeated:
        raise BadQuery(f"parameter{'s' if len(repeated) > 1 else ''} given more than once: {', '.join(repeated)}")
    return {name: values[0] for name, values in parsed.items()}


# -- the process ----------------------------------------------------------------------------------------------


def main(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        settings = api_settings(args, env)
    except GpumeterError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    start_logging(SERVICE_NAME, settings.log_level, settings.describe())
    try:
        return asyncio.run(serve(settings, handle_signals=True))
    except KeyboardInterrupt:
        return 0


async def serve(settings: ApiSettings, *, stop: asyncio.Event | None = None, clock: Clock | None = None,
                handle_signals: bool = False, ready: threading.Event | None = None) -> int:
    """Wait until the ledger's schema is there, serve until ``stop`` (or SIGTERM/SIGINT, or the duration)."""
    stop = stop or asyncio.Event()
    clock = clock or SystemClock()
    stop_on(stop, handle_signals=handle_signals, duration_seconds=settings.duration_seconds)
    try:
        ledger = Ledger(settings.ledger_url, read_only=True)
    except LedgerError as exc:
        log.error("%s", exc)
        return 2
    metrics = ServiceMetrics(SERVICE_NAME, API_METRICS, clock=clock)
    try:
        delay = 0.5
        while not stop.is_set():
            try:
                await asyncio.to_thread(ledger.require_schema)
                break
            except LedgerError as exc:
                log.warning("ledger not ready, trying again in %.1f s: %s", delay, exc)
                metrics.beat()
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, settings.ledger_retry_max_seconds)
        if stop.is_set():
            return 0
        app = AllocationApi(ledger, metrics.wsgi_app(), clock=clock,
                            max_window_seconds=settings.max_window_days * 86_400, max_steps=settings.max_steps,
                            metrics=metrics)
        server = metrics.serve(settings.metrics_port, settings.address, app)
        assert server is not None
        log.info("serving /allocation on http://%s:%d for %r", settings.address, server.server_port, ledger)
        if ready is not None:
            ready.set()
        try:
            while not stop.is_set():
                metrics.beat()
                try:
                    await asyncio.wait_for(stop.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            server.shutdown()
            server.server_close()
        return 0
    finally:
        ledger.close()
