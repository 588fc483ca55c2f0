"""The device catalogue: specs by name, planned devices and their places, link costs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipexplore import devices
from pipexplore.devices import (CATALOGUE, DeviceSpec, GiB, device_spec, is_planned, link_latency,
                                link_seconds_per_byte, node_of, planned_devices, register_device)


def test_the_catalogue_has_the_devices_with_their_datasheet_numbers():
    for name in ("H100", "H200", "A100-40GB", "A100-80GB", "L4", "MI300X"):
        spec = device_spec(name)
        assert spec.name == name and spec.source.startswith("https://")
        assert {"float32", "bfloat16", "float16"} <= set(spec.peak_flops)
        assert 0 < spec.flops_efficiency <= 1 and 0 < spec.bandwidth_efficiency <= 1
    h100 = device_spec("H100")
    assert h100.memory_bytes == 80 * GiB and h100.memory_bandwidth == 3.35e12
    assert h100.peak("bfloat16") == 989.5e12 and h100.peak(torch.float8_e4m3fn) == 1979e12
    assert h100.intra_node_bandwidth == 450e9 and h100.inter_node_bandwidth == 50e9
    assert "float8" not in device_spec("A100-80GB").peak_flops
    assert device_spec("A100") is device_spec("A100-80GB") is device_spec("a100-80gb")
    assert device_spec("H100:3") is h100 and device_spec(h100) is h100


def test_an_unknown_name_is_refused_with_the_catalogue_listed():
    with pytest.raises(ValueError, match=r"unknown device 'V100': the catalogue has H100.*H200.*A100-40GB.*"
                                         r"A100-80GB \(also A100.*L4, MI300X"):
        device_spec("V100")
    with pytest.raises(ValueError, match="has no float8 peak"):
        device_spec("A100").peak("float8")


def test_a_spec_is_frozen_checked_and_hashable():
    spec = device_spec("L4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "L5"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.peak_flops["float32"] = 1.0  # type: ignore[index]
    assert hash(spec) == hash(dataclasses.replace(spec))
    with pytest.raises(ValueError, match="memory_bandwidth must be a positive"):
        DeviceSpec("Bad", GiB, 0.0, {"float32": 1e12})
    with pytest.raises(ValueError, match="needs at least 'float32'"):
        DeviceSpec("Bad", GiB, 1e12, {"bf16": 1e12})
    with pytest.raises(ValueError, match="without ':'"):
        DeviceSpec("Bad:0", GiB, 1e12, {"float32": 1e12})
    with pytest.raises(ValueError, match="device type of this machine"):
        DeviceSpec("cuda", GiB, 1e12, {"float32": 1e12})


def test_a_custom_device_is_passed_or_registered():
    mine = DeviceSpec("MyGPU", 24 * GiB, 1e12, {"fp32": 40e12, "bf16": 160e12})
    assert device_spec(mine) is mine and mine.peak("bfloat16") == 160e12
    assert not is_planned("MyGPU:0")
    try:
        register_device(mine)
        assert device_spec("MyGPU:2") is mine and is_planned("MyGPU:0")
        assert planned_devices(["MyGPU"] * 2, 8) == ("MyGPU:0", "MyGPU:1")
        register_device(mine)  # the same spec again: nothing to refuse
        other = dataclasses.replace(mine, memory_bandwidth=2e12)
        with pytest.raises(ValueError, match="replace=True"):
            register_device(other)
        assert register_device(other, replace=True) is device_spec("MyGPU")
        with pytest.raises(ValueError, match="already names A100-80GB"):
            register_device(dataclasses.replace(mine, name="A100"))
    finally:
        CATALOGUE.pop("MyGPU", None)


@pytest.mark.parametrize("name,planned", [("H100", True), ("H100:3", True), ("a100", True), ("MI300X:15", True),
                                          ("cpu", False), ("cuda:0", False), ("cuda", False), ("H100:x", False),
                                          ("V100:0", False), (0, False), (torch.device("cpu"), False)])
def test_is_planned(name, planned):
    assert is_planned(name) is planned


def test_planned_devices_are_numbered_across_the_cluster():
    assert planned_devices(["H100"] * 16, gpus_per_node=8) == tuple(f"H100:{k}" for k in range(16))
    # Indexed names are kept; the others take the lowest free places.
    assert planned_devices(["H100:3", "H100", "H100", "H100:3"], 8) == ("H100:3", "H100:0", "H100:1", "H100:3")
    both = planned_devices(["H100"] * 8 + ["A100"] * 8, gpus_per_node=8)
    assert both[7] == "H100:7" and both[8] == "A100:8" and node_of(both[8], 8) == 1


def test_planned_devices_refuse_mixing_and_mixed_nodes():
    with pytest.raises(ValueError, match=r"cannot mix planned devices \(H100\) with devices of this machine "
                                         r"\(cuda:0, cpu\)"):
        planned_devices(["H100", "cuda:0", "cpu"], 8)
    with pytest.raises(ValueError, match="not planned devices; the catalogue has H100"):
        planned_devices(["cpu", "cpu"], 8)
    with pytest.raises(ValueError, match="node 0 .* would hold H100 and A100-80GB"):
        planned_devices(["H100"] * 4 + ["A100"] * 4, 8)
    with pytest.raises(ValueError, match="at least one"):
        planned_devices([], 8)
    with pytest.raises(ValueError, match="gpus_per_node"):
        planned_devices(["H100"], 0)


def test_node_of():
    assert [node_of(f"H100:{k}", 8) for k in (0, 7, 8, 15, 16)] == [0, 0, 1, 1, 2]
    assert node_of("H100:5", 4) == 1
    assert node_of("cuda:3", 2) == 0 and node_of("cpu", 8) == 0  # this machine
    with pytest.raises(ValueError, match="no place in the cluster"):
        node_of("H100", 8)


def test_link_costs_same_device_same_node_and_across_nodes():
    assert link_seconds_per_byte("H100:3", "H100:3", 8) == 0.0 and link_latency("H100:3", "H100:3", 8) == 0.0
    assert link_seconds_per_byte("H100:0", "H100:7", 8) == pytest.approx(1 / 450e9)  # NVLink, one direction
    assert link_seconds_per_byte("H100:7", "H100:8", 8) == pytest.approx(1 / 50e9)  # 400 Gb/s NDR per GPU
    assert link_latency("H100:0", "H100:7", 8) == pytest.approx(3e-6)
    assert link_latency("H100:7", "H100:8", 8) == pytest.approx(8e-6)
    assert link_seconds_per_byte("MI300X:0", "MI300X:1", 8) == pytest.approx(1 / 64e9)  # one xGMI link
    assert link_seconds_per_byte("L4:0", "L4:1", 8) == pytest.approx(1 / 32e9)  # PCIe
    # Two kinds: the slower end's link.
    assert link_seconds_per_byte("H100:7", "A100:8", 8) == pytest.approx(1 / 25e9)
    with pytest.raises(ValueError, match="not a planned device"):
        link_seconds_per_byte("cuda:0", "H100:0", 8)


def test_the_old_names_stay():
    assert devices.as_device("cpu") == torch.device("cpu")
    assert devices.stage_devices(2)[0] in (["cpu", "cpu"], ["cuda:0", "cuda:0"], ["cuda:0", "cuda:1"])


def test_device_memory_of_a_gpu_this_machine_lacks_is_unknown(monkeypatch):
    """A plan drawn for cuda:0…3 on a machine of one GPU: the GPUs it lacks hold no known memory
    (NaN, as the CPU), never a CUDA error; the one it has, its total."""
    import math

    class Properties:
        total_memory = 80 * 2**30

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or Properties)
    assert devices.device_memory("cuda:0") == 80 * 2**30
    assert math.isnan(devices.device_memory("cuda:1")) and math.isnan(devices.device_memory(3))
    assert asked == [0]
