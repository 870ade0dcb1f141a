"""The inputs both sides share: torch's initial weights, and the per-rank batches from the
numpy pipeline in the order torch's ``DistributedSampler`` draws them.

Jax-free; torch is imported where its init or its permutation is needed.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from parity_tests.config import ParityConfig


def torch_model(cfg: ParityConfig):
    """The torch-initialised model (float32, CPU): its family's torch init under ``manual_seed(seed)``."""
    import torch

    from torch_ref.models import create_model

    torch.manual_seed(cfg.seed)
    return create_model(cfg.model, num_classes=cfg.num_classes, **cfg.model_options())


def init_state_dict(cfg: ParityConfig) -> Dict[str, np.ndarray]:
    """{torch name: numpy} of the torch-initialised model, in the run's dtype."""
    import torch

    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    model = torch_model(cfg).to(dtype)
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def torch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """DistributedSampler's shuffle: ``randperm(n)`` from a generator seeded ``seed + epoch``."""
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy()


def make_batches(cfg: ParityConfig) -> List[Tuple[np.ndarray, np.ndarray]]:
    """``cfg.steps`` global batches: images (N, b, S, S, 3) NHWC, labels (N, b) int32.

    Row r is rank r's batch (DistributedSampler partition of torch's permutation, with
    the shared augmentation), epochs following one another as a training run would."""
    from jaxdp.data import epoch_batches, make_synthetic

    n, b = cfg.devices, cfg.batch_per_device
    train, _ = make_synthetic(cfg.dataset_size, 16, seed=cfg.seed)
    dtype = np.float64 if cfg.dtype == "float64" else np.float32
    s, o = cfg.image_size, (32 - cfg.image_size) // 2
    out: List[Tuple[np.ndarray, np.ndarray]] = []
    epoch = 0
    while len(out) < cfg.steps:
        perm = torch_permutation(len(train), cfg.seed, epoch)
        for batch in epoch_batches(train, num_replicas=n, batch_per_replica=b, epoch=epoch,
                                   seed=cfg.seed, permutation=perm):
            images = np.ascontiguousarray(batch.images[:, :, o:o + s, o:o + s, :]).astype(dtype)
            out.append((images, batch.labels.astype(np.int32)))
            if len(out) == cfg.steps:
                break
        epoch += 1
    return out


def full_batch_order(images: np.ndarray, labels: np.ndarray, accum: int):
    """(N, b, ...) per-device batches -> (1, N*b, ...) for one torch process, ordered so that
    its k-th micro-batch (``chunk(accum)``) is the union of every device's k-th micro-batch:
    what a SyncBN step with accumulation normalises over."""
    return one_process_rows(images, accum), one_process_rows(labels, accum)


def one_process_rows(x: np.ndarray, accum: int) -> np.ndarray:
    """One array of ``full_batch_order``: (N, b, ...) -> (1, N*b, ...), micro-batch k of the one
    process being every device's micro-batch k."""
    n, b = x.shape[:2]
    m = b // accum
    return np.ascontiguousarray(x.reshape(n, accum, m, *x.shape[2:]).swapaxes(0, 1).reshape(1, n * b, *x.shape[2:]))


def cast(tree, dtype):
    """Floating arrays of ``{name: array}`` (or batches) to ``dtype``; integers stay."""
    if isinstance(tree, dict):
        return {k: cast(v, dtype) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cast(v, dtype) for v in tree)
    a = np.asarray(tree)
    return a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a
