"""What every strategy shares: the per-device forward/backward, state placement and the shard_map plumbing.

A strategy says only *where state lives* (``facts.sharded``, ``state_specs``) and *where the
collectives go* (``local_step``); it never names a model. Everything in ``local_step`` runs
per device inside ``jax.shard_map``; the batch (any pytree) is always split over ``batch_axes``.

The check_vma gradient trap: params that enter shard_map replicated (``P()``) would get
gradients that autodiff has already summed over the axis, because the implicit broadcast
to "varying" transposes to a psum. Strategies therefore cast params to varying
themselves before ``local_grads``, so each device's gradient is its own and every
strategy states its reduction explicitly.

Layouts. The *canonical* layout is DDP's: full params and optimizer state (parity checks
and tests read it). The *stored* layout is what checkpoints hold: canonical shapes,
each tensor sharded over the data axis along a dimension N divides (``stored_specs``),
so each device writes only its part and any strategy at any N can read it.
"""

import functools
from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp import compile_options, reductions, task as tasks
from jaxdp.mesh import DATA_AXIS, shard_batch
from jaxdp.parallel import pipeline, protocol, staged, tensor
from jaxdp.state import TrainState
from jaxdp.strategies import layout
from jaxdp.strategies.buckets import insertion_order_paths
from jaxdp.strategies.factsheet import Facts
from jaxdp.strategies.placement import Placement


class StrategyError(ValueError):
    """A strategy option or batch shape that cannot work."""


# ----------------------------------------------------------------------------- per-device math

def local_grads(loss_fn: Callable, params, model_state, batch, rng, accum_steps: int = 1):
    """Forward/backward on this device's batch, accumulated over micro-batches.

    Mirrors torch's ``no_sync`` loop: each micro-batch's loss is scaled by 1/K, gradients
    are summed locally (the first one is taken as is, like a fresh ``.grad``), and the
    model state (BN running stats) is threaded through the micro-steps.
    Returns (mean micro-batch loss, summed grads, new model_state, mean metrics).
    """

    def micro_step(p, ms, b, key):
        def scaled(p):
            loss, (new_ms, metrics) = reductions.micro_batch_loss(loss_fn, p, ms, b, key)
            return loss / accum_steps, (loss, new_ms, metrics)

        grads, (loss, ms, metrics) = jax.grad(scaled, has_aux=True)(p)
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


# ----------------------------------------------------------------------------- the interface

class Strategy:
    """Base class. Subclasses set their ``facts`` (``factsheet.py``) and write ``local_step``."""

    facts = Facts("base")  # name, twin, what is sharded, traffic
    model_parallel = True  # runs beside a model axis (tensor parallelism); dp and async do not
    batch_axes: Any = DATA_AXIS  # mesh axes the batch is split over
    sync = None  # the gradient all-reduce (sync.AllReduce) of strategies that have one: it owns ``extra``

    @classmethod
    def facts_for(cls, **fixed) -> Facts:
        """The facts under the options a registry name fixes (a class serving several names overrides this)."""
        return cls.facts

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def sharded_params(self) -> bool:  # ZeRO-3: params live as chunks (layout.py)
        return "params" in self.facts.sharded

    @property
    def local_shapes(self):
        """The params' shapes as one device of the model axis holds them (``shapes`` without one)."""
        if self.tp is None:
            return self.shapes
        place = self.placement
        return place.tree(lambda path, s: jax.ShapeDtypeStruct(place.local_shape(path, s.shape), s.dtype),
                          self.shapes, "params")

    @property
    def sharded_opt_state(self) -> bool:  # ZeRO-1/2/3: per-parameter optimizer tensors live as chunks
        return "opt" in self.facts.sharded

    def __init__(self, model, task, tx, mesh, *, accum_steps: int = 1, sync_bn: bool = False,
                 axis: str = DATA_AXIS, return_grads: bool = False, seed: int = 0, tp_plan=None,
                 log_grad_norm: bool = False, microbatches: Optional[int] = None, compiler_options=None):
        if accum_steps < 1:
            raise StrategyError(f"accum_steps must be >= 1, got {accum_steps}")
        if axis not in mesh.axis_names:
            raise StrategyError(f"mesh has axes {mesh.axis_names}, strategy {self.name} needs {axis!r}")
        self.mesh = mesh
        self.axis = axis
        self.num_devices = int(np.prod([mesh.shape[a] for a in _as_tuple(self.batch_axes)]))
        self.shards = mesh.shape[axis]  # how many ways sharded state is cut (HSDP: the shard group)
        self.tx = tx
        self.accum_steps = accum_steps
        self.sync_bn = sync_bn
        self.seed = seed
        # Parity checks compare the averaged gradients too; off in training (it costs memory).
        self.return_grads = return_grads
        self.log_grad_norm = log_grad_norm  # the trainer logs it; off by default (one more collective)
        # The step donates the state's buffers (updated in place); the bench turns it off to measure it.
        self.donate = True
        # XLA compile options of the step: None = the platform's default, "none" = XLA's own
        # (jaxdp.compile_options); refused here, in one line, if written wrong.
        try:
            self.compiler_options = compile_options.resolve(compiler_options, mesh.devices.flat[0].platform)
        except compile_options.CompileOptionsError as e:
            raise StrategyError(str(e)) from None
        _check_model_parallel_axes(self, mesh)
        # Tensor parallelism over the mesh's model axis, when it has one (jaxdp.parallel.tensor).
        try:
            self.tp = tensor.for_mesh(model, mesh, tp_plan)
            # Pipeline stages over the mesh's stage axis (jaxdp.parallel.pipeline): the stacked
            # params are placed as a tensor split along their stage dim.
            self.pp = pipeline.for_mesh(model, mesh, microbatches, _as_tuple(self.batch_axes))
        except (tensor.TensorParallelError, pipeline.PipelineError) as e:
            raise StrategyError(str(e)) from None
        if microbatches is not None and self.pp is None:
            raise StrategyError("microbatches are pipeline micro-batches: they need a mesh with a stage axis")
        self.tp = self.pp.split if self.pp is not None else self.tp
        self.placement = Placement(self.tp, self.shards, axis)
        self.init_model = _with_bn_axis(model, None)  # model.init runs outside shard_map: no axes
        if self.pp is not None:
            self.init_model = pipeline.StackedInit(self.init_model, self.pp)
        if sync_bn and not hasattr(model, "bn_axis_name"):
            raise StrategyError("sync_bn needs a model whose BatchNorm takes its reduction axes as `bn_axis_name`")
        self.model = self._in_mesh(_with_bn_axis(model, self.batch_axes if sync_bn else None))
        rebind = sync_bn or self.tp is not None
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
        self._jit_step = None
        self._jit_eval = None
        self._in_flight = None  # the last program's outputs, on meshes that run one at a time

    def _in_mesh(self, model):
        """The model as it runs inside ``shard_map``: tensor-parallel over ``model`` if the mesh says so."""
        return model if self.tp is None or self.pp is not None else model.clone(model_axis=self.tp.axis)

    # -- learning the model's structure (abstractly: nothing is computed) -----------------------
    def init_fn(self, rng, batch):
        return self.init_model.init(rng, *self.task.model_inputs(batch), **self.task.init_kwargs)

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
        variables = self._learn_units(init, _abstract(batch))
        if self.tp is not None:
            try:
                self.tp.check(variables)
                if self.pp is None:  # the model takes its slices (jaxdp.parallel.protocol)
                    self._check_split(variables, batch)
            except tensor.TensorParallelError as e:
                raise StrategyError(str(e)) from None

    def _check_split(self, variables, batch):
        one_row = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((1,) + tuple(np.shape(x)[1:]), x.dtype),
                                         _abstract(batch))
        protocol.check_split(self._in_mesh(self.init_model), variables, self.placement.variables_specs(
            variables, False), one_row, self.task.model_inputs, self.mesh, self.tp.axis, self.tp.size,
            self.task.init_kwargs)

    def _learn_units(self, init, batch):
        return jax.eval_shape(init, batch)

    # -- placement ---------------------------------------------------------------------------
    def state_specs(self, state: TrainState):
        """PartitionSpec tree for the state, from the class facts and the strategy's own ``extra``."""
        place, canonical = self.placement, self.shapes
        return TrainState(
            step=P(), params=place.specs(state.params, "params", self.sharded_params, canonical),
            model_state=place.variables_specs(state.model_state, False),
            opt_state=place.opt_specs(self.tx, state.opt_state, canonical, self.sharded_opt_state),
            extra=_full_specs(self.extra_specs(state.extra), state.extra))

    def extra_specs(self, extra):
        return jax.tree_util.tree_map(lambda _: P(), extra)

    def state_shardings(self, state):
        return jax.tree_util.tree_map(lambda spec: NamedSharding(self.mesh, spec), self.state_specs(state),
                                      is_leaf=lambda x: isinstance(x, P))

    def init_extra(self, params):
        return None

    def init(self, rng, example_batch) -> TrainState:
        """A fresh state, each device creating only its own shards.

        Shapes come from ``eval_shape``; ``model.init`` and ``tx.init`` then run under ``jit``
        with this strategy's output shardings, so a ZeRO-3 model that fits only sharded can
        start: no device (and not the host) ever holds what the strategy does not keep.
        """
        init_params, init_opt = self.init_programs(example_batch)
        params, model_state = init_params(rng)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                           opt_state=init_opt(params), extra=self.init_extra(self.shapes))
        if state.extra is not None:
            state = state.replace(extra=jax.device_put(state.extra, self.state_shardings(state).extra))
        return state

    def init_programs(self, example_batch):
        """The two jitted programs ``init`` runs: ``rng -> (params, model_state)`` and
        ``params -> opt_state``, each with this strategy's output shardings (the memory test
        reads their compiled sizes)."""
        self.learn_structure(example_batch)
        batch = _abstract(example_batch)
        place, padded = self.placement, self.sharded_params

        def make(rng):
            variables = dict(self.init_fn(rng, _zeros(batch)))
            params = variables.pop("params")
            self.shapes = layout.shapes_of(params)
            return place.tree(lambda path, x: place.to_state(path, x, padded), params, "params"), variables

        shapes = jax.eval_shape(make, jax.random.key(0))
        key = _init_key(self, batch)
        init_params = _INIT_PROGRAMS.get(key) if key is not None else None
        if init_params is None:
            init_params = jax.jit(make, out_shardings=(
                self._shardings(place.specs(shapes[0], "params", padded, self.shapes)),
                self._shardings(place.variables_specs(shapes[1], False))))
            if key is not None:
                _INIT_PROGRAMS[key] = init_params
        self.refuse_unshardable_tx()
        # ZeRO-1/2 keep full params but give the optimizer padded chunks.
        pad_for_opt = self.sharded_opt_state and not padded
        opt_init = (lambda p: self.tx.init(place.tree(place.pad, p, "params"))) if pad_for_opt else self.tx.init
        init_opt = jax.jit(opt_init, out_shardings=self._shardings(place.opt_specs(
            self.tx, jax.eval_shape(opt_init, shapes[0]), self.shapes, self.sharded_opt_state)))
        return init_params, init_opt

    def _shardings(self, specs):
        return jax.tree_util.tree_map(lambda spec: NamedSharding(self.mesh, spec), specs,
                                      is_leaf=lambda x: isinstance(x, P))

    # -- canonical form (parity, tests) ---------------------------------------------------------
    def canonical(self, state: TrainState) -> TrainState:
        """The state in the plain DDP layout: full params and optimizer state, replicated.

        A copy, as every strategy's: the next ``step`` donates (deletes) the state's arrays.
        """
        self._need_shapes()
        replicated = NamedSharding(self.mesh, P())
        return self._converted("canonical", self._unpadder, state,
                               lambda out: jax.tree_util.tree_map(lambda _: replicated, out))

    def from_canonical(self, state: TrainState) -> TrainState:
        """DDP's layout (full tensors, e.g. from torch or a single device) -> this strategy's, on this mesh."""
        self.shapes = layout.shapes_of(state.params if self.pp is None else jax.eval_shape(self.pp.stack, state.params))
        if state.extra is None and self.init_extra(self.shapes) is not None:
            state = state.replace(extra=self.init_extra(self.shapes))
        state = jax.device_put(state, NamedSharding(self.mesh, P()))  # a plain transfer first
        return self._converted("from_canonical", self._padder, state, self.state_shardings)

    def init_state(self, variables) -> TrainState:
        """A state from given full variables (``{"params": ..., "batch_stats": ...}``): tests and parity."""
        variables = dict(variables)
        params = variables.pop("params")
        return self.from_canonical(TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                              model_state=variables, opt_state=self.tx.init(params)))

    def _padder(self):
        """Canonical state -> this strategy's: model slices in device order, ZeRO's chunks padded."""
        place, canonical = self.placement, self.shapes

        def convert(s):
            if self.pp is not None:  # the canonical tree -> the stages' stacked vectors
                s = pipeline.relayout(s, self.tx, self.pp.stack)
            return _copy(s).replace(
                params=_copy(place.tree(lambda path, x: place.to_state(path, x, self.sharded_params), s.params,
                                        "params")),
                opt_state=_copy(place.opt_map(self.tx, lambda path, x, _: place.to_state(
                    path, x, self.sharded_opt_state), s.opt_state, canonical)))
        return convert

    def _unpadder(self):
        """This strategy's state -> canonical."""
        place, canonical = self.placement, self.shapes

        def convert(s):
            s = _copy(s).replace(
                params=place.tree(lambda path, x, c: place.from_state(path, x, c.shape, self.sharded_params),
                                  s.params, "params", canonical),
                opt_state=place.opt_map(self.tx, lambda path, x, c: place.from_state(
                    path, x, c.shape, self.sharded_opt_state), s.opt_state, canonical))
            return s if self.pp is None else pipeline.relayout(s, self.tx, self.pp.unstack)
        return convert

    def with_grad_norm(self, out, grads, chunked: bool):
        """``out`` plus ``grad_norm``, the averaged gradient's global L2 norm, if ``log_grad_norm``.

        ``grads`` are this strategy's averaged gradients in its own layout (``chunked``: ZeRO's
        chunks over data; model slices under tensor parallelism): each device's sum of squares,
        summed over the mesh axes its part is cut along. ZeRO's padding is zero and adds nothing.
        """
        if not self.log_grad_norm:
            return out
        return {**out, "grad_norm": jnp.sqrt(self.global_sum_of_squares(grads, chunked))}

    def global_sum_of_squares(self, tree, chunked: bool):
        """The sum of squares over the whole model of a params-shaped ``tree`` in this strategy's layout
        (``chunked``: ZeRO's chunks over data): each device's sum, summed over the mesh axes its
        part is cut along, one psum per set of axes. ZeRO's padding is zero and adds nothing."""
        self._check_whole_tree(tree)
        specs = self.placement.specs(tree, "params", chunked, self.shapes)
        sums = {}
        for g, spec in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(
                specs, is_leaf=lambda x: isinstance(x, P))):
            axes = tuple(sorted({a for entry in spec if entry for a in _as_tuple(entry)}))
            g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
            sums[axes] = sums.get(axes, 0.0) + jnp.sum(g * g)
        return sum(jax.lax.psum(v, axes) if axes else v for axes, v in sums.items())

    def _check_whole_tree(self, tree) -> None:
        # shapes is None only when a step is lowered on a state this strategy did not build
        # (lower_step on another run's state): its tree is the state's own, whole.
        if self.shapes is not None and jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(self.shapes):
            raise StrategyError("jaxdp.clip_by_global_norm needs the whole gradient tree: put it in the top-level "
                                "optax.chain, not inside masked or multi_transform")

    def step_context(self) -> reductions.StepContext:
        """What ``jaxdp.clip_by_global_norm`` and ``jaxdp.global_mean`` need to know inside the step:
        the optimizer sees chunks exactly when its state is sharded (ZeRO-1/2/3, HSDP), slices beside
        a model or stage axis; with whole gradients (ddp, dp, async) the plain local sum is the global one."""
        return reductions.StepContext(
            batch_axes=self.batch_axes, num_devices=self.num_devices, accum_steps=self.accum_steps,
            sum_of_squares=((lambda tree: self.global_sum_of_squares(tree, self.sharded_opt_state))
                            if self._optimizer_sees_parts else None))

    @property
    def _optimizer_sees_parts(self) -> bool:
        """The optimizer holds a part of each tensor: ZeRO's chunks, or slices over a model or stage axis."""
        return self.sharded_opt_state or self.tp is not None

    def refuse_unshardable_tx(self) -> None:
        """Refuse, in one line, an optimizer that reduces over whole tensors when the optimizer sees
        only a part of each (ZeRO's chunks, tensor or pipeline slices): ``reductions.check_shardable``."""
        if not self._optimizer_sees_parts or self.__dict__.get("_tx_checked"):
            return
        self._need_shapes()
        layout_name = self.name if self.sharded_opt_state else f"{self.name} with a model or stage axis"

        def placeholder(tree):  # stands for the sharded reduction, without tracing one
            self._check_whole_tree(tree)
            return jnp.ones((), jnp.float32)
        probe = reductions.StepContext(self.batch_axes, self.num_devices, self.accum_steps, placeholder)
        try:
            reductions.check_shardable(self.tx, self.shapes, layout_name, probe)
        except reductions.UnshardableTransformError as e:
            raise StrategyError(str(e)) from None
        self._tx_checked = True

    def canonical_grads(self, grads):
        """The ``return_grads`` gradients (this strategy's full per-model-slice layout) in canonical order."""
        if self.tp is None:
            return grads
        grads = self.placement.tree(self.tp.from_state, grads, "params")
        return grads if self.pp is None else self.pp.unstack(grads)

    def _converted(self, kind: str, make_convert, state, out_shardings):
        """``make_convert()(state)`` under one jit per (kind, state structure and shapes), placed by
        ``out_shardings(abstract output)``. Cached: parity reads the canonical state every step,
        and a fresh closure would recompile each time."""
        if not (self.sharded_params or self.sharded_opt_state or self.tp) and kind in ("canonical", "from_canonical"):
            # Nothing to pad or cut (DDP, async): a copy placed as asked, no program to compile.
            # (device_put copies itself; an eager jnp.copy of mesh-sharded leaves first aborted
            # XLA:CPU once under a loaded 2-worker run.)
            return jax.device_put(state, out_shardings(layout.shapes_of(state)) if kind == "from_canonical"
                                  else NamedSharding(self.mesh, P()), may_alias=False)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        key = (kind, treedef, tuple((np.shape(x), str(x.dtype)) for x in leaves))
        cache = self.__dict__.setdefault("_conversions", {})
        if key not in cache:
            convert = make_convert()
            cache[key] = jax.jit(convert, out_shardings=out_shardings(jax.eval_shape(convert, state)))
        return cache[key](state)

    def _need_shapes(self):
        if self.shapes is None:
            raise StrategyError(f"{self.name}: build a state with init/init_state first (it fixes the params' shapes)")

    # -- the checkpoint layout -----------------------------------------------------------------
    def stored_specs(self, stored: TrainState):
        """Canonical shapes; params, optimizer tensors and ``extra`` (in its stored form) cut along
        a dimension the data axis divides (replicated where none does), model state replicated."""
        n, axis = self.shards, self.axis

        def cut(x):
            shape = np.shape(x)
            return layout.spec(shape, n, axis) if any(s % n == 0 for s in shape) else P()
        return stored.replace(step=P(), params=jax.tree_util.tree_map(cut, stored.params),
                              model_state=jax.tree_util.tree_map(lambda _: P(), stored.model_state),
                              opt_state=jax.tree_util.tree_map(cut, stored.opt_state),
                              extra=jax.tree_util.tree_map(cut, stored.extra))

    def stored_shardings(self, stored):
        return jax.tree_util.tree_map(lambda spec: NamedSharding(self.mesh, spec), self.stored_specs(stored),
                                      is_leaf=lambda x: isinstance(x, P))

    def _storer(self):
        """State -> stored values: canonical tensors, and ``extra`` in a form that does not depend
        on the device count (PowerSGD's mean error: ``compression.PowerSGD.stored``)."""
        unpad = self._unpadder()

        def convert(s):
            s = unpad(s)
            return s.replace(extra=self.sync.stored(s.extra)) if self.sync is not None else s
        return convert

    def stored(self, state: TrainState) -> TrainState:
        """This strategy's state -> the checkpoint layout: no device gathers anything whole."""
        self._need_shapes()
        return self._converted("stored", self._storer, state, self.stored_shardings)

    def from_stored(self, stored: TrainState) -> TrainState:
        """The checkpoint layout -> this strategy's state (at this strategy's device count)."""
        self._need_shapes()

        def make():
            pad = self._padder()

            def convert(s):
                if self.sync is not None:
                    s = s.replace(extra=self.sync.from_stored(s.extra, self.num_devices))
                return pad(s)
            return convert
        return self._converted("from_stored", make, stored, self.state_shardings)

    def stored_target(self, state: TrainState):
        """Shapes, dtypes and shardings of ``stored(state)``, computing nothing: what a restore fills."""
        shapes = jax.eval_shape(self._storer(), state)
        return jax.tree_util.tree_map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                      shapes, self.stored_shardings(shapes))

    def abstract_state(self, example_batch) -> TrainState:
        """This strategy's state as shapes and shardings only: a restore target that builds nothing."""
        self.learn_structure(example_batch)
        batch = _abstract(example_batch)

        def make(rng):
            variables = dict(self.init_fn(rng, _zeros(batch)))
            params = variables.pop("params")
            return params, variables
        params, model_state = jax.eval_shape(make, jax.random.key(0))
        self.shapes = layout.shapes_of(params)
        place = self.placement

        def padded(tree, zero):
            return place.tree(lambda path, s: jax.ShapeDtypeStruct(place.state_shape(path, s.shape, zero), s.dtype),
                              tree, "params")
        params = padded(self.shapes, self.sharded_params)
        opt_src = padded(self.shapes, self.sharded_opt_state)
        state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, model_state=model_state,
                           opt_state=jax.eval_shape(self.tx.init, opt_src),
                           extra=jax.eval_shape(lambda: self.init_extra(self.shapes)))
        return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                      state, self.state_shardings(state))

    # -- batches ---------------------------------------------------------------------------------
    def shard_batch(self, batch):
        """A host batch (this process's rows of a pytree) -> global arrays split over the batch axes."""
        return jax.tree_util.tree_map(lambda x: shard_batch(self.mesh, np.asarray(x), self.batch_axes), batch)

    rng_root = None  # the key the rng stream derives from (``use_rng``); None: ``jax.random.key(seed)``

    def use_rng(self, rng) -> None:
        """Derive the losses' rng stream from ``rng`` (``Trainer.init``'s key) instead of ``seed``."""
        typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
        self.rng_root = rng if typed else jax.random.wrap_key_data(rng)  # a raw uint32 key: the same bits
        self._jit_step = None  # a compiled step holds the old root as a constant

    def step_key(self, step):
        """The loss's key: unique to the step and the device's block of the global batch
        (its index over the batch axes, the order the batch is split in), so the same on
        every strategy at the same device count; ``local_grads`` splits it per micro-batch."""
        root = jax.random.key(self.seed) if self.rng_root is None else self.rng_root
        key = jax.random.fold_in(root, step)
        return jax.random.fold_in(key, _device_index(self.batch_axes))

    # -- compiled entry points -----------------------------------------------------------------
    def local_step(self, state: TrainState, batch):
        raise NotImplementedError

    def local_eval(self, state: TrainState, batch):
        """Per-device sums of ``eval_fn`` over this device's batch (ZeRO-3 gathers per unit)."""
        return self.eval_task.eval_fn(state.params, state.model_state, batch)

    def _shard_mapped(self, fn, state, in_batch, out_specs, check_vma=True):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(self.state_specs(state), in_batch),
                             out_specs=out_specs, check_vma=check_vma)

    def _step_fn(self, state: TrainState):
        """The jitted, shard_mapped step, built on first use (its specs need the state)."""
        if self._jit_step is None:
            specs = self.state_specs(state)
            self.refuse_unshardable_tx()
            local = self.local_step if self.tp is None else self._local_step_whole_grads
            self._jit_step = jax.jit(
                self._shard_mapped(self._in_step_context(local), state, P(self.batch_axes), (specs, P()),
                                   self.check_vma),
                donate_argnums=0 if self.donate else (), compiler_options=self.compiler_options)
        return self._jit_step

    def _in_step_context(self, local):
        """``local`` traced under ``step_context()`` (``jaxdp.reductions``); it keeps ``local``'s name,
        which names the compiled step (profiles, HLO, compile logs)."""
        @functools.wraps(local)
        def traced(*args):
            with reductions.in_step(self.step_context()):
                return local(*args)
        return traced

    def _local_step_whole_grads(self, state, batch):
        """``local_step``; under tensor parallelism the returned (parity) gradients are gathered
        over the model axis, so that every device holds them whole, in the state's order."""
        new_state, metrics = self.local_step(state, batch)
        if self.tp is not None and "grads" in metrics:
            def whole(path, g):
                d = self.tp.dim(path, np.shape(g))
                return g if d is None else jax.lax.all_gather(g, self.tp.axis, axis=d, tiled=True, to="invarying")
            metrics = {**metrics, "grads": self.placement.tree(whole, metrics["grads"], "params")}
        return new_state, metrics

    check_vma = True

    def step(self, state: TrainState, batch):
        self.learn_structure(batch)
        return self._one_at_a_time(self._step_fn(state), state, batch)

    def _one_at_a_time(self, program, *args):
        """Run ``program``; on a CPU mesh with two or more device axes, only once the program
        before it has finished.

        Why: XLA:CPU runs the simulated devices' programs on a shared thread pool, and a
        device blocked in a collective's rendezvous holds its thread. With the next step
        already dispatched, the devices of two steps and two kinds of group (model and data
        rows of the mesh) compete for those threads, and a rendezvous can wait for a device
        that never gets one. Measured on 2 cores, data=2 x model=4, 300 transformer steps dispatched
        back to back: 3 of 3 runs aborted ("Termination timeout for all reduce ... only 3 of
        them arrived"); waiting for each step first: 3 of 3 finished, 2.3x faster (the
        devices no longer compete). GPUs run each device on its own stream: no wait there.
        """
        if self._serialize_programs and self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
        out = program(*args)
        if self._serialize_programs:
            self._in_flight = out
        return out

    @property
    def _serialize_programs(self) -> bool:
        axes = sum(1 for size in self.mesh.shape.values() if size > 1)
        return axes >= 2 and self.mesh.devices.flat[0].platform == "cpu"

    def lower_step(self, state: TrainState, batch):
        """The lowered training step, for HLO and memory inspection."""
        self.learn_structure(batch)
        return self._step_fn(state).lower(state, batch)

    def evaluate(self, state: TrainState, batch) -> Dict[str, Any]:
        """``eval_fn``'s sums over the global batch."""
        self.learn_structure(batch)
        if self._jit_eval is None:
            def summed(state, batch):
                return jax.lax.psum(self.local_eval(state, batch), self.batch_axes)
            self._jit_eval = jax.jit(self._shard_mapped(summed, state, P(self.batch_axes), P()))
        return self._one_at_a_time(self._jit_eval, state, batch)


def refuse_with_tensor_parallel(strategy, allreduce: str, compress) -> None:
    """Options whose collectives cannot run beside a model axis."""
    if strategy.tp is None:
        return
    if allreduce == "ring":
        # The ring is traced with check_vma=False, and without the varying/invariant types JAX
        # would not insert tensor parallelism's backward all-reduces.
        raise StrategyError("allreduce='ring' does not combine with a model axis (tensor parallelism); use psum")
    if compress == "powersgd":
        raise StrategyError("compress='powersgd' does not combine with a model axis (tensor parallelism) yet")


def _check_model_parallel_axes(strategy, mesh) -> None:
    from jaxdp.mesh import MODEL_AXIS, STAGE_AXIS, axis_size

    for axis in (MODEL_AXIS, STAGE_AXIS):
        if axis_size(mesh, axis) > 1 and not strategy.model_parallel:
            raise StrategyError(f"{strategy.name} runs over the data axis only, but the mesh has "
                                f"{axis}={axis_size(mesh, axis)}: use ddp, zero1, zero2 or zero3 with a {axis} axis")


def _full_specs(specs, tree):
    """A PartitionSpec prefix (PowerSGD's one spec for the whole error tree) -> one spec per leaf
    of ``tree``, so the result pairs leaf by leaf with ``tree`` (``abstract_state``, ``stored_target``)."""
    return jax.tree_util.tree_map(lambda spec, sub: jax.tree_util.tree_map(lambda _: spec, sub), specs, tree,
                                  is_leaf=lambda x: isinstance(x, P))


# model.init's random samplers take XLA seconds to compile; a process that builds the same
# model on the same mesh again (a resume, a second run, tests) reuses the program.
_INIT_PROGRAMS: Dict[Any, Any] = {}


def _init_key(strategy, batch):
    """What the params-init program depends on, or None when some part is not hashable."""
    task = strategy.task
    key = (strategy.model, type(task), getattr(task, "model_inputs", None),
           tuple(sorted(getattr(task, "init_kwargs", {}).items())),
           jax.tree_util.tree_structure(batch), tuple((x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves(batch)),
           strategy.sharded_params, strategy.shards, strategy.axis, strategy.mesh,
           None if strategy.tp is None else tuple(sorted(strategy.tp.plan.items())))  # the model slices' order
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _copy(tree):
    # jit hands an unchanged input back as the same array, and the next step donates it.
    return jax.tree_util.tree_map(jnp.copy, tree)


def _zeros(shapes):
    """Inputs for tracing ``model.init``: only their shapes matter, and zeros cost nothing under jit."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _device_index(axes):
    """This device's linear index over ``axes`` (row-major, as the batch is split)."""
    index = 0
    for a in _as_tuple(axes):
        index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return index


def _with_bn_axis(model, axis):
    """The model with BatchNorm statistics over ``axis`` (None: per device). BN-free models pass through."""
    return model.clone(bn_axis_name=axis) if hasattr(model, "bn_axis_name") else model


def _as_tuple(axes):
    return axes if isinstance(axes, tuple) else (axes,)

