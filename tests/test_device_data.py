"""The training set on the devices (``jaxdp.run.device_data``, ``jaxdp.run.feed``) and the host
pipeline's worker processes (``jaxdp.data.workers``) hand the step the numpy pipeline's
batches bit for bit: at 1, 2 and 3 devices, in ``dp``'s per-device layout, resumed
mid-epoch, across two processes, and through ``jaxdp train``."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from device_data_job import assert_feed_equals_numpy, tiny_strategy
from launch_helpers import alive, job_env, run_job
from jaxdp.config.tree import TrainConfig
from jaxdp.data import ArrayDataset, augment, epoch_indices, make_synthetic
from jaxdp.run.device_data import DEVICE_SHARE, DeviceDataset, choose, dataset_bytes, step_draws
from jaxdp.run.feed import DeviceFeed, HostFeed
from jaxdp.run.train import train

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def train_set():
    return make_synthetic(50, 4)[0]  # 50 does not split over 3 or 4 ranks: the sampler pads


@pytest.mark.parametrize("name, devices", [("ddp", 1), ("ddp", 2), ("ddp", 3), ("dp", 2)])
def test_the_device_feed_is_the_numpy_pipeline(name, devices, train_set):
    feed = DeviceFeed(train_set, tiny_strategy(name, devices), 4, 7)
    steps = 50 // (4 * devices) if devices < 3 else 17 // 4  # 3 ranks: 17 samples each, one padded
    assert assert_feed_equals_numpy(feed, train_set, epoch=1) == steps
    assert assert_feed_equals_numpy(feed, train_set, epoch=2, first=1) == steps - 1  # a resumed epoch


def test_the_uint8_crops_and_flips_are_numpys_bit_for_bit(train_set):
    data = DeviceDataset(train_set, tiny_strategy("ddp", 2))
    mirrorless = ArrayDataset(train_set.images, train_set.labels, "mirrorless", hflip=False)  # digits' rule
    unflipped = DeviceDataset(mirrorless, data.strategy)
    for ids in epoch_indices(50, num_replicas=2, batch_per_replica=12, epoch=3, seed=1):
        for device, dataset in ((data, train_set), (unflipped, mirrorless)):
            got = np.asarray(device.pixels(step_draws(ids, 1, 3, dataset.hflip))).reshape(*ids.shape, 32, 32, 3)
            assert got.dtype == np.uint8
            np.testing.assert_array_equal(got, augment(train_set.images[ids], ids, 1, 3, hflip=dataset.hflip))
    flips = step_draws(np.arange(50), 1, 3, True)[:, 3]
    assert 0 < flips.sum() < 50  # so both the flipped and the plain branch were compared


def test_the_comparison_catches_other_draws(train_set):
    """The check can fail: seed 8's epoch 1 takes seed 7's epoch 2 samples (the shuffle is
    keyed by seed + epoch) but crops and flips them differently (keyed by both)."""
    off = DeviceFeed(train_set, tiny_strategy("ddp", 2), 4, 8)
    as_seed_7 = SimpleNamespace(strategy=off.strategy, per_device=4, seed=7, ranks=None,
                                epoch=lambda epoch, first=0: off.epoch(epoch - 1, first))
    with pytest.raises(AssertionError, match="values differ"):
        assert_feed_equals_numpy(as_seed_7, train_set, epoch=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_host_feed_is_the_numpy_pipeline(workers, train_set):
    """Crops in a thread or in worker processes, normalised on the devices."""
    feed = HostFeed(train_set, tiny_strategy("ddp", 3), 4, 7, workers=workers)
    try:
        assert assert_feed_equals_numpy(feed, train_set, epoch=1) == 4
        assert assert_feed_equals_numpy(feed, train_set, epoch=0, first=2) == 2
    finally:
        feed.close()


def test_auto_keeps_small_sets_on_the_device_and_large_ones_on_the_host(train_set):
    import jax

    cpu = jax.devices()[0]
    assert choose("auto", train_set, cpu)[0]
    sklearn = pytest.importorskip("sklearn")
    del sklearn
    from jaxdp.data.digits import load_digits

    assert choose("auto", load_digits()[0], cpu)[0]
    need = dataset_bytes(train_set)
    assert need == 50 * (32 * 32 * 3 + 4)
    limit = round(need / DEVICE_SHARE)

    def device(limit):
        return SimpleNamespace(memory_stats=lambda: {"bytes_limit": limit})

    assert choose("auto", train_set, device(limit)) == (
        True, "synthetic-train is 0.1 MiB, on every device: within 1/8 of a device's 1.2 MiB (--data-on-device auto)")
    assert not choose("auto", train_set, device(limit - 8))[0]
    assert choose("on", train_set, device(limit - 8))[0] and not choose("off", train_set, cpu)[0]


@pytest.mark.float64
def test_train_on_the_device_and_on_the_host_is_the_same_run(tmp_path, capsys):
    """jaxdp train picks the device path on CPU and says so; the host path with two
    worker processes trains the same losses, bit for bit (float64: 64-bit ints too)."""
    common = dict(width=4, blocks=(1, 1, 1, 1), synthetic_size=(48, 16), global_batch_size=16, devices=2,
                  max_steps=3, lr=0.05, dtype="float64", tensorboard=False)
    train(TrainConfig(out=str(tmp_path / "device"), **common))
    device_line = [line for line in capsys.readouterr().err.splitlines() if line.startswith("data: ")]
    assert device_line == ["data: synthetic-train is 0.1 MiB, on every device: within 1/8 of a device's "
                           + device_line[0].split("device's ")[1]]
    train(TrainConfig(out=str(tmp_path / "host"), data_on_device="off", data_workers=2, **common))
    assert ("data: synthetic-train is 0.1 MiB, loaded by the host pipeline (--data-on-device off), with 2 worker "
            "processes") in capsys.readouterr().err

    def losses(run):
        with open(tmp_path / run / "metrics.jsonl") as f:
            return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]

    assert len(losses("device")) == 3 and losses("host") == losses("device")


@pytest.mark.slow
def test_two_processes_each_get_their_own_rows(tmp_path):
    """2 processes x 2 devices: each process's shards of both feeds' batches are numpy's rows
    for its ranks (process 0: ranks 0 and 1, process 1: 2 and 3)."""
    code, out = run_job(["--nprocs", "2", "--devices-per-proc", "2"],
                        [sys.executable, os.path.join(HERE, "device_data_job.py")], timeout=240, env=job_env())
    assert code == 0, out[-5000:]
    assert "process 0 ranks [0, 1]: [3, 4] steps equal" in out, out[-3000:]
    assert "process 1 ranks [2, 3]: [3, 4] steps equal" in out, out[-3000:]


ORPHANING = """
import os, signal, sys
from jaxdp.data import epoch_indices, make_synthetic
from jaxdp.data.workers import CropWorkers
if __name__ == "__main__":
    pool = CropWorkers(make_synthetic(16, 4)[0], 2)
    list(pool.crops(epoch_indices(16, num_replicas=1, batch_per_replica=8, epoch=0), seed=0, epoch=0))
    print(pool._path, *(p.pid for p in pool._pool._processes.values()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_of_a_killed_trainer_leave_and_delete_the_shared_file(tmp_path):
    """SIGKILL leaves the pool no chance to shut down; the workers (deaf to SIGTERM, so that a
    preempted trainer can finish its step) must notice and clean up themselves."""
    script = tmp_path / "orphaning.py"
    script.write_text(ORPHANING)
    proc = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True, timeout=120)
    assert proc.returncode == -9
    path, *pids = proc.stdout.split()
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (os.path.exists(path) or any(alive(int(p)) for p in pids)):
        time.sleep(0.2)
    assert not os.path.exists(path) and not any(alive(int(p)) for p in pids)


@pytest.mark.parametrize("args, message", [
    (["--data-on-device", "maybe"], "unknown --data-on-device 'maybe'; choose one of auto, on, off"),
    (["--data-workers", "-1"], "--data-workers must be >= 0 (0 = a background thread), got -1"),
])
def test_bad_data_flags_are_one_clear_line(tmp_path, capsys, args, message):
    from jaxdp.cli.command import main

    assert main(["train", "--out", str(tmp_path / "run"), *args]) == 2
    assert capsys.readouterr().err == f"jaxdp: error: {message}\n"
    assert not (tmp_path / "run").exists()
