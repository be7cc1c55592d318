"""Integration fixtures shared across modules.

``postgres_url`` (session): a real PostgreSQL server for the whole session — the one named by
``GPUMETER_TEST_POSTGRES_URL`` when set, else a throwaway server this session starts on loopback
(``gpumeter.devtools.postgres``) and stops at the end. Tests using it are marked ``postgres`` (unmarked tests
cannot open TCP connections). It is one database for the session: tests isolate themselves (e.g. a database
or schema of their own).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def postgres_url():
    """SQLAlchemy URL (``postgresql+psycopg://...``) of the session's PostgreSQL database."""
    external = os.environ.get("GPUMETER_TEST_POSTGRES_URL")
    if external:
        yield external
        return
    from gpumeter.devtools.postgres import PostgresServer

    server = PostgresServer()
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def kube_apiserver(tmp_path_factory):
    """The session's real Kubernetes API server: etcd + kube-apiserver (``gpumeter.devtools.kube_apiserver``), built
    from source into the cache on first use (``gpumeter.devtools.kube``; ``make test`` builds them beforehand).
    One per session; tests isolate themselves with ``kube_namespace`` and node names of their own."""
    from gpumeter.devtools.kube import ensure_kube_binaries
    from gpumeter.devtools.kube_apiserver import KubeApiServer

    server = KubeApiServer(ensure_kube_binaries())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kube_namespace(request, kube_apiserver) -> str:
    """A fresh namespace on the session's API server, with the ``default`` ServiceAccount the controller manager
    would create (the ServiceAccount admission plugin refuses pods without one). For tests marked integration."""
    if not request.node.get_closest_marker("integration"):
        pytest.fail("kube_namespace is for tests marked integration")
    from tests.integration.kube_world import new_namespace

    return new_namespace(kube_apiserver)
