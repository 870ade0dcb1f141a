"""Where sharded state lives: every tensor split along one of its own dimensions.

ZeRO keeps each parameter (ZeRO-3) and each per-parameter optimizer tensor
(ZeRO-1/2/3) as N chunks over the ``data`` axis. The chunks are cut along one
dimension of the tensor itself, as FSDP2 does (it replaced FSDP1's flat
parameter for this reason):

- **sharded init needs it.** ``jit(model.init, out_shardings=...)`` with a
  per-dimension sharding lets XLA generate each device's slice of the random
  params on that device (``jax_threefry_partitionable``): the 18-layer CIFAR CNN (11.2 M params) at N = 8
  builds params + Adam state in 24.8 MiB per device, bit-identical to an
  unsharded init. A flat layout (ravel, pad, cut) cannot be partitioned that
  way: the same init would materialise 168 MiB per device.
- **it composes with other axes** (tensor parallelism shards another dim).

Which dimension: the largest one that N divides (HWIO conv kernels: the channel
dims, never the 3-row kernel height). A tensor with no such dimension is padded
with zeros along its largest dimension to a multiple of N (FSDP2 pads dim 0).
Padding costs at most N-1 slices per tensor, stays zero through training (its
gradient is zero, and the elementwise optimizers keep zeros zero), and is
dropped by ``unpad``. Scalars are replicated. The rule depends only on the
shape and N, so an optimizer tensor shaped like its parameter gets the same
spec without knowing which parameter it mirrors.
"""

from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdp.strategies.ties import in_order


def shard_dim(shape: Sequence[int], n: int) -> Optional[int]:
    """The dimension a tensor of ``shape`` is cut along for ``n`` shards (None: scalar, replicated)."""
    if len(shape) == 0:
        return None
    divisible = [d for d in range(len(shape)) if shape[d] % n == 0]
    candidates = divisible or range(len(shape))
    return max(candidates, key=lambda d: (shape[d], -d))


def padded_shape(shape: Sequence[int], n: int) -> Tuple[int, ...]:
    d = shard_dim(shape, n)
    if d is None:
        return tuple(shape)
    return tuple(-(-s // n) * n if i == d else s for i, s in enumerate(shape))


def spec(shape: Sequence[int], n: int, axis) -> P:
    """The PartitionSpec of a (padded) tensor of ``shape`` sharded ``n`` ways over ``axis``."""
    d = shard_dim(shape, n)
    if d is None:
        return P()
    return P(*([None] * d + [axis]))


def pad(x, n: int):
    """``x`` zero-padded along its shard dimension to ``padded_shape``."""
    target = padded_shape(x.shape, n)
    if tuple(x.shape) == target:
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, target)])


def unpad(x, shape: Sequence[int]):
    """Inverse of ``pad``: the leading ``shape`` of a padded tensor."""
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, s) for s in shape)]


def tree_specs(tree, n: int, axis):
    return jax.tree_util.tree_map(lambda x: spec(np.shape(x), n, axis), tree)


def shapes_of(tree):
    """Shapes and the dtypes jax will hold: numpy's int64 labels are int32 unless x64 is on (as
    ``device_put`` makes them), so tracing with them neither warns nor differs from the step."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(x.dtype)), tree)


def zeros(shapes):
    """Arrays of ``shapes`` for tracing ``model.init``: only their shapes matter, and zeros cost nothing under jit."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# ----------------------------------------------------------------------------- inside shard_map

def my_chunk(x, axis, n: int):
    """This device's chunk of a tensor every device holds whole (ZeRO-1/2's params and grads)."""
    d = shard_dim(x.shape, n)
    if d is None:
        return x
    x = pad(x, n)
    size = x.shape[d] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, axis=d)


def gather(chunk, shape: Sequence[int], axis, n: int, to: str = "varying"):
    """The whole tensor of ``shape`` from every device's chunk: one all-gather.

    ``to="varying"`` transposes to a reduce-scatter (ZeRO-3's backward);
    ``"invarying"`` says every device now holds the same value.
    """
    d = shard_dim(shape, n)
    if d is None:
        return chunk
    return unpad(jax.lax.all_gather(chunk, axis, axis=d, tiled=True, to=to), shape)


def gather_as(chunk, shape: Sequence[int], axis, n: int, dtype=None, reduce_dtype=None):
    """``gather`` (to="varying") moving ``dtype`` values: the chunk is cast before the all-gather and the
    whole tensor cast back to the chunk's dtype after it, so only the values move narrower. A caller
    that casts the tensor to ``dtype`` again gets the very values it got from the plain gather (the
    cast is elementwise; the compiler folds the exact round trip), and its gradient is the same
    program as before: the cotangent arrives in the chunk's dtype. The transpose reduce-scatters in
    ``reduce_dtype`` (None: the chunk's dtype)."""
    dtype = jnp.dtype(dtype or chunk.dtype)
    reduce_dtype = jnp.dtype(reduce_dtype or chunk.dtype)
    if shard_dim(shape, n) is None or dtype == reduce_dtype == chunk.dtype:
        return gather(chunk, shape, axis, n)

    @jax.custom_vjp
    def gathered(c):
        return gather(c.astype(dtype), shape, axis, n).astype(c.dtype)

    def forward(c):
        return gathered(c), c  # the chunk only for its type: the transpose reads no value of it

    def backward(c, ct):
        transpose = jax.linear_transpose(lambda x: gather(x, shape, axis, n), c.astype(reduce_dtype))
        return (transpose(ct.astype(reduce_dtype))[0].astype(c.dtype),)

    gathered.defvjp(forward, backward)
    return gathered(chunk)


def gather_unsharded_grad(chunk, unsharded, shape: Sequence[int], axis, n: int, dtype=None):
    """``gather_as``'s tensor, whose gradient goes whole to ``unsharded`` (zeros of the full shape, in the
    chunk's dtype) and none to the chunk: no reduce-scatter. ZeRO-3's ``accum_reduce="once"`` sums these
    unsharded gradients over the micro-batches and reduce-scatters the sum once per update."""
    @jax.custom_vjp
    def seen_by(whole, value):
        return value

    def backward(_, ct):
        return ct.astype(unsharded.dtype), jnp.zeros_like(ct)

    seen_by.defvjp(lambda whole, value: (value, None), backward)
    return seen_by(unsharded, gather_as(jax.lax.stop_gradient(chunk), shape, axis, n, dtype))


def gather_group(chunks: Sequence, shapes: Sequence[Sequence[int]], axis, n: int, to: str = "invarying") -> List:
    """Whole tensors from chunks, the group moving as ONE all-gather (a DDP-sized bucket).

    Each chunk is laid out with its shard dimension first and flattened, so device i's
    chunks concatenate into one row; the gathered (n, row) matrix is cut back apart.
    """
    if n == 1:
        # One device's bucket is no collective: XLA drops the all-gather, and the bucket's concatenate
        # then feeds every slice cut from it, which XLA:GPU fuses into each one: an 18-layer CNN's zero1 step
        # compiled for one H100 in 105 s instead of 18 (2 cores). Tensor by tensor, nothing is concatenated.
        return [gather(c, s, axis, n, to) for c, s in zip(chunks, shapes)]
    if any(len(s) == 0 for s in shapes):  # replicated scalars need no gathering
        return _split_scalars(lambda cs, ss: gather_group(cs, ss, axis, n, to), chunks, shapes, lambda c: c)
    dims = [shard_dim(s, n) for s in shapes]
    rows = [jnp.moveaxis(c, d, 0).reshape(-1) for c, d in zip(chunks, dims)]
    matrix = jax.lax.all_gather(jnp.concatenate(rows), axis, tiled=False, to=to)  # (n, sum of rows)
    out = []
    for part, c, d, shape in zip(jnp.split(matrix, np.cumsum([r.size for r in rows])[:-1], axis=1),
                                 chunks, dims, shapes):
        moved = jnp.moveaxis(c, d, 0).shape
        full = part.reshape((n * moved[0],) + moved[1:])
        out.append(unpad(jnp.moveaxis(full, 0, d), shape))
    return out


def scatter(full, axis, n: int):
    """This device's chunk of the SUM over ``axis`` of one tensor: one reduce-scatter (a scalar: summed)."""
    d = shard_dim(np.shape(full), n)
    if d is None:
        return jax.lax.psum(full, axis)
    return jax.lax.psum_scatter(pad(full, n), axis, scatter_dimension=d, tiled=True)


def scatter_group(fulls: Sequence, axis, n: int) -> List:
    """This device's chunk of the SUM over ``axis`` of each tensor, the group moving as ONE
    reduce-scatter (the inverse layout of ``gather_group``); on one device, tensor by tensor
    (``gather_group`` says why)."""
    if n == 1:
        return [scatter(x, axis, n) for x in fulls]
    if any(np.ndim(x) == 0 for x in fulls):  # replicated scalars: summed whole
        return _split_scalars(lambda xs, _: scatter_group(xs, axis, n), fulls, [np.shape(x) for x in fulls],
                              lambda x: jax.lax.psum(x, axis))
    padded = [pad(x, n) for x in fulls]
    dims = [shard_dim(x.shape, n) for x in padded]
    mats = [jnp.moveaxis(x, d, 0).reshape(n, -1) for x, d in zip(padded, dims)]
    mine = jax.lax.psum_scatter(jnp.concatenate(mats, axis=1), axis, scatter_dimension=0, tiled=False)
    out = []
    for part, x, d in zip(jnp.split(mine, np.cumsum([m.shape[1] for m in mats])[:-1]), padded, dims):
        moved = jnp.moveaxis(x, d, 0).shape
        out.append(jnp.moveaxis(part.reshape((moved[0] // n,) + moved[1:]), 0, d))
    return out


def _split_scalars(fn, xs, shapes, on_scalar):
    """``fn`` on the non-scalar members of a group, ``on_scalar`` on each scalar, in order."""
    tensors = [i for i, s in enumerate(shapes) if len(s)]
    done = fn([xs[i] for i in tensors], [shapes[i] for i in tensors]) if tensors else []
    out = [on_scalar(x) if len(s) == 0 else None for x, s in zip(xs, shapes)]
    for i, y in zip(tensors, done):
        out[i] = y
    return out


def map_groups(fn, tree, groups, *per_leaf):
    """Apply ``fn`` (a list of leaves -> a list of leaves) to each group of leaf indices of ``tree``, one
    group after another (``ties.in_order``: one collective per group, never merged by XLA); each list of
    ``per_leaf`` (one entry per leaf, e.g. its whole shape) is passed cut to the group too."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = [None] * len(leaves)
    cut = [[[side[i] for i in group] for group in groups] for side in per_leaf]
    for group, ys in zip(groups, in_order(fn, [[leaves[i] for i in group] for group in groups], *cut)):
        for i, y in zip(group, ys):
            out[i] = y
    return jax.tree_util.tree_unflatten(treedef, out)
