"""Multi-process jobs with real processes on localhost: the launcher, 2 processes x 2 devices
against 1 process x 4, and a process that never joins.

Every job runs under a timeout and is killed (launcher and workers, by pid) if it overruns.
The 2-process runs (here and in test_fault_tolerance.py) share one JAX compilation cache; only
2x2 CPU jobs write it (we saw a job hang when one cache dir mixed single-process and
multi-process entries).
"""

import dataclasses
import os
import sys
import time

import jax
import numpy as np
import pytest

from jaxdp.config.tree import TrainConfig
from jaxdp.cli.launch import LaunchError, child_env, plan
from jaxdp.runtime.distributed import INIT_TIMEOUT_EXIT_CODE, distributed_env, first_host
from jaxdp.runtime.mesh import MeshError
from jaxdp.strategies import REGISTRY
from jaxdp.run.train import train
from launch_helpers import TINY_ARGS, Job, alive, jaxdp, job_env, records, run_job, sample_records
from run_dirs import final_state

JOB_TIMEOUT = 240  # seconds; a loaded 2-core machine needs ~1-2 min for a tiny 2-process run


# ----------------------------------------------------------------------------- launcher, no jax

def test_launch_sets_torchrun_style_env(tmp_path):
    # One write per line: print(..., sep=) writes the line and its newline separately, and two
    # processes sharing the pipe could interleave them into one line (seen once in a full suite).
    show = ("import os, sys; sys.stdout.write('|'.join(['ENV', *[str(os.environ.get(k)) for k in ("
            "'JAXDP_COORDINATOR', 'JAXDP_NUM_PROCESSES', 'JAXDP_PROCESS_ID', 'JAXDP_LOCAL_RANK', 'RANK',"
            " 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'XLA_FLAGS', 'JAX_LOCAL_DEVICE_IDS')]])"
            " + '\\n')")
    code, out = run_job(["--nprocs", "2", "--devices-per-proc", "3"], [sys.executable, "-c", show], timeout=60)
    assert code == 0, out
    rows = sorted(line.split("|")[1:] for line in out.splitlines() if line.startswith("ENV"))
    assert len(rows) == 2
    coord = rows[0][0]
    assert coord.startswith("localhost:") and rows[1][0] == coord
    port = coord.split(":")[1]
    # The launcher sets each process's device count and keeps every other XLA flag it was given.
    flags = " ".join(job_env().get("XLA_FLAGS", "").split() + ["--xla_force_host_platform_device_count=3"])
    assert rows[0][1:] == ["2", "0", "0", "0", "2", "0", "localhost", port, flags, "0,1,2"]
    assert rows[1][1:] == ["2", "1", "1", "1", "2", "1", "localhost", port, flags, "3,4,5"]


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


def test_multi_node_plan_and_slurm_variables(monkeypatch):
    assert plan(2)[1:] == (2, 0, 2)
    assert plan(2, coordinator="node0:1234", num_processes=8, process_id=4, environ={}) == ("node0:1234", 8, 4, 2)
    with pytest.raises(LaunchError, match="do not fit"):
        plan(2, coordinator="node0:1234", num_processes=4, process_id=3, environ={})
    with pytest.raises(LaunchError, match="--coordinator"):
        plan(1, num_processes=4, process_id=1, environ={})
    slurm = {"SLURM_JOB_ID": "4097", "SLURM_STEP_NODELIST": "gpu[007-009,011],cpu1", "SLURM_NTASKS": "4",
             "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
    # srun jaxdp launch --nprocs 2: each SLURM task starts 2 processes.
    assert plan(2, environ=slurm) == ("gpu007:61441", 8, 4, 2)
    env = child_env({}, "gpu007:61441", 8, 5, 1, 2, None)
    assert (env["JAXDP_PROCESS_ID"], env["RANK"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("5", "5", "1", "gpu007")
    # srun jaxdp train: JAX's own SLURM detection (jax._src.clusters) finds the job.
    for k in [k for k in os.environ if k.startswith(("SLURM_", "JAXDP_", "JAX_COORDINATOR"))]:
        monkeypatch.delenv(k)
    assert distributed_env() is None  # no job: one process
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    job = distributed_env()
    assert (job.coordinator, job.num_processes, job.process_id, job.source) == ("gpu007:61441", 4, 2, "slurm")
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
