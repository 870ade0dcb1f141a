"""Device meshes, host-to-device batch placement and multi-process start-up.

Simulating N devices on a CPU-only machine: set
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` *before* jax is imported
(``jaxdp train --devices N`` does this for you). Each simulated device is a
separate XLA CPU device, so collectives and shardings behave as on real hardware.
"""

import os
from typing import Optional, Sequence

import numpy as np

DATA_AXIS = "data"
REPLICA_AXIS = "replica"

_FORCE_FLAG = "--xla_force_host_platform_device_count"


class MeshError(ValueError):
    """The mesh the user asked for cannot be built on the devices available."""


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` host (CPU) devices. Only effective before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _FORCE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FORCE_FLAG}={n}".strip()


def make_mesh(num_devices: Optional[int] = None, shape: Optional[Sequence[int]] = None,
              axis_names: Sequence[str] = (DATA_AXIS,)):
    """A mesh over the first ``num_devices`` devices (all by default).

    ``shape``/``axis_names`` give a 2-D mesh, e.g. ``(2, 4), ("replica", "data")`` for HSDP.
    """
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()
    n = num_devices or (int(np.prod(shape)) if shape else len(devices))
    if n > len(devices):
        hint = (f" On CPU, simulate devices with XLA_FLAGS={_FORCE_FLAG}={n} set before jax is"
                " imported (jaxdp train --devices does this).") if devices[0].platform == "cpu" else ""
        raise MeshError(f"asked for {n} devices but only {len(devices)} are available.{hint}")
    shape = tuple(shape) if shape else (n,)
    if int(np.prod(shape)) != n:
        raise MeshError(f"mesh shape {shape} does not hold {n} devices")
    if len(shape) != len(axis_names):
        raise MeshError(f"mesh shape {shape} needs {len(shape)} axis names, got {tuple(axis_names)}")
    return Mesh(np.array(devices[:n]).reshape(shape), tuple(axis_names))


def shard_batch(mesh, array: np.ndarray, axes=DATA_AXIS):
    """Place a host batch on the mesh, split along dim 0 over ``axes``.

    ``make_array_from_process_local_data`` takes this process's rows only, so
    the same call serves one process and many (each passes its local shard).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)), array)


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, timeout_s: int = 300) -> None:
    """Join a multi-process JAX job (one process per host or per GPU).

    On CPU, cross-process collectives need gloo. Arguments default to the
    JAXDP_/JAX_ environment set by ``jaxdp launch`` or to SLURM's variables.
    """
    import jax

    # Only affects the CPU backend, so it is safe to set on GPU hosts too.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id, initialization_timeout=timeout_s,
    )
