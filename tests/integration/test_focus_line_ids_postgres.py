"""PostgreSQL's hourly FOCUS lines by ids (migration 0016, ``services.billing.focus_rollups``) on a real server: a
ledger whose hourly FOCUS grain was written at 0015's text layout gives the same rows and the same FOCUS export,
byte for byte, after the upgrade and after going back; a true-up on the new layout keeps the grain equal to what
the minute lines (trued up) sum to; a write's new pods, GPUs and zero lines' kinds get their ids; ids its cache
lacks are read from the dictionaries, and a line whose ids are in neither is refused."""

from __future__ import annotations

import dataclasses
import io

import pytest
from alembic import command
from sqlalchemy import text

from services.billing import focus_rollups, line_ids
from services.billing.export import focus_hour_chunks
from services.billing.focus import write_focus_csv_chunks
from services.billing.ledger import FOCUS_ROLLUPS, Ledger, _alembic_config, _bill_row
from services.billing.rollups import HOUR_MS
from tests.integration.test_ledger_postgres import database_url  # noqa: F401 (a fixture)
from tests.unit.billing.data import make_ledger_0007 as recorded
from tests.unit.billing.test_ledger_compact import FIXTURE

pytestmark = pytest.mark.postgres


def hourly_rows(ledger: Ledger) -> tuple[dict, dict]:
    """The hourly FOCUS grain: charges and lines (0015's table or 0016's view), key -> measures."""
    return (focus_rollups.rows_of(ledger.read, FOCUS_ROLLUPS.charges),
            focus_rollups.rows_of(ledger.read, FOCUS_ROLLUPS.lines))


def hours() -> tuple[int, int]:
    start, end = FIXTURE["start_ms"], FIXTURE["end_ms"]
    return start - start % HOUR_MS, end - end % HOUR_MS + HOUR_MS


def hourly_export_csv(ledger: Ledger) -> str:
    """The FOCUS export at hourly grain of the fixture's hours, as CSV (``gpumeter export focus --grain hour``)."""
    start, end = hours()
    out = io.StringIO()
    assert write_focus_csv_chunks(focus_hour_chunks(ledger, start_ms=start, end_ms=end), out) > 0
    return out.getvalue()


def relkind(ledger: Ledger, name: str) -> str | None:
    with ledger.engine.connect() as connection:
        return connection.execute(text("SELECT relkind FROM pg_class WHERE relname = :n"), {"n": name}).scalar()


def columns_of(ledger: Ledger, table: str) -> list[str]:
    with ledger.engine.connect() as connection:
        return list(connection.execute(text(
            "SELECT column_name FROM information_schema.columns WHERE table_name = :t ORDER BY ordinal_position"),
            {"t": table}).scalars())


def test_the_hourly_focus_lines_move_to_ids_and_back_with_every_row_and_the_export_unchanged(database_url):
    ledger = Ledger(database_url)
    ledger.migrate()
    priced = recorded.results()
    ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    # Down to 0015's text layout: what a 0015 ledger holds.
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0015_focus_hourly")
    assert relkind(ledger, "focus_line_hourly") == "p" and relkind(ledger, "focus_line_hourly_rows") is None
    assert "charge_id" not in columns_of(ledger, "focus_charge_hourly")
    with ledger.engine.connect() as connection:
        text_rows = sorted(tuple(r) for r in connection.execute(text("SELECT * FROM focus_line_hourly")))
    assert text_rows and any(r[16] == "" for r in text_rows) and any(r[16] != "" for r in text_rows)

    assert ledger.migrate() == Ledger.head_revision() == "0018_bill_ids"
    assert relkind(ledger, "focus_line_hourly") == "v" and relkind(ledger, "focus_line_hourly_rows") == "p"
    # Numbers only; the view gives every column of every row as the table held it.
    assert columns_of(ledger, "focus_line_hourly_rows") == list(focus_rollups.ID_LINE_COLUMNS)
    with ledger.engine.connect() as connection:
        assert sorted(tuple(r) for r in connection.execute(text("SELECT * FROM focus_line_hourly"))) == text_rows
        indexes = connection.execute(text(
            "SELECT count(*) FROM pg_indexes WHERE tablename = 'focus_line_hourly_rows'")).scalar_one()
        ids = connection.execute(text("SELECT count(DISTINCT charge_id), count(*) FROM focus_charge_hourly")).one()
    assert indexes == 1 and ids[0] == ids[1] > 0
    export = hourly_export_csv(ledger)
    before = hourly_rows(ledger)

    # Trued up on the new layout: the grain moves as its minute lines do ...
    assert recorded._reconcile(ledger, recorded.FOCUS) == FIXTURE["reconcile"]
    amended = hourly_rows(ledger)
    amended_export = hourly_export_csv(ledger)
    assert amended[0] != before[0], "charges"
    assert amended[1] != before[1], "lines"
    assert amended_export != export
    # ... to what summing the trued-up minute lines gives: down to 0014 (no hourly FOCUS grain) and up again
    # (0015 backfills it from the minute lines, 0017 moves it to ids).
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0014_line_ids")
    assert relkind(ledger, "focus_line_hourly") is None
    assert ledger.migrate() == "0018_bill_ids"
    assert hourly_rows(ledger) == amended and hourly_export_csv(ledger) == amended_export

    # Back to 0015: the same rows in the text table, the same export.
    with ledger.engine.begin() as connection:
        command.downgrade(_alembic_config(connection), "0015_focus_hourly")
    assert relkind(ledger, "focus_line_hourly") == "p" and relkind(ledger, "focus_line_hourly_rows") is None
    assert hourly_rows(ledger) == amended
    ledger.close()


def test_a_write_at_head_gives_its_pods_gpus_and_zero_line_kinds_ids_and_exports_as_sqlite_does(database_url,
                                                                                              tmp_path):
    ledger = Ledger(database_url)
    ledger.migrate()
    sqlite = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    sqlite.migrate()
    priced = recorded.results()
    for target in (ledger, sqlite):
        target.write([c for r in priced for c in r.costs], [r.bill for r in priced])
        # A redelivery adds nothing to the grain.
        target.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    assert hourly_rows(ledger) == hourly_rows(sqlite)
    assert hourly_export_csv(ledger) == hourly_export_csv(sqlite)
    assert recorded._reconcile(ledger, recorded.FOCUS) == recorded._reconcile(sqlite, recorded.FOCUS)
    assert hourly_rows(ledger) == hourly_rows(sqlite)
    assert hourly_export_csv(ledger) == hourly_export_csv(sqlite)
    with ledger.engine.connect() as connection:
        # Every row resolved (the view's inner joins lose none) and the zero lines' buckets are rows of their own.
        counts = connection.execute(text(
            "SELECT (SELECT count(*) FROM focus_line_hourly_rows), (SELECT count(*) FROM focus_line_hourly), "
            "(SELECT count(*) FROM focus_line_hourly WHERE cost_micro_usd = 0 AND pod_uid = '')")).one()
    assert counts[0] == counts[1] > 0 and counts[2] > 0
    ledger.close()
    sqlite.close()


def test_ids_the_writers_cache_lacks_are_read_from_the_dictionaries_and_a_line_without_ids_is_refused(
        database_url, tmp_path, monkeypatch):
    ledger = Ledger(database_url)
    ledger.migrate()
    sqlite = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    sqlite.migrate()
    priced = recorded.results()
    sqlite.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    # The hourly FOCUS lines' upsert handed an empty cache: every GPU, pod and kind id read from the dictionaries.
    written = focus_rollups.add_written
    monkeypatch.setattr(focus_rollups, "add_written",
                        lambda *args, **kwargs: written(*args, **{**kwargs, "ids": line_ids.IdCache()}))
    ledger.write([c for r in priced for c in r.costs], [r.bill for r in priced])
    monkeypatch.undo()
    assert hourly_rows(ledger) == hourly_rows(sqlite)
    assert hourly_export_csv(ledger) == hourly_export_csv(sqlite)

    # A line of a GPU no dictionary holds (in neither the cache nor ledger_gpus): refused, nothing of it added.
    before = hourly_rows(ledger)
    first = priced[0]
    row = {**_bill_row(first.bill), "zero_line_count": 0}
    costs = [dataclasses.replace(first.costs[0], gpu_uuid="GPU-in-no-dictionary"), *first.costs[1:]]
    with pytest.raises(LookupError, match="1 of .* hourly FOCUS lines have no GPU, pod or kind id"):
        with ledger.engine.begin() as connection:
            focus_rollups.add_written(connection, FOCUS_ROLLUPS, [row], costs, ids=ledger._ids)
    assert hourly_rows(ledger) == before
    ledger.close()
    sqlite.close()
