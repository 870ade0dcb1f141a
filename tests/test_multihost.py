"""Multi-process jobs with real processes on localhost: the launcher, 2 processes x 2 devices
against 1 process x 4, and a process that never joins.

Every job runs under a timeout and is killed (launcher and workers, by pid) if it overruns.
The 2-process runs (here and in test_fault_tolerance.py) share one JAX compilation cache; only
2x2 CPU jobs write it (we saw a job hang when one cache dir mixed single-process and
multi-process entries).
"""

import dataclasses
import os
import signal
import socket
import sys
import time

import jax
import numpy as np
import pytest

from jaxdp.config.tree import TrainConfig
from jaxdp.cli import launch as launch_module
from jaxdp.cli.launch import LaunchError, child_env, coordinator_socket, hold_port, plan
from jaxdp.runtime.distributed import INIT_TIMEOUT_EXIT_CODE, bind_address, distributed_env, first_host, slurm_port
from jaxdp.runtime.mesh import MeshError
from jaxdp.strategies import REGISTRY
from jaxdp.run.train import train
from launch_helpers import (BUILD_AND_LISTEN, TINY_ARGS, TREE, Job, alive, gone_within, jaxdp, job_env, kill_all,
                            records, run_job, sample_records, tree_pids)
from run_dirs import final_state

JOB_TIMEOUT = 240  # seconds; a loaded 2-core machine needs ~1-2 min for a tiny 2-process run


# ----------------------------------------------------------------------------- launcher, no jax

def test_launch_sets_torchrun_style_env(tmp_path):
    # One write per line: print(..., sep=) writes the line and its newline separately, and two
    # processes sharing the pipe could interleave them into one line (seen once in a full suite).
    show = ("import os, sys; sys.stdout.write('|'.join(['ENV', *[str(os.environ.get(k)) for k in ("
            "'JAXDP_COORDINATOR', 'JAXDP_NUM_PROCESSES', 'JAXDP_PROCESS_ID', 'JAXDP_LOCAL_RANK', 'RANK',"
            " 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'XLA_FLAGS', 'JAX_LOCAL_DEVICE_IDS',"
            " 'JAXDP_COORDINATOR_BIND')]])"
            " + '\\n')")
    code, out = run_job(["--nprocs", "2", "--devices-per-proc", "3"], [sys.executable, "-c", show], timeout=60)
    assert code == 0, out
    rows = sorted(line.split("|")[1:] for line in out.splitlines() if line.startswith("ENV"))
    assert len(rows) == 2
    coord = rows[0][0]
    assert coord.startswith("127.0.0.1:") and rows[1][0] == coord  # one host: loopback
    port = coord.split(":")[1]
    # The launcher sets each process's device count and keeps every other XLA flag it was given.
    flags = " ".join(job_env().get("XLA_FLAGS", "").split() + ["--xla_force_host_platform_device_count=3"])
    assert rows[0][1:] == ["2", "0", "0", "0", "2", "0", "127.0.0.1", port, flags, "0,1,2", coord]
    assert rows[1][1:] == ["2", "1", "1", "1", "2", "1", "127.0.0.1", port, flags, "3,4,5", coord]


def test_a_failed_process_stops_the_others_promptly(tmp_path):
    """Process 1 exits with 3 while process 0 would run for a minute: the launcher stops
    process 0, names process 1 and its code, and returns that code."""
    script = ("import os, sys, time\n"
              "if os.environ['JAXDP_PROCESS_ID'] == '1':\n"
              "    time.sleep(0.5); sys.exit(3)\n"
              "time.sleep(60)\n")
    job = Job(["--nprocs", "2", "--grace-period", "2"], [sys.executable, "-c", script], env=job_env())
    pids = job.pids()
    t0 = time.monotonic()
    code = job.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert code == 3, job.output
    assert "process 1 (pid %d) exited with code 3; stopping the other 1 process(es)" % pids[1] in job.output
    assert "failed: process 1 exited with code 3" in job.output
    assert elapsed < 5, elapsed  # 0.5 s of work + one 50 ms poll + SIGTERM
    assert not alive(pids[0])


@pytest.mark.parametrize("how", ["the launcher is killed", "a process fails"])
def test_nothing_a_process_started_outlives_the_job(tmp_path, how):
    """Each process starts two grandchildren, one in its own session (a daemon's double fork):
    a SIGKILL of the launcher (an OOM killer, a scheduler), or the job's stop after a failure,
    ends all six processes within seconds, not only the two the launcher started."""
    job = Job(["--nprocs", "2"], [sys.executable, "-c", TREE, str(tmp_path / "pids"),
                                  *(["fail"] if how == "a process fails" else [])])
    pids = []
    try:
        pids = tree_pids(str(tmp_path / "pids"), 2)
        if how == "the launcher is killed":
            os.kill(job.proc.pid, signal.SIGKILL)
        else:
            assert job.wait(timeout=30) == 3, job.output
        assert gone_within(pids, 5) == [], job.output
    finally:
        kill_all(pids)
        job.kill()


def test_multi_node_plan_and_slurm_variables(monkeypatch):
    assert plan(2)[1:] == (2, 0, 2)
    assert plan(2, coordinator="node0:1234", num_processes=8, process_id=4, environ={}) == ("node0:1234", 8, 4, 2)
    with pytest.raises(LaunchError, match="do not fit"):
        plan(2, coordinator="node0:1234", num_processes=4, process_id=3, environ={})
    with pytest.raises(LaunchError, match="--coordinator"):
        plan(1, num_processes=4, process_id=1, environ={})
    slurm = {"SLURM_JOB_ID": "4097", "SLURM_STEP_NODELIST": "gpu[007-009,011],cpu1", "SLURM_NTASKS": "4",
             "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
    # srun jaxdp launch --nprocs 2: each SLURM task starts 2 processes. The port comes from the job and
    # step ids, hashed: job 4097 and job 1 (4096 apart) met at 61441 under job id % 4096, as did two
    # steps of one job.
    assert plan(2, environ=slurm) == ("gpu007:61728", 8, 4, 2)
    assert slurm_port({"SLURM_JOB_ID": "1"}) == 65333
    assert slurm_port(dict(slurm, SLURM_STEP_ID="1")) == 61878
    assert all(61440 <= slurm_port({"SLURM_JOB_ID": str(j)}) < 65536 for j in range(0, 10**6, 4093))
    env = child_env({}, "gpu007:61441", 8, 5, 1, 2, None)
    assert (env["JAXDP_PROCESS_ID"], env["RANK"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("5", "5", "1", "gpu007")
    # srun jaxdp train: JAX's own SLURM detection (jax._src.clusters) finds the job.
    for k in [k for k in os.environ if k.startswith(("SLURM_", "JAXDP_", "JAX_COORDINATOR"))]:
        monkeypatch.delenv(k)
    assert distributed_env() is None  # no job: one process
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    job = distributed_env()
    assert (job.coordinator, job.num_processes, job.process_id, job.source) == ("gpu007:61728", 4, 2, "slurm")
    monkeypatch.setenv("JAXDP_COORDINATOR_PORT", "5000")
    assert distributed_env().coordinator == "gpu007:5000"
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed_env() is None  # a one-task srun: one process
    # Any cluster JAX detects, e.g. Open MPI's mpirun (jaxdp had only its own SLURM parser).
    for k in slurm:
        monkeypatch.delenv(k)
    monkeypatch.delenv("JAXDP_COORDINATOR_PORT")
    for k, v in {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
                 "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    job = distributed_env()
    assert (job.coordinator, job.num_processes, job.process_id, job.local_rank, job.source) == (
        f"10.96.0.1:{1531576320 // 4096 % 4096 + 61440}", 4, 3, 1, "ompi")
    # jaxdp launch's variables override what the cluster says.
    launched = {"JAXDP_COORDINATOR": "node9:1234", "JAXDP_NUM_PROCESSES": "8", "JAXDP_PROCESS_ID": "5"}
    for k, v in launched.items():
        monkeypatch.setenv(k, v)
    job = distributed_env()
    assert (job.coordinator, job.num_processes, job.process_id, job.source) == ("node9:1234", 8, 5, "jaxdp")
    assert first_host("node001,node002") == "node001" and first_host("a[1-3]") == "a1"
    with pytest.raises(MeshError, match="JAXDP_PROCESS_ID"):
        distributed_env({"JAXDP_COORDINATOR": "h:1", "JAXDP_NUM_PROCESSES": "2"})


def test_the_coordinators_port_is_held_and_its_address_chosen(monkeypatch):
    """A one-host launch holds a free loopback port from the start (a second launch cannot take it,
    and process 0's coordinator can still bind it: JAX's server binds with SO_REUSEPORT, as the
    hold does once bound); a port in use (SLURM's derived one, taken) is one line; the bind follows
    --coordinator-bind."""
    said = []
    coordinator, bind, held = coordinator_socket("127.0.0.1:0", 2, 2, 0, "auto", said.append)
    try:
        port = int(coordinator.rsplit(":", 1)[1])
        assert port > 0 and bind == coordinator and not said
        with pytest.raises(LaunchError, match=rf"^the coordinator's address 127.0.0.1:{port} is in use on this host"):
            hold_port(f"127.0.0.1:{port}")
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as server:  # as JAX's gRPC server binds
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("::ffff:127.0.0.1", port))
            server.listen()
    finally:
        held.close()
    assert coordinator_socket("node0:1234", 8, 2, 2, "auto", said.append) == ("node0:1234", None, None)  # not host 0
    assert bind_address("127.0.0.1:1234", "all") == "[::]:1234"
    assert bind_address("localhost:1234", "127.0.0.1") == "127.0.0.1:1234"
    with pytest.raises(ValueError, match="is 192.0.2.1, which is not an address of this host"):
        bind_address("192.0.2.1:1234")  # TEST-NET-1: never this host's
    # A host name that is loopback here (Debian's 127.0.1.1 for its own name), in a job across hosts:
    # said, since the other hosts could not connect.
    monkeypatch.setattr(launch_module, "bind_address", lambda coordinator, choice: "127.0.0.1:0")
    coordinator, bind, held = coordinator_socket("node0:0", 4, 2, 0, "auto", said.append)
    held.close()
    assert said and "processes on other hosts cannot reach it (--coordinator-bind all" in said[0]


# ----------------------------------------------------------------------------- real jobs

def test_a_process_that_never_joins_is_a_clear_error_after_the_timeout(tmp_path):
    from jaxdp.cli.launch import free_port

    env = job_env(JAXDP_COORDINATOR=f"localhost:{free_port()}", JAXDP_NUM_PROCESSES="2", JAXDP_PROCESS_ID="0")
    t0 = time.monotonic()
    import subprocess

    done = subprocess.run(jaxdp("train", "--out", str(tmp_path), "--init-timeout", "4", *TINY_ARGS),
                          env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert done.returncode == INIT_TIMEOUT_EXIT_CODE, done.stderr[-3000:]
    assert ("jaxdp: error: process 0 of 2 could not join the job at localhost:"
            in done.stderr), done.stderr[-3000:]
    assert "within --init-timeout 4 s" in done.stderr
    assert elapsed < 60, elapsed  # imports + 4 s, not JAX's default 5 minutes
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_a_one_host_job_listens_on_loopback_only_and_builds_one_device_per_process():
    """jaxdp launch --nprocs 2 --devices-per-proc 1: process 0's coordinator listens on 127.0.0.1,
    not on every interface (JAX's default, [::]: an unauthenticated service open to the network);
    and each process, one device each, builds its state and the run's header."""
    code, out = run_job(["--nprocs", "2", "--devices-per-proc", "1"],
                        [sys.executable, "-c", BUILD_AND_LISTEN, os.path.dirname(__file__)], timeout=JOB_TIMEOUT)
    assert code == 0, out[-5000:]
    assert out.count("HEADER model state per device: ") == 2, out[-5000:]
    listening = [line.split()[1:] for line in out.splitlines() if line.startswith("LISTENING")]
    assert listening == [["127.0.0.1"]], out[-3000:]


EQUIV = dict(width=4, blocks=(1, 1, 1, 1), synthetic_size=(128, 32), global_batch_size=32, epochs=1, lr=0.05,
             dtype="float64", progress=False, log_sample_ids=True)


def _cli_args(cfg: TrainConfig):
    return ["--strategy", cfg.strategy, "--width", str(cfg.width), "--blocks", "1,1,1,1",
            "--synthetic-size", "128,32", "--global-batch-size", "32", "--epochs", "1", "--lr", "0.05",
            "--dtype", "float64", "--no-progress", "--log-sample-ids", "--out", cfg.out]


# zero3: the hardest case (sharded params, reduce-scatter across processes, a sharded
# checkpoint written by both). 2-process ddp jobs run in test_fault_tolerance.py (kill, resume,
# every sample once), so a ddp case here would add ~80 s of CPU for what zero3 already checks.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in ("zero3",) if s in REGISTRY])
def test_two_processes_match_one(tmp_path, strategy):
    """2 processes x 2 devices == 1 process x 4 devices, float64: losses, params, optimizer
    state, BN buffers; each process fed only its own rows of every batch."""
    one = TrainConfig(strategy=strategy, devices=4, out=str(tmp_path / "one"), **EQUIV)
    train(one)  # in this process: 1 x 4 of the 8 simulated devices
    two = dataclasses.replace(one, devices=None, out=str(tmp_path / "two"))
    code, out = run_job(["--nprocs", "2", "--devices-per-proc", "2"], jaxdp("train", *_cli_args(two)),
                        timeout=JOB_TIMEOUT, env=job_env())
    assert code == 0, out[-5000:]
    assert out.count("done: 4 steps") == 1  # one summary line per job: process 0's

    a, b = records(one.out), records(two.out)
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # process 0 alone writes metrics
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=0, atol=1e-12)
    assert records(two.out, "eval")[0]["count"] == 32
    np.testing.assert_allclose(records(two.out, "eval")[0]["loss"], records(one.out, "eval")[0]["loss"], atol=1e-12)
    sa, sb = final_state(one.out), final_state(two.out)
    for x, y in zip(jax.tree_util.tree_leaves(sb), jax.tree_util.tree_leaves(sa), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)

    # Process p loaded ranks [2p, 2p+1] only; together they are the 1-process run's batches.
    recs = sample_records(two.out)
    for p in (0, 1):
        mine = [r for r in recs if r["file"] == f"sample_ids.p{p}.jsonl"]
        assert [r["step"] for r in mine] == [1, 2, 3, 4]
        assert all(r["ranks"] == [2 * p, 2 * p + 1] for r in mine)
    ref = {r["step"]: r["ids"] for r in sample_records(one.out)}
    for r in recs:
        assert r["ids"] == ref[r["step"]][r["ranks"][0]:r["ranks"][-1] + 1]
