"""Many rows into one ledger table per statement: the ledger's bulk ``INSERT ... ON CONFLICT``.

``BulkInsert(table, columns, conflict=...)`` is compiled once per dialect; ``execute(connection, rows)`` writes
``rows`` (tuples in ``columns`` order) in the caller's transaction:

* **PostgreSQL**: a binary ``COPY`` of the rows into a temporary table of the connection (``LIKE`` the target,
  ``ON COMMIT DELETE ROWS``), then one ``INSERT INTO t (...) SELECT ... FROM that ORDER BY <key> ON CONFLICT ...``.
  SQLAlchemy's ``executemany`` sends one ``INSERT`` per row through psycopg's pipeline, which was most of
  ``Ledger.write``'s time (``bench/ledger_month.py``); an ``unnest`` of array parameters costs the client ~4x a
  binary ``COPY``'s CPU (psycopg dumps arrays element by element in Python; ``COPY`` rows in C) and the server
  more too (measured on 2,900 cost lines a batch, docs/billing.md). Rows with a conflict key are inserted in key
  order, so two writers of overlapping rows take the rows' locks in the same order and never deadlock.
* **SQLite**: one driver-level ``executemany`` of the statement SQLAlchemy compiles, with the bind processors it
  would apply: the same rows without SQLAlchemy building a parameter set per row.

``conflict``: ``None`` (a conflict is an error), ``DO_NOTHING`` (skip a row whose key is there) or the key columns
and ``add=(measures)``: ``ON CONFLICT (key) DO UPDATE SET m = t.m + excluded.m`` for each measure (rows must then
have distinct keys: PostgreSQL refuses to update one row twice in one statement). ``add_sums`` is that for the
rollup tables: sums added to the rows of their keys, in key order. Errors are SQLAlchemy's, raised to
the caller (the ledger wraps them in ``LedgerError``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from sqlalchemy import BigInteger, Boolean, Double, Integer, SmallInteger, String, Table, Text, bindparam
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection

DO_NOTHING = "nothing"

# The PostgreSQL array type of each column type the ledger's bulk tables use (most specific first).
_PG_COPY_TYPES = ((BigInteger, "int8"), (SmallInteger, "int2"), (Integer, "int4"), (Double, "float8"),
                  (Boolean, "bool"), (Text, "text"), (String, "text"))


def _pg_copy_type(table: Table, name: str) -> str:
    column_type = table.c[name].type
    if isinstance(column_type, ARRAY):
        # A one-dimensional array of one of the types below (a Python list; ``line_packs``' columns).
        return _pg_element_type(table, name, column_type.item_type) + "[]"
    return _pg_element_type(table, name, column_type)


def _pg_element_type(table: Table, name: str, column_type: Any) -> str:
    for python_type, sql in _PG_COPY_TYPES:
        if isinstance(column_type, python_type):
            return sql
    raise TypeError(f"{table.name}.{name}: no bulk copy type for {column_type!r}")


class BulkInsert:
    """One table's bulk insert (module docstring). Immutable once built; one per (table, columns, conflict)."""

    def __init__(self, table: Table, columns: Sequence[str], *, conflict: str | Sequence[str] | None = None,
                 add: Sequence[str] = ()) -> None:
        self.table = table
        self.columns = tuple(columns)
        for name in self.columns:
            table.c[name]  # noqa: B018 -- a KeyError here names a column the table lacks
        if add and (conflict is None or conflict == DO_NOTHING):
            raise ValueError("add= needs the conflict's key columns")
        self.conflict = conflict if conflict is None or conflict == DO_NOTHING else tuple(conflict)
        self.add = tuple(add)
        self._sqlite: tuple[str, tuple[tuple[int, Any], ...]] | None = None
        self._postgresql: tuple[str, str, str, str, tuple[str, ...]] | None = None
        for name in self.columns:
            _pg_copy_type(table, name)  # a TypeError now rather than at the first write

    def _on_conflict(self, statement: Any) -> Any:
        if self.conflict is None:
            return statement
        if self.conflict == DO_NOTHING:
            return statement.on_conflict_do_nothing()
        return statement.on_conflict_do_update(
            index_elements=[self.table.c[name] for name in self.conflict],
            set_={name: self.table.c[name] + statement.excluded[name] for name in self.add})

    def _sqlite_statement(self, dialect: Any) -> tuple[str, tuple[tuple[int, Any], ...]]:
        if self._sqlite is None:
            statement = self._on_conflict(
                sqlite.insert(self.table).values({name: bindparam(name) for name in self.columns}))
            compiled = statement.compile(dialect=dialect)
            if tuple(compiled.positiontup or ()) != self.columns:
                raise RuntimeError(f"{self.table.name}'s insert binds {compiled.positiontup}, not {self.columns}")
            processors = []
            for index, name in enumerate(self.columns):
                process = self.table.c[name].type._cached_bind_processor(dialect)
                if process is not None:
                    processors.append((index, process))
            self._sqlite = (str(compiled), tuple(processors))
        return self._sqlite

    def _postgresql_statements(self) -> tuple[str, str, str, str, tuple[str, ...]]:
        """(create the staging table, copy into it, insert from it, empty it, the copy's types)."""
        if self._postgresql is None:
            quote = postgresql.dialect().identifier_preparer.quote
            table = quote(self.table.name)
            staging = quote(f"{self.table.name}_bulk_staging")
            names = ", ".join(quote(name) for name in self.columns)
            create = (f"CREATE TEMPORARY TABLE IF NOT EXISTS {staging} (LIKE {table} INCLUDING DEFAULTS) "
                      "ON COMMIT DELETE ROWS")
            copy = f"COPY {staging} ({names}) FROM STDIN (FORMAT BINARY)"
            insert = f"INSERT INTO {table} ({names}) SELECT {names} FROM {staging}"
            if self.conflict == DO_NOTHING:
                insert += " ON CONFLICT DO NOTHING"
            elif self.conflict is not None:
                key = ", ".join(quote(name) for name in self.conflict)
                sets = ", ".join(f"{quote(n)} = {table}.{quote(n)} + EXCLUDED.{quote(n)}" for n in self.add)
                insert += f" ORDER BY {key} ON CONFLICT ({key}) DO " + (f"UPDATE SET {sets}" if sets else "NOTHING")
            types = tuple(_pg_copy_type(self.table, name) for name in self.columns)
            self._postgresql = (create, copy, insert, f"DELETE FROM {staging}", types)
        return self._postgresql

    def execute(self, connection: Connection, rows: Sequence[tuple]) -> None:
        """Insert ``rows`` (tuples in ``columns`` order) in ``connection``'s transaction; nothing for no rows."""
        if not rows:
            return
        dialect = connection.dialect
        if dialect.name == "postgresql":
            self._copy_postgresql(connection, rows)
            return
        sql, processors = self._sqlite_statement(dialect)
        if processors:
            processed = []
            for row in rows:
                values = list(row)
                for index, process in processors:
                    values[index] = process(values[index])
                processed.append(tuple(values))
            rows = processed
        connection.exec_driver_sql(sql, list(rows))

    def execute_copy(self, connection: Connection, payload: bytes) -> None:
        """PostgreSQL: insert the rows of ``payload``, a whole binary ``COPY`` of ``columns`` (signature, rows,
        trailer) that the caller encoded itself, as ``execute`` inserts rows (``line_packs.copy_payload``)."""
        if connection.dialect.name != "postgresql":
            raise ValueError(f"{self.table.name}: an encoded COPY is PostgreSQL's")
        create, copy, insert, clear, _types = self._postgresql_statements()
        if self.conflict is None:
            # No conflict to handle (a conflict is an error either way): straight into the table, not through the
            # staging table (which writes every row twice).
            quote = postgresql.dialect().identifier_preparer.quote
            names = ", ".join(quote(name) for name in self.columns)
            with connection.connection.driver_connection.cursor() as cursor:
                with cursor.copy(f"COPY {quote(self.table.name)} ({names}) FROM STDIN (FORMAT BINARY)") as stream:
                    stream.write(payload)
            return
        connection.exec_driver_sql(create)
        with connection.connection.driver_connection.cursor() as cursor:
            with cursor.copy(copy) as stream:
                stream.write(payload)
        connection.exec_driver_sql(insert)
        connection.exec_driver_sql(clear)

    def _copy_postgresql(self, connection: Connection, rows: Sequence[tuple]) -> None:
        create, copy, insert, clear, types = self._postgresql_statements()
        width = len(self.columns)
        for row in rows:
            if len(row) != width:
                raise ValueError(f"{self.table.name}: a row of {len(row)} values for {width} columns")
        connection.exec_driver_sql(create)
        driver = connection.connection.driver_connection
        with driver.cursor() as cursor:
            with cursor.copy(copy) as stream:
                stream.set_types(types)
                for row in rows:
                    stream.write_row(row)
        # The staging rows go at commit (ON COMMIT DELETE ROWS); a second batch in one transaction must not see
        # the first's.
        connection.exec_driver_sql(insert)
        connection.exec_driver_sql(clear)


_SUM_UPSERTS: dict[int, BulkInsert] = {}


def add_sums(connection: Connection, table: Table, dimensions: Sequence[str], measures: Sequence[str],
             rows: Iterable[tuple]) -> int:
    """Add rows of sums to ``table`` (its primary key: ``dimensions``): each row ``(*key, *measures)`` is inserted,
    or its measures are added to the stored row of its key. Rows are written in key order (distinct keys: sorting
    compares the keys only); returns how many."""
    upsert = _SUM_UPSERTS.get(id(table))
    if upsert is None or upsert.table is not table:
        upsert = _SUM_UPSERTS[id(table)] = BulkInsert(table, (*dimensions, *measures), conflict=tuple(dimensions),
                                                      add=tuple(measures))
    ordered = sorted(rows)
    upsert.execute(connection, ordered)
    return len(ordered)
