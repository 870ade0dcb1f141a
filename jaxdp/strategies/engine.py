"""The engine: a strategy's per-device code compiled into programs over the mesh, and dispatched.

A strategy writes what one device does (its hooks, ``hooks.StrategyHooks``); the engine owns the
rest: ``jit(shard_map(...))`` with the state's specs and the batch split over ``batch_axes``,
donation of the state's buffers, the init programs (each device creating only its own shards),
evaluation, lowering for inspection, and running one program at a time where the platform needs it.
It is what callers run (``strategy.engine.init``, ``.step``, ``.canonical``, ``.stored``, ...): the
strategy itself holds no forward to it. ``DataParallel`` runs on its own engine (``pmap_engine.py``)
with the same methods.
"""

import functools
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.loss import reductions
from jaxdp.runtime.mesh import shard_batch
from jaxdp.strategies.state import TrainState
from jaxdp.strategies import conversions, layout

# model.init's random samplers take XLA seconds to compile; a process that builds the same
# model on the same mesh again (a resume, a second run, tests) reuses the program.
_INIT_PROGRAMS: Dict[Any, Any] = {}


class Engine:
    """What both engines share: a state from given variables, and a restore's target."""

    strategy: Any

    def init_state(self, variables) -> TrainState:
        """A state from given full variables (``{"params": ..., "batch_stats": ...}``): tests and parity."""
        variables = dict(variables)
        params = variables.pop("params")
        return self.from_canonical(TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=variables,
                                              opt_state=self.strategy.tx.init(params)))

    def restore_target(self, example_batch) -> TrainState:
        """Shapes, dtypes and shardings of the stored layout of a state for this batch's model: what a
        checkpoint restore fills, building nothing (``conversions.stored_target`` of ``abstract_state``)."""
        s = self.strategy
        return conversions.stored_target(s, conversions.abstract_state(s, example_batch))


class ShardMapEngine(Engine):
    """Every strategy's engine but ``dp``'s: one SPMD program per step, the state placed by its specs."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.jit_step = None  # built on first use: its specs need a state
        self.compiled_step = None  # compile_step's program, which step runs while its arguments fit
        self.jit_eval = None
        self._in_flight = None  # the last program's outputs, on meshes that run one at a time

    def forget_step(self) -> None:
        """Drop the compiled step: the next one traces again (a new rng root is a constant in it)."""
        self.jit_step = self.compiled_step = None

    # -- state ---------------------------------------------------------------------------------
    def init(self, rng, example_batch) -> TrainState:
        """A fresh state, each device creating only its own shards.

        Shapes come from ``eval_shape``; ``model.init`` and ``tx.init`` then run under ``jit``
        with the strategy's output shardings, so a ZeRO-3 model that fits only sharded can
        start: no device (and not the host) ever holds what the strategy does not keep.
        """
        s = self.strategy
        init_params, init_opt = self.init_programs(example_batch)
        params, model_state = init_params(rng)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                           opt_state=init_opt(params), extra=s.init_extra(params))
        # The counter and the sync's state start where the step puts them: an unplaced counter made
        # the second step see new input shardings, and trace and compile the whole step again.
        # The counter from the host: jax 0.10.2's device_put of a one-device array onto a sharding over
        # several processes of one device each builds an array whose shards cannot be listed.
        placed = s.state_shardings(state)
        return state.replace(step=jax.device_put(np.zeros((), np.int32), placed.step),
                             extra=None if state.extra is None else jax.device_put(state.extra, placed.extra))

    def init_programs(self, example_batch):
        """The two jitted programs ``init`` runs: ``rng -> (params, model_state)`` and
        ``params -> opt_state``, each with the strategy's output shardings (the memory test
        reads their compiled sizes)."""
        s = self.strategy
        s.learn_structure(example_batch)
        batch = layout.shapes_of(example_batch)
        place, padded = s.placement, s.sharded_params
        # An NNX model's constructor built its variables: they enter as arguments (closed over, XLA
        # would embed every param in the program as a constant).
        held = s.held_variables()

        def make(rng, held=None):
            variables = dict(s.init_fn(rng, layout.zeros(batch)) if held is None else held)
            params = variables.pop("params")
            s.shapes = layout.shapes_of(params)
            return place.tree(lambda path, x: place.to_state(path, x, padded), params, "params"), variables

        shapes = jax.eval_shape(make, jax.random.key(0), held)
        key = _init_key(s, batch)
        init_params = _INIT_PROGRAMS.get(key) if key is not None else None
        if init_params is None:
            init_params = jax.jit(make, out_shardings=(
                self.shardings(place.specs(shapes[0], "params", padded, s.shapes)),
                self.shardings(place.variables_specs(shapes[1], False))))
            if key is not None:
                _INIT_PROGRAMS[key] = init_params
        s.refuse_unshardable_tx()
        # ZeRO-1/2 keep full params but give the optimizer padded chunks.
        pad_for_opt = s.sharded_opt_state and not padded
        opt_init = (lambda p: s.tx.init(place.tree(place.pad, p, "params"))) if pad_for_opt else s.tx.init
        init_opt = jax.jit(opt_init, out_shardings=self.shardings(place.opt_specs(
            s.tx, jax.eval_shape(opt_init, shapes[0]), s.shapes, s.sharded_opt_state)))
        return (init_params if held is None else functools.partial(init_params, held=held)), init_opt

    def shardings(self, specs):
        return jax.tree_util.tree_map(lambda spec: NamedSharding(self.strategy.mesh, spec), specs,
                                      is_leaf=lambda x: isinstance(x, P))

    # -- layouts (conversions.py) --------------------------------------------------------------
    def canonical(self, state):
        """The state in DDP's layout (``conversions.py``); a copy: the next step donates the state."""
        return conversions.canonical(self.strategy, state)

    def from_canonical(self, state):
        return conversions.from_canonical(self.strategy, state)

    def stored(self, state):
        return conversions.stored(self.strategy, state)

    def from_stored(self, stored):
        return conversions.from_stored(self.strategy, stored)

    def shard_batch(self, batch):
        """A host batch (this process's rows of a pytree) -> global arrays split over the batch axes."""
        s = self.strategy
        return jax.tree_util.tree_map(lambda x: shard_batch(s.mesh, np.asarray(x), s.batch_axes), batch)

    def step_shapes(self, batch):
        """The step's arguments for the global ``batch`` (numpy) as shapes and shardings: the state
        (``conversions.abstract_state``) and the batch split over the batch axes. ``lower_step``
        compiles from them, nothing allocated: for a GPU target's compile-only devices."""
        s = self.strategy
        split = NamedSharding(s.mesh, P(s.batch_axes))
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                                       sharding=split), batch)
        return conversions.abstract_state(s, batch), shapes

    # -- programs ------------------------------------------------------------------------------
    def step(self, state: TrainState, batch):
        self.strategy.learn_structure(batch)
        program = self._step_program(state)
        if self.compiled_step is not None:
            try:
                return self._one_at_a_time(self.compiled_step, state, batch)
            except (TypeError, ValueError):  # checked before it runs: arguments of another shape or placement
                self.compiled_step = None
        return self._one_at_a_time(program, state, batch)

    def lower_step(self, state: TrainState, batch):
        self.strategy.learn_structure(batch)
        return self._step_program(state).lower(state, batch)

    def step_jaxpr(self, state: TrainState, batch):
        """The step's jaxpr for these arguments (shapes suffice): nothing is lowered or compiled."""
        self.strategy.learn_structure(batch)
        return self._step_program(state).trace(state, batch).jaxpr

    def per_device_shapes(self, fn, state: TrainState, batch):
        """``fn(state, batch)``'s output shapes, ``fn`` traced per device as the step is (nothing runs)."""
        s = self.strategy
        return jax.eval_shape(jax.shard_map(fn, mesh=s.mesh, out_specs=P(), check_vma=s.check_vma,
                                            in_specs=(s.state_specs(state), P(s.batch_axes))), state, batch)

    def compile_step(self, state: TrainState, batch):
        """The step compiled ahead of time for these arguments (for its memory and cost), and
        the program ``step`` runs from then on: jit would otherwise trace and compile it again
        at the first step (measured: a second compile of every run's step)."""
        self.compiled_step = self.lower_step(state, batch).compile()
        return self.compiled_step

    def evaluate(self, state: TrainState, batch):
        s = self.strategy
        s.learn_structure(batch)
        if self.jit_eval is None:
            def summed(state, batch):
                return jax.lax.psum(s.local_eval(state, batch), s.batch_axes)
            self.jit_eval = jax.jit(self._shard_mapped(summed, state, P()))
        return self._one_at_a_time(self.jit_eval, state, batch)

    def _step_program(self, state: TrainState):
        """The jitted, shard_mapped step, built on first use (its specs need the state)."""
        s = self.strategy
        if self.jit_step is None:
            s.refuse_unshardable_tx()
            local = s.local_step if s.model_split is None else self._local_step_whole_grads
            self.jit_step = jax.jit(
                self._shard_mapped(in_step_context(s, local), state, (s.state_specs(state), P()), s.check_vma),
                donate_argnums=0 if s.donate else (), compiler_options=s.compiler_options)
        return self.jit_step

    def _shard_mapped(self, fn, state, out_specs, check_vma=True):
        s = self.strategy
        return jax.shard_map(fn, mesh=s.mesh, in_specs=(s.state_specs(state), P(s.batch_axes)),
                             out_specs=out_specs, check_vma=check_vma)

    def _local_step_whole_grads(self, state, batch):
        """``local_step``; under tensor parallelism the returned (parity) gradients are gathered
        over the model axis, so that every device holds them whole, in the state's order."""
        s = self.strategy
        new_state, metrics = s.local_step(state, batch)
        if "grads" in metrics:
            def whole(path, g):
                d = s.model_split.dim(path, np.shape(g))
                return g if d is None else jax.lax.all_gather(g, s.model_split.axis, axis=d, tiled=True, to="invarying")
            metrics = {**metrics, "grads": s.placement.tree(whole, metrics["grads"], "params")}
        return new_state, metrics

    def _one_at_a_time(self, program, *args):
        """Run ``program``; on a CPU mesh with two or more device axes, only once the program
        before it has finished.

        XLA:CPU runs the simulated devices' programs on a shared thread pool, and a device
        blocked in a collective's rendezvous holds its thread. With the next step already
        dispatched, the devices of two steps and two kinds of group (model and data rows of
        the mesh) compete for those threads, and a rendezvous can wait for a device that never
        gets one: the run aborts (2 cores, data=2 x model=4). Waiting first avoids it, and is
        faster there (2.3x). GPUs run each device on its own stream: no wait there.
        """
        serialize = _serialize_programs(self.strategy.mesh)
        if serialize and self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
        out = program(*args)
        if serialize:
            self._in_flight = out
        return out


def in_step_context(strategy, local):
    """``local`` traced under ``strategy.step_context()`` (``jaxdp.loss.reductions``); it keeps ``local``'s
    name, which names the compiled step (profiles, HLO, compile logs)."""
    @functools.wraps(local)
    def traced(*args):
        with reductions.in_step(strategy.step_context()):
            return local(*args)
    return traced


def _serialize_programs(mesh) -> bool:
    axes = sum(1 for size in mesh.shape.values() if size > 1)
    return axes >= 2 and mesh.devices.flat[0].platform == "cpu"


def _init_key(strategy, batch):
    """What the params-init program depends on, or None when some part is not hashable."""
    task = strategy.task
    key = (strategy.model, type(task), getattr(task, "model_inputs", None),
           tuple(sorted(getattr(task, "init_kwargs", {}).items())),
           jax.tree_util.tree_structure(batch), tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves(batch)),
           strategy.sharded_params, strategy.shards, strategy.axis, strategy.mesh,
           None if strategy.model_split is None else tuple(sorted(strategy.model_split.plan.items())))  # the model slices' order
    try:
        hash(key)
    except TypeError:
        return None
    return key
