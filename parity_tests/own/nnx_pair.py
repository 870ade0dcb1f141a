"""A pair whose Flax side is a Flax NNX model (``ModelPair.flax_model`` an ``nnx.Module``): what the
harness does with it where it would ``init`` or ``apply`` a Linen module.

- **its variables** are the module's own, read as jaxdp carries them (``jaxdp.loss.nnx_state``):
  ``params`` (``nnx.Param``) and ``batch_stats`` (``nnx.BatchStat``) under the module's attribute
  paths, an ``nnx.List``'s index a part (``blocks/0/...``), so the correspondence's rules read
  NNX's names as Linen's: ``nnx.Linear``/``nnx.Conv`` kernel and bias, ``nnx.LayerNorm``/
  ``nnx.RMSNorm`` scale and bias, ``nnx.BatchNorm`` mean and var, ``nnx.Embed`` embedding. Its rng
  state is not a weight: the harness neither compares nor copies it.
- **the run's dtype**: a copy of the module with the ``dtype`` attribute of every submodule that
  has one (NNX layers' compute dtype, and Flax's convention for a model's own) set to the run's
  compute dtype, and its floating Params and BatchStats cast to the params' dtype (float64 runs:
  nnx.BatchNorm's statistics too, which it creates in float32).
- **its loss**, ``flax_loss(model(*args, **kwargs), batch)`` averaged (``pair.arguments``), is an NNX
  loss (``loss_fn(model, batch, rng)``) and trains through ``jaxdp.Trainer``'s NNX path, units too.
- **dropout**: a forward that advances an ``nnx.Rngs`` stream (read from its jaxpr: a count the
  loss returns is not the count it was given) or draws without one is refused.
- **each module's output**, for ``localize``: ``nnx.capture`` of every module's ``__call__``.

Jax and flax are imported where they are used.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from parity_tests.own.pair import ModelPair, PairError


def is_nnx(model) -> bool:
    from jaxdp.loss.nnx_state import is_nnx as nnx_model

    return nnx_model(model)


def model_at(module, dtype: str, compute: str, params: str):
    """A copy of ``module`` for a run in ``dtype``: computing in ``compute``, its params in ``params``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    compute, params = jnp.dtype(compute), jnp.dtype(params)
    copy = nnx.clone(module)
    typed = [m for _, m in nnx.iter_modules(copy) if hasattr(m, "dtype")]
    if dtype == "bfloat16" and not typed:
        raise PairError(f"--dtype bfloat16 needs an nnx.Module with a `dtype` attribute somewhere (the compute dtype "
                        f"NNX layers take); {type(module).__name__} has none")
    for m in typed:
        m.dtype = compute
    with jax.enable_x64(params == jnp.float64 or bool(jax.config.jax_enable_x64)):  # called before a run's own
        for _, var in nnx.iter_graph(copy):
            if isinstance(var, (nnx.Param, nnx.BatchStat)) and jnp.issubdtype(var.get_value().dtype, jnp.floating):
                var.set_value(var.get_value().astype(params))
    return copy


def variables(module) -> Dict[str, Any]:
    """The module's weights as Flax variables: ``params`` and ``batch_stats`` (no rng state)."""
    from jaxdp.loss.nnx_state import Parts

    own = Parts(module).variables()
    return {k: v for k, v in own.items() if k in ("params", "batch_stats")}


def loss_fn(pair: ModelPair, loss: Callable):
    """The pair's loss in NNX's form, ``loss_fn(model, batch, rng)``; ``loss(outputs, batch)`` is the
    run's (``jax_pair.pair_loss``)."""
    def run(model, batch, rng):
        args, kwargs = pair.arguments("flax", batch)
        return loss(model(*args, **kwargs), batch)
    return run


def strategy_inputs(pair: ModelPair, module, loss: Callable, given: Dict[str, Any]):
    """(model, task, variables) for ``jaxdp.strategies.create_strategy``: the module as the strategies
    take it, its NNX task, and ``given`` (params, batch_stats) with the module's own rng counts."""
    from jaxdp.loss.nnx_task import NNXModel, NNXTask

    model = NNXModel(module)
    return model, NNXTask(model, loss_fn(pair, loss)), {**model.init(), **given}


def with_weights(module, given: Dict[str, Any]):
    """A copy of ``module`` holding ``given`` (params, batch_stats: numpy or jax arrays; its own rng state)."""
    import jax
    import jax.numpy as jnp

    from jaxdp.loss.nnx_task import NNXModel

    model = NNXModel(module)
    return model.merge({**model.init(), **jax.tree_util.tree_map(jnp.asarray, given)})


def unit_paths(pair: ModelPair, module) -> List[Tuple[str, ...]]:
    from jaxdp.loss.nnx_task import NNXModel
    from jaxdp.strategies.nnx_units import NNXUnits

    return NNXUnits(pair.flax_units, NNXModel(module)).paths()


def draws(pair: ModelPair, module, example, loss: Callable) -> Optional[str]:
    """Why the module's training forward draws random numbers, or None."""
    import jax

    from jaxdp.loss.nnx_task import NNXLossError
    from jaxdp.parallel.tensor import path_name

    model, task, own = strategy_inputs(pair, module, loss, {})
    params = own.pop("params")

    def counts(params, state, batch):
        return task.loss_fn(params, state, batch, None)[1][0].get("rng_counts", {})

    try:
        closed = jax.make_jaxpr(counts)(params, own, dict(example))
    except NNXLossError as e:
        return str(e).split(": build it")[0]
    given = set(map(id, closed.jaxpr.invars))
    names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(own.get("rng_counts", {}))]
    advanced = [p for p, v in zip(names, closed.jaxpr.outvars) if id(v) not in given]
    return f"the nnx.Rngs streams at {', '.join(advanced)} advance" if advanced else None


def outputs(pair: ModelPair, module, batch) -> Dict[Tuple[str, ...], Any]:
    """Each module's ``__call__`` output on ``batch`` (its first, for a module called twice), by path."""
    import jax
    from flax import nnx

    args, kwargs = pair.arguments("flax", batch)
    _, captured = nnx.capture(lambda m: m(*args, **kwargs), nnx.Intermediate, method_outputs=nnx.Intermediate)(module)
    out = {}
    for path, var in nnx.to_flat_state(captured):
        if path[-1] == "__call__":
            value = var.get_value() if isinstance(var, nnx.Variable) else var
            out[tuple(map(str, path[:-1]))] = jax.device_get(value)
    return out
