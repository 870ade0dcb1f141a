"""Data dependences that put collectives in order: the one way to tell XLA when a collective may run.

XLA is free to move and merge collectives that do not depend on each other: its latency-hiding
scheduler hoists a gather to the start of the step if nothing holds it back (every unit's params
alive at once), and its combiners merge independent collectives of a kind into one (XLA:GPU
merged ZeRO-3's eight per-unit reduce-scatters into one after the whole backward, and DDP's
buckets into two all-reduces). Compiler flags change from version to version; a data dependence
holds in every one. ``after(tree, xs)`` is ``tree`` unchanged in value, but computable only once
every float array of ``xs`` exists: ``tree + 0 * x[0]``. XLA folds ``x * 0`` for integers only (for
floats NaN * 0 is NaN), so the dependence stays; a NaN in ``xs`` would reach ``tree``, but then the
step is lost anyway. It ties on *every* array of ``xs``: tied to one of them, the combiner could
still merge the others with what waits.

``in_order(fn, groups)`` runs ``fn`` on groups of arrays one after another, each group's inputs
tied to the previous group's outputs: DDP's buckets and ZeRO's reduce-scatter and gather buckets
stay one collective each, issued as their gradients are ready, never merged into one at the end.
"""

from typing import Callable, List, Sequence

import jax
import jax.numpy as jnp

from jaxdp.parallel.protocol import varying_axes


def floats(tree) -> list:
    """Every float array of ``tree`` (None and integer leaves skipped)."""
    return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def zero_of(xs):
    """A float32 scalar zero computed from the first element of every float array of ``xs``
    (none: a constant zero). Inside shard_map it varies over every mesh axis whatever ``xs`` vary
    over, so that two zeros made from different values have one type (a ``custom_vjp`` cotangent
    must have its primal's)."""
    parts = [0 * x.reshape(-1)[0].astype(jnp.float32) for x in floats(xs)]
    zero = sum(parts[1:], parts[0]) if parts else jnp.zeros((), jnp.float32)
    uniform = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a not in varying_axes(zero))
    return jax.lax.pcast(zero, uniform, to="varying") if uniform else zero


def after(tree, xs):
    """``tree``, unchanged in value, computable only once every float array of ``xs`` exists."""
    if not floats(xs):
        return tree
    zero = zero_of(xs)
    return jax.tree_util.tree_map(
        lambda c: c + zero.astype(c.dtype) if jnp.issubdtype(c.dtype, jnp.inexact) else c, tree)


def in_order(fn: Callable[..., List], groups: Sequence[List], *per_group: Sequence) -> List[List]:
    """``[fn(group, *extras) for group, *extras in zip(groups, *per_group)]``, each group's inputs tied
    to the previous group's outputs."""
    out, previous = [], None
    for group, *extras in zip(groups, *per_group):
        previous = fn(after(list(group), previous) if previous is not None else list(group), *extras)
        out.append(previous)
    return out
