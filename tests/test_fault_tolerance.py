"""Fault tolerance: a worker SIGKILLed mid-epoch, partial and corrupted checkpoints, and
resuming on a different device count, each checked by the dataset ids every step fed
(``--log-sample-ids``): every sample of the epoch exactly once, none lost, none repeated.
"""

import os
import shutil
import signal
import subprocess
import time
import warnings

import numpy as np
import pytest

from jaxdp.checkpoint import MANIFEST, Checkpointer, CheckpointCorrupt, CheckpointWarning
from jaxdp.config.tree import TrainConfig
from jaxdp.data.loader import epoch_batches, steps_per_epoch
from jaxdp.data.datasets import ArrayDataset
from jaxdp.data.sampler import epoch_permutation, partition
from jaxdp.strategies import REGISTRY
from jaxdp.run.train import train
from launch_helpers import Job, alive, epoch_ids, jaxdp, job_env, records, run_job, sample_records

# The same model, dtype and batch as test_multihost's 2x2 jobs, so they share compiled code.
ARGS = ["--width", "4", "--blocks", "1,1,1,1", "--global-batch-size", "32", "--epochs", "1", "--lr", "0.05",
        "--dtype", "float64", "--no-progress", "--log-sample-ids"]
TINY = dict(width=4, blocks=(1, 1, 1, 1), global_batch_size=32, epochs=1, lr=0.05, dtype="float64",
            progress=False, log_sample_ids=True)


def steps_logged(out):
    """Steps process 0 has run: its --log-sample-ids file has one line per step (counted by
    newlines, so a line being written is not read half-way)."""
    path = os.path.join(out, "sample_ids.p0.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def complete_steps(out):
    root = os.path.join(out, "checkpoints")
    return sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


@pytest.mark.slow
def test_sigkilled_worker_then_resume_sees_every_sample_once(tmp_path):
    """2 processes x 2 devices, 8 steps, a checkpoint every 4. Process 1 is SIGKILLed after
    step 6, i.e. with steps 5 and 6 done but not checkpointed: the launcher stops process 0
    and fails naming process 1; ``--resume`` continues from the newest complete checkpoint
    (4), drops what the killed run did after it and feeds steps 5.. again; the checkpointed
    prefix plus the resumed run fed each of the 256 samples exactly once."""
    out = str(tmp_path / "run")
    env = job_env()
    command = jaxdp("train", *ARGS, "--synthetic-size", "256,32", "--checkpoint-every", "4", "--out", out)
    job = Job(["--nprocs", "2", "--devices-per-proc", "2"], command, env=env)
    try:
        pids = job.pids()
        deadline = time.monotonic() + 240
        while not (os.path.exists(os.path.join(out, "checkpoints", "4", MANIFEST)) and steps_logged(out) >= 6):
            assert job.proc.poll() is None and time.monotonic() < deadline, job.output[-5000:]
            time.sleep(0.01)
        os.kill(pids[1], signal.SIGKILL)
        t_kill = time.monotonic()
        code = job.wait(timeout=60)
        detected = time.monotonic() - t_kill
    finally:
        if job.proc.poll() is None:
            job.kill()
    assert code == 128 + signal.SIGKILL, job.output[-5000:]
    assert f"process 1 (pid {pids[1]}) was killed by SIGKILL; stopping the other 1 process(es)" in job.output
    assert "failed: process 1 was killed by SIGKILL" in job.output
    assert detected < 5, detected  # a 50 ms poll, SIGTERM, 1 s grace, SIGKILL
    assert not alive(pids[0])
    saved = complete_steps(out)
    assert saved == [4], saved  # killed mid-epoch, after the step-4 save
    killed_at = steps_logged(out)
    assert killed_at > saved[-1]  # work past the checkpoint that the resume must redo, not skip
    print(f"killed after step {killed_at}, newest complete checkpoint {saved[-1]}, "
          f"launcher exited {detected:.2f} s after the kill")
    elastic = out + "_on_one_process"
    shutil.copytree(out, elastic)  # the same wreck, to finish on another topology below

    code, output = run_job(["--nprocs", "2", "--devices-per-proc", "2"], command + ["--resume"],
                           timeout=240, env=env)
    assert code == 0, output[-5000:]
    assert [r["step"] for r in records(out)] == list(range(1, 9))
    for p in (0, 1):
        assert [r["step"] for r in sample_records(out) if r["file"] == f"sample_ids.p{p}.jsonl"] == list(range(1, 9))
    np.testing.assert_array_equal(epoch_ids(out, 0), np.arange(256))  # every sample exactly once

    # The 2-process sharded checkpoint, finished by one process with 2 devices.
    finish = subprocess.run(jaxdp("train", *ARGS, "--synthetic-size", "256,32", "--checkpoint-every", "4",
                                  "--out", elastic, "--devices", "2", "--resume"),
                            env=env, capture_output=True, text=True, timeout=240)
    assert finish.returncode == 0, finish.stderr[-5000:]
    assert "resuming a run saved on 4 devices (2 process(es)) on 2 (1)" in finish.stderr
    assert [r["step"] for r in records(elastic)] == list(range(1, 9))
    assert [r["step"] for r in sample_records(elastic) if r["file"] == "sample_ids.p1.jsonl"] == [1, 2, 3, 4]
    np.testing.assert_array_equal(epoch_ids(elastic, 0), np.arange(256))


@pytest.mark.slow
def test_partial_and_corrupted_checkpoints_fall_back_to_the_last_good_one(tmp_path, capsys):
    cfg = TrainConfig(out=str(tmp_path), devices=2, synthetic_size=(256, 32), checkpoint_every=2, **TINY)
    train(cfg, stop_after_steps=5)  # checkpoints 2 and 4 (and 5, the interruption's)
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    assert complete_steps(cfg.out) == [2, 4, 5]
    # A save that died half-way (orbax's temporary name) and two damaged checkpoints.
    partial = os.path.join(ckpt_dir, "6.orbax-checkpoint-tmp-1234567")
    os.makedirs(os.path.join(partial, "state"))
    with open(os.path.join(partial, "state", "junk"), "wb") as f:
        f.write(b"\0" * 100)
    truncated = _largest_file(os.path.join(ckpt_dir, "5", "state"))
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    garbled = _largest_file(os.path.join(ckpt_dir, "4", "state"))
    with open(garbled, "r+b") as f:
        f.seek(os.path.getsize(garbled) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))  # same size, one byte flipped

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = Checkpointer(ckpt_dir)
        with pytest.raises(CheckpointCorrupt, match=f"file {truncated} has .* bytes, .* were written"):
            ck.verify(5)
        with pytest.raises(CheckpointCorrupt, match=f"file {garbled} differs from what was written"):
            ck.verify(4)
        assert ck.verify(2)
        ck.close()
        assert os.path.exists(partial)  # a reader removes nothing: it may be a save in flight
        train(TrainConfig(**dict(vars(cfg), resume=True)))
        assert not os.path.exists(partial)  # the run, the directory's one writer, removes it, never restores it
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert "; removed 1 partial save(s) (6.orbax-checkpoint-tmp-1234567)" in capsys.readouterr().err  # the resume's line
    assert any(truncated in m and "falling back to step 4" in m for m in messages), messages
    assert any(garbled in m and "falling back to step 2" in m for m in messages), messages
    # Resumed from step 2: steps 3.. again, every sample once.
    assert [r["step"] for r in records(cfg.out)] == list(range(1, 9))
    np.testing.assert_array_equal(epoch_ids(cfg.out, 0), np.arange(256))


def _largest_file(root):
    files = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    return max(files, key=os.path.getsize)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3" if "zero3" in REGISTRY else "ddp"])
def test_resume_on_half_the_devices_repartitions_the_rest_of_the_epoch(tmp_path, capsys, strategy):
    """4 devices, checkpoint after 3 of 8 steps, resume on 2: the sharded checkpoint
    restores onto 2, and the remaining 5 steps deal samples 96.. of the epoch's order over
    2 devices, so the epoch's 256 samples are each fed once."""
    cfg = TrainConfig(out=str(tmp_path), strategy=strategy, devices=4, synthetic_size=(256, 32), **TINY)
    train(cfg, stop_after_steps=3)
    resumed = train(TrainConfig(**dict(vars(cfg), devices=2, resume=True)))
    assert "resuming a run saved on 4 devices (1 process(es)) on 2 (1): epoch 0 continues after its first " \
           "96 samples, repartitioned over 2 devices" in capsys.readouterr().err
    assert resumed["steps"] == 8 and np.isfinite(resumed["eval"]["loss"])
    recs = sample_records(cfg.out)
    assert [len(r["ranks"]) for r in recs] == [4, 4, 4, 2, 2, 2, 2, 2]
    np.testing.assert_array_equal(epoch_ids(cfg.out, 0), np.arange(256))
    order = epoch_permutation(256, cfg.seed, 0)
    fed = np.concatenate([np.asarray(r["ids"]).T.ravel() for r in recs])  # entry j of a step: device j % N
    np.testing.assert_array_equal(fed, order)


@pytest.mark.parametrize("n, before, after", [(254, 4, 2), (254, 2, 4), (250, 8, 2), (256, 4, 1)])
def test_elastic_data_semantics_with_a_ragged_tail(n, before, after):
    """The documented rule, on the data pipeline alone: step s takes entries [sG, (s+1)G) of
    the epoch's order padded for the current device count. Resumed on another count mid-epoch,
    the union of what was fed is exactly what a run on the new count feeds in the whole epoch:
    no sample lost or repeated beyond that count's own padding and dropped tail."""
    data = ArrayDataset(np.zeros((n, 32, 32, 3), np.uint8), np.zeros(n, np.int64), "ragged")
    g, seed, epoch, done = 16, 3, 1, 2

    def ids(replicas, start):
        batches = epoch_batches(data, num_replicas=replicas, batch_per_replica=g // replicas, epoch=epoch,
                                seed=seed, start_step=start)
        return [np.asarray(b.indices).T.ravel() for b in batches]  # entry j -> device j % N

    first = ids(before, 0)[:done]
    rest = ids(after, done)
    fed = np.concatenate(first + rest)
    whole_on_new = np.concatenate(ids(after, 0))
    np.testing.assert_array_equal(fed, whole_on_new)
    padded = partition(epoch_permutation(n, seed, epoch), after, False).T.ravel()
    np.testing.assert_array_equal(fed, padded[:steps_per_epoch(n, after, g // after) * g])
    real = fed[:min(len(fed), n)]
    assert len(np.unique(real)) == len(real)  # repeats only in the padding past n


@pytest.mark.slow
def test_sigterm_to_one_process_checkpoints_the_same_step_in_every_process(tmp_path):
    """A scheduler preempts one host of a 2-process job (SIGTERM to process 1 only): JAX's
    preemption sync point makes both stop after the same step, both checkpoint it together,
    each says so, and the launcher exits 143 (not a failure that kills the survivor). (Resuming
    such a checkpoint is what the SIGKILL test above does, at ~30 s a job.)"""
    out = str(tmp_path / "run")
    env = job_env()
    command = jaxdp("train", *ARGS, "--synthetic-size", "1024,32", "--out", out)  # 32 steps
    job = Job(["--nprocs", "2", "--devices-per-proc", "2"], command, env=env)
    try:
        pids = job.pids()
        deadline = time.monotonic() + 240
        while steps_logged(out) < 2:
            assert job.proc.poll() is None and time.monotonic() < deadline, job.output[-5000:]
            time.sleep(0.01)
        os.kill(pids[1], signal.SIGTERM)
        code = job.wait(timeout=120)
    finally:
        if job.proc.poll() is None:
            job.kill()
    assert code == 143, job.output[-5000:]
    saved = complete_steps(out)
    assert len(saved) == 1 and 2 <= saved[0] < 32, (saved, job.output[-3000:])
    step = saved[0]
    assert job.output.count(f"jaxdp: preempted (SIGTERM); step {step} was checkpointed: add --resume") == 2
    assert "waiting for the other 1 process(es)" in job.output and "failed" not in job.output
    for p in (0, 1):  # both processes stopped after the same step
        assert [r["step"] for r in sample_records(out) if r["file"] == f"sample_ids.p{p}.jsonl"][-1] == step

