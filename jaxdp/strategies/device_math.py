"""The per-device math every strategy's step is written in: it runs inside the step's program, on one device.

``local_grads`` is the forward/backward over micro-batches; the others are the small collectives and
reductions the strategies share (rank 0's buffers, per-device losses, the global sum of squares).
"""

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdp.loss import reductions, task as tasks
from jaxdp.loss.reductions import device_index  # noqa: F401 (the loss layer's: an NNX model's rng keys read it)
from jaxdp.strategies.errors import StrategyError


def local_grads(loss_fn: Callable, params, model_state, batch, rng, accum_steps: int = 1, grad_at=None):
    """Forward/backward on this device's batch, accumulated over micro-batches.

    Mirrors torch's ``no_sync`` loop: each micro-batch's loss is scaled by 1/K, gradients
    are summed locally (the first one is taken as is, like a fresh ``.grad``), and the
    model state (BN running stats) is threaded through the micro-steps.
    ``grad_at``: ``(zeros, put)``: the gradient is taken at ``zeros()`` (made in each micro-step, so
    the compiler sees zeros), which ``put(params, zeros)`` hands the loss beside the params (ZeRO-3's
    unsharded gradients); None: at the params.
    Returns (mean micro-batch loss, summed grads, new model_state, mean metrics).
    """

    def micro_step(p, ms, b, key):
        def scaled(p):
            loss, (new_ms, metrics) = reductions.micro_batch_loss(loss_fn, p, ms, b, key)
            return loss / accum_steps, (loss, new_ms, metrics)

        if grad_at is None:
            grads, (loss, ms, metrics) = jax.grad(scaled, has_aux=True)(p)
        else:
            zeros, put = grad_at
            grads, (loss, ms, metrics) = jax.grad(lambda z: scaled(put(p, z)), has_aux=True)(zeros())
        return grads, ms, loss, metrics

    size = tasks.batch_size(batch)
    if size % accum_steps:
        raise StrategyError(f"per-device batch {size} is not divisible by {accum_steps} accumulation steps")
    micro = jax.tree_util.tree_map(lambda x: x.reshape(accum_steps, size // accum_steps, *x.shape[1:]), batch)
    keys = jax.random.split(rng, accum_steps)
    try:
        return _accumulate(micro_step, params, model_state, micro, keys, accum_steps)
    except reductions.NeedWeightTotals:  # the loss calls jaxdp.global_mean: its W over all micro-batches first
        with reductions.weight_totals(loss_fn, params, model_state, micro, keys):
            return _accumulate(micro_step, params, model_state, micro, keys, accum_steps)


def _accumulate(micro_step, params, model_state, micro, keys, accum_steps: int):
    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    grads, model_state, loss, metrics = micro_step(params, model_state, first, keys[0])
    if accum_steps == 1:
        return loss, grads, model_state, metrics

    # The first micro-step seeds the carry, so every carried value is already
    # per-device ("varying") and the scan's carry types line up.
    def body(carry, xs):
        g_acc, ms, loss_acc, m_acc = carry
        b, key = xs
        g, ms, loss, m = micro_step(params, ms, b, key)
        add = lambda a, c: jax.tree_util.tree_map(jnp.add, a, c)  # noqa: E731
        return (add(g_acc, g), ms, loss_acc + loss, add(m_acc, m)), None

    rest = jax.tree_util.tree_map(lambda x: x[1:], micro)
    (grads, model_state, loss_sum, metric_sum), _ = jax.lax.scan(
        body, (grads, model_state, loss, metrics), (rest, keys[1:]))
    metrics = jax.tree_util.tree_map(lambda m: m / accum_steps, metric_sum)
    return loss_sum / accum_steps, grads, model_state, metrics


def broadcast_from(tree, axis, source: int = 0):
    """Every device gets ``source``'s value (torch's broadcast). Exact: adds zeros."""
    is_source = jax.lax.axis_index(axis) == source
    return jax.tree_util.tree_map(
        lambda x: jax.lax.psum(jnp.where(is_source, x, jnp.zeros_like(x)), axis), tree
    )


def ddp_buffers(model_state, axis, sync_bn: bool):
    """The model state (BN running stats, ...) after a step.

    DDP broadcasts rank 0's buffers before every forward, so they follow rank 0's
    trajectory; with SyncBN they are already identical on every device.
    """
    return model_state if sync_bn else broadcast_from(model_state, axis)


def per_device(x, axis):
    """A vector of each device's scalar ``x`` (for per-rank losses)."""
    n = jax.lax.axis_size(axis)
    return jax.lax.psum(jax.nn.one_hot(jax.lax.axis_index(axis), n, dtype=x.dtype) * x, axis)


def train_metrics(loss, metrics, axis, grads=None):
    """Global mean loss and user metrics, each device's loss, and (parity checks) the averaged grads."""
    n = jax.lax.axis_size(axis)
    out = {name: jax.lax.psum(m, axis) / n for name, m in metrics.items()}
    out.update(loss=jax.lax.psum(loss, axis) / n, loss_per_device=per_device(loss, axis))
    if grads is not None:
        out["grads"] = grads
    return out


def sum_of_squares(tree, specs):
    """The sum of squares over the whole model of a tree whose leaves are cut as ``specs`` say: each
    device's sum, summed over the mesh axes its part is cut along, one psum per set of axes.
    ZeRO's padding is zero and adds nothing."""
    sums = {}
    for g, spec in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, P))):
        axes = tuple(sorted({a for entry in spec if entry for a in as_tuple(entry)}))
        g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
        sums[axes] = sums.get(axes, 0.0) + jnp.sum(g * g)
    return sum(jax.lax.psum(v, axes) if axes else v for axes, v in sums.items())


def as_tuple(axes):
    return axes if isinstance(axes, tuple) else (axes,)
