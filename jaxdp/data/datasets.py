"""The dataset registry: the single entry point `load_dataset`.

Everything here is plain numpy so that jaxdp and torch_ref consume
byte-identical arrays. The sources (synthetic, cifar10) build an ``ArrayDataset``
(``arrays.py``) and never import this module: the imports go one way.
"""

from __future__ import annotations

import os

from jaxdp.names import DATASETS  # the names (jaxdp.names); their loaders are here

from . import cifar10
from .arrays import ArrayDataset, DatasetError
from .digits import load_digits
from .synthetic import make_synthetic

# Where `load_dataset("cifar10")` looks when no data_dir is given.
DATA_DIR_ENV = "JAXDP_DATA_DIR"
DEFAULT_DATA_DIR = "data"


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
        num_train, num_test = synthetic_size
        return make_synthetic(num_train, num_test, seed=seed)
    if name == "cifar10":
        return cifar10.load_cifar10(data_dir or default_data_dir(), download=download)
    if name == "digits":
        return load_digits()
    raise DatasetError(
        f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}"
    )
