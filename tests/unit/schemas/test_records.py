"""Typed records built from Avro dicts: every field in its own attribute, enums as members, immutable results."""

from __future__ import annotations

import dataclasses
from dataclasses import fields

import pytest

from schemas.examples import load_example_dicts
from schemas.records import GpuDeviceSample, NodeSample, NvmlError, SharingMode


def _device_dict(**overrides):
    # Every value distinct (and of its field's type), so a field read into another field's place shows up.
    d = {
        "uuid": "GPU-u",
        "parent_uuid": "GPU-parent",
        "index": 3,
        "model": "NVIDIA H100 80GB HBM3",
        "sharing_mode": "MIG",
        "replicas": 4,
        "mig_gpu_instance_id": 7,
        "mig_compute_instance_id": 11,
        "mig_profile": "1g.10gb",
        "mig_compute_slices": 1,
        "mig_total_compute_slices": 13,
        "memory_total_bytes": 1001,
        "memory_used_bytes": 502,
        "memory_free_bytes": 403,
        "memory_reserved_bytes": 96,
        "gpu_utilization_percent": 17,
        "memory_utilization_percent": 19,
        "power_milliwatts": 123_456,
        "process_utilization_supported": True,
        "errors": [{"nvml_function": "nvmlDeviceGetPowerUsage", "error_code": "NOT_SUPPORTED", "message": "m"}],
        "process_pids": [101, 102],
        "process_pod_index": [0, -1],
        "process_used_memory_bytes": [300, -1],
        "process_sm_utilization_percent": [-1, 40],
        "mps_server_pids": [102],
    }
    d.update(overrides)
    return d


def _node_dict(devices, **overrides):
    d = {
        "cluster": "c",
        "node_name": "n",
        "sequence": 5,
        "collector_started_at_unix_ms": 1_700_000_000_000,
        "sampled_at_unix_ms": 1_700_000_005_000,
        "interval_ms": 1000,
        "cloud_provider": "aws",
        "region": "us-east-1",
        "instance_type": "p5.48xlarge",
        "price_model": "on_demand",
        "pod_uids": ["p0", "p1"],
        "node_errors": [{"nvml_function": "nvmlInit", "error_code": "UNKNOWN", "message": "x"}],
        "devices": devices,
        "zone": "us-east-1a",
        "provider_id": "aws:///us-east-1a/i-0abc",
    }
    d.update(overrides)
    return d


def _expected(record_type, d, converted):
    # What each attribute must hold: the Avro value itself, or its conversion (enums, tuples, nested records).
    return {f.name: converted.get(f.name, d[f.name]) for f in fields(record_type)}


def test_device_from_avro_puts_every_field_in_its_own_attribute():
    d = _device_dict()
    device = GpuDeviceSample.from_avro(d)
    expected = _expected(GpuDeviceSample, d, {
        "sharing_mode": SharingMode.MIG,
        "errors": (NvmlError("nvmlDeviceGetPowerUsage", "NOT_SUPPORTED", "m"),),
        "process_pids": (101, 102),
        "process_pod_index": (0, -1),
        "process_used_memory_bytes": (300, -1),
        "process_sm_utilization_percent": (-1, 40),
        "mps_server_pids": (102,),
    })
    assert {f.name: getattr(device, f.name) for f in fields(GpuDeviceSample)} == expected
    assert device.sharing_mode is SharingMode.MIG
    assert all(type(getattr(device, name)) is tuple for name in
               ("errors", "process_pids", "process_pod_index",
                "process_used_memory_bytes", "process_sm_utilization_percent", "mps_server_pids"))
    assert GpuDeviceSample.from_avro(device.to_avro()) == device


def test_node_sample_from_avro_puts_every_field_in_its_own_attribute():
    d = _node_dict([_device_dict(), _device_dict(uuid="GPU-v", parent_uuid=None, sharing_mode="TIME_SLICING",
                                                 errors=[], mig_profile=None, gpu_utilization_percent=None)])
    sample = NodeSample.from_avro(d)
    expected = _expected(NodeSample, d, {
        "pod_uids": ("p0", "p1"),
        "node_errors": (NvmlError("nvmlInit", "UNKNOWN", "x"),),
        "devices": tuple(GpuDeviceSample.from_avro(dev) for dev in d["devices"]),
    })
    assert {f.name: getattr(sample, f.name) for f in fields(NodeSample)} == expected
    assert sample.devices[1].errors == () and sample.devices[1].sharing_mode is SharingMode.TIME_SLICING
    assert sample.devices[1].gpu_utilization_percent is None and sample.devices[1].parent_uuid is None
    assert NodeSample.from_avro(sample.to_avro()) == sample


@pytest.mark.parametrize("mode", list(SharingMode))
def test_every_sharing_mode_decodes_to_its_member(mode):
    assert GpuDeviceSample.from_avro(_device_dict(sharing_mode=mode.value)).sharing_mode is mode
    # A member passed in (a dict built from typed values) is the same member.
    assert GpuDeviceSample.from_avro(_device_dict(sharing_mode=mode)).sharing_mode is mode


@pytest.mark.parametrize("bad", ["NOPE", "mig", "", None, ["MIG"]])
def test_an_unknown_sharing_mode_is_rejected_as_the_enum_rejects_it(bad):
    with pytest.raises(ValueError):
        GpuDeviceSample.from_avro(_device_dict(sharing_mode=bad))


def test_empty_errors_and_the_shipped_examples():
    d = _node_dict([_device_dict(errors=[])], node_errors=[])
    sample = NodeSample.from_avro(d)
    assert sample.node_errors == () and sample.devices[0].errors == ()
    for example in load_example_dicts("NodeSample"):
        record = NodeSample.from_avro(example)
        assert NodeSample.from_avro(record.to_avro()) == record
        assert [dev.uuid for dev in record.devices] == [dev["uuid"] for dev in example["devices"]]


def test_decoded_records_are_frozen():
    sample = NodeSample.from_avro(_node_dict([_device_dict()]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.sequence = 6  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.devices[0].memory_used_bytes = 0  # type: ignore[misc]
