"""``jaxdp launch``: start the processes of a multi-process job and watch them.

    jaxdp launch --nprocs 2 --devices-per-proc 2 -- jaxdp train --strategy ddp ...   # one host
    jaxdp launch --coordinator node0:29500 --num-processes 4 --process-id 2 --nprocs 2 -- jaxdp train ...
    srun --ntasks-per-node 1 jaxdp launch -- jaxdp train ...                      # SLURM fills the rest

Each process it starts gets, torchrun-style:

- ``JAXDP_COORDINATOR`` (host:port of process 0's coordination service),
  ``JAXDP_NUM_PROCESSES``, ``JAXDP_PROCESS_ID``, ``JAXDP_LOCAL_RANK`` (read by
  ``jaxdp train``, see ``jaxdp.runtime.distributed``);
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``: the same numbers under torchrun's names, so
  ``jaxdp launch ... -- python -m torch_ref.train`` works as under torchrun;
- with ``--devices-per-proc D``: ``XLA_FLAGS=--xla_force_host_platform_device_count=D``
  (D simulated CPU devices) and ``JAX_LOCAL_DEVICE_IDS`` = its D GPUs (process k of
  this host gets GPUs ``k*D .. k*D+D-1``; ignored on CPU).

One host (the default): ``--nprocs P`` processes with ids ``0..P-1`` meet at a free
localhost port. Several hosts: run ``jaxdp launch`` once per host with the same
``--coordinator`` (process 0's host) and ``--num-processes`` (the total), and
``--process-id`` = the id of this host's first process; its ``--nprocs`` processes
take the ids from there. Under ``srun`` these default to SLURM's numbers
(``SLURM_PROCID``, ``SLURM_NTASKS``, first host of ``SLURM_STEP_NODELIST``).

Failure: the launcher polls its processes every 50 ms. When one exits non-zero or
is killed, it names it, stops the others (SIGTERM, then SIGKILL after
``--grace-period`` seconds, default 1: a JAX process only notes SIGTERM for its
preemption manager, and a job with a dead member cannot save or step anyway) and
exits non-zero: 128 + signal for a killed process,
else the process's own exit code. Nobody is left waiting in a collective. A process
that exits 143 (``jaxdp train`` preempted: the job agreed on a step and every process
checkpoints it) is not a failure: the others get ``SIGNAL_GRACE_S`` to do the same, and
the launcher exits 143. Ctrl-C (SIGINT) and SIGTERM are passed on to every process
(a second Ctrl-C kills them; so does the launcher 30 s after the first).

The process tree: each command runs under a small supervisor (``jaxdp.cli.supervise``) in
its own process group, which the launcher signals. When the launcher dies, by any signal
(SIGKILL included), every supervisor kills its command and all the command's descendants
(a wrapper script's real trainer too) within a fraction of a second; when a command exits,
whatever it left running goes with it.

The coordinator's address: one host, ``127.0.0.1`` and a free port, which the launcher
holds (a bound socket) for the whole job, so no other launch takes it before process 0
listens there; process 0's coordinator listens on loopback only. Several hosts (a
``--coordinator``, or SLURM): it listens on the address the coordinator's host name has on
process 0's host (``--coordinator-bind``: ``all`` for every interface, or an address).
Under SLURM the port is derived from the job and step ids (``slurm_port``) and checked free
on process 0's host. The coordination service is unauthenticated: a job spanning several
hosts belongs on a trusted network.
"""

import errno
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from jaxdp.runtime.distributed import (ENV_COORDINATOR_BIND, ENV_COORDINATOR_PORT, bind_address, first_host,
                                      host_and_port, is_loopback, slurm_port)
from jaxdp.runtime.startup import with_device_count

POLL_S = 0.05
COLLATERAL_S = 0.2  # a peer's abort after a real failure lands within this (see _cause)
SIGNAL_GRACE_S = 30.0  # after Ctrl-C, time for the processes to finish a checkpoint and exit
PREEMPTED_EXIT = 128 + signal.SIGTERM  # jaxdp train after a preemption (SIGTERM) checkpointed its step
ONE_HOST = "127.0.0.1"  # a one-host job's coordinator: loopback, not every interface
SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervise.py")


class LaunchError(ValueError):
    """Launcher arguments that cannot start a job."""


def free_port() -> int:
    """A TCP port nothing listens on now (the usual small race: taken before it is used;
    ``jaxdp launch`` itself holds its port instead, see ``hold_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def hold_port(bind: str) -> socket.socket:
    """A socket bound to ``bind`` (HOST:PORT; port 0: a free one), held while the job runs.

    Bound without ``SO_REUSEPORT``, so a port anything else holds or listens on is refused here,
    in one line; then the option is set, so that process 0's coordinator (JAX's gRPC server, which
    binds with ``SO_REUSEPORT``) can bind beside it. A bound socket that does not listen gets no
    connections; while it exists the kernel hands its port to no one else (no free-port race)."""
    host, port = host_and_port(bind)
    s = None
    try:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.bind((host, int(port)))
    except OSError as e:
        if s is not None:
            s.close()
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise LaunchError(f"the coordinator's address {bind} {why} on this host, where process 0 runs: choose another "
                          f"--coordinator port (under SLURM: {ENV_COORDINATOR_PORT}) or --coordinator-bind") from None
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return s


def plan(nprocs: Optional[int] = None, num_processes: Optional[int] = None, process_id: Optional[int] = None,
         coordinator: Optional[str] = None, environ: Optional[Dict[str, str]] = None):
    """(coordinator, total processes, first process id, processes to start here).

    Explicit arguments win; then SLURM's variables (one ``jaxdp launch`` per SLURM task,
    each starting ``nprocs`` processes); then one host with ``nprocs`` processes.
    """
    env = os.environ if environ is None else environ
    local = 1 if nprocs is None else nprocs
    if local < 1:
        raise LaunchError(f"--nprocs must be >= 1, got {local}")
    if coordinator is None and "SLURM_PROCID" in env and "SLURM_NTASKS" in env and num_processes is None:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
        port = env.get(ENV_COORDINATOR_PORT) or str(slurm_port(env))
        coordinator = f"{first_host(nodes)}:{port}"
        num_processes = int(env["SLURM_NTASKS"]) * local
        process_id = int(env["SLURM_PROCID"]) * local if process_id is None else process_id
    if coordinator is None:
        if num_processes not in (None, local) or process_id not in (None, 0):
            raise LaunchError("--num-processes/--process-id span several hosts: give --coordinator HOST:PORT too")
        return f"{ONE_HOST}:0", local, 0, local  # port 0: launch() picks a free one and holds it
    if ":" not in coordinator:
        raise LaunchError(f"--coordinator {coordinator!r} must be HOST:PORT")
    total = local if num_processes is None else num_processes
    first = 0 if process_id is None else process_id
    if not 0 <= first or first + local > total:
        raise LaunchError(f"processes {first}..{first + local - 1} do not fit in --num-processes {total}")
    return coordinator, total, first, local


def child_env(base: Dict[str, str], coordinator: str, total: int, process_id: int, local_rank: int,
              local_count: int, devices_per_proc: Optional[int], bind: Optional[str] = None) -> Dict[str, str]:
    """Process ``process_id``'s environment; ``bind``: where process 0's coordinator listens."""
    env = dict(base)
    host, port = coordinator.rsplit(":", 1)
    env.update({
        "JAXDP_COORDINATOR": coordinator, "JAXDP_NUM_PROCESSES": str(total),
        "JAXDP_PROCESS_ID": str(process_id), "JAXDP_LOCAL_RANK": str(local_rank),
        "RANK": str(process_id), "WORLD_SIZE": str(total), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_count), "MASTER_ADDR": host, "MASTER_PORT": port,
        "PYTHONUNBUFFERED": "1",  # a killed process's last lines still reach the terminal
    })
    if devices_per_proc:
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices_per_proc)
        first = local_rank * devices_per_proc
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(first + i) for i in range(devices_per_proc))
    if bind is not None:
        env[ENV_COORDINATOR_BIND] = bind
    return env


def coordinator_socket(coordinator: str, total: int, local: int, first: int, choice: str,
                       say) -> Tuple[str, Optional[str], Optional[socket.socket]]:
    """(coordinator, where process 0's coordinator binds, the socket holding that port) for this
    host; (coordinator, None, None) on a host without process 0. See the module docstring."""
    if first != 0:
        return coordinator, None, None
    host, port = host_and_port(coordinator)
    try:
        bind = bind_address(coordinator, choice)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    held = hold_port(bind)
    if port == "0":  # one host: the port just picked
        port = str(held.getsockname()[1])
        coordinator, bind = f"{host}:{port}", f"{bind.rsplit(':', 1)[0]}:{port}"
    if total > local and choice == "auto" and is_loopback(bind) and not is_loopback(coordinator):
        say(f"warning: --coordinator {coordinator} is {bind.rsplit(':', 1)[0]} on this host, a loopback address: the "
            f"coordinator listens there only, and processes on other hosts cannot reach it (--coordinator-bind all "
            f"to listen everywhere)")
    return coordinator, bind, held


class Supervised:
    """One process of the job: the user's command under ``supervise.py`` (see its docstring).
    ``pid`` is the command's own, also its process group's id."""

    def __init__(self, command: Sequence[str], env: Dict[str, str]):
        read, write = os.pipe()
        try:
            self.popen = subprocess.Popen([sys.executable, "-I", "-S", SUPERVISOR, str(os.getpid()), str(write), "--",
                                           *command], env=env, start_new_session=True, pass_fds=(write,))
        finally:
            os.close(write)
        self._answer = os.fdopen(read, "rb")
        self.pid: Optional[int] = None
        self.command = command

    def started(self) -> int:
        """The command's pid, once its supervisor has started it; LaunchError if it could not."""
        with self._answer:
            answer = self._answer.read().decode()
        if not answer.startswith("pid "):
            self.popen.wait()
            why = answer[len("error "):] if answer.startswith("error ") else "its supervisor did not start"
            raise LaunchError(f"cannot start {self.command[0]!r}: {why}")
        self.pid = int(answer.split()[1])
        return self.pid

    def signal(self, signum: int) -> None:
        try:
            if self.pid is None:  # not started yet: its supervisor passes the signal on
                self.popen.send_signal(signum)
            else:
                os.killpg(self.pid, signum)  # its group: the command and anything it started there
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.popen.wait(timeout)


def describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def launch(command: Sequence[str], *, nprocs: Optional[int] = None, devices_per_proc: Optional[int] = None,
           coordinator: Optional[str] = None, num_processes: Optional[int] = None,
           process_id: Optional[int] = None, grace_period: float = 1.0, coordinator_bind: str = "auto") -> int:
    """Start the processes, wait for all; on the first failure stop the rest. Returns the exit status."""
    if not command:
        raise LaunchError("no command to launch: jaxdp launch [options] -- jaxdp train ...")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise LaunchError(f"--devices-per-proc must be >= 1, got {devices_per_proc}")
    coordinator, total, first, local = plan(nprocs, num_processes, process_id, coordinator)
    procs: List[Supervised] = []
    ids = list(range(first, first + local))

    def say(message: str) -> None:
        print(f"jaxdp launch: {message}", file=sys.stderr, flush=True)

    coordinator, bind, held = coordinator_socket(coordinator, total, local, first, coordinator_bind, say)

    stop_signal = []

    def on_signal(signum, _frame):
        # First Ctrl-C: pass it on (each process may checkpoint and exit). Again: kill.
        stop_signal.append((signum, time.monotonic()))
        for p in procs:
            p.signal(signum if len(stop_signal) == 1 else signal.SIGKILL)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k, pid in enumerate(ids):
            procs.append(Supervised(command, child_env(os.environ, coordinator, total, pid, k, local,
                                                       devices_per_proc, bind)))
        pids = [p.started() for p in procs]  # a command that cannot start: one line, the others stopped
        where = f" (listening on {bind})" if bind and not bind.startswith(coordinator.rsplit(":", 1)[0] + ":") else ""
        say(f"started process(es) {ids[0]}..{ids[-1]} of {total}, coordinator {coordinator}{where}, pids "
            + " ".join(map(str, pids)))
        running = dict(zip(ids, procs))
        exits = _exit_queue(running)
        while running:
            try:
                pid, code = exits.get(timeout=POLL_S)
            except queue.Empty:
                pid = None
            if pid is not None:
                del running[pid]
                if code == PREEMPTED_EXIT and not stop_signal:
                    # A preempted jaxdp train: its peers agreed on the same step and are saving it
                    # too (jaxdp.runtime.distributed), so they get time to finish instead of a SIGKILL.
                    say(f"process {pid} (pid {procs[ids.index(pid)].pid}) was preempted and checkpointed; "
                        f"waiting for the other {len(running)} process(es)")
                    stop_signal.append((signal.SIGTERM, time.monotonic()))
                elif code != 0 and not stop_signal:
                    pid, code = _cause(pid, code, exits, running)
                    say(f"process {pid} (pid {procs[ids.index(pid)].pid}) {describe(code)}; stopping the other "
                        f"{len(running)} process(es)")
                    _stop(running.values(), grace_period)
                    say(f"failed: process {pid} {describe(code)}")
                    return 128 - code if code < 0 else code
            if running and stop_signal and time.monotonic() - stop_signal[0][1] > SIGNAL_GRACE_S:
                # A process stuck in a collective whose peers already exited never sees the signal.
                say(f"{len(running)} process(es) still running {SIGNAL_GRACE_S:g} s after the signal; stopping them")
                _stop(running.values(), 0.0)
                running.clear()
        if stop_signal:
            return 128 + stop_signal[0][0]
        return 0
    finally:
        _stop([p for p in procs if p.poll() is None], grace_period)
        for s, handler in old.items():
            signal.signal(s, handler)
        if held is not None:
            held.close()


def _exit_queue(running) -> "queue.Queue":
    """(process id, exit code) of each process, queued the moment it exits.

    Why a thread per process and not a poll loop: when one process dies, its peers fail
    soon after (a broken gloo connection aborts them within milliseconds). A poll finds
    several dead at once and cannot tell which went first; a blocked ``wait`` returns as
    the kernel reaps each one, so the first failure reported is the cause.
    """
    exits: "queue.Queue" = queue.Queue()
    for pid, p in running.items():
        threading.Thread(target=lambda pid=pid, p=p: exits.put((pid, p.wait())), daemon=True,
                         name=f"jaxdp-launch-wait-{pid}").start()
    return exits


def _cause(pid: int, code: int, exits: "queue.Queue", running) -> Tuple[int, int]:
    """The failure to blame: the first one, unless it is a peer's collateral abort.

    A broken gloo connection aborts the peers (SIGABRT) within milliseconds of the real
    failure; on a loaded machine the waiting thread of the real failure may be scheduled
    after a peer's, so the queue order alone can name the peer. Exits that arrive within
    ``COLLATERAL_S`` are looked at together, and a SIGABRT yields to any other failure.
    """
    seen = [(pid, code)]
    deadline = time.monotonic() + COLLATERAL_S
    while running and (left := deadline - time.monotonic()) > 0:
        try:
            other, other_code = exits.get(timeout=left)
        except queue.Empty:
            break
        del running[other]
        seen.append((other, other_code))
    not_abort = [(p, c) for p, c in seen if c not in (0, -signal.SIGABRT)]
    return not_abort[0] if not_abort else (pid, code)


def _stop(procs, grace_period: float) -> None:
    procs = list(procs)
    for p in procs:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.signal(signal.SIGKILL)  # the command's group; its supervisor then sweeps the rest and exits
            p.wait()
