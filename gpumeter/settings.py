"""Settings shared by every service, read once at an entrypoint into frozen objects and passed down.

Sources, later wins: defaults, ``GPUMETER_*`` environment variables, command-line flags. Secrets are kept out of
``repr`` and ``describe()`` (what services print at start).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from gpumeter.errors import ConfigError
from schemas.catalog import TopicCatalog

SECRET_MARK = "***"
DEFAULT_MAX_REQUEST_SIZE_BYTES = 1_048_576
"""aiokafka's default ``max_request_size``, and the broker's default ``message.max.bytes`` less its 12-byte slack."""
# The password of ``scheme://user:password@host...``: up to the authority's last "@" (an unencoded "@" in a password
# must not leave its tail visible).
_URL_PASSWORD = re.compile(r"(?P<prefix>://[^/:@]*:)[^/]*@")


def mask_url_userinfo(url: str) -> str:
    """``url`` with the password of a ``user:password@`` part shown as ``***``, by its text alone: for strings that
    do not parse as URLs (a bad port, a typo), which must still never show a password. Never raises."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group('prefix')}{SECRET_MARK}@", url)


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


def env_snapshot() -> dict[str, str]:
    """The process environment, read once by an entrypoint."""
    return dict(os.environ)
