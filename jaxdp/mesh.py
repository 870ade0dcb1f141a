"""Device meshes, host-to-device batch placement and multi-process start-up.

Simulating N devices on a CPU-only machine: set
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` *before* jax is imported
(``jaxdp train --devices N`` does this for you). Each simulated device is a
separate XLA CPU device, so collectives and shardings behave as on real hardware.
"""

import os
from typing import List, Mapping, Optional, Sequence

import numpy as np

DATA_AXIS = "data"
REPLICA_AXIS = "replica"
STAGE_AXIS = "stage"  # pipeline stages (jaxdp.parallel.pipeline)
MODEL_AXIS = "model"  # tensor parallelism (jaxdp.parallel.tensor)
# The named axes in mesh order, outermost first. ``model`` is innermost: its devices are
# consecutive, so a model-parallel group stays on one host (its all-reduces run every layer,
# on the fast links); data parallelism, which communicates once per step, spans the hosts.
AXES = (REPLICA_AXIS, DATA_AXIS, STAGE_AXIS, MODEL_AXIS)

_FORCE_FLAG = "--xla_force_host_platform_device_count"


class MeshError(ValueError):
    """The mesh the user asked for cannot be built on the devices available."""


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` host (CPU) devices. Only effective before jax is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _FORCE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FORCE_FLAG}={n}".strip()


def make_mesh(num_devices: Optional[int] = None, shape: Optional[Sequence[int]] = None,
              axis_names: Sequence[str] = (DATA_AXIS,), *, data: Optional[int] = None,
              replica: Optional[int] = None, stage: Optional[int] = None, model: Optional[int] = None):
    """A mesh over the first ``num_devices`` devices (all by default).

    Named sizes are the short form: ``make_mesh(data=4)``; ``make_mesh(replica=2, data=4)``
    for HSDP's (replica, data) mesh; ``make_mesh(data=2, model=2)`` for data x tensor
    parallelism, ``make_mesh(data=2, stage=2)`` for data x pipeline stages. The axes come
    in the order of ``AXES`` whatever the keyword order, and only the named ones exist.

    ``shape``/``axis_names`` give any other mesh, e.g. ``(2, 4), ("replica", "data")``.
    Devices are ordered process by process, so each process's devices form one
    contiguous block of ranks (its rows of every batch). A multi-process mesh
    spans every device of every process: a process without devices in the mesh
    would have nothing to do and would block every collective.
    """
    import jax
    from jax.sharding import Mesh

    named = {REPLICA_AXIS: replica, DATA_AXIS: data, STAGE_AXIS: stage, MODEL_AXIS: model}
    if any(v is not None for v in named.values()):
        if shape is not None or num_devices is not None:
            raise MeshError("give either named axis sizes (data=, replica=, stage=, model=) or num_devices/shape")
        shape, axis_names = named_shape(**named)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = num_devices or (int(np.prod(shape)) if shape else len(devices))
    if n > len(devices):
        hint = (f" On CPU, simulate devices with XLA_FLAGS={_FORCE_FLAG}={n} set before jax is"
                " imported (jaxdp train --devices does this).") if devices[0].platform == "cpu" else ""
        raise MeshError(f"asked for {n} devices but only {len(devices)} are available.{hint}")
    if jax.process_count() > 1 and n != len(devices):
        raise MeshError(
            f"asked for {n} devices, but this job's {jax.process_count()} processes have {len(devices)}"
            f" ({jax.local_device_count()} each): a multi-process mesh uses every device; "
            f"omit --devices or pass {len(devices)}")
    shape = tuple(shape) if shape else (n,)
    if int(np.prod(shape)) != n:
        raise MeshError(f"mesh shape {shape} does not hold {n} devices")
    if len(shape) != len(axis_names):
        raise MeshError(f"mesh shape {shape} needs {len(shape)} axis names, got {tuple(axis_names)}")
    return Mesh(np.array(devices[:n]).reshape(shape), tuple(axis_names))


def named_shape(**sizes: Optional[int]):
    """(shape, axis names) in ``AXES`` order for the named sizes that are not None; a data
    axis (size 1) is added when none is named, so every strategy finds one."""
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise MeshError(f"unknown mesh axis {', '.join(sorted(unknown))}; the axes are {', '.join(AXES)}")
    for name, size in sizes.items():
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise MeshError(f"mesh axis {name} must be a positive integer, got {size!r}")
    if sizes.get(DATA_AXIS) is None:
        sizes = {**sizes, DATA_AXIS: 1}
    names = tuple(a for a in AXES if sizes.get(a) is not None)
    return tuple(sizes[a] for a in names), names


def parse_mesh(text: str) -> dict:
    """``"data=2,stage=2,model=2"`` -> ``{"data": 2, "stage": 2, "model": 2}`` (``--mesh``)."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or not value.strip().isdigit():
            raise MeshError(f"--mesh takes axis=size pairs like data=2,model=2, got {part!r}")
        if name in sizes:
            raise MeshError(f"--mesh names {name} twice")
        sizes[name] = int(value)
    if not sizes:
        raise MeshError("--mesh is empty: give axis=size pairs like data=2,model=2")
    named_shape(**sizes)  # the same checks as make_mesh
    return sizes


def axis_size(mesh, axis: str) -> int:
    """``mesh``'s size along ``axis``, 1 when it has no such axis."""
    return int(mesh.shape[axis]) if axis in mesh.axis_names else 1


def process_ranks(mesh, axes=DATA_AXIS) -> List[int]:
    """The batch ranks (rows of ``epoch_batches``) this process's devices take.

    Rank r is the r-th slice of a batch split over ``axes``, as ``shard_batch``
    places it. One process: every rank. Many: this process's contiguous block,
    so ``make_array_from_process_local_data`` can stitch the blocks into the
    global batch.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    axes_t = axes if isinstance(axes, tuple) else (axes,)
    n = int(np.prod([mesh.shape[a] for a in axes_t]))
    index_map = NamedSharding(mesh, P(axes)).addressable_devices_indices_map((n,))
    ranks = sorted({idx[0].start or 0 for idx in index_map.values()})
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise MeshError(f"process {jax.process_index()} holds batch ranks {ranks}, not one contiguous block")
    return ranks


def shard_batch(mesh, array: np.ndarray, axes=DATA_AXIS):
    """Place a host batch on the mesh, split along dim 0 over ``axes``.

    ``make_array_from_process_local_data`` takes this process's rows only, so
    the same call serves one process and many (each passes its local shard).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(axes)), array)


# ----------------------------------------------------------------------------- multi-process jobs

# What `jaxdp launch` sets in each process it starts (torchrun's RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR and MASTER_PORT too, so torch_ref runs under it unchanged).
ENV_COORDINATOR = "JAXDP_COORDINATOR"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "JAXDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDP_PROCESS_ID"
ENV_LOCAL_RANK = "JAXDP_LOCAL_RANK"  # this process's index on its host
ENV_COORDINATOR_PORT = "JAXDP_COORDINATOR_PORT"  # SLURM: overrides the port derived from the job id


class DistributedEnv:
    """Where a process stands in a multi-process job: coordinator, count, id."""

    def __init__(self, coordinator: str, num_processes: int, process_id: int, local_rank: int = 0,
                 source: str = "jaxdp"):
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise MeshError(f"process id {process_id} is outside [0, {num_processes - 1}]")
        if ":" not in coordinator:
            raise MeshError(f"coordinator address {coordinator!r} must be host:port")
        self.coordinator, self.num_processes, self.process_id = coordinator, num_processes, process_id
        self.local_rank, self.source = local_rank, source

    def __repr__(self):
        return (f"DistributedEnv({self.coordinator!r}, num_processes={self.num_processes}, "
                f"process_id={self.process_id}, local_rank={self.local_rank}, source={self.source!r})")


def distributed_env(environ: Optional[Mapping[str, str]] = None) -> Optional[DistributedEnv]:
    """The job this process belongs to, from its environment; None for a single process.

    Read in this order: ``JAXDP_COORDINATOR``/``JAXDP_NUM_PROCESSES``/``JAXDP_PROCESS_ID``
    (set by ``jaxdp launch``), then a SLURM job step (``srun``): ``SLURM_PROCID``,
    ``SLURM_NTASKS`` > 1, coordinator = first host of ``SLURM_STEP_NODELIST`` on port
    ``JAXDP_COORDINATOR_PORT`` or, as JAX's own SLURM detection, 61440 + job id mod 4096.
    """
    env = os.environ if environ is None else environ
    if ENV_NUM_PROCESSES in env or ENV_COORDINATOR in env or ENV_PROCESS_ID in env:
        missing = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if k not in env]
        if missing:
            raise MeshError(f"multi-process environment is incomplete: {', '.join(missing)} not set")
        return DistributedEnv(env[ENV_COORDINATOR], _int_env(env, ENV_NUM_PROCESSES),
                              _int_env(env, ENV_PROCESS_ID), int(env.get(ENV_LOCAL_RANK, 0)), "jaxdp")
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if all(k in env for k in slurm) and _int_env(env, "SLURM_NTASKS") > 1:
        port = env.get(ENV_COORDINATOR_PORT) or str(61440 + _int_env(env, "SLURM_JOB_ID") % 4096)
        return DistributedEnv(f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}", _int_env(env, "SLURM_NTASKS"),
                              _int_env(env, "SLURM_PROCID"), int(env.get("SLURM_LOCALID", 0)), "slurm")
    return None


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise MeshError(f"{key}={env[key]!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    head = nodelist.strip()
    for i, ch in enumerate(head):
        if ch == ",":
            return head[:i]
        if ch == "[":
            first = head[i + 1:].split("]")[0].split(",")[0].split("-")[0]
            return head[:i] + first
    return head


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, timeout_s: int = 300,
                           heartbeat_timeout_s: int = 100) -> None:
    """Join a multi-process JAX job (one process per host or per GPU).

    On CPU, cross-process collectives need gloo. Arguments default to the
    environment (``distributed_env``: ``jaxdp launch``'s variables or SLURM's).

    ``timeout_s``: every process must have joined by then. JAX itself aborts the
    process (SIGABRT, a C++ stack trace) when its connect deadline passes, so we give
    JAX a longer deadline and a watchdog ends the process at ``timeout_s`` with a
    one-line error instead. ``heartbeat_timeout_s``: how long the survivors wait
    for a peer that stopped answering (e.g. killed without a launcher to stop the
    rest) before the coordination service ends them.
    """
    import sys
    import threading

    import jax

    if coordinator_address is None or num_processes is None or process_id is None:
        env = distributed_env()
        if env is None:
            raise MeshError("no multi-process job: pass coordinator, num_processes and process_id,"
                            " or start the processes with jaxdp launch (or srun)")
        coordinator_address = coordinator_address or env.coordinator
        num_processes = env.num_processes if num_processes is None else num_processes
        process_id = env.process_id if process_id is None else process_id
    # Only affects the CPU backend, so it is safe to set on GPU hosts too.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    joined = threading.Event()

    def watchdog():
        if not joined.wait(timeout_s):
            sys.stderr.write(
                f"jaxdp: error: process {process_id} of {num_processes} could not join the job at "
                f"{coordinator_address} within --init-timeout {timeout_s:g} s: not every process connected. "
                f"Start all {num_processes} processes (jaxdp launch does), check that the coordinator "
                f"address is reachable from every host, or raise --init-timeout.\n")
            sys.stderr.flush()
            os._exit(INIT_TIMEOUT_EXIT_CODE)

    threading.Thread(target=watchdog, name="jaxdp-init-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
            initialization_timeout=int(timeout_s) + 60, heartbeat_timeout_seconds=int(heartbeat_timeout_s),
        )
    finally:
        joined.set()


INIT_TIMEOUT_EXIT_CODE = 3  # a process that gave up waiting for the others


_BARRIERS = [0]


def barrier(name: str, timeout_s: int = 1800) -> None:
    """Wait until every process of the job gets here (a no-op for one process).

    Why: XLA's CPU (gloo) collectives give a peer 30 s, not configurable, to join each
    new communicator. After a long compile (tens of seconds on a loaded CPU host) the
    processes can be further apart than that. This barrier goes through JAX's
    coordination service instead, which has no such limit, so the first collective
    after it finds everyone ready. A dead peer ends it (heartbeat timeout), and
    ``jaxdp launch`` stops the job sooner.
    """
    import jax
    from jax._src import distributed

    if jax.process_count() == 1 or distributed.global_state.client is None:
        return
    _BARRIERS[0] += 1
    distributed.global_state.client.wait_at_barrier(f"jaxdp:{name}:{_BARRIERS[0]}", timeout_s * 1000)


def share_from_first(name: str, text: str, timeout_s: int = 1800) -> str:
    """Process 0's ``text`` in every process (itself in a single process), through the
    coordination service's key-value store: e.g. a verdict only process 0 computes."""
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return text
    _BARRIERS[0] += 1
    key = f"jaxdp:{name}:{_BARRIERS[0]}"
    if jax.process_index() == 0:
        client.key_value_set(key, text)
        return text
    return client.blocking_key_value_get(key, timeout_s * 1000)
