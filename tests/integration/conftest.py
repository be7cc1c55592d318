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
