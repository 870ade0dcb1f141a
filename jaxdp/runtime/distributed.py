"""Multi-process jobs: which job this process is in, joining it, barriers, and preemption.

Where the job comes from, first match wins:

1. ``jaxdp launch``'s variables (``JAXDP_COORDINATOR``, ``JAXDP_NUM_PROCESSES``,
   ``JAXDP_PROCESS_ID``): explicit, so they override anything a cluster says;
2. the clusters JAX itself detects for ``jax.distributed.initialize()``
   (``jax._src.clusters``: SLURM's ``srun``, Open MPI's ``mpirun``, Cloud TPU, Kubernetes
   JobSets), asked for the same coordinator, process count and id JAX would pick.
   ``JAXDP_COORDINATOR_PORT`` (or JAX's own ``JAX_COORDINATOR_PORT``) overrides the port;
   under SLURM it is derived from the job and step ids (``slurm_port``), as ``jaxdp launch`` does.

Where process 0's coordinator listens (``bind_address``): ``JAXDP_COORDINATOR_BIND`` (set by
``jaxdp launch``), else JAX's ``JAX_COORDINATOR_BIND_ADDRESS``, else the address the coordinator's
host name has here: loopback for a one-host job, the advertised interface for several hosts.
JAX's own default, every interface (``[::]``), would open the unauthenticated service to any
network the host is on.

Unlike a bare ``jax.distributed.initialize()``, a detected cluster does not restrict each
process to one device (JAX's SLURM default: GPU ``SLURM_LOCALID`` only): one ``srun``
task per host drives all its GPUs, and ``jaxdp launch --devices-per-proc`` (or
``JAX_LOCAL_DEVICE_IDS``) picks fewer.

Preemption: ``jax.distributed.initialize`` starts JAX's preemption sync manager, which
catches SIGTERM in every process and agrees on one step at which all of them stop
(``preemption_sync_point``): the job checkpoints that step together and exits.

Jax-free at import: the parser asks ``distributed_env`` how many processes share ``--devices``.
A cluster's detection imports jax then, before XLA's flags are set, which is early enough: jax
reads them when it creates its backend.
"""

import ipaddress
import os
import socket
import sys
import threading
import warnings
import zlib
from typing import Mapping, Optional

from jaxdp.runtime.mesh import MeshError

# What `jaxdp launch` sets in each process it starts (torchrun's RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR and MASTER_PORT too, so torch_ref runs under it unchanged).
ENV_COORDINATOR = "JAXDP_COORDINATOR"  # host:port of process 0's coordination service
ENV_NUM_PROCESSES = "JAXDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDP_PROCESS_ID"
ENV_LOCAL_RANK = "JAXDP_LOCAL_RANK"  # this process's index on its host
ENV_COORDINATOR_PORT = "JAXDP_COORDINATOR_PORT"  # a detected cluster: overrides the port JAX derives
ENV_COORDINATOR_BIND = "JAXDP_COORDINATOR_BIND"  # host:port process 0's coordinator listens on
SLURM_PORTS = (61440, 4096)  # first, count: above Linux's ephemeral ports (32768-60999), as JAX's choice

INIT_TIMEOUT_EXIT_CODE = 3  # a process that gave up waiting for the others
ENV_ONLY_CLUSTERS = ("slurm", "ompi")  # detected from variables alone (others query a server)


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
    """The job this process belongs to (see the module docstring); None for a single process.

    ``environ`` (default ``os.environ``) holds the launcher's variables; a cluster is
    detected from ``os.environ``, as JAX does."""
    env = os.environ if environ is None else environ
    if ENV_NUM_PROCESSES in env or ENV_COORDINATOR in env or ENV_PROCESS_ID in env:
        missing = [k for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID) if k not in env]
        if missing:
            raise MeshError(f"multi-process environment is incomplete: {', '.join(missing)} not set")
        return DistributedEnv(env[ENV_COORDINATOR], _int_env(env, ENV_NUM_PROCESSES),
                              _int_env(env, ENV_PROCESS_ID), _int_env(env, ENV_LOCAL_RANK, 0), "jaxdp")
    return _detected_cluster(env)


def _detected_cluster(env: Mapping[str, str]) -> Optional[DistributedEnv]:
    """A job of several processes that one of JAX's cluster environments recognises."""
    from jax._src import clusters

    for cluster in clusters.ClusterEnv._cluster_types:
        if cluster.opt_in_only_method:  # mpi4py: JAX only uses it when asked by name
            continue
        try:
            with warnings.catch_warnings():  # Kubernetes without its client package: not a job for us
                warnings.simplefilter("ignore")
                if not cluster.is_env_present():
                    continue
            count = cluster.get_process_count()
            if count < 2:
                return None  # e.g. a one-task srun: a single process
            port = env.get(ENV_COORDINATOR_PORT) or env.get("JAX_COORDINATOR_PORT")
            if port is None and cluster.name == "slurm":
                port = str(slurm_port(env))  # not JAX's job id % 4096: see slurm_port
            coordinator = cluster.get_coordinator_address(timeout_secs=None, override_coordinator_port=port)
            local = cluster.get_local_process_id()
            return DistributedEnv(coordinator, count, cluster.get_process_id(), local or 0, cluster.name)
        except MeshError:
            raise
        except Exception as e:
            if cluster.name in ENV_ONLY_CLUSTERS:  # its variables are set but wrong: say which, in one line
                raise MeshError(f"{cluster.name} job detected but incomplete: {type(e).__name__}: {e}") from None
            # Kubernetes and Cloud TPU ask an API server: any pod has KUBERNETES_SERVICE_HOST, and
            # one that is not a JobSet member is a single process, not an error.
            continue
    return None


def _int_env(env: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    if key not in env and default is not None:
        return default
    try:
        return int(env[key])
    except ValueError:
        raise MeshError(f"{key}={env[key]!r} is not an integer") from None


def slurm_port(env: Mapping[str, str]) -> int:
    """The coordinator's port for a SLURM job step: every task computes the same one.

    From the job id and the step id both (two steps of one job, ``srun ... &`` twice, run at once),
    hashed: ``job id % 4096`` (JAX's choice) gives jobs 4096 ids apart, which a busy cluster runs
    side by side, the same port. A collision left is found by ``jaxdp launch`` on process 0's host,
    which checks the port is free (``JAXDP_COORDINATOR_PORT`` picks another)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    first, count = SLURM_PORTS
    return first + zlib.crc32(f"{env.get('SLURM_JOB_ID', '0')}.{step}".encode()) % count


def host_and_port(address: str):
    """``host:port`` -> (host, port), an IPv6 host without its brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` names this host's loopback (127.0.0.0/8, ::1, localhost)."""
    host = host_and_port(address)[0]
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_address(coordinator: str, choice: str = "auto") -> str:
    """Where process 0's coordinator listens (HOST:PORT, the coordinator's port).

    ``auto``: the address the coordinator's host name has on this host (``127.0.0.1`` stays
    loopback; ``node0`` its interface); ``all``: every interface (JAX's own default, ``[::]``);
    anything else: that address or host name. ValueError, in one line, for a name that does not
    resolve or an address that is not this host's."""
    host, port = host_and_port(coordinator)
    if choice == "all":
        return f"[::]:{port}"
    name = host if choice == "auto" else choice.strip("[]")
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"the coordinator's host {name!r} does not resolve on this host, where process 0 runs: "
                         f"{e}") from None
    ip = sockaddr[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # one of this host's addresses?
        try:
            probe.bind((ip, 0))
        except OSError as e:
            raise ValueError(f"the coordinator's host {name!r} is {ip}, which is not an address of this host, where "
                             f"process 0 runs ({e.strerror}): check --coordinator, or give --coordinator-bind") from None
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


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


def join_job(timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> Optional[DistributedEnv]:
    """Join the job this process was started in, if any, before anything asks jax for its
    devices; returns it (None: a single process)."""
    import jax

    env = distributed_env()
    if env is not None and not jax.distributed.is_initialized():
        initialize_distributed(env.coordinator, env.num_processes, env.process_id,
                               timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
    return env


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, timeout_s: int = 300,
                           heartbeat_timeout_s: int = 100) -> None:
    """Join a multi-process JAX job (one process per host or per GPU).

    On CPU, cross-process collectives need gloo. Arguments default to the environment
    (``distributed_env``).

    ``timeout_s``: every process must have joined by then. JAX itself aborts the
    process (SIGABRT, a C++ stack trace) when its connect deadline passes, so we give
    JAX a longer deadline and a watchdog ends the process at ``timeout_s`` with a
    one-line error instead. ``heartbeat_timeout_s``: how long the survivors wait
    for a peer that stopped answering (e.g. killed without a launcher to stop the
    rest) before the coordination service ends them.
    """
    import jax

    if coordinator_address is None or num_processes is None or process_id is None:
        env = distributed_env()
        if env is None:
            raise MeshError("no multi-process job: pass coordinator, num_processes and process_id,"
                            " or start the processes with jaxdp launch (or srun)")
        coordinator_address = coordinator_address or env.coordinator
        num_processes = env.num_processes if num_processes is None else num_processes
        process_id = env.process_id if process_id is None else process_id
    bind = None
    if process_id == 0:  # the one process that runs the coordination service
        bind = os.environ.get(ENV_COORDINATOR_BIND) or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
        try:
            bind = bind or bind_address(coordinator_address)
        except ValueError as e:
            # A cluster's own address for process 0 (no jaxdp launch) that is not this host's: a
            # virtual IP or a proxy in front of it, which worked with JAX's default. Keep that default.
            warnings.warn(f"{e}; the coordinator listens on every interface")
            bind = bind_address(coordinator_address, "all")
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
        # Everything explicit and detection off: JAX's SLURM detection would otherwise add
        # local_device_ids=[SLURM_LOCALID] and hide every GPU of the host but one.
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
            coordinator_bind_address=bind, cluster_detection_method="deactivate",
            initialization_timeout=int(timeout_s) + 60, heartbeat_timeout_seconds=int(heartbeat_timeout_s),
        )
    finally:
        joined.set()


_BARRIERS = [0]


def _client():
    """JAX's coordination-service client in a multi-process job, else None."""
    import jax
    from jax._src import distributed

    return distributed.global_state.client if jax.process_count() > 1 else None


def barrier(name: str, timeout_s: int = 1800) -> None:
    """Wait until every process of the job gets here (a no-op for one process).

    Why: XLA's CPU (gloo) collectives give a peer 30 s, not configurable, to join each
    new communicator. After a long compile (tens of seconds on a loaded CPU host) the
    processes can be further apart than that. This barrier goes through JAX's
    coordination service instead, which has no such limit, so the first collective
    after it finds everyone ready. A dead peer ends it (heartbeat timeout), and
    ``jaxdp launch`` stops the job sooner.
    """
    client = _client()
    if client is None:
        return
    _BARRIERS[0] += 1
    client.wait_at_barrier(f"jaxdp:{name}:{_BARRIERS[0]}", timeout_s * 1000)


def share_from_first(name: str, text: str, timeout_s: int = 1800) -> str:
    """Process 0's ``text`` in every process (itself in a single process), through the
    coordination service's key-value store: e.g. a verdict only process 0 computes."""
    import jax

    client = _client()
    if client is None:
        return text
    _BARRIERS[0] += 1
    key = f"jaxdp:{name}:{_BARRIERS[0]}"
    if jax.process_index() == 0:
        client.key_value_set(key, text)
        return text
    return client.blocking_key_value_get(key, timeout_s * 1000)


def preemption_sync_point(step: int) -> bool:
    """Whether the job stops at ``step``: True in every process at the same step once any
    of them got SIGTERM (JAX's preemption sync manager picks the step after the furthest
    one). Call it at every step, in every process. Always False for a single process."""
    if _client() is None:
        return False
    from jax._src import distributed
    from jax.experimental import multihost_utils

    if distributed.global_state.preemption_sync_manager is None:  # jax_enable_preemption_service off
        return False
    return multihost_utils.reached_preemption_sync_point(step)
