"""Settings shared by every service, read once at an entrypoint into frozen objects and passed down.

Sources, later wins: defaults, ``GPUMETER_*`` environment variables, command-line flags. Secrets are kept out of
``repr`` and ``describe()`` (what services print at start); URLs are shown through ``gpumeter.redact.mask_url``, the
one masker.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from gpumeter.errors import ConfigError
from gpumeter.redact import SECRET_MARK
from schemas.catalog import TopicCatalog

DEFAULT_MAX_REQUEST_SIZE_BYTES = 1_048_576
"""aiokafka's default ``max_request_size``, and the broker's default ``message.max.bytes`` less its 12-byte slack."""


@dataclass(frozen=True)
class KafkaSettings:
    """How every client reaches Kafka. ``sasl_password`` never appears in repr or logs."""

    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = ""
    client_id: str = "gpumeter"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    compression_type: str = "lz4"
    replication_factor: int = 1  # for topics gpumeter creates; 3 on a production cluster
    # The largest record (batch) every producer sends; dead letters are sized from it (gpumeter.kafka.deadletter).
    max_request_size_bytes: int = DEFAULT_MAX_REQUEST_SIZE_BYTES

    _PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")

    def __post_init__(self) -> None:
        if isinstance(self.replication_factor, str):
            try:
                object.__setattr__(self, "replication_factor", int(self.replication_factor))
            except ValueError as exc:
                raise ConfigError(f"replication factor {self.replication_factor!r} is not a number") from exc
        if self.replication_factor < 1:
            raise ConfigError("replication factor must be at least 1")
        if isinstance(self.max_request_size_bytes, str):
            try:
                object.__setattr__(self, "max_request_size_bytes", int(self.max_request_size_bytes))
            except ValueError as exc:
                raise ConfigError(f"max request size {self.max_request_size_bytes!r} is not a number") from exc
        if self.max_request_size_bytes < 64 * 1024:
            raise ConfigError("the max request size must be at least 65536 bytes")
        if self.security_protocol not in self._PROTOCOLS:
            raise ConfigError(f"security protocol {self.security_protocol!r} is not one of {self._PROTOCOLS}")
        if self.security_protocol.startswith("SASL") and not (self.sasl_mechanism and self.sasl_username):
            raise ConfigError("SASL needs GPUMETER_KAFKA_SASL_MECHANISM and GPUMETER_KAFKA_SASL_USERNAME")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "KafkaSettings":
        prefix = "GPUMETER_KAFKA_"
        values: dict[str, Any] = {}
        bootstrap = env.get("KAFKA_BOOTSTRAP_SERVERS") or env.get(prefix + "BOOTSTRAP_SERVERS")
        if bootstrap:
            values["bootstrap_servers"] = bootstrap
        for f in fields(cls):
            if f.name.startswith("_") or f.name == "bootstrap_servers":
                continue
            raw = env.get(prefix + f.name.upper())
            if raw is not None:
                values[f.name] = raw
        return cls(**values)

    def with_flags(self, args: Any) -> "KafkaSettings":
        """These settings with a service's ``--bootstrap-servers`` and ``--topic-prefix`` flags on top (flags win
        over the environment; an empty prefix flag is a prefix)."""
        overrides: dict[str, Any] = {}
        if getattr(args, "bootstrap_servers", None):
            overrides["bootstrap_servers"] = args.bootstrap_servers
        if getattr(args, "topic_prefix", None) is not None:
            overrides["topic_prefix"] = args.topic_prefix
        return replace(self, **overrides) if overrides else self

    @property
    def catalog(self) -> TopicCatalog:
        return TopicCatalog(prefix=self.topic_prefix)

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for every aiokafka client (producer, consumer, admin)."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.security_protocol.startswith("SASL"):
            kwargs.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        if self.security_protocol in ("SSL", "SASL_SSL"):
            from aiokafka.helpers import create_ssl_context

            kwargs["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile
            )
        return kwargs

    def describe(self) -> dict[str, Any]:
        """Printable view with secrets masked."""
        view = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        if view.get("sasl_password"):
            view["sasl_password"] = SECRET_MARK
        return view


# Where every service's /metrics and /healthz server listens: all interfaces by default (a pod's IP is where
# Prometheus scrapes it); ``gpumeter run`` passes the loopback address, its processes share one machine.
METRICS_ADDRESS_ENV = "GPUMETER_METRICS_ADDRESS"
DEFAULT_METRICS_ADDRESS = "0.0.0.0"
LOOPBACK_METRICS_ADDRESS = "127.0.0.1"
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_HOST_LABEL}(\.{_HOST_LABEL})*")


def check_metrics_address(address: str) -> str:
    """``address`` (an IPv4 or IPv6 literal, or a host name) stripped; ``ConfigError`` for anything else, so a typo
    fails at start instead of binding somewhere unexpected."""
    value = address.strip()
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if _HOST_NAME.fullmatch(value):
        return value
    raise ConfigError(f"metrics address {address!r} is not an IP address or host name")


def add_metrics_address_argument(parser: Any) -> None:
    """The ``--metrics-address`` flag every service has (env ``GPUMETER_METRICS_ADDRESS``)."""
    parser.add_argument("--metrics-address", dest="metrics_address",
                        help=f"address the /metrics and /healthz server listens on (env {METRICS_ADDRESS_ENV}, "
                             f"default {DEFAULT_METRICS_ADDRESS}: every interface)")


def env_snapshot() -> dict[str, str]:
    """The process environment, read once by an entrypoint."""
    return dict(os.environ)
