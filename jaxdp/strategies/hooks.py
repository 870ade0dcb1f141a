"""What a strategy writes: the hooks the engine calls, and nothing else.

A strategy is a subclass of ``base.Strategy`` that sets or overrides only these; the engine
(``engine.py``, or ``pmap_engine.py`` for ``dp``) compiles and dispatches, ``conversions.py``
moves the state between layouts, and ``base.Strategy`` holds the rest (placement, the rng
stream, what the step's reductions need). ``Strategy`` gives every hook a default but
``local_step``.
"""

from typing import Any, Optional, Protocol, Tuple, Union

from jaxdp.strategies.state import TrainState


class StrategyHooks(Protocol):
    # -- data -----------------------------------------------------------------------------------
    facts: Any  # ``factsheet.Facts``: name, torch twin, the options it takes, what it shards, traffic
    batch_axes: Union[str, Tuple[str, ...]]  # mesh axes the batch is split over (HSDP: replica and data)
    model_parallel: bool  # runs beside a model or stage axis (dp and async do not)
    check_vma: bool  # trace the step with JAX's varying/invariant types (a ring all-reduce turns them off)
    sync: Optional[Any]  # the gradient sync transform (``jaxdp.strategies.sync``); it owns ``state.extra`` when stateful
    engine_class: type  # ``engine.ShardMapEngine``; ``dp``: ``pmap_engine.PmapEngine``

    # -- per device, inside the engine's program --------------------------------------------------
    def local_step(self, state: TrainState, batch) -> Tuple[TrainState, dict]:
        """One training step on this device's batch: (new state, metrics from ``device_math.train_metrics``).
        Its loss is ``self.step_task().loss_fn`` (an NNX model's: this device's rng streams)."""

    def local_eval(self, state: TrainState, batch) -> dict:
        """This device's sums of ``eval_fn`` (the engine sums them over the batch axes)."""

    # -- the strategy's own state ---------------------------------------------------------------
    def init_extra(self, params) -> Any:
        """``state.extra`` for these params, in the state's layout (PowerSGD's error and Qs, async's history
        seeded from them), or None. ``params`` are arrays, or their shapes where no values exist
        (``jax.eval_shape``: a restore's target; a pipeline's stacked params)."""

    def extra_specs(self, extra) -> Any:
        """Where ``extra`` lives: a PartitionSpec per leaf, or one spec for a whole subtree."""

    def learn_units(self, init, batch) -> Any:
        """The variables' shapes from ``init(batch)`` under ``eval_shape``; ZeRO-3 also records its FSDP units."""

    # -- where it runs ----------------------------------------------------------------------------
    def mesh_for(self, mesh) -> Any:
        """The mesh it runs on, given the caller's, once its options are checked (``self.options``):
        HSDP splits the data-parallel devices into replica x shard (``runtime.mesh.MeshDims``)."""
