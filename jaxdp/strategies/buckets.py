"""Gradient buckets, as torch DDP forms them.

DDP packs gradients into flat buckets of at most ``bucket_cap_mb`` in *reverse*
parameter order (roughly the order backward produces them) and runs one
all-reduce per bucket. The reduction is elementwise, so bucketing changes only
how many collectives the program issues, never the numbers.
"""

from typing import Callable, List

import jax
import jax.numpy as jnp


def definition_order_paths(tree, prefix=()):
    """Leaf paths in the order the model defined them (dict insertion order).

    ``jax.tree_util`` sorts dict keys, which would put 'bn1' before 'conv1'; DDP
    orders by ``model.parameters()``, i.e. definition order.
    """
    if isinstance(tree, dict):
        paths = []
        for key, sub in tree.items():
            paths.extend(definition_order_paths(sub, prefix + (key,)))
        return paths
    return [prefix]


def plan_buckets(sizes_in_bytes: List[int], cap_bytes: int) -> List[List[int]]:
    """Group leaf indices (already in reduction order) into buckets of <= cap bytes.

    A leaf larger than the cap gets a bucket of its own, as in torch.
    """
    buckets, current, filled = [], [], 0
    for i, size in enumerate(sizes_in_bytes):
        if current and filled + size > cap_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(current)
    return buckets


def bucketed(grads, reduce_flat: Callable, cap_mb: float):
    """Apply ``reduce_flat`` to each flat bucket of ``grads`` and return the same tree."""
    by_path = {tuple(_key(k) for k in path): leaf
               for path, leaf in jax.tree_util.tree_leaves_with_path(grads)}
    order = list(reversed(definition_order_paths(grads)))
    leaves = [by_path[p] for p in order]
    cap = int(cap_mb * 1024 * 1024)
    reduced = {}
    for bucket in plan_buckets([x.size * x.dtype.itemsize for x in leaves], cap):
        parts = [leaves[i] for i in bucket]
        flat = reduce_flat(jnp.concatenate([x.ravel() for x in parts]))
        offset = 0
        for i, x in zip(bucket, parts):
            reduced[order[i]] = flat[offset:offset + x.size].reshape(x.shape)
            offset += x.size
    return jax.tree_util.tree_map_with_path(lambda path, _: reduced[tuple(_key(k) for k in path)], grads)


def _key(entry):
    return getattr(entry, "key", getattr(entry, "idx", entry))
