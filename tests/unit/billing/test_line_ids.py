"""PostgreSQL's lines by dictionary ids (``services.billing.line_ids``): the keys and the bounded id cache. The SQL
side (ids assigned once by concurrent writers, the view reading what was written, the migration) is tested on a
real PostgreSQL in ``tests/integration/test_ledger_postgres.py``."""

from __future__ import annotations

import dataclasses

import pytest

from services.billing.line_ids import IdCache, line_keys, missing_keys, pod_key
from services.billing.line_storage import decode_zero_lines, encode_zero_lines, zero_line_gpu_ids
from tests.unit.billing.conftest import sample_costs


def lines():
    return [cost for result in sample_costs(3) for cost in result.costs]


def test_a_pod_key_tells_an_absent_namespace_or_name_from_an_empty_one():
    cost = next(c for c in lines() if c.pod_uid)
    assert pod_key(cost) == (cost.pod_uid, cost.namespace, cost.pod_name, 0)
    assert pod_key(dataclasses.replace(cost, namespace=None)) == (cost.pod_uid, "", cost.pod_name, 1)
    assert pod_key(dataclasses.replace(cost, pod_name=None)) == (cost.pod_uid, cost.namespace, "", 2)
    assert pod_key(dataclasses.replace(cost, namespace="", pod_name="")) == (cost.pod_uid, "", "", 0)
    bucket = next(c for c in lines() if c.pod_uid is None and c.namespace is None)
    assert pod_key(bucket) == ("", "", "", 3)


def test_missing_keys_lists_each_key_once_and_nothing_once_cached():
    costs = lines()
    cache = IdCache()
    wanted = missing_keys(cache, costs)
    assert wanted["nodes"] == {(c.cluster, c.node_name) for c in costs}
    assert wanted["gpus"] == {c.gpu_uuid or "" for c in costs}
    assert wanted["pods"] == {pod_key(c) for c in costs}
    assert wanted["kinds"] == {line_keys(c)[3] for c in costs}
    for kind, keys in wanted.items():
        cache.add(kind, {key: index for index, key in enumerate(sorted(keys))})
    assert missing_keys(cache, costs) == {}
    assert len(cache) == sum(len(keys) for keys in wanted.values())


def test_the_cache_is_bounded_and_keeps_a_whole_batch():
    cache = IdCache(entries=3)
    assert cache.make_room("pods", {"a", "b"}) == {"a", "b"}
    cache.add("pods", {"a": 1, "b": 2})
    # A batch of known keys needs nothing; one more fits.
    assert cache.make_room("pods", {"a", "b"}) == set()
    assert cache.make_room("pods", {"a", "c"}) == {"c"}
    cache.add("pods", {"c": 3})
    # Two new keys would pass 3: the kind is emptied and the whole batch is read again, so that all its ids are
    # cached together (the rows of one write are built from the cache).
    assert cache.make_room("pods", {"a", "d"}) == {"a", "d"}
    assert dict(cache.get("pods")) == {}
    cache.add("pods", {"a": 1, "d": 4})
    assert dict(cache.get("pods")) == {"a": 1, "d": 4} and len(cache) == 2
    # Other kinds are their own.
    assert cache.make_room("gpus", {"x"}) == {"x"}
    with pytest.raises(LookupError):
        cache.make_room("pods", {"p", "q", "r", "s"})
    with pytest.raises(LookupError):
        cache.add("pods", {"p": 5, "q": 6})
    with pytest.raises(ValueError):
        IdCache(entries=0)


def test_zero_lines_naming_their_gpus_by_id_read_back_the_same_lines():
    zero = [("GPU-0f7a", "IDLE", "exclusive", "memory", 1.0), ("GPU-0f7a", "UNAVAILABLE", "exclusive", "memory", 1.0),
            ("MIG-1c", "DRIVER_RESERVED", "mig_instance", "memory", 0.5), ("", "NODE_OTHER", "exclusive", "memory",
                                                                            1.0)]
    ids = {"GPU-0f7a": 7, "MIG-1c": 12, "": 1}
    by_uuid, by_id = encode_zero_lines(zero), encode_zero_lines(zero, ids)
    assert len(by_id) < len(by_uuid) and zero_line_gpu_ids(by_id) == {1, 7, 12} and zero_line_gpu_ids(by_uuid) == set()
    uuids = {i: uuid for uuid, i in ids.items()}
    assert decode_zero_lines(by_id, uuids) == decode_zero_lines(by_uuid) == sorted(zero)
    # What a reader gives back is the uuid text: the same as a ledger that never named ids.
    assert encode_zero_lines(decode_zero_lines(by_id, uuids)) == by_uuid
    with pytest.raises(KeyError):
        decode_zero_lines(by_id)
    # A uuid cache is bounded too.
    cache = IdCache(entries=2)
    cache.add_gpu_uuids({1: "a", 2: "b"})
    cache.add_gpu_uuids({3: "c"})
    assert dict(cache.gpu_uuids()) == {3: "c"}
