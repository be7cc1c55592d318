"""The guard service's frozen settings: flags over ``GPUMETER_*`` env over defaults, read once by ``main``.

The rules' thresholds, budgets and hold-downs live in the guard config file (``GuardConfig.load(path, env)``,
``services.guard.config``); these settings say where that file is and how the service around the engine runs:
Kafka, the consumer group, where the engine's state is kept between restarts, the optional Alertmanager and the
metrics port. An Alertmanager URL may carry basic-auth credentials; they never appear in ``repr`` or
``describe()``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from gpumeter.errors import ConfigError
from gpumeter.settings import (
    DEFAULT_METRICS_ADDRESS,
    METRICS_ADDRESS_ENV,
    KafkaSettings,
    add_metrics_address_argument,
    check_metrics_address,
)
from gpumeter.redact import mask_url
from gpumeter.validation import DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS as DEFAULT_MAX_CLOCK_SKEW_SECONDS
from gpumeter.validation import DEFAULT_MAX_SAMPLE_AGE_SECONDS

DEFAULT_CONSUMER_GROUP = "gpumeter-guard"
DEFAULT_METRICS_PORT = 9405
# Prometheus re-sends firing alerts every minute (its --rules.alert.resend-delay) and gives each an endsAt lease
# of four resend intervals; the guard does the same, so Alertmanager expires the alerts of a guard that died.
DEFAULT_ALERTMANAGER_RESEND_SECONDS = 60.0
ALERTMANAGER_LEASE_RESENDS = 4
DEFAULT_ALERTMANAGER_TIMEOUT_SECONDS = 10.0
DEFAULT_CLOCK_INTERVAL_SECONDS = 1.0
DEFAULT_SNAPSHOT_INTERVAL_SECONDS = 10.0

CONFIG_PATH_ENV = "GPUMETER_GUARD_CONFIG"
STATE_PATH_ENV = "GPUMETER_GUARD_STATE_PATH"
ALERTMANAGER_URL_ENV = "GPUMETER_GUARD_ALERTMANAGER_URL"


def _check_alertmanager_url(url: str) -> str:
    """``url`` without a trailing "/"; ``ConfigError`` (showing it masked) unless urllib -- the parser aiohttp's
    yarl follows -- reads an http(s) URL with a host, a numeric port if any, and no query or fragment. A password
    holding an unencoded "/", "?" or "#" ends the authority early (``http://am:AM/x@host`` names host ``am``, port
    ``AM``): refused here, not sent to the wrong host."""
    shown = mask_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # raises ValueError for a port that is not a number
    except ValueError:
        # Not the library's message: it quotes what it could not read as a port, which may be a password's tail.
        raise ConfigError(f"Alertmanager URL {shown!r} does not parse (a port that is not a number?); "
                          "percent-encode '@', '/', '?' and '#' in a user name or password") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"Alertmanager URL {shown!r} is not an http(s) URL with a host")
    if parts.query or parts.fragment:
        raise ConfigError(f"Alertmanager URL {shown!r}: the server's base URL has no query or fragment")
    return url.rstrip("/")


@dataclass(frozen=True)
class GuardSettings:
    """Everything the guard service needs, validated once.

    * ``config_path``: the guard config file (rules, thresholds, budgets, hold-down); None: the built-in defaults.
    * ``consumer_group``: the group the service commits its input offsets under (lag monitoring, and where a guard
      without a state file resumes). The guard reads every partition of its four input topics itself (budgets
      and stale nodes need the whole cluster), so it runs as one replica.
    * ``auto_offset_reset``: where a guard with neither a state file nor committed offsets starts reading samples,
      shares and costs. Pod events are always read from the beginning then (the compacted topic is the pod table).
    * ``state_path``: the file the engine's snapshot and the input positions it covers are written to
      (atomically, every ``snapshot_interval_seconds`` and at stop); None keeps no state across restarts.
    * ``alertmanager_url``: base URL of an Alertmanager (``POST {url}/api/v2/alerts``); None: no sink.
    * ``alertmanager_resend_seconds``: firing alerts are posted again this often; each carries an ``endsAt`` lease
      of ``ALERTMANAGER_LEASE_RESENDS`` resend intervals (``alertmanager_lease_seconds``).
    * ``alertmanager_timeout_seconds``: one HTTP request's timeout.
    * ``external_url``: where people look at a violation (``generatorURL`` of every alert); None leaves it out.
    * ``clock_interval_seconds``: how often the engine's clock rules run (stale nodes, hold-downs, idle timers).
    * ``max_clock_skew_seconds``: input stamped further ahead of the guard's clock than this (a sample, a pod
      event, a share or cost window not ended yet) is dead-lettered ``OUT_OF_RANGE``: a record from the future
      would make the real ones after it look stale (a node's samples, a pod's events, a unit's windows, a node's
      cost lines). Looser than the attributor's default: a future record here misleads one node, pod or unit,
      never a watermark.
    * ``max_sample_age_seconds``: samples older than this are dead-lettered ``OUT_OF_RANGE``.
    * ``duration_seconds``: stop after this long (None: until SIGTERM/SIGINT).
    """

    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    config_path: Path | None = None
    consumer_group: str = DEFAULT_CONSUMER_GROUP
    auto_offset_reset: str = "earliest"
    topic_partitions: int | None = None
    state_path: Path | None = None
    snapshot_interval_seconds: float = DEFAULT_SNAPSHOT_INTERVAL_SECONDS
    alertmanager_url: str | None = field(default=None, repr=False)
    alertmanager_resend_seconds: float = DEFAULT_ALERTMANAGER_RESEND_SECONDS
    alertmanager_timeout_seconds: float = DEFAULT_ALERTMANAGER_TIMEOUT_SECONDS
    external_url: str | None = None
    clock_interval_seconds: float = DEFAULT_CLOCK_INTERVAL_SECONDS
    max_clock_skew_seconds: int = DEFAULT_MAX_CLOCK_SKEW_SECONDS
    max_sample_age_seconds: int = DEFAULT_MAX_SAMPLE_AGE_SECONDS
    metrics_port: int = DEFAULT_METRICS_PORT
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    retry_initial_seconds: float = 0.5
    retry_max_seconds: float = 30.0
    max_poll_records: int = 2000
    duration_seconds: float | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.consumer_group:
            raise ConfigError("the consumer group is empty")
        if self.auto_offset_reset not in ("earliest", "latest"):
            raise ConfigError(f"auto offset reset {self.auto_offset_reset!r} is not earliest or latest")
        if self.topic_partitions is not None and self.topic_partitions < 1:
            raise ConfigError("topic partitions must be >= 1")
        if self.snapshot_interval_seconds <= 0:
            raise ConfigError("the snapshot interval must be > 0 seconds")
        if self.alertmanager_url is not None:
            if not self.alertmanager_url.strip():
                object.__setattr__(self, "alertmanager_url", None)
            else:
                object.__setattr__(self, "alertmanager_url", _check_alertmanager_url(self.alertmanager_url.strip()))
        if self.alertmanager_resend_seconds <= 0:
            raise ConfigError("the Alertmanager resend interval must be > 0 seconds")
        if self.alertmanager_timeout_seconds <= 0:
            raise ConfigError("the Alertmanager timeout must be > 0 seconds")
        if self.clock_interval_seconds <= 0:
            raise ConfigError("the clock interval must be > 0 seconds")
        if self.max_clock_skew_seconds < 0:
            raise ConfigError("the allowed clock skew must be >= 0 seconds")
        if self.max_sample_age_seconds <= 0:
            raise ConfigError("the maximum sample age must be > 0 seconds")
        if not (0 <= self.metrics_port <= 65535):
            raise ConfigError(f"metrics port {self.metrics_port} is not a TCP port (0 disables)")
        object.__setattr__(self, "metrics_address", check_metrics_address(self.metrics_address))
        if not (0 < self.retry_initial_seconds <= self.retry_max_seconds):
            raise ConfigError("retry backoff needs 0 < initial <= max seconds")
        if self.max_poll_records < 1:
            raise ConfigError("max poll records must be >= 1")
        if self.duration_seconds is not None and self.duration_seconds <= 0:
            raise ConfigError("duration must be > 0 seconds")

    @property
    def alertmanager_lease_seconds(self) -> float:
        """How long after a post Alertmanager keeps a firing alert that is not posted again."""
        return ALERTMANAGER_LEASE_RESENDS * self.alertmanager_resend_seconds

    def __repr__(self) -> str:
        view = ", ".join(f"{k}={v!r}" for k, v in self.describe().items())
        return f"GuardSettings({view})"

    def describe(self) -> dict[str, Any]:
        """Printable view: secrets masked (Kafka SASL password, Alertmanager URL password)."""
        view: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "kafka":
                value = value.describe()
            elif f.name in ("alertmanager_url", "external_url") and value is not None:
                value = mask_url(value)
            elif isinstance(value, Path):
                value = str(value)
            view[f.name] = value
        return view


def _path(raw: str) -> Path:
    return Path(raw)


_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "config_path": (CONFIG_PATH_ENV, _path),
    "consumer_group": ("GPUMETER_GUARD_CONSUMER_GROUP", str),
    "auto_offset_reset": ("GPUMETER_GUARD_AUTO_OFFSET_RESET", str),
    "topic_partitions": ("GPUMETER_TOPIC_PARTITIONS", int),
    "state_path": (STATE_PATH_ENV, _path),
    "snapshot_interval_seconds": ("GPUMETER_GUARD_SNAPSHOT_INTERVAL_SECONDS", float),
    "alertmanager_url": (ALERTMANAGER_URL_ENV, str),
    "alertmanager_resend_seconds": ("GPUMETER_GUARD_ALERTMANAGER_RESEND_SECONDS", float),
    "alertmanager_timeout_seconds": ("GPUMETER_GUARD_ALERTMANAGER_TIMEOUT_SECONDS", float),
    "external_url": ("GPUMETER_GUARD_EXTERNAL_URL", str),
    "clock_interval_seconds": ("GPUMETER_GUARD_CLOCK_INTERVAL_SECONDS", float),
    "max_clock_skew_seconds": ("GPUMETER_MAX_CLOCK_SKEW_SECONDS", int),
    "max_sample_age_seconds": ("GPUMETER_MAX_SAMPLE_AGE_SECONDS", int),
    "metrics_port": ("GPUMETER_METRICS_PORT", int),
    "metrics_address": (METRICS_ADDRESS_ENV, str),
    "retry_initial_seconds": ("GPUMETER_GUARD_RETRY_INITIAL_SECONDS", float),
    "retry_max_seconds": ("GPUMETER_GUARD_RETRY_MAX_SECONDS", float),
    "max_poll_records": ("GPUMETER_GUARD_MAX_POLL_RECORDS", int),
    "log_level": ("GPUMETER_LOG_LEVEL", str),
}

# Flags that set a field directly (attribute name == field name).
_FLAG_FIELDS = ("config_path", "consumer_group", "auto_offset_reset", "topic_partitions", "state_path",
                "snapshot_interval_seconds", "alertmanager_url", "alertmanager_resend_seconds",
                "alertmanager_timeout_seconds", "external_url", "clock_interval_seconds", "max_clock_skew_seconds",
                "max_sample_age_seconds", "metrics_port", "metrics_address",
                "duration_seconds", "log_level")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The guard service's flags (each overrides its ``GPUMETER_*`` variable)."""
    parser.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--topic-prefix", help="prefix of every topic name (env GPUMETER_KAFKA_TOPIC_PREFIX)")
    parser.add_argument("--partitions", dest="topic_partitions", type=int,
                        help="partition count for topics this service creates (default: the catalog's)")
    parser.add_argument("--config", dest="config_path", type=Path,
                        help=f"guard config file: rules, thresholds, budgets (env {CONFIG_PATH_ENV})")
    parser.add_argument("--group", dest="consumer_group",
                        help=f"consumer group (env GPUMETER_GUARD_CONSUMER_GROUP, default {DEFAULT_CONSUMER_GROUP})")
    parser.add_argument("--auto-offset-reset", choices=("earliest", "latest"),
                        help="where a guard without state or committed offsets starts (default earliest)")
    parser.add_argument("--state", dest="state_path", type=Path,
                        help=f"file keeping the engine's state across restarts (env {STATE_PATH_ENV})")
    parser.add_argument("--snapshot-interval", dest="snapshot_interval_seconds", type=float,
                        help=f"seconds between state snapshots (default {DEFAULT_SNAPSHOT_INTERVAL_SECONDS:g})")
    parser.add_argument("--alertmanager-url",
                        help=f"Alertmanager base URL, e.g. http://alertmanager:9093 (env {ALERTMANAGER_URL_ENV})")
    parser.add_argument("--alertmanager-resend", dest="alertmanager_resend_seconds", type=float,
                        help="seconds between re-posts of firing alerts "
                             f"(default {DEFAULT_ALERTMANAGER_RESEND_SECONDS:g})")
    parser.add_argument("--alertmanager-timeout", dest="alertmanager_timeout_seconds", type=float,
                        help=f"seconds per Alertmanager request (default {DEFAULT_ALERTMANAGER_TIMEOUT_SECONDS:g})")
    parser.add_argument("--external-url", help="generatorURL of every alert (env GPUMETER_GUARD_EXTERNAL_URL)")
    parser.add_argument("--clock-interval", dest="clock_interval_seconds", type=float,
                        help=f"seconds between clock rule runs (default {DEFAULT_CLOCK_INTERVAL_SECONDS:g})")
    parser.add_argument("--max-clock-skew-seconds", dest="max_clock_skew_seconds", type=int,
                        help="input stamped further ahead of this clock is dead-lettered "
                             f"(env GPUMETER_MAX_CLOCK_SKEW_SECONDS, default {DEFAULT_MAX_CLOCK_SKEW_SECONDS})")
    parser.add_argument("--max-sample-age-seconds", dest="max_sample_age_seconds", type=int,
                        help="samples older than this are dead-lettered "
                             f"(env GPUMETER_MAX_SAMPLE_AGE_SECONDS, default {DEFAULT_MAX_SAMPLE_AGE_SECONDS})")
    parser.add_argument("--metrics-port", type=int,
                        help=f"Prometheus /metrics port, 0 disables (default {DEFAULT_METRICS_PORT})")
    add_metrics_address_argument(parser)
    parser.add_argument("--duration", dest="duration_seconds", type=float, help="stop after this many seconds")
    parser.add_argument("--log-level", help="DEBUG | INFO | WARNING | ERROR")


def guard_settings(args: argparse.Namespace, env: Mapping[str, str]) -> GuardSettings:
    """Settings from ``env`` with the flags in ``args`` on top; ``ConfigError`` for anything unusable."""
    values: dict[str, Any] = {}
    for name, (variable, convert) in _ENV.items():
        raw = env.get(variable)
        if raw and raw.strip():
            try:
                values[name] = convert(raw.strip())
            except ValueError as exc:
                raise ConfigError(f"{variable}={raw!r}: {exc}") from exc
    for name in _FLAG_FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value

    kafka = KafkaSettings.from_env(env).with_flags(args)
    if not env.get("GPUMETER_KAFKA_CLIENT_ID"):
        kafka = replace(kafka, client_id="gpumeter-guard")
    values["kafka"] = kafka
    return GuardSettings(**values)
