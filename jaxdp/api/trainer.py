"""The public API: any Flax model, any loss, any strategy.

    mesh = jaxdp.make_mesh(data=4)
    trainer = jaxdp.Trainer(model, loss_fn, optax.adamw(3e-4), jaxdp.ZeRO(stage=3, units=(Block,)), mesh)
    state = trainer.init(jax.random.key(0), example_batch)
    state, metrics = trainer.step(state, batch)
    trainer.save(path, state); state = trainer.restore(path, example_batch)  # any strategy, mesh, N

``model`` is a Flax NNX ``nnx.Module`` or a Flax Linen module. For an NNX model the loss is NNX's
``loss_fn(model, batch, rng) -> loss | (loss, metrics)`` (or ``loss_fn(model, batch)``), called
with the module holding this step's state (``jaxdp.loss.nnx_task``: BatchNorm statistics, the
model's ``nnx.Rngs`` streams), and ``trainer.model(state)`` gives the trained module back. For a
Linen model it is
``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))`` (see
``jaxdp.loss.task``), or ``jaxdp.classifier(model)`` for an image classifier. A loss whose first
parameter is ``model``, ``loss_fn(model, params, ...)``, receives the model jaxdp prepared
(split over a ``model`` axis, cut into stages: ``jaxdp.loss.model_task``, ``jaxdp.parallel.protocol``). Batches are any
pytree of host arrays with a shared leading batch dimension: the global batch, or in a
multi-process job this process's rows of it. A strategy is named with the factories below
(``DDP()``, ``ZeRO(stage=3)``, ...) or by its registry name (``"zero3"``).
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxdp.api import validate
from jaxdp.checkpoint import saving
from jaxdp.loss import model_task, nnx_state, nnx_task, task as tasks
from jaxdp.parallel import supports
from jaxdp.runtime.mesh import make_mesh
from jaxdp.config.step import StrategyOptions
from jaxdp.strategies import create_strategy, engine_of


@dataclass(frozen=True)
class StrategySpec:
    """A strategy's name and options, before it meets a model, an optimizer and a mesh.

    ``options``: keywords, the public form (``jaxdp.ZeRO(stage=3, units=(Block,), remat="none")``).
    ``config``: the config tree's typed options (``jaxdp.config.step.StrategyOptions``; ``jaxdp
    train`` gives its parsed config), which go to the strategy's class as they are; ``options``
    then holds only what a program wires in beside them (``units``, ``seed``, ...)."""

    name: str
    options: dict = field(default_factory=dict)
    config: Optional[StrategyOptions] = None


def DDP(**options) -> StrategySpec:  # noqa: N802 - reads as the strategy's name
    return StrategySpec("ddp", options)


def ZeRO(stage: int = 3, **options) -> StrategySpec:  # noqa: N802
    return StrategySpec(f"zero{stage}" if stage in (1, 2, 3) else str(stage), options)


def HSDP(**options) -> StrategySpec:  # noqa: N802
    return StrategySpec("hsdp", options)


def DataParallel(**options) -> StrategySpec:  # noqa: N802
    return StrategySpec("dp", options)


def AsyncPS(staleness: int = 0, **options) -> StrategySpec:  # noqa: N802
    return StrategySpec("async", {"staleness": staleness, **options})


class Trainer:
    def __init__(self, model, loss_fn, tx, strategy: Any = "ddp", mesh=None, *, eval_fn: Optional[Callable] = None,
                 model_inputs: Optional[Callable] = None, init_kwargs: Optional[dict] = None):
        mesh = mesh if mesh is not None else make_mesh()
        self.nnx = None  # the NNX model, in the shape the strategies take a model (jaxdp.loss.nnx_task)
        spec = strategy if isinstance(strategy, StrategySpec) else StrategySpec(str(strategy))  # any registered name
        if nnx_state.is_nnx(model):
            # The one check of what a model takes on a mesh (a Linen model's: where its strategy is built).
            sync_bn = spec.options.get("sync_bn") or getattr(spec.config, "sync_bn", False)
            refused = supports.refusal(model, mesh, sync_bn)
            if refused:
                raise validate.UsageError(refused)
            model = self.nnx = _nnx_model(model, loss_fn, model_inputs, init_kwargs)
            try:
                task = nnx_task.as_task(model, loss_fn, eval_fn)
            except nnx_task.NNXLossError as e:
                raise validate.UsageError(str(e)) from None
        elif isinstance(loss_fn, tasks.Classifier):
            task = loss_fn
        elif callable(loss_fn):
            refusal = nnx_task.linen_refusal(loss_fn)
            if refusal:
                raise validate.UsageError(refusal)
            task = model_task.as_task(model, loss_fn, eval_fn, model_inputs, init_kwargs)
        else:
            raise TypeError(f"loss_fn must be callable (or jaxdp.classifier(model)), got {type(loss_fn).__name__}")
        # Checked at init (``jaxdp.api.validate``): our own classifier and pipelines need no check.
        self._check_loss = not isinstance(task, tasks.Classifier)
        self._default_inputs = model_inputs is None
        self._parts = (spec, model, task, tx)  # to build the strategy again on another mesh (inspect)
        if spec.config is None:  # keywords: checked against the name's options, then typed by the class
            self.strategy = create_strategy(spec.name, model, task, tx, mesh, **spec.options)
        else:  # typed options go to the strategy's class as they are (an option reaches its code in 3 calls)
            cls, fixed = engine_of(spec.name)
            self.strategy = cls(model, task, tx, mesh, spec.config, **fixed, **spec.options)
        self.mesh = self.strategy.mesh

    def init(self, rng, example_batch):
        """A fresh, already sharded state (nothing whole is built for ZeRO). ``rng`` seeds the
        params and the rng stream ``loss_fn`` sees (see ``step_key``): ``jax.random.key(s)``
        draws what the CLI's ``--seed s`` draws."""
        self._check(example_batch)
        self.strategy.use_rng(rng)
        return self.strategy.engine.init(rng, example_batch)

    def step(self, state, batch):
        """One optimizer update on a global batch; returns (state, metrics). The state is donated."""
        return self.strategy.engine.step(state, self._placed(batch, self.strategy.options.accum_steps))

    def evaluate(self, state, batch):
        """``eval_fn``'s sums over the global batch (a ``{"mask"}`` leaf drops padding rows for classifiers)."""
        if getattr(self.strategy.eval_task, "eval_fn", None) is None:
            raise ValueError("this Trainer has no eval_fn: pass eval_fn=... to evaluate")
        return self.strategy.engine.evaluate(state, self._placed(batch))

    def save(self, path: str, state, *, record: Optional[dict] = None, keep: int = saving.DEFAULT_KEEP) -> int:
        """Write ``state`` to the checkpoint directory ``path`` (orbax, the layout ``jaxdp train``
        writes), as step ``state.step``; each device writes its own part. ``record``: a JSON dict
        kept beside it (``restore(..., with_meta=True)`` gives it back); the newest ``keep``
        checkpoints stay. Returns the step."""
        return saving.save(self.strategy, path, state, record, keep)

    def restore(self, path: str, example_batch, step: Optional[int] = None, *,
                check: Optional[Callable[[dict], None]] = None, with_meta: bool = False,
                accept_unverified: bool = False):
        """The newest usable checkpoint in ``path`` (or ``step``), saved under any strategy, mesh or
        device count, by ``save`` or ``jaxdp train``, as this Trainer's state; restores ``init``'s rng
        stream too. ``check(meta)`` may refuse it before any array is read; ``with_meta``: returns
        ``(state, meta)``, meta as ``jaxdp.checkpoint.saving`` lays it out (``meta["record"]``: what
        ``save`` was given). A checkpoint without its manifest is unverified: skipped with a warning,
        unless ``accept_unverified``. Only reads ``path``: a run may be saving there."""
        self._check(example_batch)
        state, meta = saving.restore(self.strategy, path, example_batch, step, check, accept_unverified)
        return (state, meta) if with_meta else state

    def canonical(self, state):
        """The full params and optimizer state (DDP's layout), e.g. to export or compare."""
        return self.strategy.engine.canonical(state)

    def model(self, state):
        """An NNX model's trained module: a new ``nnx.Module`` holding the whole state (params,
        BatchNorm statistics, rng counts; gathered from any strategy's layout, on the default
        device), to evaluate or export. The module given to the Trainer is left as it was."""
        if self.nnx is None:
            raise validate.UsageError("trainer.model(state) gives back an nnx.Module; this Trainer trains a Flax "
                                      "Linen model, whose variables are trainer.canonical(state).params")
        whole = self.canonical(state)  # to host only the model's variables, not the optimizer state
        variables = jax.device_get({"params": whole.params, **whole.model_state})
        return self.nnx.merge(jax.tree_util.tree_map(jnp.asarray, variables))

    def inspect(self, example_batch, target="h100", devices: int = 8, hosts: int = 1, **options) -> dict:
        """This Trainer's step compiled for ``devices`` GPUs of kind ``target`` on each of ``hosts``
        hosts, without them: the report ``jaxdp inspect --target ... --json`` prints (memory per
        device, every collective with its window and exposed time, the estimated step). Built on any
        mesh (e.g. 2 CPU devices), compiled with its axis names over the target's GPUs; the example
        batch keeps its rows per device. ``options``: ``compile`` (False: state bytes only),
        ``schedule``, ``plot`` (a PNG of the estimated step), ``batch_per_device``, ``seed``
        (``jaxdp.analysis.trainer_inspect``)."""
        from jaxdp.analysis import trainer_inspect  # the analysis stack, only when a Trainer is inspected

        spec, model, task, tx = self._parts
        keywords, config = trainer_inspect.without_mesh_shape(spec.options, spec.config)
        return trainer_inspect.inspect_trainer(
            self.strategy, lambda mesh: _strategy(spec.name, keywords, config, model, task, tx, mesh), example_batch,
            target, devices, hosts, **options)

    def _check(self, example_batch):
        """One-line errors for a bad batch or loss_fn, before anything compiles (``jaxdp.api.validate``)."""
        validate.batch_rows(example_batch)
        if self._check_loss and self.strategy.pp is None:
            validate.loss_fn(self.strategy, example_batch, self._default_inputs)

    def _placed(self, batch, accum_steps: int = 1):
        leaves = jax.tree_util.tree_leaves(batch)
        if leaves and all(isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == self.mesh
                          for x in leaves):
            return batch  # already on the mesh
        validate.batch_splits(validate.batch_rows(batch), self.strategy.num_devices, accum_steps)
        return self.strategy.engine.shard_batch(batch)


def _strategy(name: str, options: dict, config: Optional[StrategyOptions], model, task, tx, mesh):
    """The strategy ``Trainer.__init__`` builds, on another mesh (``inspect``); ``__init__`` builds its
    own in place, so that an option reaches its code in three calls (tests/test_remat.py)."""
    if config is None:
        return create_strategy(name, model, task, tx, mesh, **options)
    cls, fixed = engine_of(name)
    return cls(model, task, tx, mesh, config, **fixed, **options)


def classifier(model):
    return tasks.classifier(model)


def _nnx_model(module, loss_fn, model_inputs, init_kwargs) -> nnx_task.NNXModel:
    """An NNX module as the strategies take it, or one line for what cannot train it."""
    if isinstance(loss_fn, tasks.Classifier):
        raise validate.UsageError("jaxdp.classifier(model) applies a Flax Linen model; for an nnx.Module write "
                                  f"{nnx_task.LOSS_FORM}")
    if model_inputs is not None or init_kwargs:
        raise validate.UsageError("model_inputs and init_kwargs tell jaxdp how to call a Linen model's init; an "
                                  "nnx.Module is built already: drop them")
    try:
        return nnx_task.NNXModel(module)
    except nnx_state.NNXStateError as e:
        raise validate.UsageError(str(e)) from None
