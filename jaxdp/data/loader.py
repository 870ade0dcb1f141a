"""Per-rank batches with fixed shapes, and a background prefetcher.

A batch is laid out (replicas, per-replica batch, ...): row r is exactly
what torch's DistributedSampler + DataLoader(drop_last=True) would hand to
rank r, so a strategy can shard the leading axis across devices as is.
"""

from __future__ import annotations

import math
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .augment import augment, normalize
from .arrays import ArrayDataset
from .sampler import epoch_permutation, num_samples_per_replica, partition


@dataclass
class Batch:
    """images (R, b, 32, 32, 3) float32, labels (R, b) int32, indices (R, b) int64.

    `indices` are dataset ids (for exactly-once checks). `mask` is set only
    by eval_batches: False marks padding that metrics must ignore.
    """

    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray
    mask: np.ndarray | None = None


def steps_per_epoch(n: int, num_replicas: int, batch_per_replica: int,
                    drop_last: bool = False) -> int:
    """Full per-rank batches in an epoch; the ragged last one is dropped.

    Compiled steps need fixed shapes, so we drop the incomplete batch like
    torch's DataLoader(drop_last=True) rather than pad it.
    """
    if batch_per_replica < 1:
        raise ValueError(f"batch_per_replica must be >= 1, got {batch_per_replica}")
    steps = num_samples_per_replica(n, num_replicas, drop_last) // batch_per_replica
    if steps == 0:
        raise ValueError(
            f"dataset of {n} samples is too small for {num_replicas} replicas x "
            f"{batch_per_replica} per replica: each replica gets "
            f"{num_samples_per_replica(n, num_replicas, drop_last)} samples, less than "
            f"one batch; lower the batch size or the replica count"
        )
    return steps


def epoch_batches(dataset: ArrayDataset, *, num_replicas: int, batch_per_replica: int,
                  epoch: int, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                  train: bool = True, permutation: np.ndarray | None = None,
                  start_step: int = 0, ranks: Sequence[int] | None = None) -> Iterator[Batch]:
    """One epoch of per-rank batches, following DistributedSampler.

    Rank r's step-s batch is its sampler indices[s*b:(s+1)*b]. train=True
    augments (pad-crop + flip, keyed by seed/epoch/index) then normalises;
    train=False only normalises and ignores `shuffle`. An explicit
    `permutation` (e.g. torch's randperm, for parity) overrides both.
    `ranks` selects the rows this process feeds (multi-host); `start_step`
    skips steps without loading them (resume). Arguments are checked now,
    not at the first next().
    """
    steps = epoch_indices(len(dataset), num_replicas=num_replicas, batch_per_replica=batch_per_replica,
                          epoch=epoch, seed=seed, shuffle=shuffle and train, drop_last=drop_last,
                          permutation=permutation, start_step=start_step, ranks=ranks)
    return _epoch_iter(dataset, steps, train, seed, epoch)


def epoch_indices(n: int, *, num_replicas: int, batch_per_replica: int, epoch: int, seed: int = 0,
                  shuffle: bool = True, drop_last: bool = False, permutation: np.ndarray | None = None,
                  start_step: int = 0, ranks: Sequence[int] | None = None) -> Iterator[np.ndarray]:
    """The dataset ids of each step of an epoch, (len(ranks), batch_per_replica) int64.

    The sampling half of ``epoch_batches`` (same arguments, same checks, made now): any
    pipeline that loads the images elsewhere (worker processes, the devices) takes its ids
    from here, so it cannot drift from the DistributedSampler partition or from resume.
    """
    steps = steps_per_epoch(n, num_replicas, batch_per_replica, drop_last)
    if not 0 <= start_step <= steps:
        raise ValueError(f"start_step {start_step} is outside [0, {steps}]")
    ranks = _check_ranks(ranks, num_replicas)
    if permutation is None:
        permutation = epoch_permutation(n, seed, epoch) if shuffle else np.arange(n)
    elif len(permutation) != n:
        raise ValueError(f"permutation has {len(permutation)} entries, dataset has {n}")
    rows = partition(permutation, num_replicas, drop_last)[ranks]
    b = batch_per_replica
    return (rows[:, s * b:(s + 1) * b] for s in range(start_step, steps))


def _epoch_iter(dataset, steps, train, seed, epoch) -> Iterator[Batch]:
    for idx in steps:
        images = dataset.images[idx]
        if train:
            images = augment(images, idx, seed, epoch, hflip=dataset.hflip)
        yield Batch(images=normalize(images), labels=dataset.labels[idx].astype(np.int32),
                    indices=idx)


def eval_batches(dataset: ArrayDataset, *, num_replicas: int, batch_per_replica: int,
                 ranks: Sequence[int] | None = None) -> Iterator[Batch]:
    """Every sample exactly once, in order, with a mask over the padding.

    Unlike DistributedSampler (which repeats samples to even out ranks and
    so skews metrics), the last global batch is filled with wrapped-around
    samples marked mask=False, keeping shapes fixed and metrics exact.
    Step s covers samples [s*R*b, (s+1)*R*b), rank r the r-th block of b.
    """
    if batch_per_replica < 1:
        raise ValueError(f"batch_per_replica must be >= 1, got {batch_per_replica}")
    n = len(dataset)
    ranks = _check_ranks(ranks, num_replicas)
    per_step = num_replicas * batch_per_replica
    steps = math.ceil(n / per_step)
    ids = np.arange(steps * per_step, dtype=np.int64)
    ids = ids.reshape(steps, num_replicas, batch_per_replica)
    return _eval_iter(dataset, ids[:, ranks], n)


def _eval_iter(dataset, ids, n) -> Iterator[Batch]:
    for step_ids in ids:
        idx = step_ids % n  # padding re-reads real images, so no NaN/garbage
        yield Batch(images=normalize(dataset.images[idx]),
                    labels=dataset.labels[idx].astype(np.int32),
                    indices=idx, mask=step_ids < n)


def _check_ranks(ranks, num_replicas: int) -> np.ndarray:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if ranks is None:
        return np.arange(num_replicas)
    ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
    if ranks.size == 0 or ranks.min() < 0 or ranks.max() >= num_replicas:
        raise ValueError(f"ranks {ranks.tolist()} must be non-empty and in [0, {num_replicas - 1}]")
    return ranks


# --------------------------------------------------------------------------
# Prefetcher
# --------------------------------------------------------------------------

_END = object()


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """Run an iterator (and an optional transform) in a background thread.

    The bounded queue keeps at most `size` items ready: enough to hide the
    numpy work behind the training step without hoarding memory. An
    exception in the producer is re-raised in the consumer at the point it
    happened in the stream. close(), a `with` block or garbage collection
    stop the thread. The thread holds no reference to the Prefetcher, so an
    abandoned one can still be collected.
    """

    def __init__(self, iterable: Iterable, size: int = 2,
                 transform: Callable | None = None):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_produce, args=(iter(iterable), transform, self._queue, self._stop),
            name="jaxdp-prefetch", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END or isinstance(item, _Raised):
            self._done = True
            self.close()
            if item is not _END:
                raise item.exc
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the producer and wait briefly for its thread to exit."""
        self._done = True
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _produce(it: Iterator, transform, q: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in it:
            if transform is not None:
                item = transform(item)
            if not _put(q, item, stop):
                return
        _put(q, _END, stop)
    except BaseException as e:  # handed to the consumer, not lost in the thread
        _put(q, _Raised(e), stop)
    finally:
        close = getattr(it, "close", None)  # release a generator's resources
        if close is not None:
            close()


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put unless stopped; polls so a full queue cannot block shutdown."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            pass
    return False


def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    try:  # free slots so a blocked put returns promptly
        while True:
            q.get_nowait()
    except queue.Empty:
        pass
    if thread is not threading.current_thread():
        thread.join(timeout=1.0)
