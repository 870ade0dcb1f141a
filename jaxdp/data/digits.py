"""Real handwritten digits, offline: scikit-learn's copy of the UCI optical digits set
(1,797 images of 8x8 pixels, 16 grey levels, ten classes), shipped inside its wheel.

Each image is scaled to 0..255, enlarged 4x by pixel repetition to 32x32 (the models'
input size, every pixel a 4x4 block) and copied into 3 channels. The train/test split is
fixed (a seeded permutation, whatever the run's --seed): 1,437 train, 360 test.
Training augmentation shifts by up to 4 pixels (one original pixel) and never mirrors.
"""

from __future__ import annotations

import numpy as np

from .arrays import ArrayDataset, DatasetError

SCALE = 4  # 8x8 -> 32x32
NUM_TEST = 360  # 20 % of 1,797
SPLIT_SEED = 20240917  # the split is part of the dataset, not of a run


def load_digits() -> tuple[ArrayDataset, ArrayDataset]:
    try:
        from sklearn.datasets import load_digits as sklearn_digits  # the [digits] extra
    except ImportError:
        raise DatasetError("--dataset digits needs scikit-learn: pip install 'jaxdp[digits]' "
                           "(or scikit-learn)") from None
    raw = sklearn_digits()
    images = to_rgb32(raw.images)
    labels = raw.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    test, train = order[:NUM_TEST], order[NUM_TEST:]
    return (ArrayDataset(images[train], labels[train], "digits-train", hflip=False),
            ArrayDataset(images[test], labels[test], "digits-test", hflip=False))


def to_rgb32(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) grey levels 0..16 -> (N, 32, 32, 3) uint8 0..255."""
    grey = np.rint(np.asarray(images, np.float64) * (255 / 16)).astype(np.uint8)
    big = grey.repeat(SCALE, axis=1).repeat(SCALE, axis=2)
    return np.ascontiguousarray(np.repeat(big[..., None], 3, axis=-1))
