"""The bulk insert's cases, shared by the SQLite unit test and the PostgreSQL integration test: a table of every
column type the ledger's bulk tables use, rows as awkward as the ledger writes (NULLs, 64-bit and small integers in
one column, unicode, quotes), and what the Core statement stores for them."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite

from services.billing.bulk_rows import DO_NOTHING, BulkInsert

metadata = MetaData()
COLUMNS = ("period", "name", "flag", "note", "small", "share", "amount", "count")
KEY = ("period", "name", "flag")
MEASURES = ("amount", "count")


def table(name: str) -> Table:
    return Table(
        name, metadata,
        Column("period", BigInteger, nullable=False), Column("name", String(64), nullable=False),
        Column("flag", Boolean, nullable=False), Column("note", Text, nullable=True),
        Column("small", Integer, nullable=True), Column("share", Double, nullable=False),
        Column("amount", BigInteger, nullable=False), Column("count", BigInteger, nullable=False),
        PrimaryKeyConstraint(*KEY),
    )


BULK = table("bulk_rows_bulk")
CORE = table("bulk_rows_core")

ROWS = [
    (1_796_000_000_000, "gpu-node-a", True, None, 60, 0.125, 9_000_000_000_123, 1),
    (1_796_000_000_000, "gpu-node-a", False, 'ünï "q" \\ ,{}', None, 1e-300, -5, 2),
    (3, "x" * 64, True, "", 0, 0.0, 0, 0),
    (1_796_003_600_000, "gpu-node-b", True, "ns", 2_147_483_647, 1 / 3, 2**62, 7),
]


def insert_both(connection, rows, *, conflict=None, add=()) -> None:
    """``rows`` into BULK by ``BulkInsert`` and into CORE by SQLAlchemy's Core ``executemany``."""
    BulkInsert(BULK, COLUMNS, conflict=conflict, add=add).execute(connection, rows)
    insert = postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert
    statement = insert(CORE)
    if conflict == DO_NOTHING:
        statement = statement.on_conflict_do_nothing()
    elif conflict is not None:
        statement = statement.on_conflict_do_update(index_elements=[CORE.c[k] for k in conflict],
                                                    set_={m: CORE.c[m] + statement.excluded[m] for m in add})
    if rows:
        connection.execute(statement, [dict(zip(COLUMNS, row)) for row in rows])


def stored(connection, which: Table) -> list[tuple]:
    return sorted((tuple(row) for row in connection.execute(select(*(which.c[c] for c in COLUMNS)))), key=repr)


def check(engine) -> None:
    """Every case: the bulk insert stores what the Core statement stores, row for row and column for column."""
    metadata.create_all(engine)
    try:
        with engine.begin() as connection:
            insert_both(connection, ROWS)
            insert_both(connection, [])
            assert stored(connection, BULK) == stored(connection, CORE) == sorted(ROWS, key=repr)
        with engine.begin() as connection:
            again = [ROWS[0][:6] + (1, 1), ROWS[2][:6] + (10, 3)]
            insert_both(connection, again, conflict=DO_NOTHING)
            assert stored(connection, BULK) == stored(connection, CORE) == sorted(ROWS, key=repr)
        with engine.begin() as connection:
            new = (5, "new", False, None, None, 0.5, 1, 1)
            insert_both(connection, [ROWS[0][:6] + (1, 1), new, ROWS[2][:6] + (10, 3)], conflict=KEY, add=MEASURES)
            after = stored(connection, BULK)
            assert after == stored(connection, CORE)
            by_key = {row[:3]: row for row in after}
            assert by_key[ROWS[0][:3]][6:] == (9_000_000_000_124, 2)
            assert by_key[ROWS[2][:3]][6:] == (10, 3)
            assert by_key[new[:3]] == new
            assert len(after) == len(ROWS) + 1
    finally:
        metadata.drop_all(engine)
