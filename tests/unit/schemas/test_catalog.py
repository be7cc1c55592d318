from __future__ import annotations

import socket

import pytest
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from schemas.catalog import ALL_TOPICS, POD_EVENTS, TopicCatalog, murmur2, partition_for_node, pod_event_key


@given(st.binary(max_size=64))
def test_murmur2_matches_aiokafka(data):
    # Ours returns Java's signed int; aiokafka the same 32 bits unsigned.
    ours = murmur2(data)
    assert -(2**31) <= ours < 2**31
    assert ours & 0xFFFFFFFF == aiokafka_murmur2(bytearray(data))


@given(st.text(min_size=1, max_size=63), st.integers(1, 64))
def test_partition_for_node_is_in_range_and_stable(node, partitions):
    first = partition_for_node(node, partitions)
    assert 0 <= first < partitions
    assert partition_for_node(node, partitions) == first


def test_catalog_topics_are_unique_and_pod_events_compacted():
    names = [spec.name for spec in ALL_TOPICS]
    assert len(set(names)) == len(names)
    assert POD_EVENTS.config()["cleanup.policy"] == "compact"
    assert all(spec.producers and spec.consumers for spec in ALL_TOPICS)


def test_prefix_and_partition_override():
    catalog = TopicCatalog(prefix="test.", partitions_override=3)
    assert catalog.pod_events == "test.gpumeter.pod-events.v1"
    assert {catalog.partitions(spec) for spec in catalog} == {3}


def test_pod_event_key_is_per_pod():
    assert pod_event_key("n1", "uid-1") == b"n1/uid-1"
    assert pod_event_key("n1", "uid-1") != pod_event_key("n1", "uid-2")


def test_unit_tests_cannot_open_tcp_connections():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        with pytest.raises(RuntimeError, match="mark it integration/network"):
            sock.connect(("127.0.0.1", 9092))
