"""The hourly FOCUS export on PostgreSQL as ``gpumeter export focus`` makes it: the lines read by ids through the
driver (``focus_rollups.hour_lines_by_ids``) give the dataset the view's joined text rows give (what the export
read before), CSV and Parquet byte for byte, a cluster's alone; and the Parquet file made a chunk per worker
process (``export.focus_hour_tables``) is the file made in one process."""

from __future__ import annotations

import io

import pytest

from services.billing import focus_rollups
from services.billing.export import _charge, focus_export, focus_hour_chunks, focus_hour_tables
from services.billing.focus import HourLines, focus_hour_columns, write_focus_csv_chunks, write_focus_parquet_chunks
from services.billing.ledger import FOCUS_ROLLUPS, Ledger, label_sets
from services.billing.rollups import HOUR_MS
from tests.integration.test_ledger_postgres import database_url  # noqa: F401 (a fixture)
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs

pytestmark = pytest.mark.postgres

HOUR0 = WINDOW_START_MS - WINDOW_START_MS % HOUR_MS
END_MS = HOUR0 + 4 * HOUR_MS
SHARED = "idle=weighted,node_other=weighted"


def view_chunks(ledger: Ledger, cluster: str | None = None):
    """The hourly chunks from the view's rows (``lines_of(by_ids=True)``: the texts joined onto every line), an hour
    at a time."""
    for at in range(HOUR0, END_MS, HOUR_MS):
        charges = focus_rollups.charges_of(ledger.read, FOCUS_ROLLUPS, at, at + HOUR_MS, cluster)
        rows = focus_rollups.lines_of(ledger.read, FOCUS_ROLLUPS, at, at + HOUR_MS, cluster, by_ids=True)
        lines, kinds, pods, gpus = focus_rollups.hour_lines_of_texts(rows)
        labels = focus_rollups.label_sets_of(ledger.read, label_sets, {line[5] for line in lines})
        prices = ledger.price_versions({row[5] for row in charges})
        yield focus_hour_columns([(tuple(row[:len(focus_rollups.LINK)]), _charge(row, prices)) for row in charges],
                                 HourLines(lines, kinds, pods, gpus, labels))


def csv_of(chunks) -> str:
    out = io.StringIO()
    write_focus_csv_chunks(chunks, out)
    return out.getvalue()


def parquet_of(chunks, path) -> bytes:
    write_focus_parquet_chunks(chunks, path, metadata={"gpumeter_grain": "hour"})
    return path.read_bytes()


def test_the_lines_read_by_ids_and_the_workers_tables_make_the_views_dataset_byte_for_byte(database_url, tmp_path):
    ledger = Ledger(database_url)
    ledger.migrate()
    for sharing, start in (("keep", HOUR0 + 20 * 60_000), (SHARED, HOUR0 + 2 * HOUR_MS + 30 * 60_000)):
        results = sample_costs(100, start_ms=start, sharing=sharing)
        ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    by_ids = list(focus_hour_chunks(ledger, start_ms=HOUR0, end_ms=END_MS, chunk_hours=1))
    assert sum(len(chunk) for chunk in by_ids) > 20
    assert csv_of(by_ids) == csv_of(view_chunks(ledger))
    serial = parquet_of(by_ids, tmp_path / "ids.parquet")
    assert serial == parquet_of(view_chunks(ledger), tmp_path / "view.parquet")
    tables = focus_hour_tables(ledger, start_ms=HOUR0, end_ms=END_MS, workers=2, chunk_hours=1)
    assert parquet_of(tables, tmp_path / "workers.parquet") == serial
    # As the command asks for it: grain auto, a day's chunk (one row group), two workers (one chunk: made here).
    grain, chunks = focus_export(ledger, start_ms=HOUR0, end_ms=END_MS, workers=2)
    assert grain.grain == "hour"
    assert parquet_of(chunks, tmp_path / "export.parquet") == parquet_of(
        focus_hour_chunks(ledger, start_ms=HOUR0, end_ms=END_MS), tmp_path / "day.parquet")
    # One cluster's rows: the charges' cluster bounds the lines read by ids as the view's join did.
    cluster = by_ids[0].origin["x_ClusterName"][0]
    assert csv_of(focus_hour_chunks(ledger, start_ms=HOUR0, end_ms=END_MS, cluster=cluster, chunk_hours=1)) == (
        csv_of(view_chunks(ledger, cluster)))
    assert csv_of(focus_hour_chunks(ledger, start_ms=HOUR0, end_ms=END_MS, cluster="no-such", chunk_hours=1)) == (
        csv_of([[]]))
    ledger.close()
