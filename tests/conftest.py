"""Test wiring.

* Unit tests cannot reach a broker or database by accident: TCP connects fail unless the test carries one of the
  opt-in markers (integration, postgres, alertmanager, network).
* Integration tests share one real Kafka broker for the session (``kafka_bootstrap``): the one named by
  ``KAFKA_BOOTSTRAP_SERVERS`` when set, else one this session starts from the pinned Kafka jars.
* ``topic_catalog`` gives each test its own random topic names, created on that broker.
* Hypothesis prints the ``@reproduce_failure`` blob of a falsifying example, so a property that fails on CI's
  random seed can be replayed here from the log alone.
* ``go_tools`` (session): helm, kustomize, promtool and prometheus, real binaries built from source once
  (``gpumeter.devtools.gotools``). ``make test`` builds them before pytest (``make deploy-tools``), so a test run
  only finds them; a run without that step builds them here, once per cache, in a subprocess (minutes; it says
  so): the tests never skip for want of them.
* ``promql`` (session): Prometheus' own PromQL parser, a throwaway server of that build with nothing to scrape
  (``promql.parse(expr)``: its syntax tree, ``gpumeter.devtools.prometheus``). Tests asking it are marked
  ``network`` (it answers on loopback).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("gpumeter", print_blob=True)
settings.load_profile("gpumeter")

OPT_IN_MARKERS = ("integration", "postgres", "alertmanager", "network")


class NetworkBlocked(RuntimeError):
    """A unit test tried to open a TCP connection."""


@pytest.fixture(autouse=True)
def _block_tcp_in_unit_tests(request, monkeypatch):
    if any(request.node.get_closest_marker(m) for m in OPT_IN_MARKERS):
        yield
        return
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def guarded(method):
        def connect(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                raise NetworkBlocked(
                    f"unit test {request.node.nodeid} tried to connect to {address}; mark it integration/network"
                )
            return method(sock, address)

        return connect

    monkeypatch.setattr(socket.socket, "connect", guarded(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(real_connect_ex))
    yield


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """The session's real Kafka broker: (bootstrap servers, KafkaBroker or None when external)."""
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        yield external, None
        return
    from gpumeter.devtools.kafka_broker import KafkaBroker

    broker = KafkaBroker(Path(tmp_path_factory.mktemp("kafka")), heap_mb=768)
    broker.start()
    try:
        yield broker.bootstrap_servers, broker
    finally:
        broker.stop()


@pytest.fixture
def kafka_bootstrap(request, kafka_broker) -> str:
    if not request.node.get_closest_marker("integration"):
        pytest.fail("kafka_bootstrap is for tests marked integration")
    return kafka_broker[0]


@pytest.fixture
def kafka_settings(kafka_bootstrap):
    from gpumeter.settings import KafkaSettings

    prefix = f"t{uuid.uuid4().hex[:10]}."
    return KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, client_id="gpumeter-test")


@pytest.fixture
def topic_catalog(kafka_settings):
    """Random-named catalog topics (3 partitions each) created on the session broker."""
    from gpumeter.kafka.admin import create_topics
    from schemas.catalog import TopicCatalog

    catalog = TopicCatalog(prefix=kafka_settings.topic_prefix, partitions_override=3)
    asyncio.run(create_topics(kafka_settings, catalog))
    return catalog


@pytest.fixture
def group_id() -> str:
    return f"g{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def go_tools() -> dict[str, Path]:
    from gpumeter.devtools import gotools

    cache_dir = gotools.DEFAULT_CACHE_DIR.resolve()
    if not all(tool.is_built(cache_dir) for tool in gotools.TOOLS):
        # A subprocess: the build downloads (the Go module proxy), which the unit tests' TCP guard forbids here.
        result = subprocess.run([sys.executable, "-m", "gpumeter.devtools.gotools", "build",
                                 "--cache-dir", str(cache_dir)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"could not build helm, kustomize, promtool and prometheus (`make deploy-tools`):\n"
                        f"{result.stderr[-4000:]}")
    return {tool.name: tool.path(cache_dir) for tool in gotools.TOOLS}


class PromQLParser:
    """Prometheus' parser behind a server of our build: ``parse(expr)`` is its syntax tree, asked once per text."""

    def __init__(self, server) -> None:
        self.server = server
        self._trees: dict[str, dict] = {}

    def parse(self, expr: str) -> dict:
        if expr not in self._trees:
            self._trees[expr] = self.server.parse(expr)
        return self._trees[expr]


@pytest.fixture(scope="session")
def promql(go_tools, tmp_path_factory):
    from gpumeter.devtools.prometheus import PrometheusServer

    server = PrometheusServer(go_tools["prometheus"], base_dir=tmp_path_factory.mktemp("promql"))
    server.start()
    try:
        yield PromQLParser(server)
    finally:
        server.stop()
