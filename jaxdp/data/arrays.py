"""The in-memory dataset every source produces, and the error a source raises.

Plain numpy. Its own module so that the sources (``synthetic``, ``cifar10``) and the
registry that picks one (``datasets.load_dataset``) import it, not each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class DatasetError(RuntimeError):
    """A dataset is missing or damaged; the message says how to fix it."""


@dataclass(frozen=True)
class ArrayDataset:
    """Images as uint8 NHWC (N, 32, 32, 3) and int64 labels (N,).

    uint8 NHWC is the on-disk layout of both sources after conversion; it is
    4x smaller than float32 and augmentation works on it directly.
    """

    images: np.ndarray
    labels: np.ndarray
    name: str
    hflip: bool = True  # whether training augmentation may mirror an image (not for digits)

    def __post_init__(self):
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ValueError(
                f"{self.name}: images must be uint8 NHWC, got "
                f"{self.images.dtype} {self.images.shape}"
            )
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"{self.name}: labels shape {self.labels.shape} does not match "
                f"{self.images.shape[0]} images"
            )

    def __len__(self) -> int:
        return int(self.images.shape[0])
