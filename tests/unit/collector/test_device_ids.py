"""Device ids from the NVIDIA device plugin and the GPU resource names it advertises."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumeter.errors import InvalidMessage
from services.collector.podresources.devices import DeviceRef, is_gpu_resource, parse_device_id

U = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
M = "9a8b7c6d-5e4f-4031-8a2b-1c0d9e8f7a6b"


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        (f"GPU-{U}", DeviceRef("gpu", f"GPU-{U}", None, None, None, None)),
        (f"GPU-{U}::0", DeviceRef("gpu_replica", f"GPU-{U}", 0, None, None, None)),
        (f"GPU-{U}::9", DeviceRef("gpu_replica", f"GPU-{U}", 9, None, None, None)),
        (f"GPU-{U}::47", DeviceRef("gpu_replica", f"GPU-{U}", 47, None, None, None)),
        (f"MIG-{M}", DeviceRef("mig", None, None, f"MIG-{M}", None, None)),
        (f"MIG-{M}::3", DeviceRef("mig", None, 3, f"MIG-{M}", None, None)),
        (f"MIG-GPU-{U}/7/0", DeviceRef("mig", f"GPU-{U}", None, None, 7, 0)),
        (f"MIG-GPU-{U}/13/2", DeviceRef("mig", f"GPU-{U}", None, None, 13, 2)),
        (f"MIG-GPU-{U}/1/0::2", DeviceRef("mig", f"GPU-{U}", 2, None, 1, 0)),
    ],
)
def test_device_id_forms(device_id, expected):
    assert parse_device_id(device_id) == expected


def test_uppercase_hex_is_normalised_to_nvml_lowercase():
    assert parse_device_id(f"GPU-{U.upper()}::1") == parse_device_id(f"GPU-{U}::1")
    assert parse_device_id(f"MIG-{M.upper()}").mig_uuid == f"MIG-{M}"
    assert parse_device_id(f"MIG-GPU-{U.upper()}/1/0").gpu_uuid == f"GPU-{U}"


def test_kinds():
    assert parse_device_id(f"GPU-{U}").kind == "gpu"
    assert parse_device_id(f"GPU-{U}::2").kind == "gpu_replica"
    assert parse_device_id(f"MIG-{M}").is_mig
    assert not parse_device_id(f"GPU-{U}").is_mig


@pytest.mark.parametrize(
    "device_id",
    [
        "",
        "GPU-",
        "GPU-xyz",
        U,
        "0",
        "0::1",
        "0:1",
        f"gpu-{U}",
        f"GPU-{U}::",
        f"GPU-{U}::-1",
        f"GPU-{U}::01",
        f"GPU-{U}::1::2",
        f"GPU-{U}:1",
        f"GPU-{U[:-1]}",
        f"GPU-{U}0",
        f" GPU-{U}",
        f"GPU-{U}\n",
        f"MIG-GPU-{U}/1",
        f"MIG-GPU-{U}/1/",
        f"MIG-GPU-{U}/a/0",
        f"MIG-GPU-{U}/1/0/0",
        f"MIG-{U}/1/0",
        f"MIG-MIG-{M}",
        "nvidia.com/gpu=0",
        "k8s.gpu.nvidia.com/device=gpu-0",
    ],
)
def test_bad_device_ids_raise_invalid_message(device_id):
    with pytest.raises(InvalidMessage) as info:
        parse_device_id(device_id)
    assert info.value.reason_code == "BAD_DEVICE_ID"


def test_non_string_raises_invalid_message():
    with pytest.raises(InvalidMessage) as info:
        parse_device_id(None)  # type: ignore[arg-type]
    assert info.value.reason_code == "BAD_DEVICE_ID"


def test_long_garbage_is_truncated_in_the_detail():
    with pytest.raises(InvalidMessage) as info:
        parse_device_id("x" * 10_000)
    assert len(info.value.detail) < 300


@settings(max_examples=200, deadline=None)
@given(gpu=st.uuids(), replica=st.none() | st.integers(min_value=0, max_value=10**6))
def test_gpu_ids_round_trip(gpu, replica):
    device_id = f"GPU-{gpu}" if replica is None else f"GPU-{gpu}::{replica}"
    ref = parse_device_id(device_id)
    assert ref.gpu_uuid == f"GPU-{gpu}"
    assert ref.replica == replica
    assert ref.kind == ("gpu" if replica is None else "gpu_replica")


@settings(max_examples=200, deadline=None)
@given(gpu=st.uuids(), gi=st.integers(0, 10**6), ci=st.integers(0, 10**6))
def test_legacy_mig_ids_round_trip(gpu, gi, ci):
    ref = parse_device_id(f"MIG-GPU-{gpu}/{gi}/{ci}")
    assert (ref.kind, ref.gpu_uuid, ref.mig_gpu_instance_id, ref.mig_compute_instance_id, ref.mig_uuid) == (
        "mig",
        f"GPU-{gpu}",
        gi,
        ci,
        None,
    )


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_random_text_raises_only_invalid_message(text):
    try:
        ref = parse_device_id(text)
    except InvalidMessage as exc:
        assert exc.reason_code == "BAD_DEVICE_ID"
    else:
        assert ref.gpu_uuid is not None or ref.mig_uuid is not None


@pytest.mark.parametrize(
    ("resource_name", "is_gpu"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia.com/gpu.shared", True),
        ("nvidia.com/mig-1g.10gb", True),
        ("nvidia.com/mig-2g.20gb", True),
        ("nvidia.com/mig-3g.40gb", True),
        ("nvidia.com/mig-7g.80gb", True),
        ("nvidia.com/mig-1g.18gb", True),
        ("nvidia.com/mig-1g.10gb+me", True),
        ("nvidia.com/mig-1c.3g.40gb", True),
        ("nvidia.com/mig-1g.10gb.shared", True),
        ("nvidia.com/mig-", False),
        ("nvidia.com/gpus", False),
        ("nvidia.com/gpu.other", False),
        ("nvidia.com/gpu ", False),
        ("amd.com/gpu", False),
        ("gpu", False),
        ("cpu", False),
        ("example.com/fpga", False),
        ("", False),
    ],
)
def test_is_gpu_resource(resource_name, is_gpu):
    assert is_gpu_resource(resource_name) is is_gpu
