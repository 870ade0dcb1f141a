"""Where ``jaxdp train``'s batches come from: the training set on the devices, or the host.

Both feeds hand the loop the same thing, each step's batch on the mesh (split over the
batch axes as ``strategy.engine.shard_batch`` splits it) and its dataset ids, and both equal
``epoch_batches``: the same DistributedSampler rows (``epoch_indices``), the same crops
and flips (``augment_params``), the same float32 values. They differ in what crosses
to the devices per step:

- ``DeviceFeed``: the set sits on every device; 16 bytes per sample (its id and draws).
- ``HostFeed``: numpy crops each step (in ``--data-workers`` processes, or one
  background thread) and sends uint8 images, 3 KiB each; the devices normalise them.

Either way a background thread keeps two batches placed ahead of the step (flax's
``prefetch_to_device`` does the same), so the copy and the host work overlap the step.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxdp.data import Prefetcher, epoch_indices
from jaxdp.data.augment import augment
from jaxdp.data.workers import CropWorkers
from jaxdp.run.device_data import DeviceDataset, choose, normalized_batches, step_draws

AHEAD = 2  # batches placed on the devices ahead of the step


def make_feed(cfg, setup, ranks):
    """The feed ``--data-on-device`` and ``--data-workers`` ask for, and the line that says
    which (printed at start)."""
    strategy = setup.strategy
    device = next(d for d in strategy.mesh.devices.flat if d.process_index == jax.process_index())
    on_device, why = choose(cfg.data_on_device, setup.train_set, device)
    args = (setup.train_set, strategy, setup.per_device, cfg.seed, ranks)
    if on_device:
        return DeviceFeed(*args), f"data: {why}"
    workers = host_workers(cfg.data_workers, device.platform)
    how = f"{workers} worker processes" if workers else "a background thread (--data-workers 0)"
    return HostFeed(*args, workers=workers), f"data: {why}, with {how}"


def host_workers(requested, platform: str) -> int:
    """``--data-workers``, or by default none on the CPU backend (its cores are the devices)
    and half the cores, at most 8, beside an accelerator."""
    if requested is not None:
        return requested
    return 0 if platform == "cpu" else max(1, min(8, (os.cpu_count() or 2) // 2))


class _Feed:
    """``train_set``'s epochs for ``strategy``: ``per_device`` samples per batch rank, this
    process's ``ranks`` (None: all), augmentation keyed by ``seed``."""

    def __init__(self, train_set, strategy, per_device: int, seed: int, ranks=None):
        self.train_set, self.strategy, self.per_device, self.seed, self.ranks = \
            train_set, strategy, per_device, seed, ranks

    def steps(self, epoch: int, first: int):
        """This process's ids of each step from ``first`` (the DistributedSampler rows)."""
        return epoch_indices(len(self.train_set), num_replicas=self.strategy.num_devices,
                             batch_per_replica=self.per_device, epoch=epoch, seed=self.seed, start_step=first,
                             ranks=self.ranks)

    def close(self) -> None:
        pass


class DeviceFeed(_Feed):
    """Batches built on the devices from the set placed there once (``jaxdp.run.device_data``)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.data = DeviceDataset(self.train_set, self.strategy)

    def epoch(self, epoch: int, first: int = 0):
        """(batch on the mesh, ids) for each step of ``epoch`` from step ``first``."""
        hflip = self.train_set.hflip
        steps = ((self.data.batch(step_draws(ids, self.seed, epoch, hflip)), ids) for ids in self.steps(epoch, first))
        return Prefetcher(steps, size=AHEAD)


class HostFeed(_Feed):
    """numpy crops on the host (``epoch_batches``' own ``augment``), normalised on the devices."""

    def __init__(self, *args, workers: int = 0):
        super().__init__(*args)
        self.pool = CropWorkers(self.train_set, workers) if workers else None
        self._normalized = normalized_batches(self.strategy)

    def epoch(self, epoch: int, first: int = 0):
        """(batch on the mesh, ids) for each step of ``epoch`` from step ``first``."""
        train, seed, steps = self.train_set, self.seed, self.steps(epoch, first)
        if self.pool is not None:
            crops = self.pool.crops(steps, seed=seed, epoch=epoch)
        else:
            crops = ((augment(train.images[ids], ids, seed, epoch, hflip=train.hflip), ids) for ids in steps)

        def place(item):
            images, ids = item
            batch = {"image": flat_rows(images), "label": flat_rows(train.labels[ids].astype(np.int32))}
            return self._normalized(self.strategy.engine.shard_batch(batch)), ids

        return Prefetcher(crops, size=AHEAD, transform=place)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def flat_rows(a: np.ndarray) -> np.ndarray:
    """(replicas, b, ...) -> (replicas * b, ...): device r gets rows [r*b, (r+1)*b)."""
    return a.reshape(-1, *a.shape[2:])
