"""The guard service's frozen settings: flags over ``GPUMETER_*`` env over defaults, read once by ``main``.

The rules' thresholds, budgets and hold-downs live in the guard config file (``GuardConfig.load(path, env)``,
``services.guard.config``); these settings say where that file is and how the service around the engine runs:
Kafka, the consumer group, where the engine's state is kept between restarts, the optional Alertmanager and the
metrics port. An Alertmanager URL may carry basic-auth credentials; they never appear in ``repr`` or
``describe()``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from gpumeter import config
from gpumeter.config import (
    at_least,
    between,
    describe,
    greater_than,
    integer,
    load,
    nested,
    non_empty,
    number,
    one_of,
    path,
    setting,
    settings_repr,
    validate,
)
from gpumeter.errors import ConfigError
from gpumeter.settings import DeadLetterHealthSettings, KafkaSettings, metrics_address_setting
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
    * ``role``: what this instance judges. ``all``: every rule over every partition of the four input topics (it
      reads them all itself), one replica. ``nodes``: every rule but budgets, over the partitions the consumer
      group assigns it -- run as many replicas as wanted, each takes its share of the nodes (no state file: an
      assigned partition is rebuilt from the violations topic and its input). ``budgets``: ``budget_exceeded``
      only, over every partition of the cost lines (one replica, beside the ``nodes`` ones).
    * ``consumer_group``: the group the service commits its input offsets under (lag monitoring, where a guard
      without a state file resumes, and -- role ``nodes`` -- the group whose members share the partitions). The
      ``budgets`` role commits under ``<consumer_group>-budgets``: it reads the cost lines beside the ``nodes``
      group, not as a member of it.
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

    kafka: KafkaSettings = nested(KafkaSettings, client_id="gpumeter-guard")
    dead_letters: DeadLetterHealthSettings = nested(DeadLetterHealthSettings)
    config_path: Path | None = setting(None, env=CONFIG_PATH_ENV, flag="--config", parse=path,
                                       help="guard config file: rules, thresholds, budgets")
    consumer_group: str = setting(DEFAULT_CONSUMER_GROUP, env="GPUMETER_GUARD_CONSUMER_GROUP", flag="--group",
                                  check=non_empty, help="consumer group")
    role: str = setting("all", env="GPUMETER_GUARD_ROLE", flag="--role", check=one_of("all", "nodes", "budgets"),
                        help="all | nodes (scales out in its consumer group) | budgets (one replica beside nodes)")
    auto_offset_reset: str = setting("earliest", env="GPUMETER_GUARD_AUTO_OFFSET_RESET", flag="--auto-offset-reset",
                                     check=one_of("earliest", "latest"),
                                     help="where a guard without state or committed offsets starts: earliest | "
                                          "latest")
    topic_partitions: int | None = setting(None, env="GPUMETER_TOPIC_PARTITIONS", flag="--partitions", parse=integer,
                                           check=at_least(1), default_text="the catalog's",
                                           help="partition count for topics this service creates")
    state_path: Path | None = setting(None, env=STATE_PATH_ENV, flag="--state", parse=path,
                                      help="file keeping the engine's state across restarts")
    snapshot_interval_seconds: float = setting(DEFAULT_SNAPSHOT_INTERVAL_SECONDS,
                                               env="GPUMETER_GUARD_SNAPSHOT_INTERVAL_SECONDS",
                                               flag="--snapshot-interval", parse=number, check=greater_than(0),
                                               help="seconds between state snapshots")
    alertmanager_url: str | None = setting(None, env=ALERTMANAGER_URL_ENV, flag="--alertmanager-url",
                                           check=_check_alertmanager_url, secret=True, mask=mask_url,
                                           help="Alertmanager base URL, e.g. http://alertmanager:9093")
    alertmanager_resend_seconds: float = setting(DEFAULT_ALERTMANAGER_RESEND_SECONDS,
                                                 env="GPUMETER_GUARD_ALERTMANAGER_RESEND_SECONDS",
                                                 flag="--alertmanager-resend", parse=number, check=greater_than(0),
                                                 help="seconds between re-posts of firing alerts")
    alertmanager_timeout_seconds: float = setting(DEFAULT_ALERTMANAGER_TIMEOUT_SECONDS,
                                                  env="GPUMETER_GUARD_ALERTMANAGER_TIMEOUT_SECONDS",
                                                  flag="--alertmanager-timeout", parse=number, check=greater_than(0),
                                                  help="seconds per Alertmanager request")
    # Not a credential, but a URL someone may have put one in: shown masked.
    external_url: str | None = setting(None, env="GPUMETER_GUARD_EXTERNAL_URL", flag="--external-url",
                                       mask=mask_url, help="generatorURL of every alert")
    clock_interval_seconds: float = setting(DEFAULT_CLOCK_INTERVAL_SECONDS, env="GPUMETER_GUARD_CLOCK_INTERVAL_SECONDS",
                                            flag="--clock-interval", parse=number, check=greater_than(0),
                                            help="seconds between clock rule runs")
    max_clock_skew_seconds: int = setting(DEFAULT_MAX_CLOCK_SKEW_SECONDS, env="GPUMETER_MAX_CLOCK_SKEW_SECONDS",
                                          flag="--max-clock-skew-seconds", parse=integer, check=at_least(0),
                                          help="input stamped further ahead of this clock is dead-lettered")
    max_sample_age_seconds: int = setting(DEFAULT_MAX_SAMPLE_AGE_SECONDS, env="GPUMETER_MAX_SAMPLE_AGE_SECONDS",
                                          flag="--max-sample-age-seconds", parse=integer, check=greater_than(0),
                                          help="samples older than this are dead-lettered")
    metrics_port: int = setting(DEFAULT_METRICS_PORT, env="GPUMETER_METRICS_PORT", flag="--metrics-port",
                                parse=integer, check=between(0, 65535), help="Prometheus /metrics port, 0 disables")
    metrics_address: str = metrics_address_setting()
    retry_initial_seconds: float = setting(0.5, env="GPUMETER_GUARD_RETRY_INITIAL_SECONDS", parse=number,
                                           help="first pause while the broker cannot be reached")
    retry_max_seconds: float = setting(30.0, env="GPUMETER_GUARD_RETRY_MAX_SECONDS", parse=number,
                                       help="longest pause while the broker cannot be reached")
    max_poll_records: int = setting(2000, env="GPUMETER_GUARD_MAX_POLL_RECORDS", parse=integer, check=at_least(1),
                                    help="records per consumer poll")
    duration_seconds: float | None = setting(None, flag="--duration", parse=number, check=greater_than(0),
                                             help="stop after this many seconds", default_text="until SIGTERM/SIGINT")
    log_level: str = setting("INFO", env="GPUMETER_LOG_LEVEL", flag="--log-level",
                             help="DEBUG | INFO | WARNING | ERROR")

    def __post_init__(self) -> None:
        validate(self)
        if not (0 < self.retry_initial_seconds <= self.retry_max_seconds):
            raise ConfigError("retry backoff needs 0 < initial <= max seconds")
        if self.role == "nodes" and self.state_path is not None:
            raise ConfigError("the guard's nodes role keeps no state file (its partitions change with the group; an "
                              "assigned partition is rebuilt from the violations topic): unset the state path")

    @property
    def group_id(self) -> str:
        """The consumer group this instance joins or commits under (see ``consumer_group``)."""
        return f"{self.consumer_group}-budgets" if self.role == "budgets" else self.consumer_group

    @property
    def alertmanager_lease_seconds(self) -> float:
        """How long after a post Alertmanager keeps a firing alert that is not posted again."""
        return ALERTMANAGER_LEASE_RESENDS * self.alertmanager_resend_seconds

    def __repr__(self) -> str:
        return settings_repr(self)

    def describe(self) -> dict[str, Any]:
        """Printable view: secrets masked (Kafka SASL password, Alertmanager URL password)."""
        return describe(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The guard service's flags (each overrides its ``GPUMETER_*`` variable), from ``GuardSettings``' fields."""
    config.add_arguments(parser, GuardSettings)


def guard_settings(args: argparse.Namespace, env: Mapping[str, str]) -> GuardSettings:
    """``load(GuardSettings, args, env)``: flags over env over defaults; ``ConfigError`` for anything unusable."""
    return load(GuardSettings, args, env)
