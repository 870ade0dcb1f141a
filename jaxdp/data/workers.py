"""The numpy pipeline's crops in worker processes, for a training set the devices cannot hold.

One Python thread crops and flips about 20-26k CIFAR images/s on a GPU host, and a GPU
trains 60-80k: so the work is spread over processes. Each worker maps the training
images from one file in shared memory (/dev/shm where there is one; no copy per worker,
no pickling of the dataset) and returns a step's uint8 crops (``augment``, the same function the reference
pipeline calls), 3 KiB an image. Normalising to float32 is 4x the bytes, so it is left
to the devices (``jaxdp.run.device_data.normalize``, exact by construction).

Steps are submitted ``ahead`` at a time and handed back in order, so the stream equals
``epoch_batches``' however the workers interleave. Plain numpy and the standard library:
torch_ref could use it as it is.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Iterator

import numpy as np

from .arrays import ArrayDataset
from .augment import augment

_IMAGES = None  # in a worker: the training images, mapped read-only from the shared file


class CropWorkers:
    """A pool of ``workers`` processes that crop and flip steps of ``dataset``'s images.

    Started with "spawn": the trainer's process runs JAX's threads, and a fork of a
    multi-threaded process may deadlock. ``close()`` (or a ``with`` block) stops them and
    deletes the shared file.
    """

    def __init__(self, dataset: ArrayDataset, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.dataset, self.workers = dataset, workers
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self._path = tempfile.mkstemp(prefix="jaxdp-images-", suffix=".npy", dir=shm)
        with os.fdopen(fd, "wb") as f:
            np.save(f, dataset.images)
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_attach, initargs=(self._path, os.getpid()))

    def crops(self, steps: Iterable[np.ndarray], *, seed: int, epoch: int, train: bool = True,
              ahead: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(uint8 images ids.shape + (H, W, C), ids) for each step's ids, in order.

        ``train=False`` gathers without augmenting. ``ahead`` steps are in flight at once
        (default: two per worker, so that none waits while the consumer takes one)."""
        ahead = ahead or 2 * self.workers
        pending: collections.deque = collections.deque()
        hflip = self.dataset.hflip
        for ids in steps:
            pending.append((self._pool.submit(_crop, ids, seed, epoch, train, hflip), ids))
            if len(pending) >= ahead:
                future, done_ids = pending.popleft()
                yield future.result(), done_ids
        while pending:
            future, done_ids = pending.popleft()
            yield future.result(), done_ids

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if os.path.exists(self._path):
            os.remove(self._path)

    def __enter__(self) -> "CropWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _attach(path: str, parent: int) -> None:
    global _IMAGES
    # Ctrl-C and SIGTERM reach the whole process group: the trainer finishes its step and
    # checkpoints, which needs the workers alive; they end when it shuts the pool down (or dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The trainer's pid, not os.getppid(): a worker may start after the trainer died.
    threading.Thread(target=_exit_with_parent, args=(parent, path), daemon=True).start()
    _IMAGES = np.load(path, mmap_mode="r")


def _exit_with_parent(parent: int, path: str) -> None:
    """A trainer killed outright (SIGKILL) cannot shut its pool down: its orphaned workers,
    deaf to SIGTERM, notice the new parent, delete the shared file and leave."""
    while os.getppid() == parent:
        time.sleep(1.0)
    try:
        os.remove(path)
    except OSError:  # another worker was first
        pass
    os._exit(0)


def _crop(ids: np.ndarray, seed: int, epoch: int, train: bool, hflip: bool) -> np.ndarray:
    images = np.asarray(_IMAGES[ids])
    return augment(images, ids, seed, epoch, hflip=hflip) if train else images
