"""Properties of ``schemas.devices.parse_device_id``: every id form round-trips, and no text makes it raise."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.devices import DeviceIdKind, is_gpu_resource, parse_device_id


@settings(max_examples=200, deadline=None)
@given(gpu=st.uuids(), replica=st.none() | st.integers(min_value=0, max_value=10**6), upper=st.booleans())
def test_gpu_ids_round_trip(gpu, replica, upper):
    text = str(gpu).upper() if upper else str(gpu)
    device_id = f"GPU-{text}" if replica is None else f"GPU-{text}::{replica}"
    ref = parse_device_id(device_id)
    assert (ref.kind, ref.gpu_uuid, ref.base_id, ref.replica) == (DeviceIdKind.GPU, f"GPU-{gpu}", f"GPU-{gpu}",
                                                                   replica)


@settings(max_examples=200, deadline=None)
@given(gpu=st.uuids(), gi=st.integers(0, 10**6), ci=st.integers(0, 10**6))
def test_legacy_mig_ids_round_trip(gpu, gi, ci):
    ref = parse_device_id(f"MIG-GPU-{gpu}/{gi}/{ci}")
    assert (ref.kind, ref.gpu_uuid, ref.mig_gpu_instance_id, ref.mig_compute_instance_id, ref.mig_uuid) == (
        DeviceIdKind.MIG_PATH, f"GPU-{gpu}", gi, ci, None)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_no_text_makes_the_parser_raise_and_other_names_nothing(text):
    ref = parse_device_id(text)
    assert ref.device_id == text
    if ref.kind is DeviceIdKind.OTHER:
        assert ref.gpu_uuid is None and ref.mig_uuid is None


@pytest.mark.parametrize(("resource_name", "is_gpu"), [
    ("nvidia.com/gpu", True), ("nvidia.com/gpu.shared", True), ("nvidia.com/mig-1g.10gb", True),
    ("nvidia.com/mig-7g.80gb", True), ("nvidia.com/mig-1g.18gb", True), ("nvidia.com/mig-1g.10gb+me", True),
    ("nvidia.com/mig-1c.3g.40gb", True), ("nvidia.com/mig-1g.10gb.shared", True), ("nvidia.com/mig-", False),
    ("nvidia.com/gpus", False), ("nvidia.com/gpu.other", False), ("nvidia.com/gpu ", False), ("amd.com/gpu", False),
    ("gpu", False), ("cpu", False), ("example.com/fpga", False), ("", False),
])
def test_is_gpu_resource(resource_name, is_gpu):
    assert is_gpu_resource(resource_name) is is_gpu
