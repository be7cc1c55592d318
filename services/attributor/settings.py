"""The attributor's frozen settings: flags over ``GPUMETER_*`` env over defaults, read once by ``main``."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
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
    number,
    one_of,
    path,
    setting,
    validate,
)
from gpumeter.errors import ConfigError
from gpumeter.clockskew import DEFAULT_CLOCK_SKEW_THRESHOLD_SECONDS
from gpumeter.settings import DeadLetterHealthSettings, KafkaSettings, metrics_address_setting
from gpumeter.validation import DEFAULT_MAX_SAMPLE_AGE_SECONDS
from services.attributor.attribution import AttributionPolicy
from services.attributor.engine import EngineConfig
from schemas.pods import GroupingLabelSources
from services.attributor.pod_index import DEFAULT_GROUPING_LABELS

STORES = ("memory://", "rocksdb://")
APP_ID_SUFFIX = "gpumeter-attributor"


IDLE_SPREAD_MOVED = (
    "GPUMETER_IDLE_HANDLING=spread (--idle-handling spread) is no longer the attributor's: sharing idle cost to pods "
    "is billing's sharing policy now. Set GPUMETER_BILLING_SHARING=idle=weighted (--sharing idle=weighted) on the "
    "billing service, and remove GPUMETER_IDLE_HANDLING here (the attributor always keeps IDLE as its own row)")


def parse_label_keys(text: str) -> tuple[str, ...]:
    """``team, model`` → ``("model", "team")`` (sorted, without repeats); an empty text carries no label."""
    return tuple(sorted({key.strip() for key in text.split(",") if key.strip()}))


def parse_label_sources(text: str) -> GroupingLabelSources:
    """``namespace,pod`` or ``team=namespace;model=namespace,pod`` → ``GroupingLabelSources`` (empty: ``pod``);
    ``ConfigError`` for anything else."""
    try:
        return GroupingLabelSources.parse(text)
    except ValueError as exc:
        raise ConfigError(f"grouping label source {exc}") from None


def _cost_basis(value: str) -> str:
    AttributionPolicy.parse(value, "memory")
    return value


def _mps_compute(value: str) -> str:
    AttributionPolicy.parse("memory", value)
    return value


def _idle_handling(value: str) -> str:
    """``keep`` (the only behaviour); ``spread`` is refused with ``IDLE_SPREAD_MOVED``, since ignoring it would
    change what pods pay."""
    idle = value.strip().lower()
    if idle == "spread":
        raise ConfigError(IDLE_SPREAD_MOVED)
    if idle != "keep":
        raise ConfigError(f"idle handling {value!r} is not keep (deprecated: see GPUMETER_BILLING_SHARING on billing)")
    return value


@dataclass(frozen=True)
class AttributorSettings:
    """Everything the streaming attributor reads at start.

    * ``window_seconds``/``grace_seconds``: tumbling windows and how long after its end a window still takes ticks.
    * ``idle_close_seconds``: wall-clock allowance after end + grace before a silent node's window is closed by the
      timer (only while the input is caught up).
    * ``cost_basis`` (``memory`` | ``compute`` | ``blend:<alpha>`` | ``request``), ``mps_compute`` (``memory`` |
      ``threads``): the attribution policy.
    * ``idle_handling``: deprecated. IDLE is always a row of its own here; sharing it to pods is billing's sharing
      policy (``GPUMETER_BILLING_SHARING``). ``keep`` is accepted (it is what the attributor does); ``spread`` is
      refused with ``IDLE_SPREAD_MOVED`` rather than silently ignored, since it would change what pods pay.
    * ``pod_linger_seconds``: how long a deleted pod stays known, for windows that close after it ended.
    * ``max_clock_skew_seconds``: ticks sampled, and pod events observed, further in the future than the clock plus
      this are dead-lettered (``OUT_OF_RANGE``).
    * ``clock_skew_threshold_seconds``: a node whose clock reads further off the broker's append time than this has
      its ticks' and pod events' times corrected by its measured offset (``gpumeter.clockskew``), so it is billed in
      the windows it really sampled in; reported as ``gpumeter_attributor_node_clock_skew_seconds``.
    * ``max_sample_age_seconds``: ticks sampled longer ago than this are dead-lettered (``OUT_OF_RANGE``): no
      collector buffers that long and the samples topic keeps one day.
    * ``app_id``: Faust app id = consumer group and changelog topic prefix; default ``<topic prefix>`` +
      ``gpumeter-attributor``.
    * ``store``: ``memory://`` (tables rebuilt from their changelogs at start) or ``rocksdb://`` (local state
      kept in ``data_dir``; needs the ``rocksdict`` package).
    * ``data_dir``: Faust's data folder; None lets ``main`` make a fresh one per worker (memory store only).
    * ``partitions``: the input topics' partition count; None lets ``main`` read it from the broker.
    * ``topic_replication_factor``: replication of the changelog topics Faust creates.
    * ``table_standby_replicas``: how many other workers keep a standby copy of each partition's tables by
      reading their changelogs (Faust's ``table_standby_replicas``). Default 0: a partition that moves is rebuilt
      from its changelog, its pod events and its samples anyway (``AttributorStream._rebuild``), so a standby
      only shortens the changelog read, and it costs every worker a full read of the others' changelogs at
      every start and every rebalance (measured in ``make bench``'s scale-out phase: docs/performance.md).
    * ``session_timeout_seconds``: consumer-group session timeout: how long a worker that died without leaving
      holds its partitions before the group moves them (the broker allows 6 s and up by default).
    * ``metrics_port``: Prometheus ``/metrics`` port, 0 for none; ``metrics_address``: where it listens.
    * ``grouping_labels``: the pod labels share rows carry (``GPUMETER_GROUPING_LABELS``, comma-separated; default
      ``team,model``). Every other label is left out of the rows and the pod table; rows say which keys they carry
      (``GpuShare.carried_label_keys``). Billing's and the guard's team label and every
      ``gpumeter report --by label:<key>`` key must be among them.
    * ``grouping_label_source``: where each grouping label's value comes from (``GPUMETER_GROUPING_LABEL_SOURCE``):
      ``pod`` (the default: the pod's own labels, which whoever creates the pod writes), ``namespace`` (the
      labels of the pod's Namespace object, which the platform writes; the collector carries them on
      ``PodEvent.namespace_labels``), ``namespace,pod`` (the namespace's, else the pod's), or per key,
      ``team=namespace;model=namespace,pod`` (keys not named: the entry without ``<key>=``, else ``pod``).
      The resolved value is the row's label: billing, reports, FOCUS and the API read it as before.
    """

    kafka: KafkaSettings = nested(KafkaSettings, client_id="gpumeter-attributor")
    dead_letters: DeadLetterHealthSettings = nested(DeadLetterHealthSettings)
    window_seconds: int = setting(60, env="GPUMETER_WINDOW_SECONDS", flag="--window-seconds", parse=integer,
                                  help="tumbling window length in seconds")
    grace_seconds: int = setting(10, env="GPUMETER_GRACE_SECONDS", flag="--grace-seconds", parse=integer,
                                 help="seconds after a window's end during which ticks still amend it")
    idle_close_seconds: int = setting(30, env="GPUMETER_IDLE_CLOSE_SECONDS", flag="--idle-close-seconds",
                                      parse=integer,
                                      help="wall-clock seconds after end + grace before a silent node's window is "
                                           "closed")
    cost_basis: str = setting("memory", env="GPUMETER_COST_BASIS", flag="--cost-basis", check=_cost_basis,
                              help="memory | compute | blend:<alpha> | request")
    idle_handling: str = setting("keep", env="GPUMETER_IDLE_HANDLING", flag="--idle-handling", check=_idle_handling,
                                 help="deprecated: keep only; idle sharing is billing's --sharing idle=weighted")
    mps_compute: str = setting("memory", env="GPUMETER_MPS_COMPUTE", flag="--mps-compute", check=_mps_compute,
                               help="memory | threads")
    mps_thread_annotation: str = setting("", env="GPUMETER_MPS_THREAD_ANNOTATION", flag="--mps-thread-annotation",
                                         help="a pod annotation the platform writes (e.g. an admission webhook) "
                                              "whose value is a pod's MPS active-thread percentage for "
                                              "--mps-compute threads; empty: none is read (a pod's owner writes its "
                                              "annotations)")
    pod_linger_seconds: int = setting(900, env="GPUMETER_POD_LINGER_SECONDS", flag="--pod-linger-seconds",
                                      parse=integer, help="seconds a deleted pod stays known")
    max_clock_skew_seconds: int = setting(120, env="GPUMETER_MAX_CLOCK_SKEW_SECONDS", flag="--max-clock-skew-seconds",
                                          parse=integer,
                                          help="ticks and pod events stamped further ahead of this clock are "
                                               "dead-lettered")
    clock_skew_threshold_seconds: int = setting(DEFAULT_CLOCK_SKEW_THRESHOLD_SECONDS,
                                                env="GPUMETER_CLOCK_SKEW_THRESHOLD_SECONDS",
                                                flag="--clock-skew-threshold-seconds", parse=integer,
                                                check=at_least(0),
                                                help="a node's clock further off the broker's than this is "
                                                     "corrected")
    max_sample_age_seconds: int = setting(DEFAULT_MAX_SAMPLE_AGE_SECONDS, env="GPUMETER_MAX_SAMPLE_AGE_SECONDS",
                                          flag="--max-sample-age-seconds", parse=integer,
                                          help="ticks older than this are dead-lettered")
    app_id: str = setting("", env="GPUMETER_ATTRIBUTOR_APP_ID", flag="--app-id",
                          default_text=f"<topic prefix>{APP_ID_SUFFIX}",
                          help="Faust app id: consumer group and changelog prefix")
    store: str = setting("memory://", env="GPUMETER_ATTRIBUTOR_STORE", flag="--store", check=one_of(*STORES),
                         help="table store: memory:// or rocksdb://")
    data_dir: Path | None = setting(None, env="GPUMETER_ATTRIBUTOR_DATA_DIR", flag="--data-dir", parse=path,
                                    default_text="a fresh temporary folder; required for rocksdb://",
                                    help="Faust data folder")
    partitions: int | None = setting(None, env="GPUMETER_ATTRIBUTOR_PARTITIONS", flag="--partitions", parse=integer,
                                     check=at_least(1), default_text="read from the broker",
                                     help="input topics' partition count")
    topic_replication_factor: int = setting(1, env="GPUMETER_TOPIC_REPLICATION_FACTOR",
                                            flag="--topic-replication-factor", parse=integer, check=at_least(1),
                                            help="replication factor of the changelog topics")
    table_standby_replicas: int = setting(0, env="GPUMETER_ATTRIBUTOR_TABLE_STANDBY_REPLICAS",
                                          flag="--table-standby-replicas", parse=integer, check=at_least(0),
                                          help="workers that keep a standby copy of each partition's tables")
    session_timeout_seconds: float = setting(30.0, env="GPUMETER_SESSION_TIMEOUT_SECONDS",
                                             flag="--session-timeout-seconds", parse=number, check=greater_than(0),
                                             help="consumer-group session timeout in seconds")
    metrics_port: int = setting(9403, env="GPUMETER_METRICS_PORT", flag="--metrics-port", parse=integer,
                                check=between(0, 65535), help="Prometheus /metrics port, 0 for none")
    metrics_address: str = metrics_address_setting()
    log_level: str = setting("INFO", env="GPUMETER_LOG_LEVEL", flag="--log-level",
                             help="DEBUG | INFO | WARNING | ERROR")
    duration_seconds: float | None = setting(None, env="GPUMETER_DURATION_SECONDS", flag="--duration", parse=number,
                                             check=greater_than(0), help="stop after this many seconds",
                                             default_text="run until SIGTERM/SIGINT")
    grouping_labels: tuple[str, ...] = setting(DEFAULT_GROUPING_LABELS, env="GPUMETER_GROUPING_LABELS",
                                               flag="--grouping-labels", parse=parse_label_keys,
                                               check=lambda keys: parse_label_keys(",".join(keys)),
                                               default_text="team,model",
                                               help="pod labels the share rows carry, comma-separated")
    grouping_label_source: GroupingLabelSources = setting(
        GroupingLabelSources(), env="GPUMETER_GROUPING_LABEL_SOURCE", flag="--grouping-label-source",
        parse=parse_label_sources, default_text="pod",
        help="where grouping labels come from: pod | namespace | namespace,pod, or per key: "
             "team=namespace;model=namespace,pod")

    def __post_init__(self) -> None:
        validate(self)
        if not self.app_id:
            object.__setattr__(self, "app_id", f"{self.kafka.topic_prefix}{APP_ID_SUFFIX}")
        if self.pod_linger_seconds < self.window_seconds + self.grace_seconds:
            raise ConfigError(
                f"pod linger ({self.pod_linger_seconds} s) must be at least window + grace "
                f"({self.window_seconds + self.grace_seconds} s), or windows closing after a pod ended lose its name"
            )
        # Fail at start, not at the first window: the engine config and the policy validate themselves.
        self.engine_config()

    @property
    def policy(self) -> AttributionPolicy:
        return AttributionPolicy.parse(self.cost_basis, self.mps_compute, self.mps_thread_annotation)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            window_seconds=self.window_seconds,
            grace_seconds=self.grace_seconds,
            idle_close_seconds=self.idle_close_seconds,
            max_clock_skew_seconds=self.max_clock_skew_seconds,
            max_sample_age_seconds=self.max_sample_age_seconds,
            clock_skew_threshold_seconds=self.clock_skew_threshold_seconds,
            pod_linger_ms=self.pod_linger_seconds * 1000,
            policy=self.policy,
            grouping_labels=tuple(self.grouping_labels),
            grouping_label_sources=self.grouping_label_source,
        )

    def replace(self, **changes: Any) -> "AttributorSettings":
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """Printable view, secrets masked, with the policy as text."""
        return {**describe(self), "policy": self.policy.describe(),
                "grouping_label_source": self.grouping_label_source.describe()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The attributor's flags (each overrides its ``GPUMETER_*`` variable), from ``AttributorSettings``' fields."""
    config.add_arguments(parser, AttributorSettings)


def attributor_settings(args: argparse.Namespace, env: Mapping[str, str]) -> AttributorSettings:
    """``load(AttributorSettings, args, env)``: flags over env over defaults; ``ConfigError`` for anything
    unusable."""
    return load(AttributorSettings, args, env)
