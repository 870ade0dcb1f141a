"""The feeds against the numpy pipeline, row by row: shared by tests/test_device_data.py (one
process) and run as is in each process of a ``jaxdp launch`` job (``python
tests/device_data_job.py``), where every process checks the rows its devices hold."""

import sys

import numpy as np


def tiny_strategy(name: str, devices: int):
    """A strategy on ``devices`` devices; the feeds use only its mesh and batch layout."""
    import optax

    from jaxdp.runtime.mesh import make_mesh
    from jaxdp.models import create_model
    from jaxdp.strategies import create_strategy
    from jaxdp.loss.task import classifier

    model = create_model("resnet18", width=4, blocks=(1, 1, 1, 1), dtype="float32")
    return create_strategy(name, model, classifier(model), optax.sgd(0.1), make_mesh(devices))


def local_rows(array) -> np.ndarray:
    """This process's rows of a global batch array, in order (the whole array in one process)."""
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    rows, seen = [], set()
    for shard in shards:  # replicas of a row (a model axis) are kept once
        if (shard.index[0].start or 0) not in seen:
            seen.add(shard.index[0].start or 0)
            rows.append(np.asarray(shard.data))
    return np.concatenate(rows)


def assert_feed_equals_numpy(feed, train_set, *, epoch: int, first: int = 0) -> int:
    """Every step of ``feed.epoch(epoch, first)`` is ``epoch_batches``' step for the same
    ranks: the same ids and labels, the images bit for bit. Returns the steps compared."""
    from jaxdp.data import epoch_batches

    n = feed.strategy.num_devices
    expected = epoch_batches(train_set, num_replicas=n, batch_per_replica=feed.per_device, epoch=epoch,
                             seed=feed.seed, start_step=first, ranks=feed.ranks)
    steps = 0
    for (batch, ids), want in zip(feed.epoch(epoch, first), expected, strict=True):
        np.testing.assert_array_equal(ids, want.indices)
        images = local_rows(batch["image"]).reshape(want.images.shape)
        assert images.dtype == np.float32 and images.tobytes() == want.images.tobytes(), \
            f"step {first + steps}: {np.sum(images != want.images)} values differ"
        np.testing.assert_array_equal(local_rows(batch["label"]).reshape(want.labels.shape), want.labels)
        steps += 1
    return steps


def main() -> None:
    """In each process of a 2-process x 2-device job: both feeds equal numpy on this process's rows."""
    import jax

    from jaxdp.runtime.distributed import join_job

    join_job(60, 60)
    from jaxdp.data import make_synthetic
    from jaxdp.run.feed import DeviceFeed, HostFeed
    from jaxdp.runtime.mesh import process_ranks

    strategy = tiny_strategy("ddp", jax.device_count())
    ranks = process_ranks(strategy.mesh, strategy.batch_axes)
    train, _ = make_synthetic(50, 4)  # 50 over 4 ranks: padded to 52
    args = (train, strategy, 3, 5, ranks)
    steps = [assert_feed_equals_numpy(DeviceFeed(*args), train, epoch=1, first=1),
             assert_feed_equals_numpy(HostFeed(*args), train, epoch=2)]
    print(f"process {jax.process_index()} ranks {ranks}: {steps} steps equal", flush=True)


if __name__ == "__main__":
    sys.exit(main())
