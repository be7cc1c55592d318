"""Settings shared by every service, read once at an entrypoint into frozen objects and passed down.

``KafkaSettings`` (nested in every service's settings), the metrics address every service has, and the process
environment snapshot. They are declared and loaded like every other settings class, by ``gpumeter.config`` (flags
over ``GPUMETER_*`` environment variables over defaults; secrets kept out of ``repr``, ``describe()`` and errors).
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from gpumeter.config import (
    at_least,
    check_client_id,
    describe,
    greater_than,
    integer,
    load,
    non_empty,
    number,
    one_of,
    setting,
    validate,
)
from gpumeter.errors import ConfigError
from gpumeter.health import (
    DEFAULT_DEAD_LETTER_MAX_RATIO,
    DEFAULT_DEAD_LETTER_MIN_INPUTS,
    DEFAULT_DEAD_LETTER_WINDOW_SECONDS,
)
from gpumeter.redact import SECRET_MARK  # noqa: F401 - re-exported: tests import the mark from here
from schemas.catalog import TopicCatalog

DEFAULT_MAX_REQUEST_SIZE_BYTES = 1_048_576
"""aiokafka's default ``max_request_size``, and the broker's default ``message.max.bytes`` less its 12-byte slack."""
DEFAULT_PRODUCER_BATCH_MAX_BYTES = 512 * 1024
"""Half the default request: room for several partitions' batches in one produce request."""
_KAFKA = "GPUMETER_KAFKA_"


_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


@dataclass(frozen=True)
class KafkaSettings:
    """How every client reaches Kafka, from ``GPUMETER_KAFKA_<FIELD>`` variables (``KAFKA_BOOTSTRAP_SERVERS`` wins
    over ``GPUMETER_KAFKA_BOOTSTRAP_SERVERS``) and the ``--bootstrap-servers`` and ``--topic-prefix`` flags.
    ``sasl_password`` never appears in repr, logs or errors. ``client_id``: ``GPUMETER_KAFKA_CLIENT_ID`` when set,
    else the default of the service that nests these settings (``gpumeter-<service>``), else ``gpumeter``."""

    bootstrap_servers: str = setting("127.0.0.1:9092", env=("KAFKA_BOOTSTRAP_SERVERS", _KAFKA + "BOOTSTRAP_SERVERS"),
                                     flag="--bootstrap-servers", check=non_empty, help="Kafka bootstrap servers")
    topic_prefix: str = setting("", env=_KAFKA + "TOPIC_PREFIX", flag="--topic-prefix",
                                help="prefix of every topic name", default_text="none")
    client_id: str = setting("gpumeter", env=_KAFKA + "CLIENT_ID", check=check_client_id,
                             help="Kafka client id (default gpumeter-<service>)")
    security_protocol: str = setting("PLAINTEXT", env=_KAFKA + "SECURITY_PROTOCOL", check=one_of(*_PROTOCOLS),
                                     help=" | ".join(_PROTOCOLS))
    sasl_mechanism: str | None = setting(None, env=_KAFKA + "SASL_MECHANISM", help="SASL mechanism (SCRAM-SHA-512, "
                                                                                   "PLAIN, ...)")
    sasl_username: str | None = setting(None, env=_KAFKA + "SASL_USERNAME", help="SASL user name")
    sasl_password: str | None = setting(None, env=_KAFKA + "SASL_PASSWORD", secret=True, help="SASL password")
    ssl_cafile: str | None = setting(None, env=_KAFKA + "SSL_CAFILE", help="CA bundle for SSL")
    ssl_certfile: str | None = setting(None, env=_KAFKA + "SSL_CERTFILE", help="client certificate for SSL")
    ssl_keyfile: str | None = setting(None, env=_KAFKA + "SSL_KEYFILE", help="client key for SSL")
    compression_type: str = setting("lz4", env=_KAFKA + "COMPRESSION_TYPE", help="producer compression")
    # For topics gpumeter creates; 3 on a production cluster.
    replication_factor: int = setting(1, env=_KAFKA + "REPLICATION_FACTOR", parse=integer, check=at_least(1),
                                      help="replication factor of the topics gpumeter creates")
    # The largest record (batch) every producer sends; dead letters are sized from it (gpumeter.stream.deadletter).
    max_request_size_bytes: int = setting(DEFAULT_MAX_REQUEST_SIZE_BYTES, env=_KAFKA + "MAX_REQUEST_SIZE_BYTES",
                                          parse=integer, check=at_least(64 * 1024),
                                          help="the producers' max_request_size in bytes")
    # A producer batch holds one partition's records while the request before it is in flight; aiokafka keeps one
    # request in flight per broker, and a send that finds its partition's batch full waits for that request to
    # come back. At Faust's own default (16 KiB) one node-window's shares record (~12 KB at 8 GPUs x 8 pods) fills
    # a batch, so the attributor's sends went out one broker round trip each (docs/performance.md, 2026-12-05 fifth
    # session). Every producer takes ``producer_batch_bytes``: the services' RecordProducer and the attributor's
    # Faust app.
    producer_batch_max_bytes: int = setting(DEFAULT_PRODUCER_BATCH_MAX_BYTES,
                                            env=_KAFKA + "PRODUCER_BATCH_MAX_BYTES", parse=integer,
                                            check=at_least(16 * 1024),
                                            help="the most bytes of one partition's records a producer gathers "
                                                 "into one batch (above the max request size, that size)")
    # The streaming consumers' fetches (attributor, billing, guard): the broker answers a fetch once it holds this
    # many bytes for it, or after the wait. With Kafka's default of 1 byte every fetch comes back with the few
    # records that arrived since the last one, and at a fleet's steady 1 Hz the round trips -- a request written,
    # a response read, on the client and on the broker -- cost more CPU than the records' processing
    # (docs/performance.md, "Fetches that wait for data"). The wait bounds what it adds to a record's latency at
    # rates too low to fill a fetch (a fleet's rates fill one well within it); below it, an idle consumer's fetch
    # loop is most of what a waiting service costs: 500 ms (Kafka's own default) took an idle attributor worker
    # from 1.17 to 0.5 % of a core, and 4 attributor workers' CPU per GPU-sample from 1.46x to 1.11x one worker's
    # (docs/performance.md, 2026-12-05 fourth session).
    consumer_fetch_min_bytes: int = setting(256 * 1024, env=_KAFKA + "CONSUMER_FETCH_MIN_BYTES", parse=integer,
                                            check=at_least(1),
                                            help="bytes the broker gathers before it answers a streaming "
                                                 "consumer's fetch")
    consumer_fetch_max_wait_ms: int = setting(500, env=_KAFKA + "CONSUMER_FETCH_MAX_WAIT_MS", parse=integer,
                                              check=at_least(0),
                                              help="the longest the broker holds a streaming consumer's fetch "
                                                   "for those bytes, ms")

    def __post_init__(self) -> None:
        validate(self)
        if self.security_protocol.startswith("SASL") and not (self.sasl_mechanism and self.sasl_username):
            raise ConfigError("SASL needs GPUMETER_KAFKA_SASL_MECHANISM and GPUMETER_KAFKA_SASL_USERNAME")

    @property
    def producer_batch_bytes(self) -> int:
        """The producers' batch size: ``producer_batch_max_bytes``, at most ``max_request_size_bytes`` (a batch goes
        out in one request; a deployment that lowered the request size for its brokers keeps a working default)."""
        return min(self.producer_batch_max_bytes, self.max_request_size_bytes)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "KafkaSettings":
        """``load(KafkaSettings, None, env)``: these settings for a command without Kafka flags of its own."""
        return load(cls, None, env)

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

    def consumer_fetch_kwargs(self) -> dict[str, int]:
        """aiokafka consumer arguments of the streaming consumers' fetches (``consumer_fetch_min_bytes``,
        ``consumer_fetch_max_wait_ms``). One-off readers (a topic read to its end) keep aiokafka's defaults."""
        return {"fetch_min_bytes": self.consumer_fetch_min_bytes,
                "fetch_max_wait_ms": self.consumer_fetch_max_wait_ms}

    def describe(self) -> dict[str, Any]:
        """Printable view with secrets masked (``gpumeter.config.describe``)."""
        return describe(self)


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


def _below_one(value: float) -> float:
    if not 0 <= value < 1:
        raise ValueError("must be >= 0 and < 1")
    return value


def metrics_address_setting(help: str = "address the /metrics and /healthz server listens on") -> Any:
    """The ``metrics_address`` field every service has: ``--metrics-address`` / ``GPUMETER_METRICS_ADDRESS``,
    default every interface."""
    return setting(DEFAULT_METRICS_ADDRESS, env=METRICS_ADDRESS_ENV, flag="--metrics-address",
                   check=check_metrics_address, help=help, default_text=f"{DEFAULT_METRICS_ADDRESS}: every interface")


@dataclass(frozen=True)
class DeadLetterHealthSettings:
    """When a consumer (attributor, billing, guard) says ``degraded`` on ``/healthz``: more than ``max_ratio`` of
    its input messages of the last ``window_seconds`` dead-lettered, over at least ``min_inputs`` of them
    (``gpumeter.health.DeadLetterWindow``). Liveness is not affected."""

    window_seconds: float = setting(DEFAULT_DEAD_LETTER_WINDOW_SECONDS, env="GPUMETER_DEAD_LETTER_WINDOW_SECONDS",
                                    parse=number, check=greater_than(0),
                                    help="seconds of recent input the dead-letter ratio of /healthz is taken over")
    max_ratio: float = setting(DEFAULT_DEAD_LETTER_MAX_RATIO, env="GPUMETER_DEAD_LETTER_MAX_RATIO", parse=number,
                               check=_below_one,
                               help="share of recent input dead-lettered above which /healthz says degraded "
                                    "(0 to 1, exclusive of 1)")
    min_inputs: int = setting(DEFAULT_DEAD_LETTER_MIN_INPUTS, env="GPUMETER_DEAD_LETTER_MIN_INPUTS", parse=integer,
                              check=at_least(1),
                              help="recent input messages needed before the ratio can say degraded")

    def __post_init__(self) -> None:
        validate(self)


def env_snapshot() -> dict[str, str]:
    """The process environment, read once by an entrypoint."""
    return dict(os.environ)

