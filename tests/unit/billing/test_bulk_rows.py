"""``services.billing.bulk_rows`` on SQLite (the PostgreSQL half is tests/integration/test_bulk_rows_postgres.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from services.billing.bulk_rows import DO_NOTHING, BulkInsert
from tests.unit.billing import bulk_cases


def test_the_bulk_insert_stores_what_the_core_statement_stores_on_sqlite(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'bulk.sqlite3'}")
    try:
        bulk_cases.check(engine)
    finally:
        engine.dispose()


def test_a_bulk_insert_names_only_columns_of_its_table_and_adds_only_on_a_key():
    with pytest.raises(KeyError):
        BulkInsert(bulk_cases.BULK, ("period", "nope"))
    with pytest.raises(ValueError, match="key columns"):
        BulkInsert(bulk_cases.BULK, bulk_cases.COLUMNS, conflict=DO_NOTHING, add=("amount",))
