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
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Mapping

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
from gpumeter.redact import mask_url
from gpumeter.settings import DeadLetterHealthSettings, KafkaSettings, metrics_address_setting
from gpumeter.validation import DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS
from services.billing.catalog import PriceCatalog, PriceError, parse_spot_discounts
from services.billing.ledger import DEFAULT_LEDGER_URL, LEDGER_URL_ENV
from services.billing.pricing import DEFAULT_SPLIT_POLICY, SplitPolicy
from services.billing.rollups import DEFAULT_TEAM_LABEL
from services.billing.sharing import KEEP_ALL, SHARING_ENV, SharingPolicy

DEFAULT_CONSUMER_GROUP = "gpumeter-billing"
"""The default group is the topic prefix followed by this, so deployments that share a broker under different
prefixes never share a group (whose offsets would make each skip the other's input)."""
DEFAULT_METRICS_PORT = 9404
DEFAULT_SERIES_MEMORY_SECONDS = 6 * 3600.0

_SPLIT_RULE_ENV = "GPUMETER_BILLING_SPLIT_RULE"
_GPU_FRACTION_ENV = "GPUMETER_BILLING_GPU_FRACTION"
_SPLIT_WEIGHTS_ENV = "GPUMETER_BILLING_SPLIT_WEIGHTS"


def _split_text(variable: str):
    """A check of one split setting's text by the parser ``SplitPolicy.from_env`` applies to ``variable``."""
    def check(value: str) -> str:
        SplitPolicy.from_env({variable: value})
        return value
    return check


@dataclass(frozen=True)
class BillingSettings:
    """Everything the billing service needs, validated once.

    * ``series_memory_seconds``: how long the metric series of a node that bills nothing more (scaled down,
      renamed, gone) are kept after its last window. (A node-window arrives whole, so nothing waits for the rest
      of one: the incomplete-window expiry of the per-row topic is gone, and ``GPUMETER_BILLING_WINDOW_EXPIRY_SECONDS``
      is no longer read.)
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

    kafka: KafkaSettings = nested(KafkaSettings, client_id="gpumeter-billing")
    dead_letters: DeadLetterHealthSettings = nested(DeadLetterHealthSettings)
    ledger_url: str = setting(DEFAULT_LEDGER_URL, env=LEDGER_URL_ENV, flag="--ledger-url", check=non_empty,
                              secret=True, mask=mask_url, help="SQLAlchemy URL of the ledger")
    price_dir: Path | None = setting(None, env="GPUMETER_BILLING_PRICE_DIR", flag="--price-dir", parse=path,
                                     help="folder of price CSVs", default_text="the bundled prices")
    price_override_csv: Path | None = setting(None, env="GPUMETER_BILLING_PRICE_OVERRIDE_CSV", flag="--price-override",
                                              parse=path, help="OpenCost-style custom price CSV")
    spot_discounts: Mapping[str, Decimal] = setting(env="GPUMETER_BILLING_SPOT_DISCOUNTS", flag="--spot-discounts",
                                                    parse=parse_spot_discounts, default_factory=dict,
                                                    help="derive spot prices: aws=0.6,azure=0.5")
    # The split rule's three settings, as the text SplitPolicy.from_env reads (each checked by it on its own);
    # split_policy is built from them.
    split_rule: str | None = setting(None, env=_SPLIT_RULE_ENV, flag="--split-rule",
                                     check=_split_text(_SPLIT_RULE_ENV),
                                     help="auto | sku | marginal | weights | gpu_fraction", default_text="auto")
    gpu_fraction: str | None = setting(None, env=_GPU_FRACTION_ENV, flag="--gpu-fraction",
                                       check=_split_text(_GPU_FRACTION_ENV),
                                       help="GPU share of the node price for the gpu_fraction rule")
    split_weights: str | None = setting(None, env=_SPLIT_WEIGHTS_ENV, flag="--split-weights",
                                        check=_split_text(_SPLIT_WEIGHTS_ENV),
                                        help="cpu=0.031611,ram=0.004237,gpu=0.95 for the weights rule")
    split_policy: SplitPolicy = field(init=False, default=DEFAULT_SPLIT_POLICY)
    sharing: SharingPolicy = setting(KEEP_ALL, env=SHARING_ENV, flag="--sharing", parse=SharingPolicy.parse,
                                     default_text="keep",
                                     help="share buckets to each node-window's pods: keep | "
                                          "<bucket>=weighted|even|requests,... with buckets idle, driver_reserved, "
                                          "unattributed, unavailable, node_other or all")
    consumer_group: str = setting("", env="GPUMETER_BILLING_CONSUMER_GROUP", flag="--group",
                                  default_text=f"<topic prefix>{DEFAULT_CONSUMER_GROUP}",
                                  help="consumer group, also the publisher name the ledger records")
    auto_offset_reset: str = setting("earliest", env="GPUMETER_BILLING_AUTO_OFFSET_RESET", flag="--auto-offset-reset",
                                     check=one_of("earliest", "latest"),
                                     help="where a new consumer group starts: earliest | latest")
    topic_partitions: int | None = setting(None, env="GPUMETER_TOPIC_PARTITIONS", flag="--partitions", parse=integer,
                                           check=at_least(1), default_text="the catalog's",
                                           help="partition count for topics this service creates")
    metrics_port: int = setting(DEFAULT_METRICS_PORT, env="GPUMETER_METRICS_PORT", flag="--metrics-port",
                                parse=integer, check=between(0, 65535), help="Prometheus /metrics port, 0 disables")
    metrics_address: str = metrics_address_setting()
    # The older name of the same horizon (it bounded a memory of billed windows, whose series went with it) is still
    # read after the new one.
    series_memory_seconds: float = setting(DEFAULT_SERIES_MEMORY_SECONDS,
                                           env=("GPUMETER_BILLING_SERIES_MEMORY_SECONDS",
                                                "GPUMETER_BILLING_FINISHED_WINDOW_MEMORY_SECONDS"),
                                           flag="--series-memory", parse=number, check=greater_than(0),
                                           help="seconds a node that bills nothing more keeps its metric series")
    ledger_retry_initial_seconds: float = setting(0.5, env="GPUMETER_BILLING_LEDGER_RETRY_INITIAL_SECONDS",
                                                  parse=number, help="first pause while the ledger is unreachable")
    ledger_retry_max_seconds: float = setting(30.0, env="GPUMETER_BILLING_LEDGER_RETRY_MAX_SECONDS", parse=number,
                                              help="longest pause while the ledger is unreachable")
    max_poll_records: int = setting(2000, env="GPUMETER_BILLING_MAX_POLL_RECORDS", parse=integer, check=at_least(1),
                                    help="records per consumer poll")
    max_poll_interval_seconds: float = setting(600.0, env="GPUMETER_BILLING_MAX_POLL_INTERVAL_SECONDS", parse=number,
                                               help="the consumer's max poll interval")
    team_label: str = setting(DEFAULT_TEAM_LABEL, env="GPUMETER_BILLING_TEAM_LABEL", flag="--team-label",
                              check=non_empty, help="pod label used as the metrics' team")
    max_clock_skew_seconds: int = setting(DEFAULT_DOWNSTREAM_MAX_CLOCK_SKEW_SECONDS,
                                          env="GPUMETER_MAX_CLOCK_SKEW_SECONDS", flag="--max-clock-skew-seconds",
                                          parse=integer, check=at_least(0),
                                          help="share rows of windows ending further ahead of this clock are "
                                               "dead-lettered")
    duration_seconds: float | None = setting(None, flag="--duration", parse=number, check=greater_than(0),
                                             help="stop after this many seconds", default_text="until SIGTERM/SIGINT")
    log_level: str = setting("INFO", env="GPUMETER_LOG_LEVEL", flag="--log-level",
                             help="DEBUG | INFO | WARNING | ERROR")

    def __post_init__(self) -> None:
        validate(self)
        object.__setattr__(self, "split_policy", SplitPolicy.from_env(
            {variable: text for variable, text in ((_SPLIT_RULE_ENV, self.split_rule),
                                                   (_GPU_FRACTION_ENV, self.gpu_fraction),
                                                   (_SPLIT_WEIGHTS_ENV, self.split_weights)) if text}))
        if not self.consumer_group:
            object.__setattr__(self, "consumer_group", f"{self.kafka.topic_prefix}{DEFAULT_CONSUMER_GROUP}")
        if not (0 < self.ledger_retry_initial_seconds <= self.ledger_retry_max_seconds):
            raise ConfigError("ledger retry backoff needs 0 < initial <= max seconds")
        if self.max_poll_interval_seconds <= self.ledger_retry_max_seconds:
            raise ConfigError("max poll interval must exceed the longest ledger retry pause")

    def __repr__(self) -> str:
        return settings_repr(self)

    def price_catalog(self) -> PriceCatalog:
        """Load the price files, the override CSV and the spot discounts (``ConfigError`` when unusable)."""
        try:
            return PriceCatalog.load(self.price_dir, self.price_override_csv, spot_discounts=self.spot_discounts)
        except PriceError as exc:
            raise ConfigError(f"price catalog: {exc}") from exc

    def describe(self) -> dict[str, Any]:
        """Printable view: secrets masked (Kafka SASL password, ledger URL password)."""
        return describe(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The billing service's flags (each overrides its ``GPUMETER_*`` variable), from ``BillingSettings``' fields."""
    config.add_arguments(parser, BillingSettings)


def billing_settings(args: argparse.Namespace, env: Mapping[str, str]) -> BillingSettings:
    """``load(BillingSettings, args, env)``: flags over env over defaults; ``ConfigError`` for anything unusable."""
    return load(BillingSettings, args, env)
