"""In-memory datasets and the single entry point `load_dataset`.

Everything here is plain numpy so that jaxdp and torch_ref consume
byte-identical arrays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

DATASETS = ("synthetic", "cifar10", "digits")

# Where `load_dataset("cifar10")` looks when no data_dir is given.
DATA_DIR_ENV = "JAXDP_DATA_DIR"
DEFAULT_DATA_DIR = "data"


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


def default_data_dir() -> str:
    return os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR


def load_dataset(
    name: str,
    data_dir: str | None = None,
    download: bool = False,
    synthetic_size: tuple[int, int] = (10000, 2000),
    seed: int = 0,
) -> tuple[ArrayDataset, ArrayDataset]:
    """Return (train, test) for `name` in DATASETS.

    cifar10: data_dir defaults to $JAXDP_DATA_DIR or ./data; it may be the
    extracted `cifar-10-batches-py/` folder, the `.tar.gz`, or a directory
    holding either. `download=True` fetches the archive when it is absent.
    synthetic: `synthetic_size=(num_train, num_test)` and `seed`; no files.
    digits: scikit-learn's 1,797 real 8x8 handwritten digits (in its wheel: offline).
    """
    if name == "synthetic":
        from .synthetic import make_synthetic

        num_train, num_test = synthetic_size
        return make_synthetic(num_train, num_test, seed=seed)
    if name == "cifar10":
        from . import cifar10

        return cifar10.load_cifar10(data_dir or default_data_dir(), download=download)
    if name == "digits":
        from .digits import load_digits

        return load_digits()
    raise DatasetError(
        f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}"
    )
