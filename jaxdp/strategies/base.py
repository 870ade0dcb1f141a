"""``Strategy``: the hooks a strategy writes, and what they share.

A strategy says only *where state lives* (``facts.sharded``, ``state_specs``) and *what one device
does* (``local_step``): its hooks, listed in ``hooks.StrategyHooks``. It never names a model. Its
engine (``strategy.engine``, ``engine.py``) is what callers run: ``init``, ``step``, ``evaluate``,
``canonical``, ``stored``, ... ; ``conversions.py`` moves the state between the strategy's layout,
the canonical one and the checkpoint's; ``device_math.py`` holds the per-device math the steps are
written in. ``Strategy`` itself holds no forward to either.

The check_vma gradient trap: params that enter shard_map replicated (``P()``) would get gradients
that autodiff has already summed over the axis, because the implicit broadcast to "varying"
transposes to a psum. Strategies therefore cast params to varying themselves before
``local_grads``, so each device's gradient is its own and every strategy states its reduction.
"""

from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.runtime import compile_options
from jaxdp.runtime.mesh import DATA_AXIS, MeshDims, MeshError
from jaxdp.parallel import pipeline, protocol, staged, supports, tensor
from jaxdp.config.step import StrategyOptions
from jaxdp.loss.nnx_task import NNXModel, NNXTask
from jaxdp.strategies.state import TrainState
from jaxdp.strategies import layout
from jaxdp.strategies.sync import Where
from jaxdp.strategies.sync.buckets import insertion_order_paths
from jaxdp.strategies.device_math import as_tuple, device_index
from jaxdp.strategies.device_math import (broadcast_from, ddp_buffers, local_grads, per_device,  # noqa: F401
                                          train_metrics)  # re-exported: parity_tests.bugs patches them here
from jaxdp.strategies.engine import ShardMapEngine
from jaxdp.strategies.errors import StrategyError
from jaxdp.strategies.factsheet import Facts
from jaxdp.strategies.options import checked
from jaxdp.strategies.placement import Placement
from jaxdp.strategies.step_reductions import StepReductions


class Strategy(StepReductions):
    """Base class. Subclasses set their ``facts`` (``factsheet.py``) and write the hooks (``hooks.py``)."""

    # -- the hooks' defaults (hooks.StrategyHooks) ------------------------------------------------
    facts = Facts("base")
    model_parallel = True
    batch_axes: Any = DATA_AXIS
    check_vma = True
    sync = None
    engine_class = ShardMapEngine

    def local_step(self, state: TrainState, batch):
        raise NotImplementedError

    def local_eval(self, state: TrainState, batch):
        """Per-device sums of ``eval_fn`` over this device's batch (ZeRO-3 gathers per unit)."""
        return self.eval_task.eval_fn(state.params, state.model_state, batch)

    def init_extra(self, params):
        """The gradient sync's own state (PowerSGD's), or None: the sync owns ``state.extra`` (``hooks.py``)."""
        return None if self.sync is None else self.sync.init(params, self.num_devices)

    def extra_specs(self, extra):
        if self.sync is not None and self.sync.stateful:
            return self.sync.specs(self.axis)
        return jax.tree_util.tree_map(lambda _: P(), extra)

    def learn_units(self, init, batch):
        return jax.eval_shape(init, batch)

    def mesh_for(self, mesh):
        return mesh

    @classmethod
    def facts_for(cls, **fixed) -> Facts:
        """The facts under the options a registry name fixes (a class serving several names overrides this)."""
        return cls.facts

    # -- what the facts say ----------------------------------------------------------------------
    @property
    def sharded_params(self) -> bool:  # ZeRO-3: params live as chunks (layout.py)
        return "params" in self.facts.sharded

    @property
    def sharded_opt_state(self) -> bool:  # ZeRO-1/2/3: per-parameter optimizer tensors live as chunks
        return "opt" in self.facts.sharded

    @property
    def local_shapes(self):
        """The params' shapes as one device of the model axis holds them (``shapes`` without one)."""
        if self.model_split is None:
            return self.shapes
        place = self.placement
        return place.tree(lambda path, s: jax.ShapeDtypeStruct(place.local_shape(path, s.shape), s.dtype),
                          self.shapes, "params")

    def __init__(self, model, task, tx, mesh, options: Optional[StrategyOptions] = None, *, axis: str = DATA_AXIS,
                 return_grads: bool = False, seed: int = 0, tp_plan=None, log_grad_norm: bool = False,
                 microbatches: Optional[int] = None, compiler_options=None, **option_keywords):
        """``options``: the config tree's typed strategy options (``jaxdp train``'s parsed config
        itself), None for the defaults; ``option_keywords``: options as keywords (``remat="none"``,
        a registry name's fixed ones). Both are checked once, here (``options.checked``), and kept
        as ``self.options``; the other keywords are what a program wires in."""
        self.options = checked(self.facts, options, option_keywords)
        mesh = self.mesh_for(mesh)
        if axis not in mesh.axis_names:
            raise StrategyError(f"mesh has axes {mesh.axis_names}, strategy {self.facts.name} needs {axis!r}")
        self.mesh = mesh
        self.axis = axis
        self.num_devices = int(np.prod([mesh.shape[a] for a in as_tuple(self.batch_axes)]))
        self.shards = mesh.shape[axis]  # how many ways sharded state is cut (HSDP: the shard group)
        self.tx = tx
        self.seed = seed
        self.return_grads = return_grads  # parity checks compare the averaged gradients too (costs memory)
        self.log_grad_norm = log_grad_norm  # the trainer logs it; off by default (one more collective)
        self.donate = True  # the step updates the state's buffers in place; the bench turns it off to measure it
        try:  # None: the platform's default options, "none": XLA's own (jaxdp.runtime.compile_options)
            self.compiler_options = compile_options.resolve(compiler_options, mesh.devices.flat[0].platform)
        except compile_options.CompileOptionsError as e:
            raise StrategyError(str(e)) from None
        try:  # the mesh's degrees against what this strategy splits (runtime.mesh.MeshDims)
            MeshDims.of(mesh).check_for(self.facts.name, as_tuple(self.batch_axes), self.model_parallel)
        except MeshError as e:
            raise StrategyError(str(e)) from None
        refused = supports.refusal(model, mesh, self.options.sync_bn, tp_plan)  # what the model takes on the mesh
        if refused:
            raise StrategyError(refused)
        try:
            tensor_parallel = tensor.for_mesh(model, mesh, tp_plan)  # over the mesh's model axis, if any
            self.pp = pipeline.for_mesh(model, mesh, microbatches, as_tuple(self.batch_axes))  # its stage axis
        except (tensor.TensorParallelError, pipeline.PipelineError) as e:
            raise StrategyError(str(e)) from None
        if microbatches is not None and self.pp is None:
            raise StrategyError("microbatches are pipeline micro-batches: they need a mesh with a stage axis")
        # How the params are cut beside the data axis: tensor parallelism's plan over the model axis,
        # or on pipeline stages the stacked params split along their stage dim; None without either.
        self.model_split = self.pp.split if self.pp is not None else tensor_parallel
        self.placement = Placement(self.model_split, self.shards, axis)
        self.init_model = _with_bn_axis(model, None)  # model.init runs outside shard_map: no axes
        if self.pp is not None:
            self.init_model = pipeline.StackedInit(self.init_model, self.pp)
        sync_bn = self.options.sync_bn
        self.model = self._in_mesh(_with_bn_axis(model, self.batch_axes if sync_bn else None))
        rebind = sync_bn or self.model_split is not None
        try:
            if self.pp is not None:  # the model's layers run stage by stage
                self.task, self.eval_task = staged.bind(self.pp, task)
            else:
                self.task = task.with_model(self.model) if rebind else task
                self.eval_task = task.with_model(self._in_mesh(self.init_model)) if rebind else task
        except ValueError as e:
            raise StrategyError(str(e)) from None
        self.shapes = None  # the full params' shapes, known once a state is built
        self.param_order = None  # the params' definition order (torch's model.parameters())
        self.engine = self.engine_class(self)

    def _in_mesh(self, model):
        """The model as it runs inside ``shard_map``: tensor-parallel over ``model`` if the mesh says so."""
        split = self.model_split
        return model if split is None or self.pp is not None else model.clone(model_axis=split.axis)

    # -- learning the model's structure (abstractly: nothing is computed) -------------------------
    def init_fn(self, rng, batch):
        return self.init_model.init(rng, *self.task.model_inputs(batch), **self.task.init_kwargs)

    def held_variables(self):
        """An NNX model's variables as its constructor built them (``init`` draws none); None for a
        Linen model, whose ``init`` draws them."""
        return self.init_model.init() if isinstance(self.init_model, NNXModel) else None

    def learn_structure(self, batch) -> None:
        """Read what the strategy needs from the model once, from a (local or global) batch's shapes."""
        if self.param_order is not None:
            return
        order = []

        def init(b):
            variables = self.init_fn(jax.random.key(0), b)
            order.extend(insertion_order_paths(variables["params"]))  # before JAX sorts the dict
            return variables

        self.param_order = order
        variables = self.learn_units(init, layout.shapes_of(batch))
        if self.model_split is not None:
            try:
                self.model_split.check(variables)
                if self.pp is None:  # the model takes its slices (jaxdp.parallel.protocol)
                    self._check_split(variables, batch)
            except tensor.TensorParallelError as e:
                raise StrategyError(str(e)) from None

    def _check_split(self, variables, batch):
        one_row = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((1,) + tuple(np.shape(x)[1:]), x.dtype),
                                         layout.shapes_of(batch))
        split = self.model_split
        protocol.check_split(self._in_mesh(self.init_model), variables, self.placement.variables_specs(
            variables, False), one_row, self.task.model_inputs, self.mesh, split.axis, split.size,
            self.task.init_kwargs)

    # -- placement ---------------------------------------------------------------------------------
    def state_specs(self, state: TrainState):
        """PartitionSpec tree for the state, from the class facts and the strategy's own ``extra``."""
        place, canonical = self.placement, self.shapes
        return TrainState(
            step=P(), params=place.specs(state.params, "params", self.sharded_params, canonical),
            model_state=place.variables_specs(state.model_state, False),
            opt_state=place.opt_specs(self.tx, state.opt_state, canonical, self.sharded_opt_state),
            extra=_full_specs(self.extra_specs(state.extra), state.extra))

    def state_shardings(self, state):
        return jax.tree_util.tree_map(lambda spec: NamedSharding(self.mesh, spec), self.state_specs(state),
                                      is_leaf=lambda x: isinstance(x, P))

    # -- the losses' rng stream ------------------------------------------------------------------
    rng_root = None  # the key the rng stream derives from (``use_rng``); None: ``jax.random.key(seed)``

    def use_rng(self, rng) -> None:
        """Derive the losses' rng stream from ``rng`` (``Trainer.init``'s key) instead of ``seed``."""
        typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
        self.rng_root = rng if typed else jax.random.wrap_key_data(rng)  # a raw uint32 key: the same bits
        self.engine.forget_step()  # a compiled step holds the old root as a constant

    def where(self, step, **sharded) -> Where:
        """What the gradient sync needs to know about this step (``sharded``: ZeRO's shards and buckets)."""
        return Where(step, self.axis, self.num_devices, self.param_order, **sharded)

    def step_task(self):
        """The task as this device's step runs it (a ``local_step`` takes its loss from here): an NNX
        model draws from this device's own rng streams, by its index over the batch axes
        (``jaxdp.loss.nnx_task``); any other task is the same task."""
        return self.task.on_device(self.batch_axes) if isinstance(self.task, NNXTask) else self.task

    def step_key(self, step):
        """The loss's key: unique to the step and the device's block of the global batch
        (its index over the batch axes, the order the batch is split in), so the same on
        every strategy at the same device count; ``local_grads`` splits it per micro-batch."""
        root = jax.random.key(self.seed) if self.rng_root is None else self.rng_root
        key = jax.random.fold_in(root, step)
        return jax.random.fold_in(key, device_index(self.batch_axes))


def _full_specs(specs, tree):
    """A PartitionSpec prefix (PowerSGD's one spec for the whole error tree) -> one spec per leaf
    of ``tree``, so the result pairs leaf by leaf with ``tree`` (``abstract_state``, ``stored_target``)."""
    return jax.tree_util.tree_map(lambda spec, sub: jax.tree_util.tree_map(lambda _: spec, sub), specs, tree,
                                  is_leaf=lambda x: isinstance(x, P))


def _with_bn_axis(model, axis):
    """The model with BatchNorm statistics over ``axis`` (None: per device). BN-free models pass through."""
    return model.clone(bn_axis_name=axis) if hasattr(model, "bn_axis_name") else model
