"""A CIFAR-shaped synthetic dataset that a small ResNet learns quickly.

Each class is a smooth random colour pattern (a sum of a few low-frequency
2-D sinusoids per channel). A sample is its class pattern circularly shifted
by up to SHIFT pixels, with random contrast and brightness and Gaussian
noise. Every class pattern has the same mean colour, so the mean colour of an
image says nothing about its class: a model has to look at spatial structure.
"""

from __future__ import annotations

import numpy as np

from .arrays import ArrayDataset

SIZE = 32
NUM_WAVES = 4      # sinusoids per class and channel
MAX_FREQ = 2       # cycles per image: low frequency = smooth, learnable
AMPLITUDE = 32.0   # template std in pixel units (before jitter)
SHIFT = 5          # max circular shift in pixels
NOISE = 40.0       # per-pixel Gaussian noise std
BASE = 128.0       # shared mean pixel value of every class


def make_synthetic(num_train: int, num_test: int, seed: int = 0,
                   num_classes: int = 10) -> tuple[ArrayDataset, ArrayDataset]:
    """Deterministic (train, test) for the seed.

    Templates, train and test use separate seeded streams, so the test set
    does not change when num_train does.
    """
    templates = _templates(np.random.default_rng([seed, 0]), num_classes)
    train = _samples(np.random.default_rng([seed, 1]), templates, num_train, "synthetic-train")
    test = _samples(np.random.default_rng([seed, 2]), templates, num_test, "synthetic-test")
    return train, test


def _templates(rng: np.random.Generator, num_classes: int) -> np.ndarray:
    """(K, 32, 32, 3) float32 zero-mean patterns with std AMPLITUDE.

    Integer frequencies make each pattern periodic over the image, so a
    circular shift is a seamless translation.
    """
    shape = (num_classes, 3, NUM_WAVES)
    fy = rng.integers(0, MAX_FREQ + 1, size=shape)
    fx = rng.integers(1, MAX_FREQ + 1, size=shape) * rng.choice([-1, 1], size=shape)
    phase = rng.uniform(0, 2 * np.pi, size=shape)
    weight = rng.normal(size=shape)
    t = 2 * np.pi * np.arange(SIZE) / SIZE
    # angle[k, c, w, y, x] = fy*y + fx*x + phase
    angle = (fy[..., None, None] * t[:, None] + fx[..., None, None] * t[None, :]
             + phase[..., None, None])
    pattern = (weight[..., None, None] * np.cos(angle)).sum(axis=2)  # (K, 3, H, W)
    pattern -= pattern.mean(axis=(2, 3), keepdims=True)  # same mean colour for all
    pattern *= AMPLITUDE / pattern.std(axis=(1, 2, 3), keepdims=True)
    return np.ascontiguousarray(pattern.transpose(0, 2, 3, 1), dtype=np.float32)


def _samples(rng: np.random.Generator, templates: np.ndarray, n: int, name: str) -> ArrayDataset:
    k = templates.shape[0]
    labels = rng.permutation(np.arange(n) % k)  # balanced to within one
    dy, dx = rng.integers(-SHIFT, SHIFT + 1, size=(2, n))
    contrast = rng.uniform(0.7, 1.3, size=(n, 1, 1, 1)).astype(np.float32)
    brightness = rng.uniform(-30, 30, size=(n, 1, 1, 1)).astype(np.float32)
    # Gather whole shifted templates from a small bank: one contiguous copy
    # per sample, much faster than per-pixel fancy indexing.
    x = _shift_bank(templates)[labels, dy + SHIFT, dx + SHIFT]
    x *= contrast
    x += BASE + brightness
    x += NOISE * rng.standard_normal(size=x.shape, dtype=np.float32)
    np.rint(x, out=x)
    np.clip(x, 0, 255, out=x)
    images = x.astype(np.uint8)
    return ArrayDataset(images=images, labels=labels.astype(np.int64), name=name)


def _shift_bank(templates: np.ndarray) -> np.ndarray:
    """(K, 2S+1, 2S+1, H, W, C): every class template at every shift."""
    shifts = range(-SHIFT, SHIFT + 1)
    return np.stack([
        np.stack([np.roll(templates, (dy, dx), axis=(1, 2)) for dx in shifts], axis=1)
        for dy in shifts
    ], axis=1)
