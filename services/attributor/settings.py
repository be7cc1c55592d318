"""The attributor's frozen settings: flags over ``GPUMETER_*`` env over defaults, read once by ``main``."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpumeter.errors import ConfigError
from gpumeter.settings import DEFAULT_METRICS_ADDRESS, METRICS_ADDRESS_ENV, KafkaSettings, check_metrics_address
from gpumeter.validation import DEFAULT_MAX_SAMPLE_AGE_SECONDS
from services.attributor.attribution import AttributionPolicy
from services.attributor.engine import EngineConfig
from services.attributor.pod_index import DEFAULT_GROUPING_LABELS

STORES = ("memory://", "rocksdb://")
APP_ID_SUFFIX = "gpumeter-attributor"


IDLE_SPREAD_MOVED = (
    "GPUMETER_IDLE_HANDLING=spread (--idle-handling spread) is no longer the attributor's: sharing idle cost to pods "
    "is billing's sharing policy now. Set GPUMETER_BILLING_SHARING=idle=weighted (--sharing idle=weighted) on the "
    "billing service, and remove GPUMETER_IDLE_HANDLING here (the attributor always keeps IDLE as its own row)")


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
    * ``max_sample_age_seconds``: ticks sampled longer ago than this are dead-lettered (``OUT_OF_RANGE``): no
      collector buffers that long and the samples topic keeps one day.
    * ``app_id``: Faust app id = consumer group and changelog topic prefix; default ``<topic prefix>`` +
      ``gpumeter-attributor``.
    * ``store``: ``memory://`` (tables rebuilt from their changelogs at start) or ``rocksdb://`` (local state
      kept in ``data_dir``; needs the ``rocksdict`` package).
    * ``data_dir``: Faust's data folder; None lets ``main`` make a fresh one per worker (memory store only).
    * ``partitions``: the input topics' partition count; None lets ``main`` read it from the broker.
    * ``topic_replication_factor``: replication of the changelog topics Faust creates.
    * ``session_timeout_seconds``: consumer-group session timeout: how long a worker that died without leaving
      holds its partitions before the group moves them (the broker allows 6 s and up by default).
    * ``metrics_port``: Prometheus ``/metrics`` port, 0 for none; ``metrics_address``: where it listens.
    * ``grouping_labels``: the pod labels share rows carry (``GPUMETER_GROUPING_LABELS``, comma-separated; default
      ``team,model``). Every other label is left out of the rows and the pod table; rows say which keys they carry
      (``GpuShare.carried_label_keys``). Billing's and the guard's team label and every
      ``gpumeter report --by label:<key>`` key must be among them.
    """

    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    window_seconds: int = 60
    grace_seconds: int = 10
    idle_close_seconds: int = 30
    cost_basis: str = "memory"
    idle_handling: str = "keep"
    mps_compute: str = "memory"
    pod_linger_seconds: int = 900
    max_clock_skew_seconds: int = 120
    max_sample_age_seconds: int = DEFAULT_MAX_SAMPLE_AGE_SECONDS
    app_id: str = ""
    store: str = "memory://"
    data_dir: Path | None = None
    partitions: int | None = None
    topic_replication_factor: int = 1
    session_timeout_seconds: float = 30.0
    metrics_port: int = 9403
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    log_level: str = "INFO"
    duration_seconds: float | None = None
    grouping_labels: tuple[str, ...] = DEFAULT_GROUPING_LABELS

    def __post_init__(self) -> None:
        keys = self.grouping_labels
        object.__setattr__(self, "grouping_labels",
                           parse_label_keys(keys if isinstance(keys, str) else ",".join(keys)))
        if not self.app_id:
            object.__setattr__(self, "app_id", f"{self.kafka.topic_prefix}{APP_ID_SUFFIX}")
        if self.store not in STORES:
            raise ConfigError(f"store {self.store!r} is not one of {', '.join(STORES)}")
        if self.partitions is not None and self.partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {self.partitions}")
        if self.topic_replication_factor < 1:
            raise ConfigError(f"topic replication factor must be >= 1, got {self.topic_replication_factor}")
        if self.pod_linger_seconds < self.window_seconds + self.grace_seconds:
            raise ConfigError(
                f"pod linger ({self.pod_linger_seconds} s) must be at least window + grace "
                f"({self.window_seconds + self.grace_seconds} s), or windows closing after a pod ended lose its name"
            )
        if self.session_timeout_seconds <= 0:
            raise ConfigError(f"session timeout must be positive, got {self.session_timeout_seconds}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port {self.metrics_port} is not a port")
        object.__setattr__(self, "metrics_address", check_metrics_address(self.metrics_address))
        if self.duration_seconds is not None and self.duration_seconds <= 0:
            raise ConfigError("duration must be positive")
        idle = self.idle_handling.strip().lower()
        if idle == "spread":
            raise ConfigError(IDLE_SPREAD_MOVED)
        if idle != "keep":
            raise ConfigError(f"idle handling {self.idle_handling!r} is not keep (deprecated: see "
                              "GPUMETER_BILLING_SHARING on billing)")
        # Fail at start, not at the first window: the engine config and the policy validate themselves.
        self.engine_config()

    @property
    def policy(self) -> AttributionPolicy:
        return AttributionPolicy.parse(self.cost_basis, self.mps_compute)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            window_seconds=self.window_seconds,
            grace_seconds=self.grace_seconds,
            idle_close_seconds=self.idle_close_seconds,
            max_clock_skew_seconds=self.max_clock_skew_seconds,
            max_sample_age_seconds=self.max_sample_age_seconds,
            pod_linger_ms=self.pod_linger_seconds * 1000,
            policy=self.policy,
            grouping_labels=tuple(self.grouping_labels),
        )

    def replace(self, **changes: Any) -> "AttributorSettings":
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """Printable view, secrets masked."""
        view = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items() if k != "kafka"}
        view["policy"] = self.policy.describe()
        view["kafka"] = self.kafka.describe()
        return view


def _int(text: str) -> int:
    return int(text)


def parse_label_keys(text: str) -> tuple[str, ...]:
    """``team, model`` → ``("model", "team")`` (sorted, without repeats); an empty text carries no label."""
    return tuple(sorted({key.strip() for key in text.split(",") if key.strip()}))


# setting -> (environment variable, converter, flag)
_OPTIONS: dict[str, tuple[str, Any, str]] = {
    "window_seconds": ("GPUMETER_WINDOW_SECONDS", _int, "--window-seconds"),
    "grace_seconds": ("GPUMETER_GRACE_SECONDS", _int, "--grace-seconds"),
    "idle_close_seconds": ("GPUMETER_IDLE_CLOSE_SECONDS", _int, "--idle-close-seconds"),
    "cost_basis": ("GPUMETER_COST_BASIS", str, "--cost-basis"),
    "idle_handling": ("GPUMETER_IDLE_HANDLING", str, "--idle-handling"),
    "mps_compute": ("GPUMETER_MPS_COMPUTE", str, "--mps-compute"),
    "pod_linger_seconds": ("GPUMETER_POD_LINGER_SECONDS", _int, "--pod-linger-seconds"),
    "max_clock_skew_seconds": ("GPUMETER_MAX_CLOCK_SKEW_SECONDS", _int, "--max-clock-skew-seconds"),
    "max_sample_age_seconds": ("GPUMETER_MAX_SAMPLE_AGE_SECONDS", _int, "--max-sample-age-seconds"),
    "app_id": ("GPUMETER_ATTRIBUTOR_APP_ID", str, "--app-id"),
    "store": ("GPUMETER_ATTRIBUTOR_STORE", str, "--store"),
    "data_dir": ("GPUMETER_ATTRIBUTOR_DATA_DIR", Path, "--data-dir"),
    "partitions": ("GPUMETER_ATTRIBUTOR_PARTITIONS", _int, "--partitions"),
    "topic_replication_factor": ("GPUMETER_TOPIC_REPLICATION_FACTOR", _int, "--topic-replication-factor"),
    "session_timeout_seconds": ("GPUMETER_SESSION_TIMEOUT_SECONDS", float, "--session-timeout-seconds"),
    "metrics_port": ("GPUMETER_METRICS_PORT", _int, "--metrics-port"),
    "metrics_address": (METRICS_ADDRESS_ENV, str, "--metrics-address"),
    "log_level": ("GPUMETER_LOG_LEVEL", str, "--log-level"),
    "duration_seconds": ("GPUMETER_DURATION_SECONDS", float, "--duration"),
    "grouping_labels": ("GPUMETER_GROUPING_LABELS", parse_label_keys, "--grouping-labels"),
}

_HELP = {
    "window_seconds": "tumbling window length in seconds (default 60)",
    "grace_seconds": "seconds after a window's end during which ticks still amend it (default 10)",
    "idle_close_seconds": "wall-clock seconds after end + grace before a silent node's window is closed (default 30)",
    "cost_basis": "memory | compute | blend:<alpha> | request (default memory)",
    "idle_handling": "deprecated: keep only; idle sharing is billing's --sharing idle=weighted",
    "mps_compute": "memory | threads (default memory)",
    "pod_linger_seconds": "seconds a deleted pod stays known (default 900)",
    "max_clock_skew_seconds": "ticks and pod events stamped further ahead of this clock are dead-lettered "
                              "(default 120)",
    "max_sample_age_seconds": f"ticks older than this are dead-lettered (default {DEFAULT_MAX_SAMPLE_AGE_SECONDS})",
    "app_id": "Faust app id: consumer group and changelog prefix (default <topic prefix>gpumeter-attributor)",
    "store": "table store: memory:// (default) or rocksdb://",
    "data_dir": "Faust data folder (default: a fresh temporary folder; required for rocksdb://)",
    "partitions": "input topics' partition count (default: read from the broker)",
    "topic_replication_factor": "replication factor of the changelog topics (default 1)",
    "session_timeout_seconds": "consumer-group session timeout in seconds (default 30)",
    "metrics_port": "Prometheus /metrics port, 0 for none (default 9403)",
    "metrics_address": f"address the /metrics server listens on (default {DEFAULT_METRICS_ADDRESS}: every interface)",
    "log_level": "DEBUG | INFO | WARNING | ERROR (default INFO)",
    "duration_seconds": "stop after this many seconds (default: run until SIGTERM/SIGINT)",
    "grouping_labels": "pod labels the share rows carry, comma-separated (default team,model)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, (variable, convert, flag) in _OPTIONS.items():
        kind = convert if convert in (float, Path) else (int if convert is _int else str)
        parser.add_argument(flag, dest=name, type=kind, help=f"{_HELP[name]}; env {variable}")
    parser.add_argument("--bootstrap-servers", help="Kafka bootstrap servers (env GPUMETER_KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--topic-prefix", help="prefix of every topic name (env GPUMETER_KAFKA_TOPIC_PREFIX)")


def attributor_settings(args: argparse.Namespace, env: Mapping[str, str]) -> AttributorSettings:
    """Settings from defaults, then ``GPUMETER_*`` env, then flags. Raises ConfigError on unusable values."""
    values: dict[str, Any] = {}
    for name, (variable, convert, _flag) in _OPTIONS.items():
        raw = env.get(variable)
        if raw:
            try:
                values[name] = convert(raw)
            except ValueError as exc:
                raise ConfigError(f"{variable}={raw!r}: {exc}") from None
    for name in _OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    kafka = KafkaSettings.from_env(env)
    if kafka.client_id == KafkaSettings().client_id:
        kafka = KafkaSettings(**{**kafka.__dict__, "client_id": "gpumeter-attributor"})
    values["kafka"] = kafka.with_flags(args)
    return AttributorSettings(**values)
