"""Framework-neutral numpy data pipeline shared by jaxdp and torch_ref.

Imports only numpy and the standard library, so both frameworks consume
byte-identical batches: datasets -> DistributedSampler partition ->
augment -> normalize -> per-rank Batch.
"""

from .arrays import ArrayDataset, DatasetError
from .augment import CIFAR10_MEAN, CIFAR10_STD, augment, augment_params, normalize
from .cifar10 import (CIFAR10_MD5, CIFAR10_URL, download_cifar10, find_cifar10,
                      load_cifar10, read_cifar10)
from .datasets import DATASETS, load_dataset
from .loader import Batch, Prefetcher, epoch_batches, epoch_indices, eval_batches, steps_per_epoch
from .sampler import (DistributedSampler, epoch_permutation, num_samples_per_replica,
                      partition)
from .synthetic import make_synthetic

__all__ = [
    "ArrayDataset", "Batch", "CIFAR10_MD5", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10_URL",
    "DATASETS", "DatasetError", "DistributedSampler", "Prefetcher", "augment",
    "augment_params", "download_cifar10", "epoch_batches", "epoch_indices", "epoch_permutation",
    "eval_batches", "find_cifar10", "load_cifar10", "load_dataset", "make_synthetic",
    "normalize", "num_samples_per_replica", "partition", "read_cifar10", "steps_per_epoch",
]
