"""The training set on the devices: per step the host sends ids and augmentation draws only.

A dataset that fits (synthetic, digits, CIFAR-10's 150 MB of uint8) is copied to every
device once, replicated. Each step the host computes, with the numpy pipeline's own code
(``epoch_indices`` for the DistributedSampler partition, ``augment_params`` for the crop
offsets and flip bits), one small int32 array: (id, dy, dx, flip) per sample, 16 bytes
where a host batch sends a 12 KiB float32 image (3 KiB as uint8). On the devices, inside a jitted
``shard_map`` over the batch axes, each data-parallel device gathers its own rows, pads
and crops them, flips them and normalises them. The result is laid out exactly as
``strategy.engine.shard_batch`` lays out a host batch, so the step cannot tell the two apart;
tests/test_device_data.py checks the values against ``epoch_batches``: uint8 crops and
normalised values bit for bit.

airbench keeps CIFAR-10 on the GPU the same way; the copy per step is what it removes.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.data.augment import CIFAR10_MEAN, CIFAR10_STD, PAD, augment_params
from jaxdp.data.augment import normalize as host_normalize

MODES = ("auto", "on", "off")
# auto keeps a training set on the devices when it takes at most this share of one
# device's memory: the model, its activations and XLA's workspace need the rest.
DEVICE_SHARE = 1 / 8


# ----------------------------------------------------------------------------- on the device

def normalize(pixels, mean=CIFAR10_MEAN, std=CIFAR10_STD):
    """``jaxdp.data.normalize`` on the device, as a lookup: uint8 (..., C) -> float32.

    Why a table: XLA turns ``x / 255`` and ``/ std`` into multiplications by reciprocals
    (measured on CPU: 576 of the 768 values differ, by up to ~2000 ulp near zero). The
    table is the numpy pipeline's own output for every pixel value and channel, so the
    device's values equal it bit for bit, on any backend and at any optimisation level.
    """
    channels = pixels.shape[-1]
    levels = np.repeat(np.arange(256, dtype=np.uint8)[:, None], channels, axis=1)
    table = jnp.asarray(host_normalize(levels, mean, std))  # (256, C)
    return table[pixels.astype(jnp.int32), jnp.arange(channels)]


def crop_flip(images, dy, dx, flip):
    """``jaxdp.data.augment``'s pad-crop and flip of a batch (b, H, W, C) uint8, given its draws.

    Pads with zeros, takes each image's (H, W) window at (dy, dx) and mirrors it where
    ``flip``: the window numpy's ``augment`` slices, one dynamic slice per image.
    """
    h, w, c = images.shape[1:]
    padded = jnp.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD), (0, 0)))
    # Start indices of one dtype (a literal 0 would be int64 beside int32 under jax_enable_x64).
    window = jax.vmap(lambda x, y0, x0: jax.lax.dynamic_slice(x, (y0, x0, jnp.zeros_like(y0)), (h, w, c)))
    crops = window(padded, dy, dx)
    return jnp.where(flip[:, None, None, None], crops[:, :, ::-1], crops)


def local_pixels(images, draws):
    """One device's uint8 crops (..., H, W, C) from the whole dataset and its own rows of
    draws (..., 4) int32. Leading dims are kept (``dp`` lays a batch out (1, b) per device,
    the others (b,))."""
    lead = draws.shape[:-1]
    ids, dy, dx, flip = (draws.reshape(-1, 4)[:, k] for k in range(4))
    return crop_flip(images[ids], dy, dx, flip.astype(bool)).reshape(*lead, *images.shape[1:])


def local_batch(images, labels, draws):
    """One device's batch {"image": normalised float32, "label": int32}."""
    return {"image": normalize(local_pixels(images, draws)), "label": labels[draws[..., 0]]}


def on_batch_rows(strategy, fn, replicated: int = 0):
    """``fn`` jitted and ``shard_map``ped over ``strategy``'s mesh: its first ``replicated``
    arguments whole on every device, the last one's rows split over the batch axes as
    ``strategy.engine.shard_batch`` splits a batch, and so is the result."""
    rows = P(strategy.batch_axes)
    return jax.jit(jax.shard_map(fn, mesh=strategy.mesh, in_specs=(*[P()] * replicated, rows), out_specs=rows))


def normalized_batches(strategy):
    """The host pipeline's last stage on the devices: a placed batch with uint8 images ->
    the same batch with ``normalize``d float32 images (the host sends 4x fewer bytes)."""
    return on_batch_rows(strategy, lambda batch: {**batch, "image": normalize(batch["image"])})


# ----------------------------------------------------------------------------- host side

def step_draws(ids: np.ndarray, seed: int, epoch: int, hflip: bool) -> np.ndarray:
    """(ids.shape..., 4) int32: each sample's dataset id and its pad-crop/flip draws, from
    the numpy pipeline's ``augment_params`` (so both pipelines draw the same by construction)."""
    dy, dx, flip = augment_params(ids.reshape(-1), seed, epoch)
    flip &= hflip
    draws = np.stack([ids.reshape(-1), dy, dx, flip], axis=-1).astype(np.int32)
    return draws.reshape(*ids.shape, 4)


class DeviceDataset:
    """A training set replicated on every device of ``strategy``'s mesh, and the compiled
    function that turns a step's draws into that strategy's batch."""

    def __init__(self, dataset, strategy):
        if len(dataset) >= 2**31:
            raise ValueError(f"{dataset.name}: {len(dataset)} samples do not fit int32 ids")
        self.dataset, self.strategy = dataset, strategy
        everywhere = NamedSharding(strategy.mesh, P())
        # Every process holds the whole set, so its local data is the global array.
        self.images = jax.make_array_from_process_local_data(everywhere, dataset.images)
        self.labels = jax.make_array_from_process_local_data(everywhere, dataset.labels.astype(np.int32))
        self._batch = on_batch_rows(strategy, local_batch, replicated=2)
        self._pixels = on_batch_rows(strategy, local_pixels, replicated=1)

    def place(self, draws: np.ndarray):
        """This process's rows of draws (ranks, b, 4) -> the global draws, laid out like a batch."""
        return self.strategy.engine.shard_batch({"draws": draws.reshape(-1, 4)})["draws"]

    def batch(self, draws: np.ndarray) -> dict:
        """The step's batch {"image", "label"}, built on the devices (dispatched, not waited for)."""
        return self._batch(self.images, self.labels, self.place(draws))

    def pixels(self, draws: np.ndarray):
        return self._pixels(self.images, self.place(draws))


# ----------------------------------------------------------------------------- the choice

def dataset_bytes(dataset) -> int:
    """What the copy on each device takes: uint8 images and int32 labels."""
    return int(dataset.images.nbytes) + 4 * len(dataset)


def device_memory(device) -> int:
    """Bytes one device may use: its allocator's limit, or on the CPU backend (no limit
    reported) the host's memory shared by this process's devices."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, jax.local_device_count())


def choose(mode: str, dataset, device) -> tuple[bool, str]:
    """(keep the training set on the devices?, the line that says why) for --data-on-device."""
    if mode not in MODES:
        raise ValueError(f"--data-on-device takes {', '.join(MODES)}, got {mode!r}")
    need, have = dataset_bytes(dataset), device_memory(device)
    size = f"{dataset.name} is {_mib(need)}"
    if mode == "on":
        return True, f"{size}, on every device (--data-on-device on)"
    if mode == "off":
        return False, f"{size}, loaded by the host pipeline (--data-on-device off)"
    fits = need <= DEVICE_SHARE * have
    where = "on every device" if fits else "loaded by the host pipeline"
    return fits, (f"{size}, {where}: {'within' if fits else 'more than'} 1/{round(1 / DEVICE_SHARE)} of a "
                  f"device's {_mib(have)} (--data-on-device auto)")


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

