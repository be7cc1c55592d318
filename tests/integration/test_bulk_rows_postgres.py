"""``services.billing.bulk_rows`` on a real PostgreSQL: one ``unnest`` statement per batch stores what SQLAlchemy's
Core ``executemany`` stores (the SQLite half is tests/unit/billing/test_bulk_rows.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from services.billing.bulk_rows import BulkInsert
from tests.unit.billing import bulk_cases

pytestmark = pytest.mark.postgres


def test_the_bulk_insert_stores_what_the_core_statement_stores_on_postgresql(postgres_url):
    engine = create_engine(postgres_url)
    try:
        bulk_cases.check(engine)
    finally:
        engine.dispose()


def test_a_row_of_the_wrong_width_is_refused_before_postgresql_sees_it(postgres_url):
    engine = create_engine(postgres_url)
    try:
        bulk_cases.metadata.create_all(engine)
        with engine.begin() as connection:
            with pytest.raises(ValueError, match="7 values for 8 columns"):
                BulkInsert(bulk_cases.BULK, bulk_cases.COLUMNS).execute(connection, [bulk_cases.ROWS[0][:7]])
            assert connection.execute(text("SELECT count(*) FROM bulk_rows_bulk")).scalar() == 0
    finally:
        bulk_cases.metadata.drop_all(engine)
        engine.dispose()
