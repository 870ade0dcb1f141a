"""CIFAR augmentation (pad-4 random crop + horizontal flip) and normalisation.

The random choices for a sample depend only on (seed, epoch, dataset index),
never on which batch, step or replica the sample lands in. So changing the
number of replicas, resuming mid-epoch, or comparing jaxdp against torch_ref
all see the same augmented pixels for the same sample.
"""

from __future__ import annotations

import numpy as np

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
PAD = 4  # torchvision RandomCrop(32, padding=4): offsets 0..2*PAD

_STREAM = 0xA06  # separates augmentation randomness from other seeded uses
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x + _GAMMA
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def augment_params(indices: np.ndarray, seed: int, epoch: int):
    """(dy, dx, flip) for each dataset index: a counter-based hash.

    A hash of (seed, epoch, index) rather than a generator draw over the
    whole dataset: it needs no dataset size and no cache, and a sample's
    draw cannot depend on the batch it is in.
    """
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64)
    key = np.array([_STREAM], dtype=np.uint64)
    for part in (seed, epoch):
        key = _splitmix64(key ^ np.array([part], dtype=np.int64).astype(np.uint64))
    h = _splitmix64(key + idx * _GAMMA)
    span = np.uint64(2 * PAD + 1)
    # Multiply-shift maps 24 random bits onto 0..8 (bias ~1e-6, unlike %).
    dy = ((h >> np.uint64(40)) * span) >> np.uint64(24)
    dx = (((h >> np.uint64(16)) & np.uint64(0xFFFFFF)) * span) >> np.uint64(24)
    flip = (h & np.uint64(1)).astype(bool)
    return dy.astype(np.intp), dx.astype(np.intp), flip


def augment(images: np.ndarray, indices: np.ndarray, seed: int, epoch: int, hflip: bool = True) -> np.ndarray:
    """Random crop from the zero-padded image, then random horizontal flip (unless
    ``hflip`` is False: a mirrored digit is not the same digit).

    images: uint8 (..., H, W, C); indices: dataset ids, shape images.shape[:-3].
    One basic slice per image (a view, mirrored by a negative stride) copied into the
    output: 3.5x faster than one fancy-index gather of every pixel (measured, 512 images).
    """
    images = np.asarray(images)
    indices = np.asarray(indices)
    if indices.shape != images.shape[:-3]:
        raise ValueError(f"indices shape {indices.shape} does not match images {images.shape}")
    h, w, c = images.shape[-3:]
    flat = images.reshape(-1, h, w, c)
    dy, dx, flip = augment_params(indices.reshape(-1), seed, epoch)
    flip &= hflip
    padded = np.pad(flat, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
    out = np.empty_like(flat)
    for i, (y, x, mirrored) in enumerate(zip(dy.tolist(), dx.tolist(), flip.tolist())):
        crop = padded[i, y:y + h, x:x + w]
        out[i] = crop[:, ::-1] if mirrored else crop
    return out.reshape(images.shape)


def normalize(images: np.ndarray, mean=CIFAR10_MEAN, std=CIFAR10_STD,
              dtype=np.float32) -> np.ndarray:
    """(x / 255 - mean) / std in float32, the op order of ToTensor + Normalize.

    Computed in float32 whatever `dtype` is, so float64 runs see the same
    values as float32 runs (and as torch), merely widened.
    """
    x = np.asarray(images).astype(np.float32) / np.float32(255)
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return x.astype(dtype, copy=False)
