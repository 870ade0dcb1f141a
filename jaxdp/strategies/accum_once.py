"""ZeRO-3/HSDP's ``accum_reduce="once"``: FSDP2's ``set_requires_gradient_sync(False)`` until the
last micro-batch.

By default ZeRO-3 reduce-scatters every micro-batch's gradient (the transpose of its gather), so
gradients stay sharded. Under ``once`` each micro-batch's gradient is taken whole, at zeros of the
full shapes (``unsharded_zeros``), summed over the K micro-batches, and reduce-scattered once per
update, unit by unit (``scatter_unit_by_unit``): K times fewer reduce-scatters for pΨ more bytes
per device (``unsharded_grad_bytes``), refused in one line where that does not fit
(``refuse_unless_it_fits``). The sum is linear, so the update is the default's.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.parallel.protocol import varying_axes
from jaxdp.strategies import layout
from jaxdp.strategies.errors import StrategyError
from jaxdp.strategies.sync.buckets import leaf_path


class Unsharded(NamedTuple):
    """What the loss takes under ``once``: the param chunks, and zeros of the full shapes that take
    their gradient whole (None in a forward-only pass)."""
    chunks: Any
    unsharded: Any


def unsharded_grad_bytes(shapes) -> int:
    """pΨ: what ``once`` adds per device, every param's gradient whole."""
    return int(sum(np.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree_util.tree_leaves(shapes)))


def memory_limit(device):
    """The bytes a device's allocator may use, None where it reports none (the CPU backend, compile-only GPUs)."""
    try:
        stats = device.memory_stats()
    except Exception:  # compile-only devices have no allocator to ask
        return None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def refuse_unless_it_fits(device, state, shapes) -> None:
    """One line if ``once`` does not fit ``device`` by the formula: the state a device keeps (params
    and optimizer chunks), its gradient chunk, and the unsharded gradients. Devices that report no
    limit (the CPU backend) are not checked."""
    capacity = memory_limit(device)
    if capacity is None:
        return
    kept = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves((state.params, state.opt_state)))
    chunk = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state.params))
    needed = kept + chunk + unsharded_grad_bytes(shapes)
    if needed > capacity:
        raise StrategyError(f"accum_reduce once needs {needed / 2**30:.2f} GiB per device for the model state "
                            f"and the unsharded gradients, the device has {capacity / 2**30:.2f} GiB: use "
                            "accum_reduce each (the default)")


def unsharded_zeros(chunks, shapes, axis: str, shards: int):
    """Zeros of every param's full shape, varying where its gathered tensor varies: what the
    gradient is taken at (``layout.gather_unsharded_grad``)."""
    def zeros(c, s):
        axes = set(varying_axes(c)) | ({axis} if layout.shard_dim(s.shape, shards) is not None else set())
        return jax.lax.pcast(jnp.zeros(s.shape, c.dtype), tuple(sorted(axes)), to="varying") if axes else \
            jnp.zeros(s.shape, c.dtype)
    return jax.tree_util.tree_map(zeros, chunks, shapes)


def scatter_unit_by_unit(grads, shapes, unit_paths, axis: str, shards: int, reduce_dtype=None):
    """The summed unsharded gradients reduce-scattered (summed) to this device's chunks in
    ``reduce_dtype`` (None: their own): one reduce-scatter per FSDP unit, the last unit's first,
    then the root's."""
    def scatter(gs):
        out = layout.scatter_group([g.astype(reduce_dtype or g.dtype) for g in gs], axis, shards)
        return [o.astype(g.dtype) for o, g in zip(out, gs)]
    return layout.map_groups(scatter, grads, unit_groups(shapes, unit_paths))


def unit_groups(shapes, unit_paths):
    """Leaf indices of the params, one group per FSDP unit (backward's order: the last unit first),
    the root's last."""
    paths = [leaf_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(shapes)]
    units = list(reversed(unit_paths or []))
    owner = [next((i for i, u in enumerate(units) if path[:len(u)] == u), len(units)) for path in paths]
    return [g for g in ([i for i, o in enumerate(owner) if o == k] for k in range(len(units) + 1)) if g]
