"""What every strategy shares: the per-device forward/backward and the shard_map plumbing.

A strategy says only *where state lives* (``state_specs``) and *where the
collectives go* (``local_step``). Everything here runs per device inside
``jax.shard_map``; the batch is always split over the data axis.

The check_vma gradient trap: params that enter shard_map replicated (``P()``)
would get gradients that autodiff has already summed over the axis, because the
implicit broadcast to "varying" transposes to a psum. ``local_grads`` therefore
takes params it can cast to varying itself, so each device's gradient is its own
and every strategy states its reduction explicitly.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.mesh import DATA_AXIS, shard_batch
from jaxdp.state import TrainState
from jaxdp.strategies import flat


class StrategyError(ValueError):
    """A strategy option or batch shape that cannot work."""


# ----------------------------------------------------------------------------- per-device math

def cross_entropy(logits, labels):
    """Mean cross-entropy, as torch.nn.functional.cross_entropy(reduction='mean')."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def local_grads(model, params, batch_stats, images, labels, accum_steps: int = 1):
    """Forward/backward on this device's batch, accumulated over micro-batches.

    Mirrors torch's ``no_sync`` loop: each micro-batch's loss is scaled by 1/K,
    gradients are summed locally (the first one is taken as is, like a fresh
    ``.grad``), and BN running stats are threaded through the micro-steps.
    Returns (mean micro-batch loss, summed grads, new batch_stats, correct count).
    """

    def micro_step(p, bs, x, y):
        def loss_fn(p):
            logits, updated = model.apply(
                {"params": p, "batch_stats": bs}, x, train=True, mutable=["batch_stats"]
            )
            loss = cross_entropy(logits, y)
            return loss / accum_steps, (loss, updated["batch_stats"], logits)

        grads, (loss, bs, logits) = jax.grad(loss_fn, has_aux=True)(p)
        correct = (jnp.argmax(logits, -1) == y).sum()
        return grads, bs, loss, correct

    if images.shape[0] % accum_steps:
        raise StrategyError(
            f"per-device batch {images.shape[0]} is not divisible by {accum_steps} accumulation steps"
        )
    micro = images.shape[0] // accum_steps
    xs = images.reshape(accum_steps, micro, *images.shape[1:])
    ys = labels.reshape(accum_steps, micro)
    grads, batch_stats, loss, correct = micro_step(params, batch_stats, xs[0], ys[0])
    if accum_steps == 1:
        return loss, grads, batch_stats, correct

    # The first micro-step seeds the carry, so every carried value is already
    # per-device ("varying") and the scan's carry types line up.
    def body(carry, xy):
        g_acc, bs, loss_acc, correct_acc = carry
        g, bs, loss, correct = micro_step(params, bs, *xy)
        g_acc = jax.tree_util.tree_map(jnp.add, g_acc, g)
        return (g_acc, bs, loss_acc + loss, correct_acc + correct), None

    (grads, batch_stats, loss_sum, correct), _ = jax.lax.scan(
        body, (grads, batch_stats, loss, correct), (xs[1:], ys[1:])
    )
    return loss_sum / accum_steps, grads, batch_stats, correct


def broadcast_from(tree, axis, source: int = 0):
    """Every device gets ``source``'s value (torch's broadcast). Exact: adds zeros."""
    is_source = jax.lax.axis_index(axis) == source
    return jax.tree_util.tree_map(
        lambda x: jax.lax.psum(jnp.where(is_source, x, jnp.zeros_like(x)), axis), tree
    )


def ddp_buffers(batch_stats, axis, sync_bn: bool):
    """BN running stats after a step.

    DDP broadcasts rank 0's buffers before every forward, so the running stats
    follow rank 0's trajectory; with SyncBN they are already identical.
    """
    return batch_stats if sync_bn else broadcast_from(batch_stats, axis)


def per_device(x, axis):
    """A vector of each device's scalar ``x`` (for per-rank losses)."""
    n = jax.lax.axis_size(axis)
    return jax.lax.psum(jax.nn.one_hot(jax.lax.axis_index(axis), n, dtype=x.dtype) * x, axis)


def train_metrics(loss, correct, local_count, axis, grads=None):
    """Global loss and accuracy, each device's loss, and (for parity checks) the full averaged grads."""
    n = jax.lax.axis_size(axis)
    metrics = {
        "loss": jax.lax.psum(loss, axis) / n,
        "loss_per_device": per_device(loss, axis),
        "accuracy": jax.lax.psum(correct, axis) / (local_count * n),
    }
    if grads is not None:
        metrics["grads"] = grads
    return metrics


# ----------------------------------------------------------------------------- the interface

class Strategy:
    """Base class: ``init_state(variables) -> state`` and ``step(state, images, labels)``.

    Subclasses define ``state_specs`` (where each part of the TrainState lives)
    and ``local_step`` (the per-device update with its collectives).
    """

    name = "base"
    batch_axes: Any = DATA_AXIS  # mesh axes the batch is split over
    # Which parts this strategy keeps in the flat, padded, sharded layout of ``flat.py``
    # (DDP: none; ZeRO-1/2: the optimizer state; ZeRO-3: the params too).
    flat_params = False
    flat_opt_state = False

    def __init__(self, model, tx: optax.GradientTransformation, mesh, *, accum_steps: int = 1,
                 sync_bn: bool = False, axis: str = DATA_AXIS, return_grads: bool = False):
        if accum_steps < 1:
            raise StrategyError(f"accum_steps must be >= 1, got {accum_steps}")
        if axis not in mesh.axis_names:
            raise StrategyError(f"mesh has axes {mesh.axis_names}, strategy {self.name} needs {axis!r}")
        self.mesh = mesh
        self.axis = axis
        self.num_devices = int(np.prod([mesh.shape[a] for a in _as_tuple(self.batch_axes)]))
        self.shards = mesh.shape[axis]  # chunks of the flat layout (HSDP: the shard group's size)
        self.shapes = None  # the full params' shapes, known once a state is built
        self.tx = tx
        self.accum_steps = accum_steps
        self.sync_bn = sync_bn
        # Parity checks compare the averaged gradients too; off in training (it costs memory).
        self.return_grads = return_grads
        self.model = _with_bn_axis(model, self.batch_axes if sync_bn else None)
        self._jit_step = None
        self._jit_eval = None

    # -- placement ---------------------------------------------------------------------------
    def state_specs(self, state: TrainState):
        """PartitionSpec tree (or prefix) for the state. Default: replicated."""
        return P()

    def init_state(self, variables) -> TrainState:
        params = variables["params"]
        self.shapes = flat.shapes_of(params)
        state = TrainState(
            step=jnp.zeros((), jnp.int32), params=params,
            batch_stats=variables.get("batch_stats", {}), opt_state=self.tx.init(params),
            extra=self.init_extra(params),
        )
        return self.place(state)

    def init_extra(self, params):
        return None

    def place(self, state: TrainState) -> TrainState:
        """Put a host/global state onto the mesh with this strategy's layout.

        Always copies: ``step`` donates its state, which must never delete the
        caller's own arrays (e.g. the initial variables they keep for reference).
        """
        # may_alias=False alone still aliased device 0's buffer in JAX 0.10.2.
        state = jax.tree_util.tree_map(jnp.copy, state)
        return jax.device_put(state, self.state_shardings(state), may_alias=False)

    def state_shardings(self, state):
        specs = self.state_specs(state)
        return jax.tree_util.tree_map(
            lambda spec: NamedSharding(self.mesh, spec), _broadcast_prefix(specs, state),
            is_leaf=lambda x: isinstance(x, P),
        )

    def shard_batch(self, images: np.ndarray, labels: np.ndarray, mask: Optional[np.ndarray] = None):
        out = [shard_batch(self.mesh, images, self.batch_axes), shard_batch(self.mesh, labels, self.batch_axes)]
        if mask is not None:
            out.append(shard_batch(self.mesh, mask, self.batch_axes))
        return tuple(out)

    # -- canonical form (checkpoints, parity) ---------------------------------------------------
    def canonical(self, state: TrainState) -> TrainState:
        """The state in the plain DDP layout: full params and optimizer state.

        A copy, as every strategy's: the next ``step`` donates (deletes) the state's arrays.
        """
        return jax.tree_util.tree_map(jnp.copy, state)

    def from_canonical(self, state: TrainState) -> TrainState:
        self.shapes = flat.shapes_of(state.params)
        return self.place(state)

    # -- the checkpoint layout -----------------------------------------------------------------
    # Checkpoints hold every strategy's state in ZeRO-3's layout: params and per-parameter
    # optimizer state flat, padded and sharded over the data axis (``flat.py``); step, BN
    # buffers and ``extra`` as the strategy keeps them. So each device writes only its own
    # chunks, and saving or restoring never puts more on a device than the strategy keeps
    # there (a ZeRO-3 model that fits only sharded can be checkpointed). The same files
    # restore onto any strategy and any device count: orbax pads or truncates each flat
    # array to the new count's padding, and only padding (zeros) changes.
    def stored(self, state: TrainState) -> TrainState:
        """This strategy's state -> the checkpoint layout (each strategy flattens what it keeps whole)."""
        return flat.to_flat_state(state, self.tx, self.shards, self.stored_shardings,
                                  params=not self.flat_params, opt_state=not self.flat_opt_state)

    def from_stored(self, stored: TrainState) -> TrainState:
        """The checkpoint layout (padded for this device count) -> this strategy's state."""
        if self.shapes is None:
            raise StrategyError(f"{self.name}: build a state with init_state first (it fixes the params' shapes)")
        return flat.from_flat_state(stored, self.tx, self.shapes, self.state_shardings,
                                    params=not self.flat_params, opt_state=not self.flat_opt_state)

    def stored_target(self, state: TrainState):
        """Shapes, dtypes and shardings of ``stored(state)``, computing nothing: what a restore fills."""
        shapes = jax.eval_shape(self.stored, state)
        return jax.tree_util.tree_map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                      shapes, self.stored_shardings(shapes))

    def stored_shardings(self, stored):
        specs = _broadcast_prefix(self.state_specs(stored), stored)
        chunks = P(self.axis)
        specs = specs.replace(params=jax.tree_util.tree_map(lambda _: chunks, stored.params),
                              opt_state=flat.opt_state_specs(stored.opt_state, chunks, P()))
        return jax.tree_util.tree_map(lambda spec: NamedSharding(self.mesh, spec), specs,
                                      is_leaf=lambda x: isinstance(x, P))

    # -- compiled entry points -----------------------------------------------------------------
    def local_step(self, state: TrainState, images, labels):
        raise NotImplementedError

    def eval_logits(self, state: TrainState, images):
        """The model in eval mode (BN running stats) on this device's images (ZeRO-3 gathers per unit)."""
        return _with_bn_axis(self.model, None).apply(
            {"params": state.params, "batch_stats": state.batch_stats}, images, train=False)

    def _step_fn(self, state: TrainState):
        """The jitted, shard_mapped step, built on first use (its specs need the state)."""
        if self._jit_step is None:
            specs = self.state_specs(state)
            batch = P(self.batch_axes)
            self._jit_step = jax.jit(
                jax.shard_map(self.local_step, mesh=self.mesh, in_specs=(specs, batch, batch),
                              out_specs=(specs, P())),
                donate_argnums=0,
            )
        return self._jit_step

    def step(self, state: TrainState, images, labels):
        return self._step_fn(state)(state, images, labels)

    def lower_step(self, state: TrainState, images, labels):
        """The lowered training step, for HLO and memory inspection."""
        return self._step_fn(state).lower(state, images, labels)

    def evaluate(self, state: TrainState, images, labels, mask):
        """Summed loss, correct count and sample count over the global batch (mask drops padding)."""
        if self._jit_eval is None:
            batch = P(self.batch_axes)
            self._jit_eval = jax.jit(jax.shard_map(
                self._local_eval, mesh=self.mesh,
                in_specs=(self.state_specs(state), batch, batch, batch), out_specs=P(),
            ))
        return self._jit_eval(state, images, labels, mask)

    def _local_eval(self, state, images, labels, mask):
        logits = self.eval_logits(state, images)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        weight = mask.astype(losses.dtype)
        correct = (jnp.argmax(logits, -1) == labels).astype(losses.dtype)
        return {
            "loss_sum": jax.lax.psum((losses * weight).sum(), self.batch_axes),
            "correct": jax.lax.psum((correct * weight).sum(), self.batch_axes),
            "count": jax.lax.psum(weight.sum(), self.batch_axes),
        }


def _with_bn_axis(model, axis):
    """The model with BatchNorm statistics over ``axis`` (None: per device). BN-free models pass through."""
    return model.clone(bn_axis_name=axis) if hasattr(model, "bn_axis_name") else model


def _as_tuple(axes):
    return axes if isinstance(axes, tuple) else (axes,)


def _broadcast_prefix(prefix, tree):
    """Expand a PartitionSpec prefix so it has one spec per leaf of ``tree``."""
    if isinstance(prefix, P):
        return jax.tree_util.tree_map(lambda _: prefix, tree)
    return jax.tree_util.tree_map(
        lambda spec, sub: _broadcast_prefix(spec, sub), prefix, tree,
        is_leaf=lambda x: isinstance(x, P),
    )
