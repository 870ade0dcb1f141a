"""A strategy's state in its three layouts, and the conversions between them.

- **the strategy's own** (what its step reads): ``Placement``'s specs, ZeRO's chunks padded,
  model slices in device order, pipeline stages stacked;
- **canonical** (DDP's): full params and optimizer state, replicated. Parity checks, tests and
  ``from_canonical`` (a state from torch or a single device) speak it;
- **stored** (checkpoints): canonical shapes, each tensor cut over the data axis along a dimension
  N divides (``stored_specs``), so each device writes only its part and any strategy at any N
  can read it; ``extra`` in a form that does not depend on the device count.

Every conversion is one jitted program per (kind, state structure and shapes), cached on the strategy.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.parallel import pipeline
from jaxdp.strategies.state import TrainState
from jaxdp.strategies import layout
from jaxdp.strategies.errors import StrategyError


def need_shapes(strategy) -> None:
    if strategy.shapes is None:
        raise StrategyError(f"{strategy.facts.name}: build a state with init/init_state first (it fixes the params' shapes)")


# ----------------------------------------------------------------------------- canonical

def canonical(strategy, state: TrainState) -> TrainState:
    need_shapes(strategy)
    replicated = NamedSharding(strategy.mesh, P())
    return converted(strategy, "canonical", lambda: unpadder(strategy), state,
                     lambda out: jax.tree_util.tree_map(lambda _: replicated, out))


def from_canonical(strategy, state: TrainState) -> TrainState:
    pp = strategy.pp
    strategy.shapes = layout.shapes_of(state.params if pp is None else jax.eval_shape(pp.stack, state.params))
    if state.extra is None:  # the strategy's own state for these params (async's history starts as them)
        state = state.replace(extra=strategy.init_extra(state.params if pp is None else strategy.shapes))
    state = jax.device_put(state, NamedSharding(strategy.mesh, P()))  # a plain transfer first
    return converted(strategy, "from_canonical", lambda: padder(strategy), state, strategy.state_shardings)


def padder(strategy):
    """Canonical state -> the strategy's: model slices in device order, ZeRO's chunks padded."""
    place, shapes, tx, pp = strategy.placement, strategy.shapes, strategy.tx, strategy.pp

    def convert(s):
        if pp is not None:  # the canonical tree -> the stages' stacked vectors
            s = pipeline.relayout(s, tx, pp.stack)
        return _copy(s).replace(
            params=_copy(place.tree(lambda path, x: place.to_state(path, x, strategy.sharded_params), s.params,
                                    "params")),
            opt_state=_copy(place.opt_map(tx, lambda path, x, _: place.to_state(
                path, x, strategy.sharded_opt_state), s.opt_state, shapes)))
    return convert


def unpadder(strategy):
    """The strategy's state -> canonical."""
    place, shapes, tx, pp = strategy.placement, strategy.shapes, strategy.tx, strategy.pp

    def convert(s):
        s = _copy(s).replace(
            params=place.tree(lambda path, x, c: place.from_state(path, x, c.shape, strategy.sharded_params),
                              s.params, "params", shapes),
            opt_state=place.opt_map(tx, lambda path, x, c: place.from_state(
                path, x, c.shape, strategy.sharded_opt_state), s.opt_state, shapes))
        return s if pp is None else pipeline.relayout(s, tx, pp.unstack)
    return convert


def canonical_grads(strategy, grads):
    """The ``return_grads`` gradients (the strategy's full per-model-slice layout) in canonical order."""
    if strategy.model_split is None:
        return grads
    grads = strategy.placement.tree(strategy.model_split.from_state, grads, "params")
    return grads if strategy.pp is None else strategy.pp.unstack(grads)


def converted(strategy, kind: str, make_convert, state, out_shardings):
    """``make_convert()(state)`` under one jit per (kind, state structure and shapes), placed by
    ``out_shardings(abstract output)``. Cached: parity reads the canonical state every step,
    and a fresh closure would recompile each time."""
    cut = strategy.sharded_params or strategy.sharded_opt_state or strategy.model_split
    if not cut and kind in ("canonical", "from_canonical"):
        # Nothing to pad or cut (DDP, async): a copy placed as asked, no program to compile.
        # device_put copies by itself; an eager jnp.copy of mesh-sharded leaves can abort XLA:CPU under load.
        return jax.device_put(state, out_shardings(layout.shapes_of(state)) if kind == "from_canonical"
                              else NamedSharding(strategy.mesh, P()), may_alias=False)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    key = (kind, treedef, tuple((np.shape(x), str(x.dtype)) for x in leaves))
    cache = strategy.__dict__.setdefault("_conversions", {})
    if key not in cache:
        convert = make_convert()
        cache[key] = jax.jit(convert, out_shardings=out_shardings(jax.eval_shape(convert, state)))
    return cache[key](state)


# ----------------------------------------------------------------------------- stored (checkpoints)

def stored_specs(strategy, stored: TrainState):
    """Canonical shapes; params, optimizer tensors and ``extra`` (in its stored form) cut along
    a dimension the data axis divides (replicated where none does), model state replicated."""
    n, axis = strategy.shards, strategy.axis

    def cut(x):
        shape = np.shape(x)
        return layout.spec(shape, n, axis) if any(s % n == 0 for s in shape) else P()
    return stored.replace(step=P(), params=jax.tree_util.tree_map(cut, stored.params),
                          model_state=jax.tree_util.tree_map(lambda _: P(), stored.model_state),
                          opt_state=jax.tree_util.tree_map(cut, stored.opt_state),
                          extra=jax.tree_util.tree_map(cut, stored.extra))


def stored_shardings(strategy, stored):
    return jax.tree_util.tree_map(lambda spec: NamedSharding(strategy.mesh, spec), stored_specs(strategy, stored),
                                  is_leaf=lambda x: isinstance(x, P))


def storer(strategy):
    """State -> stored values: canonical tensors, and ``extra`` in a form that does not depend
    on the device count (PowerSGD's mean error: ``sync.powersgd.PowerSGD.stored``)."""
    unpad, sync = unpadder(strategy), strategy.sync

    def convert(s):
        s = unpad(s)
        return s.replace(extra=sync.stored(s.extra)) if sync is not None else s
    return convert


def stored(strategy, state: TrainState) -> TrainState:
    """The strategy's state -> the checkpoint layout: no device gathers anything whole."""
    need_shapes(strategy)
    return converted(strategy, "stored", lambda: storer(strategy), state,
                     lambda out: stored_shardings(strategy, out))


def from_stored(strategy, stored_state: TrainState) -> TrainState:
    """The checkpoint layout -> the strategy's state (at the strategy's device count)."""
    need_shapes(strategy)

    def make():
        pad, sync = padder(strategy), strategy.sync

        def convert(s):
            if sync is not None:
                s = s.replace(extra=sync.from_stored(s.extra, strategy.num_devices))
            return pad(s)
        return convert
    return converted(strategy, "from_stored", make, stored_state, strategy.state_shardings)


def stored_target(strategy, state: TrainState):
    """Shapes, dtypes and shardings of ``stored(state)``, computing nothing: what a restore fills."""
    shapes = jax.eval_shape(storer(strategy), state)
    return jax.tree_util.tree_map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  shapes, stored_shardings(strategy, shapes))


# ----------------------------------------------------------------------------- the strategy's own, abstractly

def abstract_state(strategy, example_batch) -> TrainState:
    """The strategy's state as shapes and shardings only: a restore target that builds nothing."""
    strategy.learn_structure(example_batch)
    batch = layout.shapes_of(example_batch)

    def make(rng):
        variables = dict(strategy.init_fn(rng, layout.zeros(batch)))
        params = variables.pop("params")
        return params, variables
    params, model_state = jax.eval_shape(make, jax.random.key(0))
    strategy.shapes = shapes = layout.shapes_of(params)
    place = strategy.placement

    def padded(tree, zero):
        return place.tree(lambda path, s: jax.ShapeDtypeStruct(place.state_shape(path, s.shape, zero), s.dtype),
                          tree, "params")
    state_params = padded(shapes, strategy.sharded_params)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=state_params, model_state=model_state,
                       opt_state=jax.eval_shape(strategy.tx.init, padded(shapes, strategy.sharded_opt_state)),
                       extra=jax.eval_shape(strategy.init_extra, state_params))
    return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                  state, strategy.state_shardings(state))


def _copy(tree):
    # jit hands an unchanged input back as the same array, and the next step donates it.
    return jax.tree_util.tree_map(jnp.copy, tree)
