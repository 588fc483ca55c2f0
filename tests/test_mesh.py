"""A device mesh: ranks placed as Megatron-LM and torchtitan place them (tensor-parallel groups
inside a node first), checked against Megatron's own example and torch's DeviceMesh on a fake
process group; collectives costed by the ring over the group's slowest link."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipexplore.devices import Mesh, planned_devices
from pipexplore.predict.collectives import FABRICS, collective_cost, collective_seconds, ring_seconds


def test_the_groups_are_megatrons_own_example():
    """Megatron-LM's parallel_state: 16 GPUs, tensor 2, pipeline 4 (data 2)."""
    mesh = Mesh.of({"tp": 2, "pp": 4, "dp": 2}, devices=16)
    assert mesh.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert mesh.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert mesh.groups("pp") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    for rank in range(16):
        assert mesh.rank(**mesh.coordinates(rank)) == rank


@pytest.fixture
def fake_world():
    """torch's fake process group, one process standing for a world of 16 ranks (nothing is sent)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        yield 16
    finally:
        dist.destroy_process_group()


def test_the_layout_is_torchs_device_mesh(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh.of({"tp": 2, "cp": 2, "dp": 2, "pp": 2}, devices=fake_world)
    torch_mesh = init_device_mesh("cpu", (mesh.pp, mesh.dp, mesh.cp, mesh.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    layout = torch_mesh.mesh  # rank r at its (pp, dp, cp, tp) place
    for rank in range(fake_world):
        place = mesh.coordinates(rank)
        assert int(layout[place["pp"], place["dp"], place["cp"], place["tp"]]) == rank
    for dim in ("tp", "cp", "dp", "pp"):  # rank 0's group in each dimension, as torch makes it
        assert tuple(torch_mesh[dim].mesh.tolist()) == mesh.group(dim, 0), dim


def test_a_mesh_that_does_not_fill_the_devices_is_refused_with_what_would():
    with pytest.raises(ValueError, match=r"mesh tp 4 × pp 8 = 32 ranks, but there are 64 devices: dp=2 would fill"):
        Mesh.of({"tp": 4, "pp": 8}, devices=64)
    with pytest.raises(ValueError, match=r"unknown dimension 'sp'"):
        Mesh.of({"tp": 2, "sp": 2}, devices=4)
    with pytest.raises(ValueError, match=r"tp \(tensor parallelism\) is a whole number of ranks from 1, got 0"):
        Mesh.of({"tp": 0, "pp": 4}, devices=4)
    with pytest.raises(ValueError, match=r"is a mapping of tp, pp, dp and cp"):
        Mesh.of([4, 8], devices=32)
    assert Mesh.of(None, devices=8) == Mesh(pp=8)  # no mesh: a stage a device, as plans were


def test_tensor_parallelism_across_nodes_is_allowed_and_flagged():
    inside = Mesh.of({"tp": 8, "pp": 2}, devices=16)
    across = Mesh.of({"tp": 16}, devices=16)
    assert inside.notes(gpus_per_node=8) == [] and inside.nodes_of("tp", 3, gpus_per_node=8) == 1
    assert inside.nodes_of("pp", 3, gpus_per_node=8) == 2
    assert across.nodes_of("tp", 0, gpus_per_node=8) == 2
    assert "tensor parallelism across nodes" in across.notes(gpus_per_node=8)[0]


def test_ring_costs_are_their_formulas():
    n, size, per_byte, latency = 4, 2**26, 1 / 450e9, 3e-6
    assert ring_seconds("all_reduce", size, n, per_byte, latency) == pytest.approx(
        2 * (n - 1) / n * size * per_byte + 2 * (n - 1) * latency)
    for kind in ("all_gather", "reduce_scatter"):
        assert ring_seconds(kind, size, n, per_byte, latency) == pytest.approx(
            (n - 1) / n * size * per_byte + (n - 1) * latency)
    assert ring_seconds("all_reduce", size, 1, per_byte, latency) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'broadcast': all_reduce, all_gather, reduce_scatter"):
        ring_seconds("broadcast", size, n, per_byte)


def test_a_group_runs_over_nvlink_inside_a_node_and_its_nics_across():
    """As NCCL runs it (:mod:`pipexplore.predict.collectives`): four GPUs of a node over NVLink,
    two GPUs on two nodes through one NIC each; the pair across nodes outlasts the four inside."""
    fabric = FABRICS["H100"]
    devices = planned_devices(["H100"] * 16, gpus_per_node=8)
    size = 2**28
    inside = collective_cost("all_reduce", size, devices[:4], gpus_per_node=8)
    assert inside.algorithm in ("ring", "nvls") and inside.bus_bandwidth > 0.8 * fabric.nvlink_busbw
    across = collective_cost("all_reduce", size, [devices[0], devices[8]], gpus_per_node=8)
    one_nic = fabric.nic_bandwidth * fabric.lone_nic_efficiency
    assert 0.9 * one_nic < across.bus_bandwidth <= one_nic
    assert collective_seconds("all_reduce", size, [devices[0], devices[8]], gpus_per_node=8) == across.seconds
    assert across.seconds > inside.seconds  # two ranks across nodes outlast four inside one