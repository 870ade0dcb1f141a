"""Which params a loss reads only through one cast to a narrower float: ZeRO-3 gathers those already cast.

A model that computes in bfloat16 on float32 params (Flax's ``dtype=bfloat16, param_dtype=float32``)
casts each weight where it uses it. The cast is elementwise and an all-gather only moves values, so
casting a chunk before the gather gives the very values the model would cast after it, in half the
bytes (FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16)``). Which params qualify is read from
the loss itself, traced once on shapes: a param qualifies when its one use is a single
``convert_element_type`` to a narrower float (looking through calls: ``jit``, custom derivatives,
remat, and the ``pvary`` casts of shard_map's types). A param used as is (the norm layers' scale
and shift, which jaxdp's BatchNorm and Flax's LayerNorm apply in float32) or cast twice stays as
it is: twice, its two bfloat16 cotangents are summed in float32 today and would be summed in
bfloat16, so the gradient would change; as is, its value would.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxdp.loss import reductions

# Primitives that pass their operands through with another shard_map type only.
_TYPE_ONLY = {"pvary", "pcast"}


def single_casts(loss_fn, shapes, *args):
    """The tree of ``shapes`` (params' ShapeDtypeStructs) with, per leaf, the narrower float dtype the
    loss casts it to once and uses only so, or None."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    with reductions.in_step(None):  # outside the step's bookkeeping: global_mean, say, counts nothing here
        jaxpr = jax.make_jaxpr(lambda ps: loss_fn(jax.tree_util.tree_unflatten(treedef, ps), *args))(leaves).jaxpr
    return jax.tree_util.tree_unflatten(treedef, [_cast_of(jaxpr, v) for v in jaxpr.invars[:len(leaves)]])


def none_of(shapes):
    """``single_casts``' tree with no cast for any leaf: every param gathered as it is stored."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    return jax.tree_util.tree_unflatten(treedef, [None] * len(leaves))


def _cast_of(jaxpr, var) -> Optional[jnp.dtype]:
    uses = _uses(jaxpr, var)
    if len(uses) != 1 or uses[0] is None:
        return None
    narrower = uses[0]
    wide = jnp.dtype(var.aval.dtype)
    if jnp.issubdtype(narrower, jnp.floating) and narrower.itemsize < wide.itemsize:
        return narrower
    return None


def _uses(jaxpr, var) -> list:
    """Each use of ``var``: the dtype a cast makes of it, or None for any other use."""
    found = [None for out in jaxpr.outvars if out is var]
    for eqn in jaxpr.eqns:
        for i, x in enumerate(eqn.invars):
            if x is not var:
                continue
            name = eqn.primitive.name
            if name == "convert_element_type":
                found.append(jnp.dtype(eqn.params["new_dtype"]))
            elif name in _TYPE_ONLY and len(eqn.outvars) == len(eqn.invars):
                found += _uses(jaxpr, eqn.outvars[i])
            else:
                inner = _inner_jaxpr(eqn)
                found += _uses(inner, inner.invars[i]) if inner is not None else [None]
    return found


def _inner_jaxpr(eqn):
    """The jaxpr a call-like equation runs on its operands, one for one (None: not such a call)."""
    for key in ("jaxpr", "call_jaxpr"):
        inner = eqn.params.get(key)
        if isinstance(inner, jcore.ClosedJaxpr):
            inner = inner.jaxpr
        if isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(eqn.invars):
            return inner
    return None
