"""ZeRO's syncs: each device ends a step with only its chunk of the averaged gradient.

Against ``allreduce.AllReduce`` (every device gets the whole average):

- ``ReduceScatter`` (zero2): one ``psum_scatter(g / N)`` per DDP bucket: each device receives
  the averaged chunk it updates (torch FSDP with ``reshard_after_forward=False``);
- ``GatherOnUse`` (zero3, hsdp): the params are chunks at rest, gathered per FSDP unit just
  before use (``strategies/units.py``). The gathers' transposes have reduce-scattered (summed) the
  gradient over the shard group already, so the sync divides by N and, under HSDP, sums the
  chunks across the replicas: ``psum(g / N, "replica")``.

``all_gather`` is the way back for params that are whole at rest (zero1, zero2): the updated
chunks gathered into whole tensors, one all-gather per bucket.
"""

import jax

from jaxdp.strategies import layout
from jaxdp.strategies.sync import Stateless, Where


class ReduceScatter(Stateless):
    def update(self, grads, state, where: Where):
        scaled = jax.tree_util.tree_map(lambda g: g / where.n, grads)
        return layout.map_groups(lambda gs: layout.scatter_group(gs, where.axis, where.shards), scaled,
                                 where.groups), state


class GatherOnUse(Stateless):
    def __init__(self, replica_axis=None, reduce_dtype=None):
        self.replica_axis = replica_axis  # HSDP's: the chunks are summed across the replicas
        self.reduce_dtype = reduce_dtype  # ... in this dtype (None: the gradients' own), as FSDP2's reduce_dtype

    def update(self, grads, state, where: Where):
        grads = jax.tree_util.tree_map(lambda g: g / where.n, grads)
        if not self.replica_axis:
            return grads, state
        if self.reduce_dtype is None:
            return jax.lax.psum(grads, self.replica_axis), state
        return jax.tree_util.tree_map(
            lambda g: jax.lax.psum(g.astype(self.reduce_dtype), self.replica_axis).astype(g.dtype), grads), state


def all_gather(chunks, shapes, groups, axis, shards: int):
    """Whole tensors (of ``shapes``, one per leaf) from every device's chunks, one all-gather per group."""
    return layout.map_groups(lambda cs, ss: layout.gather_group(cs, ss, axis, shards), chunks, groups, shapes)
