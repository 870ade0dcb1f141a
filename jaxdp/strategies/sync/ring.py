"""Ring collectives written with ``jax.lax.ppermute``, for use inside ``jax.shard_map``.

The textbook bandwidth-optimal all-reduce (Patarasuk & Yuan; what NCCL and gloo
run for large buffers), spelled out so every hop is visible in the program:

- ``ring_reduce_scatter``: the flat buffer, zero-padded to a multiple of N, is
  cut into N chunks. In N-1 steps each device passes a partial sum one place
  to the right and adds its own copy of the chunk it receives; afterwards device
  i holds the full sum of chunk i (the layout of ``psum_scatter(tiled=True)``).
- ``ring_all_gather``: in N-1 more steps each device forwards the chunk it
  received last, so every device ends with every chunk.
- ``ring_all_reduce`` = reduce-scatter then all-gather, unpadded and reshaped.

Each step sends one chunk of ``ceil(S/N)`` elements, so per device an
all-reduce sends 2(N-1)·ceil(S/N) elements, i.e. 2(N-1)/N·S bytes up to the
padding, and a reduce-scatter or all-gather half that. The loops are Python
loops (N is static), so the compiled program holds 2(N-1) separate
``collective-permute`` ops that tests can count and size.

Summation order: chunk c is summed around the ring starting at device c+1,
((x[c+1] + x[c+2]) + ...) + x[c], rounding to the buffer dtype at every hop,
as a ring implementation does. ``psum`` on XLA:CPU sums in device order (and
promotes bf16 to f32 first; f16 stays f16), so float results can differ in the last bits.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp import names


def _ring(axis):
    n = jax.lax.axis_size(axis)
    return n, jax.lax.axis_index(axis), [(j, (j + 1) % n) for j in range(n)]


def _chunks(x, n):
    """x flattened, zero-padded to a multiple of n, as an (n, ceil(size/n)) array."""
    flat = x.ravel()
    chunk = -(-flat.size // n)
    return jnp.pad(flat, (0, chunk * n - flat.size)).reshape(n, chunk)


def _row(a, index):
    return jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False)


def ring_reduce_scatter(x, axis):
    """Device i gets chunk i of the sum over ``axis`` of ``x`` (flattened, padded): shape (ceil(size/N),)."""
    n, i, right = _ring(axis)
    chunks = _chunks(x, n)
    if n == 1:
        return chunks[0]
    # Step s: send the partial sum of chunk (i-1-s) mod n, receive chunk (i-2-s) mod n
    # from the left neighbour and add our own copy. After n-1 steps: chunk i, complete.
    acc = _row(chunks, (i - 1) % n)
    for s in range(n - 1):
        acc = jax.lax.ppermute(acc, axis, right) + _row(chunks, (i - 2 - s) % n)
    return acc


def ring_all_gather(chunk, axis):
    """Inverse layout of ``ring_reduce_scatter``: device i holds chunk i; every device gets all, shape (N, c)."""
    n, i, right = _ring(axis)
    out = jnp.zeros((n,) + chunk.shape, chunk.dtype)
    out = jax.lax.dynamic_update_index_in_dim(out, chunk, i, 0)
    for s in range(n - 1):
        # Forward what arrived last step (our own chunk first): chunk (i-1-s) mod n arrives.
        chunk = jax.lax.ppermute(chunk, axis, right)
        out = jax.lax.dynamic_update_index_in_dim(out, chunk, (i - 1 - s) % n, 0)
    return out


def ring_all_reduce(x, axis):
    """The sum of ``x`` over ``axis`` on every device (same shape and dtype as ``x``)."""
    n = jax.lax.axis_size(axis)
    if n == 1:
        return x
    full = ring_all_gather(ring_reduce_scatter(x, axis), axis)
    return full.ravel()[: x.size].reshape(x.shape)


def ring_all_reduce_many(tree, axis):
    """``ring_all_reduce`` of every array of ``tree`` at once: packed into one buffer, one
    ring (a DDP bucket), then cut back into the tree's arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    packed = ring_all_reduce(jnp.concatenate([x.ravel() for x in leaves]), axis)
    parts = jnp.split(packed, np.cumsum([x.size for x in leaves])[:-1])
    return treedef.unflatten([p.reshape(x.shape) for p, x in zip(parts, leaves)])


ALL_REDUCES = names.ALLREDUCES  # what each name runs is below


def all_reduce_fn(name: str):
    """The SUM all-reduce of a pytree (one collective for all of it) a strategy asked for by
    name: ``psum`` (XLA's, variadic) or ``ring`` (the ppermutes above)."""
    if name == "psum":
        return jax.lax.psum
    if name == "ring":
        return ring_all_reduce_many
    raise ValueError(f"unknown allreduce {name!r}; choose one of {', '.join(ALL_REDUCES)}")
