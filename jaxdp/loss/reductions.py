"""Reductions over the whole model or the whole global batch, right under every layout.

Inside a strategy's step each device holds only part of what a global reduction needs:
ZeRO's optimizer sees a chunk of every gradient, tensor parallelism a slice, and the loss
one device's micro-batch. Two helpers make such reductions exact whatever the strategy,
mesh, device count N and ``accum_steps`` K:

- ``clip_by_global_norm(max_norm)``: an optax transform, torch's ``clip_grad_norm_``;
- ``global_mean(values, weights)``: for the user's ``loss_fn``, the global weighted mean.

How they learn the layout: the strategy traces its step inside ``in_step(context)``, a
``StepContext`` saying which mesh axes the batch is split over, N, K and how to sum squares
over the cut state (one ``psum`` per set of cut axes, as the logged ``grad_norm``). Outside
a step (a plain optax loop, one device) there is no context and both are the ordinary
single-device reduction, so a reference run uses the same code.

Refusing what cannot be sharded: an optax transform that reduces over whole tensors
(``optax.clip_by_global_norm``, ``adaptive_grad_clip``, LAMB/LARS trust ratios,
``apply_if_finite``, ...) would silently reduce over this device's chunk only.
``check_shardable`` finds such a transform before anything runs: it traces ``tx.update``
once on abstract values and follows what the gradients, params and per-parameter state
feed; a reduction (sum, max, dot, sort, ...) over any of them is refused in one line. Going
by the trace rather than a list of names catches user transforms too, and sees every
reduction, where a numeric probe (sharded vs whole update on random values) misses a clip
whose threshold the probe's values do not reach. The reductions made through the context
(this module's) are invisible to the check: they are the sharded ones.
"""

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jax_core


class UnshardableTransformError(ValueError):
    """An optax transform that reduces over whole tensors, under a layout that cuts them."""


class NeedWeightTotals(Exception):
    """``global_mean`` with K > 1 micro-batches before their weight sums are known: ``local_grads``
    catches it, collects them (``weight_totals``) and traces the micro-steps again. So a loss
    without ``global_mean`` costs nothing extra."""


@dataclasses.dataclass
class StepContext:
    """What a strategy's step tells the reductions traced inside it."""

    batch_axes: Any  # the mesh axes the batch is split over (HSDP: ("replica", "data"))
    num_devices: int  # N, the devices the batch is split over; the strategy averages over them
    accum_steps: int = 1  # K micro-batches per device per update, each loss scaled by 1/K
    sum_of_squares: Optional[Callable] = None  # tree as the optimizer sees it -> global sum of squares
    # accum_steps > 1: each global_mean call's global weight sum over the update (local_grads' pre-pass)
    totals: Optional[List[Any]] = None
    collecting: Optional[List[Any]] = None  # the pre-pass: each call's local weight sum
    calls: int = 0  # global_mean calls so far in this micro-batch's loss


_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("jaxdp_step_context", default=None)


def current() -> Optional[StepContext]:
    return _CONTEXT.get()


@contextlib.contextmanager
def in_step(context: Optional[StepContext]):
    """Trace a strategy's step (or the probe of ``check_shardable``) under ``context``."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


def device_index(axes):
    """This device's linear index over ``axes`` (row-major, as the batch is split)."""
    index = 0
    for a in axes if isinstance(axes, tuple) else (axes,):
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return index


# ----------------------------------------------------------------------------- clipping

def global_sum_of_squares(tree):
    """The sum of squares of every entry of ``tree`` over the whole model, whichever device holds which part."""
    context = current()
    if context is not None and context.sum_of_squares is not None:
        return context.sum_of_squares(tree)
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32)))) for x in leaves)


def global_norm(tree):
    """The L2 norm of ``tree`` over the whole model (``optax.global_norm``, sharding-aware)."""
    return jnp.sqrt(global_sum_of_squares(tree))


def clip_by_global_norm(max_norm: float, eps: float = 1e-6) -> optax.GradientTransformation:
    """Scale the updates so that their global L2 norm is at most ``max_norm``: torch's
    ``clip_grad_norm_(params, max_norm)`` (its ``eps``: ``coef = max_norm / (norm + 1e-6)``,
    clamped to 1), computed over the whole model under every strategy.

    ``optax.clip_by_global_norm`` differs in two ways: it has no ``eps``, and under ZeRO or
    tensor parallelism it sees one device's part only (jaxdp refuses it there). Use this one
    first in the chain, on the gradients: ``optax.chain(jaxdp.clip_by_global_norm(1.0), optax.sgd(0.1))``.
    """
    if not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm!r}")

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        coef = jnp.minimum(max_norm / (norm + eps), 1.0)
        return jax.tree_util.tree_map(lambda u: u * coef.astype(u.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# ----------------------------------------------------------------------------- the loss

def global_mean(values, weights=None):
    """The mean of ``values`` weighted by ``weights`` over the whole global batch (every device,
    every micro-batch), for use inside ``loss_fn``: ``loss = jaxdp.global_mean(per_example_loss, mask)``.

    Why it is needed: a strategy averages the per-device losses (DDP's semantics), each of them
    the mean over K micro-batches: the gradient it steps with is (1/(N K)) sum over devices d
    and micro-batches k of grad L_dk. For the gradient of the global weighted mean
    sum_dk S_dk / W (S_dk = sum of w v over micro-batch k of device d, W = sum of every w of
    the update), each micro-batch's loss must be

        L_dk = N K S_dk / W,

    which is what this returns. W must be known at the first micro-batch: with K = 1 it is
    one ``psum`` of the local weight sum over the batch axes; with K > 1 the strategy traces
    ``loss_fn`` once more, forward only, to collect each call's weight sums first
    (``weight_totals``), and that pass feeds nothing but W, so XLA keeps nothing else of it. Weights
    must not depend on the params (they get no gradient). The loss the strategy reports,
    the mean over devices and micro-batches of L_dk, is then the global weighted mean itself.

    Outside a strategy's step: the plain weighted mean. ``weights=None``: every example weighs 1.
    """
    values = jnp.asarray(values)
    weights = jnp.ones_like(values) if weights is None else jnp.broadcast_to(jnp.asarray(weights, values.dtype),
                                                                            values.shape)
    weighted = jnp.sum(values * weights)
    local = jax.lax.stop_gradient(jnp.sum(weights))
    context = current()
    if context is None:
        return weighted / local
    if context.collecting is not None:  # the pre-pass: only the weight sums matter
        context.collecting.append(local)
        return weighted
    if context.accum_steps == 1:
        total = jax.lax.psum(local, context.batch_axes)
    else:
        if context.totals is None:
            raise NeedWeightTotals()
        if context.calls >= len(context.totals):
            raise RuntimeError("jaxdp.global_mean: call it the same number of times on every micro-batch")
        total = context.totals[context.calls]
        context.calls += 1
    return weighted * (context.num_devices * context.accum_steps) / total


def micro_batch_loss(loss_fn, *args):
    """``loss_fn(*args)`` as one micro-batch's loss: ``global_mean`` calls count from the first again."""
    context = current()
    if context is not None:
        context.calls = 0
    return loss_fn(*args)


@contextlib.contextmanager
def weight_totals(loss_fn, params, model_state, micro, keys):
    """With K > 1 micro-batches: the global weight sum of each ``global_mean`` call over the
    whole update, set on the context for the micro-steps traced inside this block.

    ``loss_fn`` runs forward on every micro-batch (a ``lax.map``) with ``global_mean`` only
    recording its local weight sums; those sums, psum'd over the batch axes, are all that
    pass returns, so the rest of it is dead code, dropped before XLA sees it
    (``test_global_mean_pass_over_the_micro_batches_is_compiled_away``).
    """
    context = current()

    def collect(xs):
        b, key = xs
        context.collecting = []
        try:
            loss_fn(params, model_state, b, key)
            return context.collecting
        finally:
            context.collecting = None

    sums = jax.lax.map(collect, (micro, keys))  # one (K,) array per global_mean call
    context.totals = [jax.lax.psum(jnp.sum(s), context.batch_axes) for s in sums]
    try:
        yield
    finally:
        context.totals = None


# ----------------------------------------------------------------------------- refusing

# Primitives that combine several entries of one tensor: over a chunk they give another answer.
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "reduce", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
    "dot_general", "conv_general_dilated", "fft",
})


def check_shardable(tx: optax.GradientTransformation, params, layout: str, context: StepContext) -> None:
    """Raise ``UnshardableTransformError`` if ``tx.update`` reduces over whole tensors.

    ``params``: abstract params (``jax.ShapeDtypeStruct`` tree) with their real tree structure;
    ``layout``: how the strategy cuts them, for the message. Traced under ``context`` (whose
    ``sum_of_squares`` must not reduce: the sharded reductions are not what is looked for).
    """
    opt_state = jax.eval_shape(tx.init, params)
    with in_step(context):
        closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(params, opt_state, params)
    # The gradients, the params and every per-parameter state tensor; not scalars (step counts).
    tainted = [np.ndim(v.aval) > 0 for v in closed.jaxpr.invars]
    found = _reduction_over(closed.jaxpr, tainted)
    if found:
        raise UnshardableTransformError(
            f"the optimizer reduces over whole tensors ({found}), but under {layout} each device holds only a "
            "part of each: for a global-norm clip use jaxdp.clip_by_global_norm; transforms with no sharded "
            "form (adaptive_grad_clip, LAMB/LARS trust ratios, apply_if_finite) need ddp")


def _reduction_over(jaxpr, tainted_in) -> Optional[str]:
    """The first reduction primitive whose non-scalar operand depends on a tainted input, or None."""
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}
    for eqn in jaxpr.eqns:
        hit = [_is_var(v) and v in tainted for v in eqn.invars]
        if not any(hit):
            continue
        name = eqn.primitive.name
        if name in _REDUCTIONS and any(h and np.ndim(v.aval) > 0 for h, v in zip(hit, eqn.invars)):
            return name
        for sub in _sub_jaxprs(eqn.params):
            # Inputs map one to one where the counts agree (jit, custom_jvp, scan); cond's
            # branches take all but the index; otherwise (while) every input counts as tainted.
            n = len(sub.invars)
            sub_hit = hit if n == len(hit) else hit[1:] if n == len(hit) - 1 else [True] * n
            found = _reduction_over(sub, sub_hit)
            if found:
                return found
        tainted.update(eqn.outvars)
    return None


def _sub_jaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax_core.Jaxpr):
                yield item


def _is_var(v) -> bool:
    return not isinstance(v, jax_core.Literal)
