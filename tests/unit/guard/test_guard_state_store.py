"""The guard's state file: exact round trip, atomic replacement, and every kind of damage detected."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.guard.state import (
    STATE_MAGIC,
    GuardState,
    GuardStateError,
    GuardStateStore,
    decode_state,
    encode_state,
)

positions_strategy = st.dictionaries(
    st.tuples(st.text(min_size=1, max_size=30), st.integers(min_value=0, max_value=2**10)),
    st.integers(min_value=0, max_value=2**62),
    max_size=20,
)


@given(engine_bytes=st.binary(max_size=4096), positions=positions_strategy,
       saved_at=st.integers(min_value=0, max_value=2**52), role=st.none() | st.sampled_from(["all", "budgets"]),
       topics=st.none() | st.frozensets(st.text(min_size=1, max_size=30), max_size=4))
def test_round_trip_is_exact(engine_bytes, positions, saved_at, role, topics):
    state = GuardState(engine_bytes=engine_bytes, positions=positions, saved_at_unix_ms=saved_at, role=role,
                       topics=topics)
    assert decode_state(encode_state(state)) == state


def sample_state(engine_bytes: bytes = b"\x00engine\nstate\xff" * 10) -> GuardState:
    return GuardState(engine_bytes=engine_bytes,
                      positions={("p.gpumeter.node-samples.v1", 0): 42, ("p.gpumeter.pod-events.v1", 2): 7},
                      saved_at_unix_ms=1_780_000_000_000)


def test_save_replaces_the_file_and_leaves_no_temporary(tmp_path):
    store = GuardStateStore(tmp_path / "state" / "guard.state")
    assert store.load() is None  # nothing saved yet
    first, second = sample_state(b"first"), sample_state(b"second" * 100)
    store.save(first)
    assert store.load() == first
    store.save(second)
    assert store.load() == second
    assert sorted(os.listdir(store.path.parent)) == ["guard.state"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "header"])
def test_damaged_files_are_refused(tmp_path, damage):
    store = GuardStateStore(tmp_path / "guard.state")
    store.save(sample_state())
    data = bytearray(store.path.read_bytes())
    if damage == "truncate":
        data = data[:-3]
    elif damage == "flip":
        data[-1] ^= 0x01
    elif damage == "magic":
        data[0:8] = b"NOTGUARD"
    else:
        start = data.index(b"\n") + 1
        data[start:start + 1] = b"["
    store.path.write_bytes(bytes(data))
    with pytest.raises(GuardStateError):
        store.load()


@pytest.mark.parametrize("field, value", [("role", 7), ("topics", "unit.gpumeter.node-samples.v1"),
                                          ("topics", [1, 2])])
def test_a_role_or_topics_of_the_wrong_type_is_refused(field, value):
    state = GuardState(engine_bytes=b"e", positions={}, saved_at_unix_ms=0, role="all", topics=frozenset({"t"}))
    data = encode_state(state)
    start = len(STATE_MAGIC)
    end = data.index(b"\n", start)
    header = {**json.loads(data[start:end]), field: value}
    with pytest.raises(GuardStateError):
        decode_state(data[:start] + json.dumps(header).encode() + data[end:])


def test_move_aside_keeps_the_damaged_file_for_a_post_mortem(tmp_path):
    store = GuardStateStore(tmp_path / "guard.state")
    store.path.write_bytes(b"garbage")
    moved = store.move_aside(1234)
    assert moved == tmp_path / "guard.state.corrupt-1234"
    assert moved.read_bytes() == b"garbage"
    assert store.load() is None


def test_an_unwritable_folder_is_a_state_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = GuardStateStore(blocker / "guard.state")
    with pytest.raises(GuardStateError):
        store.save(sample_state())
