"""``gpumeter api``: a read-only HTTP API over the ledger, OpenCost-compatible ``GET /allocation``.

A role of its own, beside the billing service rather than in it: billing is a Kafka consumer whose loop must not
wait on queries, the API scales (and restarts) on its own, and it holds no Kafka client. It opens the ledger
read-only (the database refuses writes on its connections: ``Ledger(read_only=True)``), never migrates it (it
waits, with backoff, until billing has), and serves on one port -- one HTTP server per process -- ``/allocation``
(also at ``/model/allocation``, where OpenCost's UI asks), ``/healthz`` and ``/metrics``. The query and the answer
are ``services.billing.allocation``'s; ``gpumeter report`` and this API read the same ledger lines, so
``/allocation?aggregate=label:team&includeIdle=true`` adds up to ``gpumeter report --by label:team`` of the same
windows.

Answers: 200 with OpenCost's envelope; 400 ``{"code": 400, "message": ...}`` for a bad query -- a bad parameter
(what is wrong and what is allowed), a parameter given twice, more than ``MAX_QUERY_FIELDS`` parameters; 401 with
``WWW-Authenticate: Bearer`` when a token file is set and the request carries no accepted token; 405 for anything
but GET and HEAD; 404 for other paths; 503 while the ledger (or the token file) cannot be read. Query windows are
bounded (``max_window_days``, ``max_steps``). Exit codes: 0 after SIGTERM/SIGINT or ``--duration``, 2 for unusable
settings (an unreadable or empty token file included).

Authentication (``token_file``, ``GPUMETER_API_TOKEN_FILE``): ``/allocation`` then needs ``Authorization: Bearer
<token>`` with one of the file's tokens (its non-empty lines: two during a rotation), compared in constant time.
The file is read at start and again whenever it changes (its modification time, size or inode, looked at on every
request: a Kubernetes Secret volume replaces the file), so a rotated token takes effect without a restart; a file
that cannot be read any more fails closed (503). ``/healthz`` and ``/metrics`` stay unauthenticated: the kubelet's
probes and Prometheus read them, and they hold no cost data (request counts and liveness only). Without a token
file every caller that reaches the port is answered: keep the port to trusted callers (the Helm chart's
NetworkPolicy).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import parse_qs

from gpumeter import config
from gpumeter.clock import Clock, SystemClock
from gpumeter.config import (
    between,
    describe,
    greater_than,
    integer,
    load,
    non_empty,
    number,
    path,
    setting,
    validate,
)
from gpumeter.entrypoint import start_logging, stop_on
from gpumeter.errors import ConfigError, GpumeterError
from gpumeter.metrics import ServiceMetrics
from gpumeter.redact import mask_url
from gpumeter.settings import metrics_address_setting
from services.billing import grain_reads
from services.billing.allocation import (
    DEFAULT_MAX_STEPS,
    BadQuery,
    allocation_sets,
    error_response,
    parse_query,
    response,
)
from services.billing.ledger import DEFAULT_LEDGER_URL, LEDGER_URL_ENV, Ledger, LedgerError, MinuteLinesDropped

log = logging.getLogger("gpumeter.api")

SERVICE_NAME = "api"
API_METRICS = ("gpumeter_api_requests_total", "gpumeter_api_request_seconds")
DEFAULT_PORT = 9003  # OpenCost's API port
DEFAULT_MAX_WINDOW_DAYS = 93
ALLOCATION_PATHS = ("/allocation", "/model/allocation")
MAX_QUERY_FIELDS = 50  # OpenCost's queries use a dozen at most; more is a mistake or an attempt to load the parser
AUTH_REALM = "gpumeter"
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
    * ``token_file`` (``GPUMETER_API_TOKEN_FILE``, ``--token-file``): the bearer tokens ``/allocation`` accepts, one
      per line (module doc); None: no authentication.
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
    token_file: Path | None = setting(None, env="GPUMETER_API_TOKEN_FILE", flag="--token-file", parse=path,
                                      default_text="none: no authentication",
                                      help="file of the bearer tokens /allocation accepts, one per line (re-read "
                                           "when it changes); /healthz and /metrics stay open")
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


# -- authentication -------------------------------------------------------------------------------------------


class TokenFileUnreadable(GpumeterError):
    """The token file cannot be read (any more): the API refuses ``/allocation`` until it can (fails closed)."""


class TokenFile:
    """The bearer tokens in ``path``: its non-empty lines, stripped. Read now (``ConfigError`` when the file cannot
    be read or holds no token: a start with authentication asked for and no token is a mistake) and again whenever
    its modification time, size or inode changes, looked at by every ``accepts``. Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        try:
            self._current()
        except TokenFileUnreadable as exc:
            raise ConfigError(str(exc)) from None
        if not self._tokens:
            raise ConfigError(f"token file {self.path} holds no token (one per line)")

    def _current(self) -> tuple[bytes, ...]:
        try:
            status = os.stat(self.path)
            stamp = (status.st_mtime_ns, status.st_size, status.st_ino)
            with self._lock:
                if stamp != self._stamp:
                    lines = self.path.read_bytes().splitlines()
                    self._tokens = tuple(line.strip() for line in lines if line.strip())
                    self._stamp = stamp
                    if not self._tokens:
                        log.warning("token file %s holds no token: every /allocation request is refused", self.path)
                return self._tokens
        except OSError as exc:
            raise TokenFileUnreadable(f"token file {self.path} cannot be read: {exc.strerror or exc}") from None

    def accepts(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the file's tokens, compared in constant time with each of them.
        Raises ``TokenFileUnreadable``."""
        accepted = False
        for token in self._current():
            accepted |= hmac.compare_digest(token, presented)
        return accepted


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case); None for no header or
    another scheme."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("utf-8", "surrogateescape")


# -- the WSGI app ---------------------------------------------------------------------------------------------


class AllocationApi:
    """The WSGI app: ``/allocation`` (and ``/model/allocation``) from ``ledger``, everything else to ``fallback``
    (the service's ``/healthz`` and ``/metrics``). Thread-safe: the ledger's engine pools connections."""

    def __init__(self, ledger: Ledger, fallback, *, clock: Clock, max_window_seconds: int, max_steps: int,
                 metrics: ServiceMetrics | None = None, tokens: TokenFile | None = None) -> None:
        self.ledger = ledger
        self.tokens = tokens
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
            refused = self._authenticate(environ, start_response, path)
            if refused is not None:
                return refused
            try:
                params = _single_params(environ.get("QUERY_STRING", ""))
                query = parse_query(params, self.clock.now_ms(), max_window_seconds=self.max_window_seconds,
                                    max_steps=self.max_steps)
            except BadQuery as exc:
                return self._send(start_response, 400, error_response(400, str(exc)), path)
            try:
                body = self.answer(query)
            except MinuteLinesDropped as exc:
                return self._send(start_response, 400, error_response(400, str(exc)), path)
            except LedgerError as exc:
                log.warning("cannot read the ledger: %s", exc)
                return self._send(start_response, 503, error_response(503, "the ledger cannot be read now"), path)
            return self._send(start_response, 200, body, path, head=method == "HEAD")
        finally:
            if self.metrics is not None:
                self.metrics.get("gpumeter_api_request_seconds").labels("/allocation").observe(
                    time.perf_counter() - began)

    def _authenticate(self, environ, start_response, path: str):
        """None when the request may be answered; else the 401 (or, the token file unreadable, 503) sent."""
        if self.tokens is None:
            return None
        presented = bearer_token(environ.get("HTTP_AUTHORIZATION"))
        try:
            accepted = presented is not None and self.tokens.accepts(presented)
        except TokenFileUnreadable as exc:
            log.warning("%s: refusing /allocation until it can be read", exc)
            return self._send(start_response, 503, error_response(503, "authentication is unavailable now"), path)
        if accepted:
            return None
        challenge = f'Bearer realm="{AUTH_REALM}"'
        if presented is not None:
            challenge += ', error="invalid_token"'
        message = "a bearer token is required" if presented is None else "the bearer token is not accepted"
        return self._send(start_response, 401, error_response(401, message), path,
                          [("WWW-Authenticate", challenge)])

    def answer(self, query) -> dict[str, Any]:
        """The response to ``query``, from the coarsest grain that answers it (``grain_reads``: the rollups over
        whole hours and days by namespace, node, cluster or the team label; the minute lines otherwise);
        ``MinuteLinesDropped`` when retention dropped a part of its range at the grain that would answer it."""
        pods, buckets, segments = grain_reads.allocation_sums(self.ledger, query)
        sets = allocation_sets(query, pods, buckets)
        bills = grain_reads.summarize_bills(self.ledger, grain_reads.bill_plan(self.ledger, query.start_ms,
                                                                               query.end_ms),
                                            cluster=query.cluster)
        return response(query, sets, policies=bills.sharing_policies, bills_micro_usd=bills.bills_micro_usd,
                        grain=grain_reads.describe_segments(segments))

    def _send(self, start_response, code: int, body: Mapping[str, Any], path: str, extra_headers=(), *,
              head: bool = False):
        payload = json.dumps(body, separators=(",", ":")).encode()
        status = {200: "200 OK", 400: "400 Bad Request", 401: "401 Unauthorized", 404: "404 Not Found",
                  405: "405 Method Not Allowed", 503: "503 Service Unavailable"}[code]
        start_response(status, [*_JSON, ("Content-Length", str(len(payload))), *extra_headers])
        if self.metrics is not None:
            known = path if path in ALLOCATION_PATHS else "other"
            self.metrics.get("gpumeter_api_requests_total").labels(known, str(code)).inc()
        return [] if head else [payload]


def _single_params(query_string: str) -> dict[str, str]:
    """Each parameter's one value; ``BadQuery`` for more than ``MAX_QUERY_FIELDS`` parameters or a repeated one."""
    try:
        parsed = parse_qs(query_string, keep_blank_values=True, strict_parsing=False,
                          max_num_fields=MAX_QUERY_FIELDS)
    except ValueError:  # parse_qs' refusal of too many fields
        raise BadQuery(f"more than {MAX_QUERY_FIELDS} query parameters") from None
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
    tokens = None
    if settings.token_file is not None:
        try:
            tokens = TokenFile(settings.token_file)
        except ConfigError as exc:
            log.error("%s", exc)
            return 2
    elif settings.address not in ("127.0.0.1", "::1", "localhost"):
        log.warning("no token file (GPUMETER_API_TOKEN_FILE): /allocation answers every caller that reaches %s",
                    settings.address)
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
                            metrics=metrics, tokens=tokens)
        server = metrics.serve(settings.metrics_port, settings.address, app)
        assert server is not None
        log.info("serving /allocation on http://%s:%d for %r (%s)", settings.address, server.server_port, ledger,
                 "bearer tokens required" if tokens is not None else "no authentication")
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
