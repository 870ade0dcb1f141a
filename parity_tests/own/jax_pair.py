"""jaxdp's side of a pair's run: the Flax model at the run's dtype, the loss as jaxdp's task
contract, the strategy, and K steps recorded through the correspondence
(``jax_side.step_records``: the same loop and record format as the built-in pairs).

Nothing here imports jax at module level.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Mapping, Sequence

import numpy as np

from parity_tests.own import non_trainable
from parity_tests.own.outputs import map_arrays
from parity_tests.own.pair import ModelPair, PairError

# run dtype -> (compute dtype, params' dtype): bfloat16 is bf16 compute on float32 master weights
DTYPES = {"float64": ("float64", "float64"), "float32": ("float32", "float32"), "bfloat16": ("bfloat16", "float32")}


def flax_model_at(model, dtype: str):
    """``model`` computing in ``dtype``'s compute dtype: its ``dtype`` (and ``param_dtype``) fields set,
    where it has them. bfloat16 needs the field: it is how a Flax model is told to compute in bf16."""
    import jax.numpy as jnp

    from parity_tests.own import nnx_pair

    compute, params = DTYPES[dtype]
    if nnx_pair.is_nnx(model):
        return nnx_pair.model_at(model, dtype, compute, params)
    names = {f.name for f in dataclasses.fields(model)} if dataclasses.is_dataclass(model) else set()
    if "dtype" not in names:
        if dtype == "bfloat16":
            raise PairError(f"--dtype bfloat16 needs a Flax model with a `dtype` field (the compute dtype its layers "
                            f"take, Flax's convention); {type(model).__name__} has none")
        return model
    changes = {"dtype": jnp.dtype(compute)}
    if "param_dtype" in names:
        changes["param_dtype"] = jnp.dtype(params)
    return model.clone(**changes)


def host_batch(batch: Mapping[str, Any], dtype: str) -> Dict[str, np.ndarray]:
    """The pair's numpy batch with its floating leaves in the run's dtype (float64, else float32)."""
    from parity_tests.inputs import cast

    return cast(dict(batch), np.float64 if dtype == "float64" else np.float32)


def apply_fn(pair: ModelPair, model, dtype: str):
    """``(variables, batch) -> (loss, new model state)``: the model on the batch's inputs, in
    training (``flax_kwargs``), its non-params collections mutable (the params that do not
    train, put back among the params and returned as they came); the pair's loss, averaged."""
    loss = pair_loss(pair, dtype)

    def run(variables, batch):
        variables, kept = non_trainable.joined(variables)
        mutable = [c for c in variables if c != "params"]
        args, kwargs = pair.arguments("flax", batch)
        out = model.apply(variables, *args, mutable=mutable or False, **kwargs)
        outputs, new_state = out if mutable else (out, {})
        return loss(outputs, batch), {**new_state, **kept}

    return run


def pair_loss(pair: ModelPair, dtype: str):
    """``(outputs, batch) -> loss``: the pair's Flax loss on the model's outputs, averaged."""
    import jax.numpy as jnp

    def loss(outputs, batch):
        if dtype == "bfloat16":  # the loss in float32, as torch's autocast and FSDP2's root policy give it
            outputs = map_arrays(outputs, lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                                 else x)
        return jnp.mean(pair.flax_loss(outputs, batch))
    return loss


def _call_on_batch(pair: ModelPair):
    """A Flax ``method`` that calls the module on a batch's arguments: jaxdp's task contract takes
    positional model inputs only (``model.init(rng, *model_inputs(batch), **init_kwargs)``), so
    the batch is the one input and this method spreads it into the pair's args and kwargs."""
    def call(module, batch):
        args, kwargs = pair.arguments("flax", batch)
        return module(*args, **kwargs)

    return call


def task(pair: ModelPair, model, dtype: str):
    """jaxdp's task contract (``jaxdp.loss.task``) for the pair: ``loss_fn(params, model_state, batch, rng)``."""
    from jaxdp.loss.task import as_task

    run = apply_fn(pair, model, dtype)

    def loss_fn(params, model_state, batch, rng):
        loss, new_state = run({"params": params, **model_state}, batch)
        return loss, (new_state, {})

    return as_task(loss_fn, model_inputs=lambda batch: (batch,), init_kwargs={"method": _call_on_batch(pair)})


def run_jax_pair(p, pair: ModelPair, model, corr, variables: Mapping[str, Any],
                 batches: Sequence[Mapping[str, np.ndarray]]) -> List[dict]:
    """K jaxdp steps of the plan's strategy from ``variables``; a record per step, by torch name."""
    import jax

    from jaxdp.runtime.mesh import make_mesh
    from jaxdp.strategies import create_strategy, options_of
    from parity_tests.jax_side import optimizer, step_records
    from parity_tests.own import nnx_pair

    cfg = p.cfg
    with jax.enable_x64(cfg.dtype == "float64"):
        p.jax_x64 = bool(jax.config.jax_enable_x64)
        units = {"units": tuple(pair.flax_units)} if "units" in options_of(cfg.strategy) else {}
        if nnx_pair.is_nnx(model):  # its rng state beside the weights, and its own loss form
            model, pair_task, variables = nnx_pair.strategy_inputs(pair, model, pair_loss(pair, cfg.dtype), variables)
        else:
            pair_task = task(pair, model, cfg.dtype)
            keys = corr.non_trainable_params
            model, variables = non_trainable.for_strategy(model, keys), non_trainable.split(variables, keys)
        strategy = create_strategy(cfg.strategy, model, pair_task, optimizer(p), make_mesh(cfg.devices),
                                   accum_steps=cfg.accum_steps, return_grads=True, **units, **p.jax_options)
        state = strategy.engine.init_state(variables)
        return step_records(strategy, state, batches, cfg.optimizer, corr.params_to_torch,
                            functools.partial(corr.state_to_torch, key=non_trainable.jax_key))
