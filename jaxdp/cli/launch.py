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
the launcher exits 143. Each
process also dies with the launcher (``PR_SET_PDEATHSIG``) if the launcher itself
is killed. Ctrl-C (SIGINT) and SIGTERM are passed on to every process (a second
Ctrl-C kills them; so does the launcher 30 s after the first).
"""

import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from jaxdp.runtime.distributed import ENV_COORDINATOR_PORT, first_host
from jaxdp.runtime.startup import with_device_count

POLL_S = 0.05
COLLATERAL_S = 0.2  # a peer's abort after a real failure lands within this (see _cause)
SIGNAL_GRACE_S = 30.0  # after Ctrl-C, time for the processes to finish a checkpoint and exit
PREEMPTED_EXIT = 128 + signal.SIGTERM  # jaxdp train after a preemption (SIGTERM) checkpointed its step


class LaunchError(ValueError):
    """Launcher arguments that cannot start a job."""


def free_port() -> int:
    """A TCP port nothing listens on now (the usual small race: taken before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
        port = env.get(ENV_COORDINATOR_PORT) or str(61440 + int(env.get("SLURM_JOB_ID", "0")) % 4096)
        coordinator = f"{first_host(nodes)}:{port}"
        num_processes = int(env["SLURM_NTASKS"]) * local
        process_id = int(env["SLURM_PROCID"]) * local if process_id is None else process_id
    if coordinator is None:
        if num_processes not in (None, local) or process_id not in (None, 0):
            raise LaunchError("--num-processes/--process-id span several hosts: give --coordinator HOST:PORT too")
        return f"localhost:{free_port()}", local, 0, local
    if ":" not in coordinator:
        raise LaunchError(f"--coordinator {coordinator!r} must be HOST:PORT")
    total = local if num_processes is None else num_processes
    first = 0 if process_id is None else process_id
    if not 0 <= first or first + local > total:
        raise LaunchError(f"processes {first}..{first + local - 1} do not fit in --num-processes {total}")
    return coordinator, total, first, local


def child_env(base: Dict[str, str], coordinator: str, total: int, process_id: int, local_rank: int,
              local_count: int, devices_per_proc: Optional[int]) -> Dict[str, str]:
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
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL me when the launcher dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


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
           process_id: Optional[int] = None, grace_period: float = 1.0) -> int:
    """Start the processes, wait for all; on the first failure stop the rest. Returns the exit status."""
    if not command:
        raise LaunchError("no command to launch: jaxdp launch [options] -- jaxdp train ...")
    if devices_per_proc is not None and devices_per_proc < 1:
        raise LaunchError(f"--devices-per-proc must be >= 1, got {devices_per_proc}")
    coordinator, total, first, local = plan(nprocs, num_processes, process_id, coordinator)
    procs: List[subprocess.Popen] = []
    ids = list(range(first, first + local))

    def say(message: str) -> None:
        print(f"jaxdp launch: {message}", file=sys.stderr, flush=True)

    stop_signal = []

    def on_signal(signum, _frame):
        # First Ctrl-C: pass it on (each process may checkpoint and exit). Again: kill.
        stop_signal.append((signum, time.monotonic()))
        for p in procs:
            _signal(p, signum if len(stop_signal) == 1 else signal.SIGKILL)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k, pid in enumerate(ids):
            env = child_env(os.environ, coordinator, total, pid, k, local, devices_per_proc)
            try:
                procs.append(subprocess.Popen(list(command), env=env, start_new_session=True,
                                              preexec_fn=_die_with_parent))
            except OSError as e:  # no such program, not executable: the user's command, said in one line
                raise LaunchError(f"cannot start {command[0]!r}: {e.strerror}") from None
        say(f"started process(es) {ids[0]}..{ids[-1]} of {total}, coordinator {coordinator}, pids "
            + " ".join(str(p.pid) for p in procs))
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


def _signal(p: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(p.pid, signum)  # its session: the process and anything it started
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs, grace_period: float) -> None:
    procs = list(procs)
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()
