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
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import parse_qs

from gpumeter import config
from gpumeter.clock import Clock, SystemClock
from gpumeter.config import between, describe, greater_than, integer, load, non_empty, number, setting, validate
from gpumeter.entrypoint import start_logging, stop_on
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.metrics import ServiceMetrics
from gpumeter.redact import mask_url
from gpumeter.settings import metrics_address_setting
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

    ledger_url: str = setting(DEFAULT_LEDGER_URL, env=LEDGER_URL_ENV, flag="--ledger-url", check=non_empty,
                              secret=True, mask=mask_url, help="SQLAlchemy URL of the ledger")
    metrics_port: int = setting(DEFAULT_PORT, env="GPUMETER_METRICS_PORT", flag=("--port", "--metrics-port"),
                                parse=integer, check=between(1, 65535),
                                help="HTTP port of /allocation, /healthz and /metrics (the API cannot be disabled)")
    address: str = metrics_address_setting("address /allocation, /healthz and /metrics listen on")
    max_window_days: int = setting(DEFAULT_MAX_WINDOW_DAYS, env="GPUMETER_API_MAX_WINDOW_DAYS",
                                   flag="--max-window-days", parse=integer, check=between(1, 3660), help="the longest query window")
    max_steps: int = setting(DEFAULT_MAX_STEPS, env="GPUMETER_API_MAX_STEPS", flag="--max-steps", parse=integer,
                             check=between(1, 100_000), help="the most allocation sets per query")
    ledger_retry_max_seconds: float = 30.0
    duration_seconds: float | None = setting(None, flag="--duration", parse=number, check=greater_than(0),
                                             help="stop after this many seconds", default_text="until SIGTERM/SIGINT")
    log_level: str = setting("INFO", env="GPUMETER_LOG_LEVEL", flag="--log-level",
                             help="DEBUG | INFO | WARNING | ERROR")

    def __post_init__(self) -> None:
        validate(self)
        if self.ledger_retry_max_seconds <= 0:
            raise ConfigError("the ledger retry backoff must be > 0 seconds")

    def describe(self) -> dict[str, Any]:
        return describe(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser, ApiSettings)


def api_settings(args: argparse.Namespace, env: Mapping[str, str]) -> ApiSettings:
    """``load(ApiSettings, args, env)``: flags over env over defaults; ``ConfigError`` for anything unusable."""
    return load(ApiSettings, args, env)


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
