"""torch.utils.data.DistributedSampler's partition rules, in numpy.

Given the same permutation, every rank gets exactly the indices torch would
give it. We cannot reproduce torch.randperm in numpy, so the parity harness
passes torch's permutation in; standalone runs use `epoch_permutation`.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np


def num_samples_per_replica(n: int, num_replicas: int, drop_last: bool) -> int:
    """torch's `num_samples`: every rank gets the same count.

    drop_last trims the tail to a multiple of num_replicas; otherwise the
    count rounds up and the shortfall is padded (see `partition`).
    """
    _check_replicas(num_replicas)
    if drop_last and n % num_replicas != 0:
        return math.ceil((n - num_replicas) / num_replicas)
    return math.ceil(n / num_replicas)


def partition(permutation: np.ndarray, num_replicas: int, drop_last: bool) -> np.ndarray:
    """Split a permutation of range(n) into (num_replicas, num_samples) rows.

    Row r is rank r's index list, `indices[r:total:R]` as in torch. Without
    drop_last the list is padded by repeating its head, cyclically, so that
    every rank runs the same number of steps (collectives would hang
    otherwise); the duplicates are the first samples of this permutation.
    """
    perm = np.asarray(permutation, dtype=np.int64)
    if perm.ndim != 1:
        raise ValueError(f"permutation must be 1-D, got shape {perm.shape}")
    n = perm.shape[0]
    total = num_samples_per_replica(n, num_replicas, drop_last) * num_replicas
    if total <= n:
        indices = perm[:total]  # drop_last (or already divisible)
    else:
        # torch: indices += (indices * ceil(pad / n))[:pad], i.e. cyclic repeat.
        indices = np.tile(perm, math.ceil(total / n))[:total]
    # Interleaved (not blocked) split: indices[r::R] gives rank r its rows.
    return indices.reshape(-1, num_replicas).T.copy()


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """Shuffle for one epoch; seed + epoch, like torch's generator seeding."""
    return np.random.default_rng(seed + epoch).permutation(n)


class DistributedSampler:
    """One rank's view of the epoch, with torch's constructor and semantics.

    Takes the dataset length instead of the dataset (the pipeline only
    needs the count). `indices(permutation)` lets the parity harness feed
    torch's own `randperm` so both frameworks see the same order.
    """

    def __init__(self, num_samples_total: int, num_replicas: int, rank: int,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        _check_replicas(num_replicas)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas - 1}]")
        if num_samples_total < 0:
            raise ValueError(f"num_samples_total must be >= 0, got {num_samples_total}")
        self.num_samples_total = int(num_samples_total)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.num_samples = num_samples_per_replica(
            self.num_samples_total, self.num_replicas, drop_last)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch, as with torch, or every epoch repeats."""
        self.epoch = int(epoch)

    def permutation(self) -> np.ndarray:
        if self.shuffle:
            return epoch_permutation(self.num_samples_total, self.seed, self.epoch)
        return np.arange(self.num_samples_total)

    def indices(self, permutation: np.ndarray | None = None) -> np.ndarray:
        """This rank's indices; an explicit permutation overrides the shuffle."""
        if permutation is None:
            permutation = self.permutation()
        elif len(permutation) != self.num_samples_total:
            raise ValueError(
                f"permutation has {len(permutation)} entries, dataset has {self.num_samples_total}"
            )
        return partition(permutation, self.num_replicas, self.drop_last)[self.rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples


def _check_replicas(num_replicas: int) -> None:
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
