"""Multi-host placement: a ``model`` group stays inside one process (its all-reduces run every
layer), checked on fake device lists (objects with ``process_index`` and ``id``), no jax."""

from dataclasses import dataclass

import numpy as np
import pytest

from jaxdp.runtime.mesh import MeshError, check_model_within_hosts, host_ordered, mesh_sizes


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
