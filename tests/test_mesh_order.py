"""Multi-host placement: a ``model`` group stays inside one process (its all-reduces run every
layer), checked on fake device lists (objects with ``process_index`` and ``id``), no jax."""

from dataclasses import dataclass

import numpy as np
import pytest

from jaxdp.runtime.mesh import MeshDims, MeshError, check_model_within_hosts, host_ordered, mesh_sizes


@dataclass(frozen=True)
class FakeDevice:
    process_index: int
    id: int


def interleaved(processes: int, per_process: int):
    """Device ids handed out round-robin over processes (as a GPU cluster's global ids may be)."""
    return [FakeDevice(i % processes, i) for i in range(processes * per_process)]


def test_model_groups_are_one_process_each_whatever_the_ids():
    devices = host_ordered(interleaved(processes=2, per_process=4))
    grid = np.array([d.process_index for d in devices]).reshape(2, 2, 2)  # (replica, data, model)
    # model is the last (fastest) axis: each model pair is one process; the outer axis spans the hosts.
    assert all(len(set(pair)) == 1 for pair in grid.reshape(-1, 2))
    assert list(grid[:, 0, 0]) == [0, 1] and set(grid[1].ravel()) == {1}  # replica: one host each
    check_model_within_hosts(devices, (2, 2, 2), ("replica", "data", "model"))
    # jax's CPU/GPU default (ids as given, or sorted by id) would pair devices of two processes.
    by_id = sorted(interleaved(2, 4), key=lambda d: d.id)
    with pytest.raises(MeshError, match="would span processes"):
        check_model_within_hosts(by_id, (4, 2), ("data", "model"))


def test_a_model_axis_that_cannot_fit_a_host_is_refused_only_when_it_could():
    three_each = host_ordered(interleaved(processes=2, per_process=3))
    with pytest.raises(MeshError, match="model=2 does not divide the 3 devices of each process"):
        check_model_within_hosts(three_each, (3, 2), ("data", "model"))
    two_each = host_ordered(interleaved(processes=4, per_process=2))
    check_model_within_hosts(two_each, (2, 4), ("data", "model"))  # model=4 > 2 per host: must span


def test_mesh_sizes_is_every_command_s_mesh_check():
    assert mesh_sizes("data=2,stage=2,model=2") == {"data": 2, "stage": 2, "model": 2}
    assert mesh_sizes("model=2,data=4", devices=8) == {"model": 2, "data": 4}
    with pytest.raises(MeshError, match="holds 4 devices but --devices is 8"):
        mesh_sizes("data=2,model=2", devices=8)


# ----------------------------------------------------------------------------- the mesh's degrees (MeshDims)

def test_mesh_dims_are_validated_once_and_read_back_from_a_mesh():
    dims = MeshDims.parse("model=2,data=4")
    assert (dims.axes, dims.shape, dims.devices, dims.data_parallel) == (("data", "model"), (4, 2), 8, 4)
    assert dims.sizes() == {"data": 4, "model": 2} and dims.size("stage") == 1 and dims.size("replica") == 1
    assert MeshDims.named(stage=2).sizes() == {"data": 1, "stage": 2}  # every strategy finds a data axis
    for bad, match in (({"data": 0}, "data must be a positive integer, got 0"),
                       ({"model": True}, "model must be a positive integer"),
                       ({"tensor": 2}, "unknown mesh axis tensor; the axes are replica, data, stage, model")):
        with pytest.raises(MeshError, match=match):
            MeshDims.named(**bad)

    class FakeMesh:  # what MeshDims.of reads: axis names and sizes
        axis_names = ("replica", "data", "model")
        shape = {"replica": 2, "data": 2, "model": 2}
    assert MeshDims.of(FakeMesh()) == MeshDims(replica=2, data=2, model=2)


def test_replica_by_shard_splits_and_the_hsdp_default_are_the_mesh_dims():
    dims = MeshDims.parse("data=8,model=2").with_replicas((2, 4), "--mesh-shape 2,4")
    assert dims == MeshDims(replica=2, data=4, model=2) and dims.data_parallel == 8
    with pytest.raises(MeshError, match="--mesh-shape 3,2 must be two positive sizes R,S with R\\*S = 4"):
        MeshDims(data=4).with_replicas((3, 2), "--mesh-shape 3,2")
    assert [MeshDims.hsdp_default(n) for n in (1, 2, 3, 8)] == [(1, 1), (2, 1), (1, 3), (2, 4)]
    assert MeshDims.hsdp_default(16, hosts=2) == (2, 8)  # one shard group per host
    assert MeshDims.replica_splits(8) == [(2, 4), (4, 2)] and MeshDims.replica_splits(3) == []


def test_the_device_count_and_strategy_checks_are_the_mesh_dims():
    MeshDims(data=4).check_devices(8, platform="cpu")  # a mesh of 4 of the 8 devices
    with pytest.raises(MeshError, match="asked for 8 devices but only 4 are available. On CPU, simulate"):
        MeshDims(data=8).check_devices(4, platform="cpu")
    with pytest.raises(MeshError, match="XLA_FLAGS sets 4, which --devices does not override"):
        MeshDims(data=8).check_devices(4, platform="cpu", preset="4")
    with pytest.raises(MeshError, match="a multi-process mesh uses every device; omit --devices or pass 8"):
        MeshDims(data=4).check_devices(8, platform="gpu", processes=2)
    MeshDims(replica=2, data=2).check_for("hsdp", ("replica", "data"), model_parallel=True)
    with pytest.raises(MeshError, match="ddp has no replica degree, but the mesh has replica=2"):
        MeshDims(replica=2, data=2).check_for("ddp", ("data",), model_parallel=True)
    with pytest.raises(MeshError, match="dp runs over the data axis only, but the mesh has model=2"):
        MeshDims(data=2, model=2).check_for("dp", ("data",), model_parallel=False)
