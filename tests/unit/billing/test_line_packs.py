"""The packing of PostgreSQL's cost lines by node-window (``services.billing.line_packs``), pure parts."""

from __future__ import annotations

import importlib.util

import pytest
from sqlalchemy import MetaData

from services.billing import line_packs
from services.billing.bulk_rows import BulkInsert
from services.billing.ledger import MIGRATIONS_DIR

# ``line_ids.ROW_COLUMNS`` order: start, label set, cost, cost share, memory, compute, fraction, node, gpu, pod, kind
ROWS = [
    (60_000, 7, 30, 0.5, 0.25, 0.125, 1.0, 2, 11, 5, 1),
    (0, 0, 10, 0.1, 0.0, 0.0, 1.0, 2, 12, 3, 2),
    (0, 9, 20, 0.2, 0.5, -0.0, 0.5, 2, 11, 4, 1),
    (0, 0, 5, 0.3, 0.0, 0.0, 1.0, 1, 11, 4, 1),
    (0, 8, 40, 0.4, 0.75, 0.5, 0.5, 2, 11, 3, 1),
]


def test_a_node_windows_lines_are_one_pack_in_gpu_kind_pod_order():
    packed = line_packs.pack_rows(ROWS)
    assert [p[:2] for p in packed] == [(0, 1), (0, 2), (60_000, 2)]
    (_s, _n, *one), (_s2, _n2, *two), (_s3, _n3, *three) = packed
    # Node 2 at 0: gpu 11 kind 1 pods 3, 4, then gpu 12: every array in that order.
    assert two == [[8, 9, 0], [40, 20, 10], [0.4, 0.2, 0.1], [0.75, 0.5, 0.0], [0.5, -0.0, 0.0], [0.5, 0.5, 1.0],
                   [11, 11, 12], [3, 4, 3], [1, 1, 2]]
    assert one == [[0], [5], [0.3], [0.0], [0.0], [1.0], [11], [4], [1]]
    assert three[1] == [30]
    assert len(packed[0]) == len(line_packs.PACK_COLUMNS)
    # Every line once: a pack's columns are all as long as its lines.
    assert sum(len(p[2]) for p in packed) == len(ROWS) and all(len({len(c) for c in p[2:]}) == 1 for p in packed)


def test_one_line_twice_in_a_node_window_is_refused():
    with pytest.raises(ValueError, match="same gpu, kind and pod ids"):
        line_packs.pack_rows([ROWS[1], ROWS[1]])


def test_the_trued_array_sets_the_named_lines_and_is_null_when_none_is_trued():
    keys = [("g1", "POD", "p1", ""), ("g1", "POD", "p2", ""), ("g2", "IDLE", "", "")]
    assert line_packs.trued_array(None, keys, {keys[1]: 7}) == [None, 7, None]
    assert line_packs.trued_array([1, 2, 3], keys, {keys[0]: 4, keys[2]: None}) == [4, 2, None]
    assert line_packs.trued_array([1, None, None], keys, {keys[0]: None}) is None
    with pytest.raises(KeyError):
        line_packs.trued_array(None, keys, {("g3", "POD", "p1", ""): 1})
    with pytest.raises(ValueError, match="2 trued-up costs"):
        line_packs.trued_array([1, 2], keys, {})


def test_the_migration_creates_the_view_line_packs_describes():
    """0016 freezes the view's SQL; the service's copy must say the same (a change needs a new migration)."""
    path = MIGRATIONS_DIR / "versions" / "0016_line_packs.py"
    spec = importlib.util.spec_from_file_location("migration_0016", path)
    migration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migration)
    assert migration.VIEW_SELECT == line_packs.VIEW_SELECT
    assert [name for name, _sql in migration._ARRAYS] == [name for name, _type in line_packs.PACK_ARRAYS]
    assert dict(migration._ARRAYS) == line_packs.PACK_SQL_TYPES


def test_the_packs_are_copied_as_arrays_of_their_element_types():
    table = line_packs.define_table(MetaData(), "only_on")
    insert = BulkInsert(table, line_packs.PACK_COLUMNS)
    *_sql, types = insert._postgresql_statements()
    assert types == ("int8", "int4", "int8[]", "int8[]", "float8[]", "float8[]", "float8[]", "float8[]", "int4[]",
                     "int4[]", "int2[]")


def test_the_encoded_copy_is_the_one_psycopg_writes_for_the_same_rows():
    from psycopg import postgres
    from psycopg._copy_base import _binary_signature, _binary_trailer, format_row_binary
    from psycopg.adapt import Transformer
    from psycopg.pq import Format

    table = line_packs.define_table(MetaData(), "only_on")
    types = BulkInsert(table, line_packs.PACK_COLUMNS)._postgresql_statements()[-1]
    transformer = Transformer()
    transformer.set_dumper_types([postgres.types[name.rstrip("[]")].array_oid if name.endswith("[]")
                                  else postgres.types[name].oid for name in types], Format.BINARY)
    packs = line_packs.pack_rows(ROWS + [(0, -(2 ** 63), -(2 ** 62), float("nan"), float("inf"), 5e-324, -1.5, 3,
                                          2 ** 31 - 1, -(2 ** 31), -(2 ** 15))])
    expected = bytearray(line_packs.COPY_SIGNATURE)
    for pack in packs:
        format_row_binary(pack, transformer, expected)
    expected += line_packs.COPY_TRAILER
    assert line_packs.copy_payload(packs) == bytes(expected)
    assert (line_packs.COPY_SIGNATURE, line_packs.COPY_TRAILER) == (_binary_signature, _binary_trailer)
