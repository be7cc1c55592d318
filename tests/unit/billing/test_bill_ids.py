"""PostgreSQL's node bills by dictionary ids (``services.billing.bill_ids``): the keys, the zero sets' ids, the rows,
the frozen view. No database: the SQL side (the migration, the write path, retention) is tested on a real
PostgreSQL in ``tests/integration/test_ledger_bill_ids_postgres.py``."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re

from sqlalchemy import BigInteger, Integer, MetaData

from services.billing import bill_ids
from services.billing.ledger import MIGRATIONS_DIR, _bill_row, node_bills
from services.billing.line_ids import IdCache, missing_keys
from services.billing.line_storage import encode_zero_lines
from tests.unit.billing.conftest import sample_costs


def bills(count: int = 3, **kwargs):
    return [result.bill for result in sample_costs(count, **kwargs)]


def migration_0018():
    path = MIGRATIONS_DIR / "versions" / "0018_bill_ids.py"
    spec = importlib.util.spec_from_file_location("migration_0018", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_zero_set_id_is_the_first_8_bytes_of_the_texts_sha256_signed():
    text = encode_zero_lines([("GPU-0", "UNAVAILABLE", "exclusive", "memory", 1.0),
                              ("GPU-1", "IDLE", "exclusive", "memory", 0.5)], {"GPU-0": 7, "GPU-1": 8})
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    assert bill_ids.zero_set_id(text) == int.from_bytes(digest[:8], "big", signed=True)
    assert bill_ids.zero_set_id(text) == bill_ids.zero_set_id(str(text))
    assert bill_ids.zero_set_id(text + " ") != bill_ids.zero_set_id(text)
    # Signed 64-bit (PostgreSQL's bigint): a digest whose first bit is set is negative.
    ids = [bill_ids.zero_set_id(f"[{i}]") for i in range(64)]
    assert all(-(2 ** 63) <= i < 2 ** 63 for i in ids) and min(ids) < 0 < max(ids)
    # Not ASCII: hashed as UTF-8, as the migration's convert_to(text, 'UTF8') does.
    assert bill_ids.zero_set_id("[\"é\"]") == int.from_bytes(
        hashlib.sha256("[\"é\"]".encode("utf-8")).digest()[:8], "big", signed=True)


def test_a_bill_kind_is_what_every_bill_of_a_node_repeats():
    first, *rest = bills(3)
    row = _bill_row(first)
    assert bill_ids.kind_key(row) == tuple(row[name] for name in bill_ids.KIND_COLUMNS)
    assert bill_ids.node_key(row) == (first.cluster, first.node_name)
    # The same node a minute later: the same kind; another sharing policy or price version: another.
    later = dataclasses.replace(first, window_start_unix_ms=first.window_start_unix_ms + 60_000)
    assert bill_ids.kind_key(_bill_row(later)) == bill_ids.kind_key(row)
    assert bill_ids.kind_key(_bill_row(dataclasses.replace(first, sharing="all=weighted"))) != bill_ids.kind_key(row)
    assert bill_ids.kind_key({**row, "price_version": "v2"}) != bill_ids.kind_key(row)
    # Every text column of the bill but its node's is in the kind (or the view could not give it back).
    texts = {c.name for c in node_bills.c if c.type.python_type is str}
    assert texts - set(bill_ids.KIND_COLUMNS) == {"cluster", "node_name", "publisher", "trueup_id", "zero_lines"}


def test_wanted_keys_name_the_bills_nodes_kinds_and_the_publisher():
    priced = bills(3)
    rows = [_bill_row(b) for b in priced]
    wanted = bill_ids.wanted_keys(rows, "billing-a")
    assert wanted == {"nodes": {(b.cluster, b.node_name) for b in priced},
                      "bill_kinds": {bill_ids.kind_key(r) for r in rows}, "names": {"billing-a"}}
    assert bill_ids.wanted_keys(rows, None)["names"] == set()


def test_missing_keys_take_the_bills_nodes_with_the_lines_in_one_batch():
    results = sample_costs(2)
    costs = [c for r in results for c in r.costs]
    rows = [_bill_row(r.bill) for r in results]
    # A bill of a node none of whose lines is stored (every line a zero line): its node is wanted all the same.
    lonely = _bill_row(dataclasses.replace(results[0].bill, node_name="gpu-lonely"))
    more = bill_ids.wanted_keys([*rows, lonely], "billing-a")
    cache = IdCache()
    wanted = missing_keys(cache, costs, (), more)
    assert wanted["nodes"] == {(c.cluster, c.node_name) for c in costs} | {(lonely["cluster"], "gpu-lonely")}
    assert wanted["bill_kinds"] == more["bill_kinds"] and wanted["names"] == {"billing-a"}
    for kind, keys in wanted.items():
        cache.add(kind, {key: index for index, key in enumerate(sorted(keys, key=repr))})
    assert missing_keys(cache, costs, (), more) == {}


def test_a_bills_row_holds_its_numbers_and_ids():
    bill = bills(1)[0]
    row = {**_bill_row(bill), "publisher": None, "zero_lines": None, "zero_line_count": 0}
    values = bill_ids.row_values(row, node_id=3, bill_kind_id=5, publisher_id=None)
    assert set(values) == set(bill_ids.ROW_COLUMNS)
    assert (values["window_start_unix_ms"], values["node_cost_micro_usd"], values["gpu_cost_micro_usd"],
            values["node_other_micro_usd"], values["billed_milliseconds"]) == (
        bill.window_start_unix_ms, bill.node_cost_micro_usd, bill.gpu_cost_micro_usd, bill.node_other_micro_usd,
        bill.billed_milliseconds)
    assert (values["node_id"], values["bill_kind_id"], values["publisher_id"], values["zero_set_id"]) == (
        3, 5, None, None)
    zero = encode_zero_lines([("GPU-0", "UNAVAILABLE", "exclusive", "memory", 1.0)], {"GPU-0": 9})
    listed = bill_ids.row_values({**row, "zero_lines": zero, "zero_line_count": 1}, node_id=3, bill_kind_id=5,
                                 publisher_id=2)
    assert (listed["zero_set_id"], listed["zero_line_count"], listed["publisher_id"]) == (
        bill_ids.zero_set_id(zero), 1, 2)


def test_the_rows_8_byte_columns_come_first_so_nothing_is_padded():
    tables = bill_ids.define_tables(MetaData(), "only_on")
    widths = [8 if isinstance(c.type, BigInteger) else 4 if isinstance(c.type, Integer) else 0
              for c in tables.rows.c]
    assert 0 not in widths and widths == sorted(widths, reverse=True)
    assert {c.name for c in tables.rows.c} == {*bill_ids.ROW_COLUMNS, "published_at_unix_ms",
                                                "trued_cost_micro_usd", "trueup_name_id"}
    assert [c.name for c in tables.rows.primary_key.columns] == ["window_start_unix_ms", "node_id"]


def _view_columns(select_sql: str) -> list[str]:
    listed = select_sql[len("SELECT "):select_sql.index(" FROM ")]
    return [re.split(r"\.| AS ", item.strip())[-1] for item in listed.split(", ")]


def test_the_migration_creates_the_view_bill_ids_describes_with_every_column_of_node_bills():
    """0018 freezes the view's SQL; the service's copy must say the same (a change needs a new migration). The view
    has every column of ``node_bills``, in 0017's PostgreSQL order (``SELECT *`` reads the same)."""
    migration = migration_0018()
    assert migration.VIEW_SELECT == bill_ids.VIEW_SELECT
    assert migration._KIND == bill_ids.KIND_COLUMNS
    columns = _view_columns(bill_ids.VIEW_SELECT)
    assert sorted(columns) == sorted(c.name for c in node_bills.c)
    # 0017's table as the downgrade recreates it: the same columns in the same order.
    old = migration._OLD_TABLE
    old_columns = [part.split()[0] for part in re.split(r", (?=[a-z_]+ (?:bigint|integer|varchar|text))",
                                                         old[old.index("(") + 1:old.index(", CONSTRAINT")])]
    assert columns == old_columns
