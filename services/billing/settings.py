"""The billing service's frozen settings: flags over ``GPUMETER_*`` env over defaults, read once by ``main``.

Price settings are the very variables ``PriceCatalog.from_env`` and ``SplitPolicy.from_env`` read
(``GPUMETER_BILLING_PRICE_DIR``, ``GPUMETER_BILLING_PRICE_OVERRIDE_CSV``, ``GPUMETER_BILLING_SPOT_DISCOUNTS``,
``GPUMETER_BILLING_SPLIT_RULE``, ``GPUMETER_BILLING_GPU_FRACTION``, ``GPUMETER_BILLING_SPLIT_WEIGHTS``): a flag
overrides its variable and the result is handed to those same parsers, so the service and ``gpumeter replay``
price alike. The ledger URL is ``GPUMETER_LEDGER_URL`` (as ``gpumeter report`` reads it). Its password never
appears in ``repr`` or ``describe()``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, Mapping


from gpumeter.errors import ConfigError
from gpumeter.settings import (
    DEFAULT_METRICS_ADDRESS,
    METRICS_ADDRESS_ENV,
    KafkaSettings,
    add_metrics_address_argument,
    check_metrics_address,
)
from gpumeter.redact import mask_url
from gpumeter.validation import DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS
from services.billing.catalog import PriceCatalog, PriceError, parse_spot_discounts
from services.billing.ledger import DEFAULT_LEDGER_URL, LEDGER_URL_ENV
from services.billing.pricing import DEFAULT_SPLIT_POLICY, SplitPolicy
from services.billing.sharing import KEEP_ALL, SHARING_ENV, SharingPolicy

DEFAULT_CONSUMER_GROUP = "gpumeter-billing"
"""The default group is the topic prefix followed by this, so deployments that share a broker under different
prefixes never share a group (whose offsets would make each skip the other's input)."""
DEFAULT_METRICS_PORT = 9404
DEFAULT_WINDOW_EXPIRY_SECONDS = 600.0
DEFAULT_FINISHED_WINDOW_MEMORY_SECONDS = 6 * 3600.0
DEFAULT_TEAM_LABEL = "team"

# Variables the price parsers read, and the flag (attribute of the parsed args) that overrides each.
_PRICE_ENV_FLAGS = {
    "GPUMETER_BILLING_PRICE_DIR": "price_dir",
    "GPUMETER_BILLING_PRICE_OVERRIDE_CSV": "price_override_csv",
    "GPUMETER_BILLING_SPOT_DISCOUNTS": "spot_discounts",
    "GPUMETER_BILLING_SPLIT_RULE": "split_rule",
    "GPUMETER_BILLING_GPU_FRACTION": "gpu_fraction",
    "GPUMETER_BILLING_SPLIT_WEIGHTS": "split_weights",
}


@dataclass(frozen=True)
class BillingSettings:
    """Everything the billing service needs, validated once.

    * ``window_expiry_seconds``: a node-window whose rows have not all arrived this long after its first row is
      dead-lettered (``INCOMPLETE_WINDOW``) with every row it holds.
    * ``finished_window_memory_seconds``: how far behind the newest window start seen a billed node-window is
      still remembered, so that redelivered rows of it are recognised as duplicates without a ledger round trip.
    * ``ledger_retry_*_seconds``: exponential backoff while the ledger cannot be reached.
    * ``team_label``: the pod label whose value is the ``team`` label of the cost metrics.
    * ``consumer_group``: the consumer group, default ``<topic prefix>gpumeter-billing``; it is also the name the
      ledger records as a node-window's publisher (only the group whose write inserted a node-window publishes its
      cost records: ``services.billing.ledger``).
    * ``max_clock_skew_seconds``: a share row whose window ends further ahead of this service's clock than this
      is dead-lettered ``OUT_OF_RANGE`` (billed, it would take the real window's place in the ledger).
    * ``sharing``: which buckets of each node-window are shared to its pods, and how (``GPUMETER_BILLING_SHARING``,
      ``--sharing``: ``keep`` | ``<bucket>=weighted|even|requests,...``; ``services.billing.sharing``). Applied
      once, here, so the ledger, the costs topic and every report agree; recorded on every bill.
    * ``duration_seconds``: stop after this long (None: until SIGTERM/SIGINT).
    """

    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    ledger_url: str = field(default=DEFAULT_LEDGER_URL, repr=False)
    price_dir: Path | None = None
    price_override_csv: Path | None = None
    spot_discounts: Mapping[str, Decimal] = field(default_factory=dict)
    split_policy: SplitPolicy = DEFAULT_SPLIT_POLICY
    sharing: SharingPolicy = KEEP_ALL
    consumer_group: str = ""
    auto_offset_reset: str = "earliest"
    topic_partitions: int | None = None
    metrics_port: int = DEFAULT_METRICS_PORT
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    window_expiry_seconds: float = DEFAULT_WINDOW_EXPIRY_SECONDS
    finished_window_memory_seconds: float = DEFAULT_FINISHED_WINDOW_MEMORY_SECONDS
    ledger_retry_initial_seconds: float = 0.5
    ledger_retry_max_seconds: float = 30.0
    max_poll_records: int = 2000
    max_poll_interval_seconds: float = 600.0
    team_label: str = DEFAULT_TEAM_LABEL
    max_clock_skew_seconds: int = DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS
    duration_seconds: float | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.ledger_url:
            raise ConfigError("the ledger URL is empty")
        if not self.consumer_group:
            object.__setattr__(self, "consumer_group", f"{self.kafka.topic_prefix}{DEFAULT_CONSUMER_GROUP}")
        if self.auto_offset_reset not in ("earliest", "latest"):
            raise ConfigError(f"auto offset reset {self.auto_offset_reset!r} is not earliest or latest")
        if self.topic_partitions is not None and self.topic_partitions < 1:
            raise ConfigError("topic partitions must be >= 1")
        if not (0 <= self.metrics_port <= 65535):
            raise ConfigError(f"metrics port {self.metrics_port} is not a TCP port (0 disables)")
        object.__setattr__(self, "metrics_address", check_metrics_address(self.metrics_address))
        if self.window_expiry_seconds <= 0:
            raise ConfigError("the incomplete-window expiry must be > 0 seconds")
        if self.finished_window_memory_seconds < 0:
            raise ConfigError("the finished-window memory must be >= 0 seconds")
        if not (0 < self.ledger_retry_initial_seconds <= self.ledger_retry_max_seconds):
            raise ConfigError("ledger retry backoff needs 0 < initial <= max seconds")
        if self.max_poll_records < 1:
            raise ConfigError("max poll records must be >= 1")
        if self.max_poll_interval_seconds <= self.ledger_retry_max_seconds:
            raise ConfigError("max poll interval must exceed the longest ledger retry pause")
        if not self.team_label:
            raise ConfigError("the team label key is empty")
        if self.max_clock_skew_seconds < 0:
            raise ConfigError("the allowed clock skew must be >= 0 seconds")
        if self.duration_seconds is not None and self.duration_seconds <= 0:
            raise ConfigError("duration must be > 0 seconds")

    def __repr__(self) -> str:
        view = ", ".join(f"{k}={v!r}" for k, v in self.describe().items())
        return f"BillingSettings({view})"

    def price_catalog(self) -> PriceCatalog:
        """Load the price files, the override CSV and the spot discounts (``ConfigError`` when unusable)."""
        try:
            return PriceCatalog.load(self.price_dir, self.price_override_csv, spot_discounts=self.spot_discounts)
        except PriceError as exc:
            raise ConfigError(f"price catalog: {exc}") from exc

    def describe(self) -> dict[str, Any]:
        """Printable view: secrets masked (Kafka SASL password, ledger URL password)."""
        view: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "kafka":
                value = value.describe()
            elif f.name == "ledger_url":
                value = mask_url(value)
            elif f.name == "split_policy":
                value = {k.name: str(getattr(value, k.name)) for k in fields(value)}
            elif f.name == "sharing":
                value = value.describe()
            elif f.name == "spot_discounts":
                value = {provider: str(discount) for provider, discount in value.items()}
            elif isinstance(value, Path):
                value = str(value)
            view[f.name] = value
        return view



_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "ledger_url": (LEDGER_URL_ENV, str),
    "consumer_group": ("GPUMETER_BILLING_CONSUMER_GROUP", str),
    "auto_offset_reset": ("GPUMETER_BILLING_AUTO_OFFSET_RESET", str),
    "topic_partitions": ("GPUMETER_TOPIC_PARTITIONS", int),
    "metrics_port": ("GPUMETER_METRICS_PORT", int),
    "metrics_address": (METRICS_ADDRESS_ENV, str),
    "window_expiry_seconds": ("GPUMETER_BILLING_WINDOW_EXPIRY_SECONDS", float),
    "finished_window_memory_seconds": ("GPUMETER_BILLING_FINISHED_WINDOW_MEMORY_SECONDS", float),
    "ledger_retry_initial_seconds": ("GPUMETER_BILLING_LEDGER_RETRY_INITIAL_SECONDS", float),
    "ledger_retry_max_seconds": ("GPUMETER_BILLING_LEDGER_RETRY_MAX_SECONDS", float),
    "max_poll_records": ("GPUMETER_BILLING_MAX_POLL_RECORDS", int),
    "max_poll_interval_seconds": ("GPUMETER_BILLING_MAX_POLL_INTERVAL_SECONDS", float),
    "team_label": ("GPUMETER_BILLING_TEAM_LABEL", str),
    "max_clock_skew_seconds": ("GPUMETER_MAX_CLOCK_SKEW_SECONDS", int),
    "log_level": ("GPUMETER_LOG_LEVEL", str),
}

# Flags that set a field directly (attribute name == field name).
_FLAG_FIELDS = ("ledger_url", "consumer_group", "auto_offset_reset", "topic_partitions", "metrics_port",
                "metrics_address", "window_expiry_seconds", "team_label", "max_clock_skew_seconds", "duration_seconds",
                "log_level")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The billing service's flags (each overrides its ``GPUMETER_*`` variable)."""
    parser.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (env KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--topic-prefix", help="prefix of every topic name (env GPUMETER_KAFKA_TOPIC_PREFIX)")
    parser.add_argument("--partitions", dest="topic_partitions", type=int,
                        help="partition count for topics this service creates (default: the catalog's)")
    parser.add_argument("--ledger-url", help=f"SQLAlchemy URL of the ledger (env {LEDGER_URL_ENV}, "
                                             f"default {DEFAULT_LEDGER_URL})")
    parser.add_argument("--group", dest="consumer_group",
                        help="consumer group, also the publisher name the ledger records (env "
                             f"GPUMETER_BILLING_CONSUMER_GROUP, default <topic prefix>{DEFAULT_CONSUMER_GROUP})")
    parser.add_argument("--auto-offset-reset", choices=("earliest", "latest"),
                        help="where a new consumer group starts (default earliest)")
    parser.add_argument("--price-dir", type=Path, help="folder of price CSVs (env GPUMETER_BILLING_PRICE_DIR)")
    parser.add_argument("--price-override", dest="price_override_csv", type=Path,
                        help="OpenCost-style custom price CSV (env GPUMETER_BILLING_PRICE_OVERRIDE_CSV)")
    parser.add_argument("--spot-discounts", help="derive spot prices: aws=0.6,azure=0.5 "
                                                 "(env GPUMETER_BILLING_SPOT_DISCOUNTS)")
    parser.add_argument("--split-rule", help="auto | sku | weights | gpu_fraction (env GPUMETER_BILLING_SPLIT_RULE)")
    parser.add_argument("--gpu-fraction", help="GPU share of the node price for the gpu_fraction rule")
    parser.add_argument("--split-weights", help="cpu=0.031611,ram=0.004237,gpu=0.95 for the weights rule")
    parser.add_argument("--sharing", help="share buckets to each node-window's pods: keep | "
                                          "<bucket>=weighted|even|requests,... with buckets idle, driver_reserved, "
                                          f"unattributed, unavailable, node_other or all (env {SHARING_ENV}, "
                                          "default keep)")
    parser.add_argument("--window-expiry", dest="window_expiry_seconds", type=float,
                        help="seconds an incomplete node-window waits before it is dead-lettered "
                             f"(default {DEFAULT_WINDOW_EXPIRY_SECONDS:g})")
    parser.add_argument("--team-label", help=f"pod label used as the metrics' team (default {DEFAULT_TEAM_LABEL})")
    parser.add_argument("--max-clock-skew-seconds", dest="max_clock_skew_seconds", type=int,
                        help="share rows of windows ending further ahead of this clock are dead-lettered "
                             "(env GPUMETER_MAX_CLOCK_SKEW_SECONDS, "
                             f"default {DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS})")
    parser.add_argument("--metrics-port", type=int,
                        help=f"Prometheus /metrics port, 0 disables (default {DEFAULT_METRICS_PORT})")
    add_metrics_address_argument(parser)
    parser.add_argument("--duration", dest="duration_seconds", type=float, help="stop after this many seconds")
    parser.add_argument("--log-level", help="DEBUG | INFO | WARNING | ERROR")


def billing_settings(args: argparse.Namespace, env: Mapping[str, str]) -> BillingSettings:
    """Settings from ``env`` with the flags in ``args`` on top; ``ConfigError`` for anything unusable."""
    values: dict[str, Any] = {}
    for name, (variable, convert) in _ENV.items():
        raw = env.get(variable)
        if raw:
            try:
                values[name] = convert(raw.strip())
            except ValueError as exc:
                raise ConfigError(f"{variable}={raw!r}: {exc}") from exc
    for name in _FLAG_FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value

    price_env = {variable: env[variable] for variable in _PRICE_ENV_FLAGS if env.get(variable)}
    for variable, attribute in _PRICE_ENV_FLAGS.items():
        value = getattr(args, attribute, None)
        if value is not None:
            price_env[variable] = str(value)
    if price_env.get("GPUMETER_BILLING_PRICE_DIR"):
        values["price_dir"] = Path(price_env["GPUMETER_BILLING_PRICE_DIR"])
    if price_env.get("GPUMETER_BILLING_PRICE_OVERRIDE_CSV"):
        values["price_override_csv"] = Path(price_env["GPUMETER_BILLING_PRICE_OVERRIDE_CSV"])
    try:
        values["spot_discounts"] = parse_spot_discounts(price_env.get("GPUMETER_BILLING_SPOT_DISCOUNTS", ""))
    except PriceError as exc:
        raise ConfigError(str(exc)) from exc
    values["split_policy"] = SplitPolicy.from_env(price_env)
    sharing_text = getattr(args, "sharing", None)
    values["sharing"] = SharingPolicy.parse(sharing_text if sharing_text is not None else env.get(SHARING_ENV))

    kafka = KafkaSettings.from_env(env).with_flags(args)
    if not env.get("GPUMETER_KAFKA_CLIENT_ID"):
        kafka = replace(kafka, client_id="gpumeter-billing")
    values["kafka"] = kafka
    return BillingSettings(**values)
