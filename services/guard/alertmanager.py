"""Violations as Alertmanager alerts: the pure payload mapping and the sink that posts them (API v2).

``to_alertmanager(violation)`` (pure) follows Alertmanager's conventions for a ``postableAlert``:

* labels identify the alert (Alertmanager deduplicates and routes on them): ``alertname`` = the rule,
  ``severity`` in lower case, then ``cluster``, ``node``, ``gpu_uuid``, ``namespace``, ``pod``, ``team`` and
  ``fingerprint`` -- only those the violation has (no empty or null label ever; Alertmanager treats an empty
  label as absent, and a labelset must be identical between the firing and the resolving post);
* annotations describe it: ``summary``, ``description`` (the summary, the subject and every evidence number
  with its unit spelled out), ``pod_uid`` when known, and one ``evidence_<name>`` per evidence entry with the
  raw number; in labels and annotations every control character is escaped (``gpumeter.safetext``: no CRLF or
  ANSI sequence reaches a receiver; names have Kubernetes' syntax already, ``gpumeter.validation``);
* ``startsAt`` is the violation's first sighting (RFC 3339, UTC); ``endsAt`` is the resolution time for a
  resolved violation, and for a firing one ``now`` plus a lease: the sender re-posts firing alerts more often
  than the lease runs out, so Alertmanager resolves the alerts of a guard that died by itself (what Prometheus
  does with its resend delay and a lease of four resends).

``AlertmanagerSink`` posts batches to ``POST {url}/api/v2/alerts`` with aiohttp (``user:password@`` in the URL
becomes HTTP basic auth, kept out of every log line and error), retrying with exponential
backoff on connection errors, timeouts, 429 and 5xx (``AlertmanagerUnavailable`` once the attempts are spent),
never on other 4xx (``AlertmanagerRejected``: the payload or the URL is wrong and would fail again). It keeps the
firing violations and posts them again every resend interval. Violations handed to ``update`` are posted by
``flush`` (or by ``run``, the sink's own task): while Alertmanager cannot be reached they stay pending -- the
latest state per fingerprint -- and go out when it is back, so a resolution is never lost.
"""

from __future__ import annotations

import asyncio
import logging
import math
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from gpumeter.clock import Clock, SystemClock
from gpumeter.errors import GpumeterError
from gpumeter.safetext import escape_control
from schemas.records import Violation, ViolationState

log = logging.getLogger(__name__)

ALERTS_PATH = "/api/v2/alerts"
DEFAULT_RESEND_SECONDS = 60.0
DEFAULT_LEASE_SECONDS = 4 * DEFAULT_RESEND_SECONDS
DEFAULT_MAX_BATCH = 500
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class AlertmanagerError(GpumeterError):
    """An alert batch did not reach Alertmanager."""


class AlertmanagerUnavailable(AlertmanagerError):
    """Alertmanager could not be reached, timed out or answered 429/5xx on every attempt (retry later)."""


class AlertmanagerRejected(AlertmanagerError):
    """Alertmanager refused the batch with a 4xx: the same request would fail again."""

    def __init__(self, detail: str, status: int) -> None:
        super().__init__(detail)
        self.status = status


# -- the payload (pure) -----------------------------------------------------------------------------------------


def rfc3339_ms(unix_ms: int) -> str:
    """``unix_ms`` as RFC 3339 in UTC with millisecond precision (``2024-05-01T12:00:00.250Z``)."""
    moment = _EPOCH + timedelta(milliseconds=unix_ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{unix_ms % 1000:03d}Z"


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _format_bytes(value: float) -> str:
    size = abs(value)
    unit = 0
    while size >= 1024 and unit < len(_BINARY_UNITS) - 1:
        size /= 1024
        unit += 1
    sign = "-" if value < 0 else ""
    if unit == 0:
        return f"{sign}{size:g} B"
    return f"{sign}{size:.2f} {_BINARY_UNITS[unit]} ({value:.0f} B)"


def _format_duration(seconds: float) -> str:
    total = abs(seconds)
    if total < 60:
        return f"{seconds:g} s"
    whole = int(round(total))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h"] if hours else []
    parts += [f"{minutes}m", f"{secs}s"]
    return f"{'-' if seconds < 0 else ''}{' '.join(parts)} ({seconds:g} s)"


def format_evidence_value(name: str, value: float) -> str:
    """One evidence number with its unit, read from the name's unit suffix (the project's naming rule):
    ``_bytes`` binary sizes, ``_micro_usd`` dollars, ``_percent``, ``_ratio``/``_fraction``/``_share`` as
    percent, ``_seconds``/``_minutes``/``_ms`` durations, ``_unix_ms`` instants; other names plain."""
    if not math.isfinite(value):
        return str(value)
    if name.endswith("_bytes"):
        return _format_bytes(value)
    if name.endswith("_micro_usd"):
        return f"${value / 1_000_000:,.2f} ({value:.0f} micro-USD)"
    if name.endswith("_usd"):
        return f"${value:,.2f}"
    if name.endswith("_percent"):
        return f"{value:.4g} %"
    if name.endswith(("_ratio", "_fraction", "_share")):
        return f"{value * 100:.4g} %"
    if name.endswith("_unix_ms"):
        return rfc3339_ms(int(value))
    if name.endswith("_seconds"):
        return _format_duration(value)
    if name.endswith("_minutes"):
        return _format_duration(value * 60)
    if name.endswith("_ms"):
        return _format_duration(value / 1000)
    if float(value).is_integer():
        return f"{int(value)}"
    return f"{value:.6g}"


def alert_labels(violation: Violation) -> dict[str, str]:
    """The alert's identity: rule, severity and the subject fields the violation has (never an empty value)."""
    candidates = (
        ("alertname", violation.rule),
        ("severity", str(violation.severity).lower()),
        ("cluster", violation.cluster),
        ("node", violation.node_name),
        ("gpu_uuid", violation.gpu_uuid),
        ("namespace", violation.namespace),
        ("pod", violation.pod_name),
        ("team", violation.team),
        ("fingerprint", violation.fingerprint),
    )
    # Names are validated on input (gpumeter.validation); escaped again here so that no record from elsewhere (an
    # older guard's topic, a foreign writer) puts a control character into a label.
    return {name: escape_control(value) for name, value in candidates if value}


def describe_subject(violation: Violation) -> str:
    parts = [f"cluster {violation.cluster}"] if violation.cluster else []
    if violation.node_name:
        parts.append(f"node {violation.node_name}")
    if violation.gpu_uuid:
        parts.append(f"GPU {violation.gpu_uuid}")
    if violation.namespace and violation.pod_name:
        parts.append(f"pod {violation.namespace}/{violation.pod_name}")
    elif violation.namespace:
        parts.append(f"namespace {violation.namespace}")
    elif violation.pod_name:
        parts.append(f"pod {violation.pod_name}")
    if violation.team:
        parts.append(f"team {violation.team}")
    return ", ".join(parts)


def describe_violation(violation: Violation) -> str:
    """The human description: summary, subject, evidence with units, and when it was seen (and resolved)."""
    lines = [escape_control(violation.summary).rstrip(".") + "."]
    subject = escape_control(describe_subject(violation))
    if subject:
        lines.append(f"Subject: {subject}.")
    if violation.evidence:
        evidence = "; ".join(f"{name} = {format_evidence_value(name, float(value))}"
                             for name, value in sorted(violation.evidence.items()))
        lines.append(f"Evidence: {evidence}.")
    seen = f"First seen {rfc3339_ms(violation.first_seen_unix_ms)}, last seen {rfc3339_ms(violation.last_seen_unix_ms)}"
    if violation.state is ViolationState.RESOLVED and violation.resolved_at_unix_ms is not None:
        seen += f", resolved {rfc3339_ms(violation.resolved_at_unix_ms)}"
    lines.append(seen + ".")
    return "\n".join(lines)


def _raw_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def to_alertmanager(violation: Violation, *, generator_url: str | None = None, now_ms: int | None = None,
                    lease_seconds: float = DEFAULT_LEASE_SECONDS) -> dict[str, Any]:
    """The ``postableAlert`` of ``violation`` (pure; see the module docstring).

    ``endsAt`` of a firing violation is ``now_ms`` (default: its last sighting) plus ``lease_seconds``; of a
    resolved one its ``resolved_at`` (its last sighting when that is missing), never before ``startsAt``.
    """
    if lease_seconds <= 0:
        raise ValueError("the lease must be > 0 seconds")
    annotations = {"summary": escape_control(violation.summary), "description": describe_violation(violation)}
    if violation.pod_uid:
        annotations["pod_uid"] = escape_control(violation.pod_uid)
    for name, value in sorted(violation.evidence.items()):
        annotations[f"evidence_{name}"] = _raw_number(value)
    if violation.state is ViolationState.RESOLVED:
        ends_ms = violation.resolved_at_unix_ms
        if ends_ms is None:
            ends_ms = violation.last_seen_unix_ms
    else:
        base_ms = violation.last_seen_unix_ms if now_ms is None else now_ms
        ends_ms = base_ms + int(lease_seconds * 1000)
    ends_ms = max(ends_ms, violation.first_seen_unix_ms)
    alert: dict[str, Any] = {
        "labels": alert_labels(violation),
        "annotations": annotations,
        "startsAt": rfc3339_ms(violation.first_seen_unix_ms),
        "endsAt": rfc3339_ms(ends_ms),
    }
    if generator_url:
        alert["generatorURL"] = generator_url
    return alert


def resolved_labelset(labels: Mapping[str, str], *, starts_ms: int, now_ms: int) -> dict[str, Any]:
    """An alert that resolves ``labels`` now (for a fingerprint whose labels changed, e.g. a new severity)."""
    return {"labels": dict(labels), "annotations": {}, "startsAt": rfc3339_ms(min(starts_ms, now_ms)),
            "endsAt": rfc3339_ms(now_ms)}


# -- the sink ---------------------------------------------------------------------------------------------------


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its ``user:password@`` part, and that (user, password) for HTTP basic auth: the URL the
    sink logs and raises errors with never carries the password."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return (urlunsplit(parts._replace(netloc=host)),
            (unquote(parts.username or ""), unquote(parts.password or "")))



class AlertmanagerSink:
    """Posts violations to one Alertmanager (see the module docstring).

    * ``update(violations)``: remember the latest state of each fingerprint; firing ones join the resend set,
      resolved ones leave it. Nothing is sent yet.
    * ``flush()``: post everything pending; on ``AlertmanagerUnavailable`` it stays pending (raised), on
      ``AlertmanagerRejected`` it is dropped (raised, logged): a refused batch would be refused forever.
    * ``resend_active()``: post every firing alert again with a fresh lease.
    * ``run(stop)``: the sink's task: flushes soon after each ``update`` and re-sends every
      ``resend_interval_s``; errors are logged and retried with backoff, never raised.
    * ``post(alerts)``: one raw POST with retries (the mechanism the others use).
    """

    def __init__(self, url: str, timeout_s: float = 10.0, *, clock: Clock | None = None,
                 resend_interval_s: float = DEFAULT_RESEND_SECONDS, lease_s: float | None = None,
                 generator_url: str | None = None, max_attempts: int = 4, retry_initial_s: float = 0.5,
                 retry_max_s: float = 10.0, max_batch: int = DEFAULT_MAX_BATCH,
                 sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        if timeout_s <= 0 or resend_interval_s <= 0:
            raise ValueError("timeout and resend interval must be > 0 seconds")
        if max_attempts < 1 or max_batch < 1:
            raise ValueError("max_attempts and max_batch must be >= 1")
        self.url, self._credentials = split_credentials(url.rstrip("/"))
        self.timeout_s = timeout_s
        self.clock = clock or SystemClock()
        self.resend_interval_s = resend_interval_s
        self.lease_s = lease_s if lease_s is not None else 4 * resend_interval_s
        if self.lease_s <= resend_interval_s:
            raise ValueError("the lease must be longer than the resend interval, or alerts expire between posts")
        self.generator_url = generator_url
        self.max_attempts = max_attempts
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.max_batch = max_batch
        self._sleep = sleep or asyncio.sleep
        self._session = None
        self._active: dict[str, Violation] = {}
        self._pending: dict[str, Violation] = {}
        self._posted_labels: dict[str, dict[str, str]] = {}
        self._wake = asyncio.Event()
        self.posts = 0
        self.alerts_posted = 0
        self.alerts_rejected = 0
        self.failures = 0

    @property
    def endpoint(self) -> str:
        return self.url + ALERTS_PATH

    @property
    def active(self) -> Mapping[str, Violation]:
        """Firing violations by fingerprint (what ``resend_active`` posts)."""
        return dict(self._active)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    # -- lifecycle --

    async def start(self) -> None:
        import aiohttp

        if self._session is None:
            headers = {"Authorization": aiohttp.encode_basic_auth(*self._credentials)} if self._credentials else {}
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  headers=headers)

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> "AlertmanagerSink":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- state --

    def update(self, violations: Iterable[Violation]) -> None:
        """Remember ``violations`` (in order; the last one of a fingerprint wins) for the next ``flush``."""
        changed = False
        for violation in violations:
            fingerprint = violation.fingerprint
            if violation.state is ViolationState.FIRING:
                self._active[fingerprint] = violation
            else:
                self._active.pop(fingerprint, None)
            self._pending[fingerprint] = violation
            changed = True
        if changed:
            self._wake.set()

    def _alert(self, violation: Violation, now_ms: int) -> dict[str, Any]:
        return to_alertmanager(violation, generator_url=self.generator_url, now_ms=now_ms,
                               lease_seconds=self.lease_s)

    def _relabelled(self, violation: Violation, alert: dict[str, Any], now_ms: int) -> list[dict[str, Any]]:
        # Alertmanager knows an alert by its labelset: when a fingerprint's labels change (a new severity), the
        # old labelset would fire on until its lease ran out unless it is resolved explicitly.
        previous = self._posted_labels.get(violation.fingerprint)
        if previous is None or previous == alert["labels"]:
            return []
        return [resolved_labelset(previous, starts_ms=violation.first_seen_unix_ms, now_ms=now_ms)]

    def _posted(self, violations: Iterable[Violation], alerts: Iterable[dict[str, Any]]) -> None:
        for violation, alert in zip(violations, alerts):
            if violation.state is ViolationState.FIRING:
                self._posted_labels[violation.fingerprint] = alert["labels"]
            else:
                self._posted_labels.pop(violation.fingerprint, None)

    # -- sending --

    async def flush(self, *, attempts: int | None = None) -> int:
        """Post every pending alert (``attempts`` per batch, default ``max_attempts``); returns how many alerts
        were posted."""
        if not self._pending:
            return 0
        now_ms = self.clock.now_ms()
        batch_violations = list(self._pending.values())
        alerts = [self._alert(v, now_ms) for v in batch_violations]
        extra: list[dict[str, Any]] = []
        for violation, alert in zip(batch_violations, alerts):
            extra.extend(self._relabelled(violation, alert, now_ms))
        try:
            await self.post(extra + alerts, attempts=attempts)
        except AlertmanagerRejected:
            self.alerts_rejected += len(extra) + len(alerts)
            self._forget_sent(batch_violations)
            raise
        self._posted(batch_violations, alerts)
        self._forget_sent(batch_violations)
        return len(extra) + len(alerts)

    def _forget_sent(self, sent: Sequence[Violation]) -> None:
        for violation in sent:
            # ``update`` may have replaced it while the POST was in flight: the newer state is still pending.
            if self._pending.get(violation.fingerprint) is violation:
                del self._pending[violation.fingerprint]

    async def resend_active(self) -> int:
        """Post every firing alert again (a fresh ``endsAt`` lease); returns how many."""
        if not self._active:
            return 0
        now_ms = self.clock.now_ms()
        violations = list(self._active.values())
        alerts = [self._alert(v, now_ms) for v in violations]
        await self.post(alerts)
        self._posted(violations, alerts)
        return len(alerts)

    async def post(self, alerts: Sequence[Mapping[str, Any]], *, attempts: int | None = None) -> None:
        """POST ``alerts`` (in batches of ``max_batch``), each batch tried up to ``attempts`` times (default
        ``max_attempts``); see the class docstring for errors."""
        for start in range(0, len(alerts), self.max_batch):
            await self._post_batch(list(alerts[start:start + self.max_batch]), attempts or self.max_attempts)

    async def _post_batch(self, alerts: list[Mapping[str, Any]], attempts: int) -> None:
        import aiohttp

        if self._session is None:
            await self.start()
        assert self._session is not None
        delay = self.retry_initial_s
        problem = ""
        for attempt in range(1, attempts + 1):
            try:
                async with self._session.post(self.endpoint, json=alerts) as response:
                    if 200 <= response.status < 300:
                        self.posts += 1
                        self.alerts_posted += len(alerts)
                        return
                    body = (await response.text())[:500]
                    problem = f"HTTP {response.status}: {body.strip()}"
                    if response.status != 429 and response.status < 500:
                        raise AlertmanagerRejected(f"Alertmanager at {self.endpoint} refused {len(alerts)} "
                                                   f"alerts: {problem}", response.status)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                problem = repr(exc)
            if attempt < attempts:
                log.debug("Alertmanager post attempt %d failed (%s); retrying in %.1f s", attempt, problem, delay)
                await self._sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
        self.failures += 1
        raise AlertmanagerUnavailable(f"Alertmanager at {self.endpoint} unavailable after {attempts} "
                                      f"attempt{'s' if attempts > 1 else ''}: {problem}")

    async def run(self, stop: asyncio.Event) -> None:
        """Flush on every ``update`` and re-send firing alerts every resend interval until ``stop``; then one
        last flush (a single attempt: stopping must not wait out the retries)."""
        next_resend = self.clock.monotonic_s() + self.resend_interval_s
        backoff = self.retry_initial_s
        stopper = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                timeout = max(0.0, next_resend - self.clock.monotonic_s())
                waker = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait((waker, stopper), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
                if stop.is_set():
                    break
                self._wake.clear()
                try:
                    await self.flush()
                    if self.clock.monotonic_s() >= next_resend:
                        await self.resend_active()
                        next_resend = self.clock.monotonic_s() + self.resend_interval_s
                    backoff = self.retry_initial_s
                except AlertmanagerRejected as exc:
                    log.error("%s (dropped)", exc)
                except AlertmanagerUnavailable as exc:
                    log.warning("%s; %d alerts kept pending, next try in %.1f s", exc, self.pending_count, backoff)
                    await asyncio.wait((stopper,), timeout=backoff)
                    backoff = min(backoff * 2, max(self.retry_max_s, self.resend_interval_s))
                    self._wake.set()
        finally:
            stopper.cancel()
        try:
            await self.flush(attempts=1)
        except AlertmanagerError as exc:
            log.warning("last Alertmanager flush failed: %s", exc)
