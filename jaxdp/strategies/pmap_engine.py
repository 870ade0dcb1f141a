"""``dp``'s engine: the strategy's per-device step under ``jax.pmap``, one Python call driving every device.

pmap's layout gives every leaf of the state a leading device axis, each device holding its own copy
(``nn.DataParallel``'s replicas); the batch is cut into equal chunks along that axis. The engine
methods match ``engine.ShardMapEngine``'s, so ``Strategy``'s front serves both; the checkpoint
layout is the shared one (``conversions.py``), reached through device 0's copy.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.strategies.state import TrainState
from jaxdp.strategies import conversions, layout
from jaxdp.strategies.engine import Engine, in_step_context
from jaxdp.strategies.errors import StrategyError


class PmapEngine(Engine):
    def __init__(self, strategy):
        self.strategy = strategy
        self.devices = list(strategy.mesh.devices.flat)
        self._split = NamedSharding(strategy.mesh, P(strategy.batch_axes))  # the leading device axis
        self.forget_step()
        self.jit_eval = jax.pmap(self._device_eval, axis_name=strategy.axis, devices=self.devices)

    def forget_step(self) -> None:
        s = self.strategy
        self.jit_step = jax.pmap(in_step_context(s, s.local_step), axis_name=s.axis, devices=self.devices,
                                 donate_argnums=0)
        self.compiled_step = None

    # -- state: a copy per device -----------------------------------------------------------------
    def init(self, rng, example_batch) -> TrainState:
        s = self.strategy
        s.learn_structure(example_batch)
        batch = layout.shapes_of(example_batch)
        held = s.held_variables()  # an NNX model's own, built by its constructor
        return self.init_state(jax.jit(lambda r: s.init_fn(r, layout.zeros(batch)))(rng) if held is None else held)

    def from_canonical(self, state):
        self.strategy.shapes = layout.shapes_of(state.params)
        n = len(self.devices)
        return jax.tree_util.tree_map(
            lambda x: jax.device_put(np.broadcast_to(np.asarray(x)[None], (n,) + np.shape(x)), self._split), state)

    def canonical(self, state):
        """Device 0's copy: the state nn.DataParallel's module and optimizer hold."""
        return jax.tree_util.tree_map(lambda x: jax.device_put(x[0], self.devices[0]), state)

    def stored(self, state):
        # Device 0's copy, replicated on the mesh so that the shared layout code can cut it.
        s = self.strategy
        return conversions.stored(s, jax.device_put(self.canonical(state), NamedSharding(s.mesh, P())))

    def from_stored(self, stored):
        return self.from_canonical(jax.device_get(stored))

    def shard_batch(self, batch):
        def split(a):
            a = np.asarray(a)
            return jax.device_put(a.reshape(self._chunked(a.shape)), self._split)
        return jax.tree_util.tree_map(split, batch)

    def _chunked(self, shape):
        """A batch leaf's shape cut into one equal chunk per device, on a leading device axis."""
        n = len(self.devices)
        if shape[0] % n:
            raise StrategyError(f"dp: batch {shape[0]} does not split into {n} equal chunks")
        return (n, shape[0] // n, *shape[1:])

    def step_shapes(self, batch):
        """As ``ShardMapEngine.step_shapes``, in pmap's layout: the leading device axis that
        ``from_canonical`` gives every leaf of the state, and ``shard_batch`` the batch's."""
        n = len(self.devices)

        def stacked(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._split)
        state = jax.tree_util.tree_map(lambda x: stacked((n, *x.shape), x.dtype),
                                       conversions.abstract_state(self.strategy, batch))
        return state, jax.tree_util.tree_map(lambda x: stacked(self._chunked(np.shape(x)), np.asarray(x).dtype), batch)

    # -- programs ---------------------------------------------------------------------------------
    def step(self, state, batch):
        self.strategy.learn_structure(_first(batch))
        state, metrics = self._run(state, batch)
        return state, _first(metrics)

    def _run(self, state, batch):
        if self.compiled_step is not None:
            try:
                return self.compiled_step(state, batch)
            except (TypeError, ValueError):  # checked before it runs: arguments of another shape or placement
                self.compiled_step = None
        return self.jit_step(state, batch)

    def lower_step(self, state, batch):
        return self.jit_step.lower(state, batch)

    def step_jaxpr(self, state, batch):
        """As ``ShardMapEngine.step_jaxpr`` (a pmapped function has no ``trace``)."""
        return jax.make_jaxpr(self.jit_step)(state, batch)

    def per_device_shapes(self, fn, state, batch):
        """As ``ShardMapEngine.per_device_shapes``: pmap hands each device its own state and batch."""
        return jax.eval_shape(jax.pmap(fn, axis_name=self.strategy.axis, devices=self.devices), state, batch)

    def compile_step(self, state, batch):
        """As ``ShardMapEngine.compile_step``: compiled once, and run by ``step`` from then on."""
        self.compiled_step = self.lower_step(state, batch).compile()
        return self.compiled_step

    def _device_eval(self, state, batch):
        return jax.lax.psum(self.strategy.local_eval(state, batch), self.strategy.axis)

    def evaluate(self, state, batch):
        return _first(self.jit_eval(state, batch))


def _first(tree):
    """Device 0's entry of every leaf (the leading axis is pmap's device axis)."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)
