"""Security from configuration: Kafka SASL/SSL settings reach every client, and no secret is ever printed.

* Every Kafka client gpumeter creates -- the collector's producer, the attributor's Faust producer and consumer
  and its topic admin, billing's consumer, producer and admin, the guard's consumer, producer and admins,
  ``gpumeter topics`` and ``gpumeter violations`` -- is built from the settings each entry point reads from its
  environment. No broker is needed: aiokafka's client classes are wrapped so that each instance is kept and
  starting one either does nothing or fails as an unreachable broker would; each client's own configuration
  (security protocol, SASL mechanism, user and password, SSL context with the configured CA, bootstrap
  servers) is then inspected.
* No secret -- the SASL password, the ledger URL's password, the Alertmanager URL's basic-auth password -- shows
  in any entry point's start-up config dump, in its error output, or in any log record, at DEBUG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import ssl
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError

from gpumeter import cli
from gpumeter.settings import SECRET_MARK, KafkaSettings
from schemas.catalog import TopicCatalog

SASL_PASSWORD = f"sasl-{uuid.uuid4().hex}"
LEDGER_PASSWORD = f"ledger-{uuid.uuid4().hex}"
ALERTMANAGER_PASSWORD = f"am-{uuid.uuid4().hex}"
SECRETS = (SASL_PASSWORD, LEDGER_PASSWORD, ALERTMANAGER_PASSWORD)
LEDGER_URL = f"postgresql+psycopg://billing:{LEDGER_PASSWORD}@/ledger?host=/nonexistent-gpumeter-socket-dir"
BOOTSTRAP = "kafka-1.example.internal:9093,kafka-2.example.internal:9093"
PREFIX = "sec."
PARTITIONS = 3


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, Path]:
    """A self-signed CA certificate and a client certificate and key (made with openssl, offline)."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "client.key", folder / "ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=gpumeter-test-ca"], check=True, capture_output=True)
    return {"ca": cert, "cert": cert, "key": key}


@pytest.fixture
def env(tls_files, tmp_path) -> dict[str, str]:
    """A production-like environment: SASL_SSL with SCRAM, a CA and a client certificate, secrets everywhere."""
    return {
        "KAFKA_BOOTSTRAP_SERVERS": BOOTSTRAP,
        "GPUMETER_KAFKA_TOPIC_PREFIX": PREFIX,
        "GPUMETER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "GPUMETER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "GPUMETER_KAFKA_SASL_USERNAME": "gpumeter",
        "GPUMETER_KAFKA_SASL_PASSWORD": SASL_PASSWORD,
        "GPUMETER_KAFKA_SSL_CAFILE": str(tls_files["ca"]),
        "GPUMETER_KAFKA_SSL_CERTFILE": str(tls_files["cert"]),
        "GPUMETER_KAFKA_SSL_KEYFILE": str(tls_files["key"]),
        # A server on a unix socket that is not there: refused without any TCP connection.
        "GPUMETER_LEDGER_URL": LEDGER_URL,
        "GPUMETER_GUARD_ALERTMANAGER_URL": f"http://guard:{ALERTMANAGER_PASSWORD}@127.0.0.1:1",
        "GPUMETER_NODE_NAME": "gpu-node-1",
        "GPUMETER_METRICS_PORT": "0",
        "GPUMETER_GUARD_STATE_PATH": str(tmp_path / "guard.state"),
        "GPUMETER_ATTRIBUTOR_DATA_DIR": str(tmp_path / "attributor"),
        "GPUMETER_LOG_LEVEL": "DEBUG",
    }


class NoBroker:
    """Wraps aiokafka's client classes: every instance is kept in ``clients``; producers and admins start without
    a broker (an admin answers as if the catalog's topics existed), consumers fail to start as an unreachable
    broker would. Closing closes the client's (never connected) network client."""

    def __init__(self, monkeypatch) -> None:
        self.clients: list[tuple[str, Any]] = []
        catalog = TopicCatalog(prefix=PREFIX)
        names = [catalog.name(spec) for spec in catalog]

        def keep(kind: str, cls):
            original = cls.__init__

            def init(client, *args, **kwargs):
                original(client, *args, **kwargs)
                self.clients.append((kind, client))

            monkeypatch.setattr(cls, "__init__", init)

        keep("producer", AIOKafkaProducer)
        keep("consumer", AIOKafkaConsumer)
        keep("admin", AIOKafkaAdminClient)

        async def nothing(client, *args, **kwargs):
            return None

        async def unreachable(client, *args, **kwargs):
            raise KafkaConnectionError("no broker in a unit test")

        async def close_network(client, *args, **kwargs):
            await close_client(client)

        async def list_topics(client):
            return names

        async def describe_topics(client, topics=None):
            return [{"topic": name, "error_code": 0, "partitions": [{"partition": p} for p in range(PARTITIONS)]}
                    for name in (topics or names)]

        monkeypatch.setattr(AIOKafkaProducer, "start", nothing)
        monkeypatch.setattr(AIOKafkaProducer, "stop", close_network)
        monkeypatch.setattr(AIOKafkaProducer, "flush", nothing)
        monkeypatch.setattr(AIOKafkaConsumer, "start", unreachable)
        monkeypatch.setattr(AIOKafkaConsumer, "stop", close_network)
        monkeypatch.setattr(AIOKafkaAdminClient, "start", nothing)
        monkeypatch.setattr(AIOKafkaAdminClient, "create_topics", nothing)  # topics outside the catalog
        monkeypatch.setattr(AIOKafkaAdminClient, "close", close_network)
        monkeypatch.setattr(AIOKafkaAdminClient, "list_topics", list_topics)
        monkeypatch.setattr(AIOKafkaAdminClient, "describe_topics", describe_topics)

    def kinds(self) -> list[str]:
        return sorted(kind for kind, _ in self.clients)


def network_client(client) -> Any:
    """The aiokafka ``AIOKafkaClient`` inside a producer, consumer or admin client (where the security lives)."""
    return client.client if isinstance(client, AIOKafkaProducer) else client._client


def assert_secured(client, tls_files) -> None:
    net = network_client(client)
    servers = net._bootstrap_servers
    servers = servers.split(",") if isinstance(servers, str) else list(servers)
    assert servers == BOOTSTRAP.split(",")
    assert (net._security_protocol, net._sasl_mechanism, net._sasl_plain_username, net._sasl_plain_password) == (
        "SASL_SSL", "SCRAM-SHA-512", "gpumeter", SASL_PASSWORD)
    context = net._ssl_context
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] == 1  # exactly the configured CA, not the system store


def args_for(command: str, *argv: str) -> argparse.Namespace:
    return cli.build_parser(command).parse_args([command, *argv])


async def close_client(client) -> None:
    await network_client(client).close()
    client._closed = True  # never started: nothing else to stop (and aiokafka would warn it was left open)


def close_all(broker: NoBroker) -> None:
    async def close() -> None:
        for _, client in broker.clients:
            await close_client(client)

    asyncio.run(close())


# ----------------------------------------------------------------------------------------------------------------
# SASL/SSL reaches every client


def test_the_collectors_producer(monkeypatch, env, tls_files):
    from gpumeter.kafka.producer import RecordProducer
    from services.collector.settings import collector_settings

    broker = NoBroker(monkeypatch)
    settings = collector_settings(args_for("collector"), env)

    async def build() -> None:
        # What services.collector.main builds for its BufferedPublisher.
        RecordProducer(settings.kafka, request_timeout_ms=int(settings.delivery_timeout_seconds * 1000))

    asyncio.run(build())
    assert broker.kinds() == ["producer"]
    assert_secured(broker.clients[0][1], tls_files)
    close_all(broker)


def test_the_attributors_faust_producer_consumer_and_topic_admin(monkeypatch, env, tls_files, capsys):
    from gpumeter.clock import SystemClock
    from services.attributor import main as attributor_main
    from services.attributor.app import build_app
    from services.attributor.settings import attributor_settings

    broker = NoBroker(monkeypatch)
    monkeypatch.setattr(attributor_main, "_run_worker", lambda settings: 0)
    # Catalog topics created, input partitions checked, changelog topics created: one admin each.
    assert attributor_main.main(args_for("attributor"), env) == 0
    assert broker.kinds() == ["admin", "admin", "admin"]

    settings = attributor_settings(args_for("attributor"), env).replace(partitions=PARTITIONS)

    async def build() -> None:
        app = build_app(settings, SystemClock())
        assert app.conf.broker_credentials is not None
        app.producer._new_producer()  # what Faust's producer starts
        app.consumer._thread._create_worker_consumer(app.transport)  # what Faust's consumer thread starts

    asyncio.run(build())
    assert broker.kinds() == ["admin", "admin", "admin", "consumer", "producer"]
    for _, client in broker.clients:
        assert_secured(client, tls_files)
    close_all(broker)


def test_billings_consumer_producer_and_admin(monkeypatch, env, tls_files, tmp_path):
    from services.billing.main import serve
    from services.billing.settings import billing_settings

    broker = NoBroker(monkeypatch)
    settings = billing_settings(args_for("billing"), {**env, "GPUMETER_LEDGER_URL": f"sqlite:///{tmp_path}/l.db"})
    # The consumer cannot reach the broker: the service stops with 1 after building every client it has.
    assert asyncio.run(serve(settings)) == 1
    assert broker.kinds() == ["admin", "consumer", "producer"]
    for _, client in broker.clients:
        assert_secured(client, tls_files)
    close_all(broker)


def test_the_guards_consumer_producer_and_admins(monkeypatch, env, tls_files):
    from services.guard.main import serve
    from services.guard.settings import guard_settings

    broker = NoBroker(monkeypatch)
    monkeypatch.setattr(AIOKafkaConsumer, "start", lambda client: asyncio.sleep(0))
    monkeypatch.setattr(AIOKafkaConsumer, "assign", lambda client, partitions: None)

    async def unreachable(client, *partitions):
        raise KafkaConnectionError("no broker in a unit test")

    monkeypatch.setattr(AIOKafkaConsumer, "seek_to_beginning", unreachable)
    monkeypatch.setattr(AIOKafkaConsumer, "committed", unreachable)
    settings = guard_settings(args_for("guard"), {k: v for k, v in env.items()
                                                  if k != "GPUMETER_GUARD_ALERTMANAGER_URL"})
    assert asyncio.run(serve(settings)) == 1
    # topics created (admin), violations producer, input consumer, partition metadata for it (admin)
    assert broker.kinds() == ["admin", "admin", "consumer", "producer"]
    for _, client in broker.clients:
        assert_secured(client, tls_files)
    close_all(broker)


def test_gpumeter_topics_and_gpumeter_violations(monkeypatch, env, tls_files, capsys):
    from gpumeter.commands import topics
    from services.guard import violations_cli

    broker = NoBroker(monkeypatch)
    assert topics.main(args_for("topics", "create"), env) == 0
    assert broker.kinds() == ["admin"]
    assert violations_cli.main(args_for("violations", "--timeout", "5"), env) == 1  # metadata, then no broker
    assert broker.kinds() == ["admin", "admin", "consumer"]
    for _, client in broker.clients:
        assert_secured(client, tls_files)
    close_all(broker)


def test_plain_text_settings_give_plain_clients_and_ssl_alone_needs_no_sasl(tls_files):
    plain = KafkaSettings(bootstrap_servers="k:9092").client_kwargs()
    assert plain["security_protocol"] == "PLAINTEXT" and "sasl_plain_password" not in plain
    assert "ssl_context" not in plain
    tls = KafkaSettings(bootstrap_servers="k:9093", security_protocol="SSL", ssl_cafile=str(tls_files["ca"]),
                        ssl_certfile=str(tls_files["cert"]), ssl_keyfile=str(tls_files["key"])).client_kwargs()
    assert tls["security_protocol"] == "SSL" and "sasl_plain_password" not in tls
    assert tls["ssl_context"].cert_store_stats()["x509_ca"] == 1


# ----------------------------------------------------------------------------------------------------------------
# No secret in config dumps, errors or logs


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"a secret was printed:\n{text[:2000]}"


def logged(caplog) -> str:
    return "\n".join(f"{r.name} {r.levelname} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)


def config_dump(out: str, marker: str) -> dict:
    line = next(line for line in out.splitlines() if line.startswith(marker))
    return json.loads(line[len(marker):])


@pytest.fixture
def debug_logs(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    # The entry points call logging.basicConfig; caplog's handler sees everything regardless.
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    return caplog


def test_the_collector_prints_its_settings_without_the_sasl_password(monkeypatch, env, capsys, debug_logs):
    from services.collector import main as collector_main

    async def no_run(settings, scenario=None):
        return 0

    monkeypatch.setattr(collector_main, "run", no_run)
    assert collector_main.main(args_for("collector"), env) == 0
    out, err = capsys.readouterr()
    dump = config_dump(out, "gpumeter collector ")
    assert dump["kafka"]["sasl_password"] == SECRET_MARK and dump["kafka"]["sasl_username"] == "gpumeter"
    assert_no_secret(out, err, logged(debug_logs))


def test_the_attributor_prints_its_settings_without_the_sasl_password(monkeypatch, env, capsys, debug_logs):
    from services.attributor import main as attributor_main
    from services.attributor.settings import attributor_settings

    NoBroker(monkeypatch)
    monkeypatch.setattr(attributor_main, "_run_worker", lambda settings: 0)
    assert attributor_main.main(args_for("attributor"), env) == 0
    out, err = capsys.readouterr()
    dump = json.loads(next(line for line in out.splitlines() if line.startswith('{"attributor"')))["attributor"]
    assert dump["kafka"]["sasl_password"] == SECRET_MARK and dump["kafka"]["sasl_username"] == "gpumeter"
    settings = attributor_settings(args_for("attributor"), env)
    assert_no_secret(out, err, logged(debug_logs), repr(settings), str(settings.describe()))


def test_billing_prints_and_logs_without_the_sasl_or_ledger_password(monkeypatch, env, capsys, debug_logs):
    from services.billing import main as billing_main
    from services.billing.settings import billing_settings

    NoBroker(monkeypatch)
    # The ledger cannot be reached: the service retries (logging each try) until --duration ends.
    args = args_for("billing", "--duration", "1.5")
    env = {**env, "GPUMETER_BILLING_LEDGER_RETRY_INITIAL_SECONDS": "0.2"}
    assert billing_main.main(args, env) == 0
    out, err = capsys.readouterr()
    dump = config_dump(out, "gpumeter billing ")
    assert dump["kafka"]["sasl_password"] == SECRET_MARK
    assert dump["ledger_url"] == "postgresql+psycopg://billing:***@/ledger?host=/nonexistent-gpumeter-socket-dir"
    logs = logged(debug_logs)
    assert "ledger unavailable" in logs  # the retries ran and were logged
    settings = billing_settings(args, env)
    assert_no_secret(out, err, logs, repr(settings))


@pytest.mark.parametrize("ledger_url", [
    f"postgresql+nosuchdriver://billing:{LEDGER_PASSWORD}@db/ledger",  # parses, no such driver
    f"postgresql://billing:{LEDGER_PASSWORD}@db:notaport/ledger",  # does not parse
])
def test_billing_errors_about_a_bad_ledger_url_do_not_show_its_password(monkeypatch, env, capsys, debug_logs,
                                                                         ledger_url):
    from services.billing import main as billing_main

    NoBroker(monkeypatch)
    assert billing_main.main(args_for("billing"), {**env, "GPUMETER_LEDGER_URL": ledger_url}) == 2
    out, err = capsys.readouterr()
    logs = logged(debug_logs)
    assert "cannot open ledger" in logs
    assert_no_secret(out, err, logs)


def test_the_guard_prints_and_logs_without_the_sasl_or_alertmanager_password(monkeypatch, env, capsys,
                                                                              debug_logs):
    from services.guard import main as guard_main
    from services.guard.settings import guard_settings

    NoBroker(monkeypatch)
    assert guard_main.main(args_for("guard"), env) == 1  # the consumer cannot reach the broker
    out, err = capsys.readouterr()
    dump = config_dump(out, "gpumeter guard ")
    assert dump["kafka"]["sasl_password"] == SECRET_MARK
    assert dump["alertmanager_url"] == "http://guard:***@127.0.0.1:1"
    logs = logged(debug_logs)
    assert "cannot reach Kafka" in logs
    settings = guard_settings(args_for("guard"), env)
    assert_no_secret(out, err, logs, repr(settings))


@pytest.mark.parametrize("url", [f"ftp://guard:{ALERTMANAGER_PASSWORD}@am:9093",
                                 f"http://guard:{ALERTMANAGER_PASSWORD}@am:9093/?x=1"])
def test_the_guards_errors_about_a_bad_alertmanager_url_do_not_show_its_password(env, capsys, url):
    from services.guard import main as guard_main

    assert guard_main.main(args_for("guard"), {**env, "GPUMETER_GUARD_ALERTMANAGER_URL": url}) == 2
    out, err = capsys.readouterr()
    assert out.startswith("error: ")
    assert_no_secret(out, err)


def test_the_clis_errors_do_not_show_the_sasl_password(monkeypatch, env, capsys, debug_logs):
    from gpumeter.commands import topics
    from services.guard import violations_cli

    NoBroker(monkeypatch)
    monkeypatch.setattr(AIOKafkaAdminClient, "start", AIOKafkaConsumer.start)  # unreachable, like the consumer
    assert topics.main(args_for("topics", "create"), env) == 1
    assert violations_cli.main(args_for("violations", "--timeout", "5"), env) == 1
    out, err = capsys.readouterr()
    assert "error: " in out + err
    assert_no_secret(out, err, logged(debug_logs))


# ----------------------------------------------------------------------------------------------------------------
# Where the metrics server listens


SERVICES = ("collector", "attributor", "billing", "guard")


def _service_settings(command: str, argv: tuple[str, ...], env: dict[str, str]):
    from services.attributor.settings import attributor_settings
    from services.billing.settings import billing_settings
    from services.collector.settings import collector_settings
    from services.guard.settings import guard_settings

    loaders = {"collector": collector_settings, "attributor": attributor_settings, "billing": billing_settings,
               "guard": guard_settings}
    return loaders[command](args_for(command, *argv), env)


@pytest.mark.parametrize("command", SERVICES)
def test_every_service_takes_its_metrics_address_from_the_flag_or_the_environment(command, capsys):
    env = {"GPUMETER_NODE_NAME": "gpu-node-1"}
    assert _service_settings(command, (), env).metrics_address == "0.0.0.0"  # the manifests' default
    assert _service_settings(command, (), {**env, "GPUMETER_METRICS_ADDRESS": "10.1.2.3"}).metrics_address == \
        "10.1.2.3"
    flagged = _service_settings(command, ("--metrics-address", "::1"), {**env, "GPUMETER_METRICS_ADDRESS": "10.1.2.3"})
    assert flagged.metrics_address == "::1"  # the flag wins
    from gpumeter.errors import ConfigError

    with pytest.raises(ConfigError, match="metrics address"):
        _service_settings(command, ("--metrics-address", "0.0.0.0; rm -rf /"), env)
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    help_text = capsys.readouterr().out
    assert "--metrics-address" in help_text and "GPUMETER_METRICS_ADDRESS" in help_text


def test_every_service_serves_its_metrics_on_the_configured_address(monkeypatch, env, tmp_path):
    """Each service's real start-up hands its settings' address to the metrics server."""
    from gpumeter.metrics import ServiceMetrics
    from services.attributor import main as attributor_main
    from services.billing import main as billing_main
    from services.collector import main as collector_main
    from services.guard import main as guard_main

    served: dict[str, tuple[int, str]] = {}

    class Served(Exception):
        pass

    def serve(metrics, port, address="unset"):
        served[metrics.service] = (port, address)
        if metrics.service in ("collector", "attributor"):
            raise Served  # nothing further of these is needed
        return None

    monkeypatch.setattr(ServiceMetrics, "serve", serve)
    broker = NoBroker(monkeypatch)
    env = {**env, "GPUMETER_METRICS_PORT": "9999", "GPUMETER_METRICS_ADDRESS": "127.0.0.2",
           "GPUMETER_LEDGER_URL": f"sqlite:///{tmp_path}/ledger.db"}
    env.pop("GPUMETER_GUARD_ALERTMANAGER_URL")
    with pytest.raises(Served):
        asyncio.run(collector_main.run(_service_settings("collector", (), env)))
    with pytest.raises(Served):
        attributor_main._run_worker(_service_settings("attributor", (), env))
    assert asyncio.run(billing_main.serve(_service_settings("billing", (), env))) == 1  # no broker for its consumer
    assert asyncio.run(guard_main.serve(_service_settings("guard", (), env))) == 1
    close_all(broker)
    assert served == {service: (9999, "127.0.0.2") for service in SERVICES}

