"""The collector's frozen settings: flags over ``GPUMETER_*`` env over defaults, read once by ``main``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpumeter.errors import ConfigError
from gpumeter.redact import mask_url
from gpumeter.settings import (
    DEFAULT_METRICS_ADDRESS,
    METRICS_ADDRESS_ENV,
    KafkaSettings,
    add_metrics_address_argument,
    check_metrics_address,
)
from services.collector.nodefacts import NodeFactOverrides


@dataclass(frozen=True)
class CollectorSettings:
    node_name: str
    cluster: str = "default"
    interval_seconds: float = 1.0
    simulate: Path | None = None
    time_scale: float = 1.0
    duration_seconds: float | None = None
    kubelet_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    kubelet_timeout_seconds: float = 2.0
    kubelet_refresh_seconds: float = 10.0
    proc_root: Path = Path("/proc")
    kube_api: str = "in-cluster"  # "in-cluster", "none", or an API server URL
    # Node facts the configuration sets (the ConfigMap): each one set here overrides the node's own (its Node
    # object's labels and providerID, read at start); None leaves it to the Node.
    cloud_provider: str | None = None
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    price_model: str | None = None
    provider_id: str | None = None
    sharing_config: str = ""  # "<gpu uuid or *>=<exclusive|time_slicing:N|mps:N>[,...]" for facts NVML lacks
    buffer_max_records: int = 10_000
    delivery_timeout_seconds: float = 10.0  # past this an unacknowledged record is resent from the buffer
    metrics_port: int = 9402
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    log_level: str = "INFO"
    kafka: KafkaSettings = field(default_factory=KafkaSettings)

    def __post_init__(self) -> None:
        if not self.node_name:
            raise ConfigError("the collector needs --node or GPUMETER_NODE_NAME")
        if self.interval_seconds <= 0:
            raise ConfigError("interval must be positive")
        if self.time_scale <= 0:
            raise ConfigError("time scale must be positive")
        if self.price_model is not None and self.price_model not in ("on_demand", "spot", "committed"):
            raise ConfigError(f"price model {self.price_model!r} is not on_demand, spot or committed")
        if self.buffer_max_records < 1:
            raise ConfigError("buffer must hold at least one record")
        object.__setattr__(self, "metrics_address", check_metrics_address(self.metrics_address))

    @property
    def node_fact_overrides(self) -> NodeFactOverrides:
        return NodeFactOverrides(self.cloud_provider, self.region, self.zone, self.instance_type, self.price_model,
                                 self.provider_id)

    def describe(self) -> dict[str, Any]:
        view = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items() if k != "kafka"}
        view["kube_api"] = mask_url(self.kube_api)  # an API server URL may carry credentials
        view["kafka"] = self.kafka.describe()
        return view


_ENV = {
    "node_name": ("GPUMETER_NODE_NAME", str),
    "cluster": ("GPUMETER_CLUSTER", str),
    "interval_seconds": ("GPUMETER_INTERVAL_SECONDS", float),
    "simulate": ("GPUMETER_SIMULATE", Path),
    "time_scale": ("GPUMETER_TIME_SCALE", float),
    "kubelet_socket": ("GPUMETER_KUBELET_SOCKET", Path),
    "proc_root": ("GPUMETER_PROC_ROOT", Path),
    "kube_api": ("GPUMETER_KUBE_API", str),
    "cloud_provider": ("GPUMETER_CLOUD_PROVIDER", str),
    "region": ("GPUMETER_REGION", str),
    "zone": ("GPUMETER_ZONE", str),
    "instance_type": ("GPUMETER_INSTANCE_TYPE", str),
    "price_model": ("GPUMETER_PRICE_MODEL", str),
    "provider_id": ("GPUMETER_PROVIDER_ID", str),
    "sharing_config": ("GPUMETER_SHARING", str),
    "buffer_max_records": ("GPUMETER_BUFFER_MAX_RECORDS", int),
    "delivery_timeout_seconds": ("GPUMETER_DELIVERY_TIMEOUT_SECONDS", float),
    "metrics_port": ("GPUMETER_METRICS_PORT", int),
    "metrics_address": (METRICS_ADDRESS_ENV, str),
    "log_level": ("GPUMETER_LOG_LEVEL", str),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", dest="node_name", help="node name (env GPUMETER_NODE_NAME)")
    parser.add_argument("--cluster", help="cluster name")
    parser.add_argument("--simulate", type=Path, metavar="SCENARIO", help="run against the NVML simulator")
    parser.add_argument("--interval", dest="interval_seconds", type=float, help="seconds between ticks")
    parser.add_argument("--time-scale", type=float, help="simulated seconds per real second (simulate only)")
    parser.add_argument("--duration", dest="duration_seconds", type=float, help="stop after this many seconds")
    parser.add_argument("--kubelet-socket", type=Path)
    parser.add_argument("--proc-root", type=Path)
    parser.add_argument("--kube-api", help="in-cluster | none | API server URL")
    parser.add_argument("--metrics-port", type=int)
    add_metrics_address_argument(parser)
    parser.add_argument("--bootstrap-servers", help="Kafka bootstrap servers")
    parser.add_argument("--topic-prefix")


def collector_settings(args: argparse.Namespace, env: Mapping[str, str]) -> CollectorSettings:
    values: dict[str, Any] = {}
    for name, (variable, convert) in _ENV.items():
        if env.get(variable):
            try:
                values[name] = convert(env[variable])
            except ValueError as exc:
                raise ConfigError(f"{variable}={env[variable]!r}: {exc}") from exc
    for name in ("node_name", "cluster", "simulate", "interval_seconds", "time_scale", "duration_seconds",
                 "kubelet_socket", "proc_root", "kube_api", "metrics_port", "metrics_address"):
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    kafka = KafkaSettings.from_env(env).with_flags(args)
    if not values.get("node_name"):
        raise ConfigError("the collector needs --node or GPUMETER_NODE_NAME")
    values["kafka"] = KafkaSettings(**{**kafka.__dict__, "client_id": f"gpumeter-collector-{values['node_name']}"})
    return CollectorSettings(**values)
