"""``PackedBackedNodeSample``: what ``codec_for(NodeSample).decode`` returns for a v4 message -- a ``NodeSample``
whose devices are built from the record's columns on first read. It must behave as the ``NodeSample`` v3 decoding
builds, everywhere a ``NodeSample`` goes."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest

from pipeline.recordings import scenario_records
from schemas.packed import PackedBackedNodeSample
from schemas.records import NodeSample
from schemas.typed import codec_for
from simulator.scenario import load_scenario

REPO = Path(__file__).resolve().parents[3]


def _samples(scenario: str) -> list[NodeSample]:
    records = scenario_records(load_scenario(REPO / "scenarios" / f"{scenario}.yaml"))
    return [r.message for r in records if isinstance(r.message, NodeSample)]


@pytest.mark.parametrize("scenario", ["two_nodes", "mig_mixed", "mps", "faults", "hami"])
def test_decoded_sample_equals_the_sample_written_and_builds_its_devices_once(scenario: str) -> None:
    codec = codec_for(NodeSample)
    for sample in _samples(scenario):
        decoded = codec.decode(codec.encode(sample))
        assert type(decoded) is PackedBackedNodeSample and decoded.packed is not None
        assert decoded == sample and sample == decoded and not decoded != sample
        assert hash(decoded) == hash(sample)
        assert decoded.devices == sample.devices
        assert decoded.devices is decoded.devices  # built on the first read, kept
        assert codec_for(type(decoded)) is codec  # re-encoding a decoded sample goes through the same codec
        assert codec_for(type(decoded)).encode(decoded) == codec.encode(sample)


def test_decoded_sample_is_immutable_and_replace_gives_a_plain_sample() -> None:
    codec = codec_for(NodeSample)
    sample = _samples("two_nodes")[0]
    decoded = codec.decode(codec.encode(sample))
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.devices = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.sampled_at_unix_ms = 0  # type: ignore[misc]
    moved = dataclasses.replace(decoded, sampled_at_unix_ms=decoded.sampled_at_unix_ms - 5_000)
    assert moved.packed is None  # its fields are no longer the record's: nothing may read the record for them
    assert moved == dataclasses.replace(sample, sampled_at_unix_ms=sample.sampled_at_unix_ms - 5_000)
    for copied in (pickle.loads(pickle.dumps(decoded)), copy.deepcopy(decoded)):
        assert type(copied) is NodeSample and copied == sample


def test_a_sample_that_let_its_columns_go_still_says_the_same_and_builds_its_devices_from_its_message() -> None:
    codec = codec_for(NodeSample)
    for sample in _samples("mig_mixed") + _samples("faults"):
        decoded = codec.decode(codec.encode(sample))
        decoded.release_columns()
        assert decoded.packed is None
        assert decoded == sample and decoded.devices == sample.devices
    built = NodeSample(*[getattr(sample, f.name) for f in dataclasses.fields(NodeSample)])
    without_message = PackedBackedNodeSample.over(codec.decode_packed(codec.encode(built)), tuple(
        None if f.name == "devices" else getattr(built, f.name) for f in dataclasses.fields(NodeSample)))
    without_message.release_columns()  # nothing to build them from again: the columns stay
    assert without_message.packed is not None and without_message == built
