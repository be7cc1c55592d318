"""The collector's frozen settings: flags over ``GPUMETER_*`` env over defaults, read once by ``main``."""

from __future__ import annotations

import argparse
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
    non_empty,
    number,
    one_of,
    path,
    setting,
    settings_repr,
    validate,
)
from gpumeter.redact import mask_url
from gpumeter.settings import KafkaSettings, metrics_address_setting
from services.collector.nodefacts import NodeFactOverrides


DEFAULT_CLUSTER = "default"
"""The cluster a collector reports when neither ``--cluster``/``GPUMETER_CLUSTER`` nor a simulated scenario names
one."""


@dataclass(frozen=True)
class CollectorSettings:
    """Everything the per-node collector reads at start. Node facts set here (the ConfigMap's
    ``GPUMETER_CLOUD_PROVIDER`` ... ``GPUMETER_PROVIDER_ID``) override the node's own (its Node object's labels and
    providerID, read at start); None leaves each to the Node. The Kafka client id is
    ``gpumeter-collector-<node>`` unless ``GPUMETER_KAFKA_CLIENT_ID`` is set."""

    node_name: str = setting(env="GPUMETER_NODE_NAME", flag="--node", check=non_empty, help="node name")
    # None: not set; the cluster then is the simulated scenario's, or DEFAULT_CLUSTER (``cluster_for``).
    cluster: str | None = setting(None, env="GPUMETER_CLUSTER", flag="--cluster", check=non_empty, help="cluster name",
                                  default_text=f"the scenario's cluster with --simulate, else {DEFAULT_CLUSTER}")
    interval_seconds: float = setting(1.0, env="GPUMETER_INTERVAL_SECONDS", flag="--interval", parse=number,
                                      check=greater_than(0), help="seconds between ticks")
    simulate: Path | None = setting(None, env="GPUMETER_SIMULATE", flag="--simulate", parse=path, metavar="SCENARIO",
                                    help="run against the NVML simulator")
    time_scale: float = setting(1.0, env="GPUMETER_TIME_SCALE", flag="--time-scale", parse=number,
                                check=greater_than(0), help="simulated seconds per real second (simulate only)")
    duration_seconds: float | None = setting(None, flag="--duration", parse=number, check=greater_than(0),
                                             help="stop after this many seconds", default_text="until SIGTERM/SIGINT")
    kubelet_socket: Path = setting(Path("/var/lib/kubelet/pod-resources/kubelet.sock"), env="GPUMETER_KUBELET_SOCKET",
                                   flag="--kubelet-socket", parse=path, help="the kubelet's PodResources socket")
    kubelet_timeout_seconds: float = 2.0
    kubelet_refresh_seconds: float = 10.0
    proc_root: Path = setting(Path("/proc"), env="GPUMETER_PROC_ROOT", flag="--proc-root", parse=path,
                              help="the host's /proc")
    # An API server URL may carry credentials: shown masked.
    kube_api: str = setting("in-cluster", env="GPUMETER_KUBE_API", flag="--kube-api", mask=mask_url,
                            help="in-cluster | none | API server URL")
    cloud_provider: str | None = setting(None, env="GPUMETER_CLOUD_PROVIDER", help="node fact: cloud provider")
    region: str | None = setting(None, env="GPUMETER_REGION", help="node fact: region")
    zone: str | None = setting(None, env="GPUMETER_ZONE", help="node fact: zone")
    instance_type: str | None = setting(None, env="GPUMETER_INSTANCE_TYPE", help="node fact: instance type")
    price_model: str | None = setting(None, env="GPUMETER_PRICE_MODEL", check=one_of("on_demand", "spot", "committed"),
                                      help="node fact: on_demand | spot | committed")
    provider_id: str | None = setting(None, env="GPUMETER_PROVIDER_ID", help="node fact: the cloud providerID")
    sharing_config: str = setting("", env="GPUMETER_SHARING", default_text="none",
                                  help="<gpu uuid or *>=<exclusive|time_slicing:N|mps:N>[,...] for facts NVML lacks")
    buffer_max_records: int = setting(10_000, env="GPUMETER_BUFFER_MAX_RECORDS", parse=integer, check=at_least(1),
                                      help="records buffered while Kafka is unreachable")
    delivery_timeout_seconds: float = setting(10.0, env="GPUMETER_DELIVERY_TIMEOUT_SECONDS", parse=number,
                                              check=greater_than(0),
                                              help="past this an unacknowledged record is resent from the buffer")
    metrics_port: int = setting(9402, env="GPUMETER_METRICS_PORT", flag="--metrics-port", parse=integer,
                                check=between(0, 65535), help="Prometheus /metrics port, 0 disables")
    metrics_address: str = metrics_address_setting()
    log_level: str = setting("INFO", env="GPUMETER_LOG_LEVEL", help="DEBUG | INFO | WARNING | ERROR")
    kafka: KafkaSettings = nested(KafkaSettings, client_id=lambda values: f"gpumeter-collector-{values['node_name']}")

    def __post_init__(self) -> None:
        validate(self)

    @property
    def node_fact_overrides(self) -> NodeFactOverrides:
        return NodeFactOverrides(self.cloud_provider, self.region, self.zone, self.instance_type, self.price_model,
                                 self.provider_id)

    def cluster_for(self, scenario_cluster: str | None) -> str:
        """The cluster the collector reports: ``--cluster``/``GPUMETER_CLUSTER`` when set, else the simulated
        scenario's ``cluster`` (``scenario_cluster``; None outside simulate mode), else ``DEFAULT_CLUSTER``."""
        return self.cluster or scenario_cluster or DEFAULT_CLUSTER

    def __repr__(self) -> str:
        return settings_repr(self)

    def describe(self) -> dict[str, Any]:
        """Printable view: secrets masked (Kafka SASL password, an API server URL's password)."""
        return describe(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The collector's flags (each overrides its ``GPUMETER_*`` variable), from ``CollectorSettings``' fields."""
    config.add_arguments(parser, CollectorSettings)


def collector_settings(args: argparse.Namespace, env: Mapping[str, str]) -> CollectorSettings:
    """``load(CollectorSettings, args, env)``: flags over env over defaults; ``ConfigError`` for anything unusable."""
    return load(CollectorSettings, args, env)
