"""Torch weights into a Flax model and back, in one call each: the correspondence derived
(``matching.derive``) and applied, for a Linen model's variables or an NNX module.

A Linen model is given by its variables (``model.init(...)`` or ``jax.eval_shape`` of it; with
``trace_linen`` the classes of its modules too): the result is new variables, numpy arrays, for
``model.apply``. An NNX module is given itself: the
result is a copy of it holding the torch weights (its ``nnx.Param``s and ``nnx.BatchStat``s; its
rng state stays its own), and its submodules' classes tell a square 2-D weight's layout. Each
loaded array takes the dtype of the Flax variable it replaces, or ``dtype`` if given.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.interop.correspondence import Correspondence, flatten
from jaxdp.interop.layouts import as_numpy
from jaxdp.interop.matching import derive
from jaxdp.loss.nnx_state import Parts, is_nnx

WEIGHTS = ("params", "batch_stats")  # an NNX module's collections that hold weights (not its rng state)


def load_torch_weights(torch_model, flax, state_dict: Optional[Mapping[str, Any]] = None, override=None,
                       flax_classes: Optional[Mapping[Sequence[str], type]] = None, dtype=None):
    """``torch_model``'s weights (or ``state_dict``'s, by its names) in ``flax``: a Linen model's
    variables -> new variables; an ``nnx.Module`` -> a copy of it holding them.
    ``override``/``flax_classes``: as ``derive`` takes them. ``CorrespondenceError`` in one
    message if the two models do not correspond one to one."""
    state_dict = torch_model.state_dict() if state_dict is None else state_dict
    if is_nnx(flax):
        parts = Parts(flax, type(flax).__name__)
        own = parts.variables()
        weights = {k: v for k, v in own.items() if k in WEIGHTS}
        corr = derive(torch_model, weights, override, flax_classes or module_classes(flax))
        loaded = _like(corr.to_flax(state_dict, dtype), weights, dtype)
        return parts.merge({**own, **{k: _as_jax(v) for k, v in loaded.items()}})
    corr = derive(torch_model, flax, override, flax_classes)
    return _like(corr.to_flax(state_dict, dtype), flax, dtype)


def torch_state_dict(torch_model, flax, override=None,
                     flax_classes: Optional[Mapping[Sequence[str], type]] = None) -> Dict[str, np.ndarray]:
    """The Flax model's weights (Linen variables, or an ``nnx.Module``) as a whole torch
    ``state_dict`` of numpy arrays, in torch's order, for ``torch_model.load_state_dict``: a
    tied tensor under each of its names, and a buffer Flax has no counterpart of (BatchNorm's
    ``num_batches_tracked``) with torch's own value."""
    if is_nnx(flax):
        variables = {k: v for k, v in Parts(flax, type(flax).__name__).variables().items() if k in WEIGHTS}
        flax_classes = flax_classes or module_classes(flax)
    else:
        variables = flax
    corr = derive(torch_model, variables, override, flax_classes)
    return complete(corr, torch_model.state_dict(), corr.to_torch(variables))


def complete(corr: Correspondence, torch_own: Mapping[str, Any], converted: Mapping[str, np.ndarray]):
    """``converted`` with what it lacks of a whole state_dict: torch's own values of the tensors
    with no Flax counterpart, and each tied tensor's second names."""
    out = {name: as_numpy(value).copy() for name, value in torch_own.items()}
    out.update(converted)
    out.update({alias: out[name] for alias, name in corr.tied.items()})
    return out


def trace_linen(model: nn.Module, *args, **kwargs):
    """(a Linen model's variables as ``ShapeDtypeStruct``s, the class of the module at each path):
    its ``init`` on these inputs traced, nothing computed."""
    classes: Dict[tuple, type] = {}

    def record(next_fun, a, kw, ctx):
        classes.setdefault(tuple(ctx.module.path), type(ctx.module))
        return next_fun(*a, **kw)

    with nn.intercept_methods(record):
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    return shapes, classes


def module_classes(module) -> Dict[tuple, type]:
    """The class of an NNX module's submodule at each attribute path (a square weight's layout)."""
    return {tuple(map(str, path)): type(node) for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Module)}


def _like(loaded: Dict[str, Any], target: Mapping[str, Any], dtype=None) -> Dict[str, Any]:
    """``loaded`` with each array in the dtype of the target's variable at its key (``dtype`` given:
    those that ``to_flax`` cast to it stay so)."""
    if dtype is not None:
        return loaded
    dtypes = {key: np.dtype(getattr(v, "dtype", np.asarray(v).dtype)) for key, v in flatten(target).items()}

    def cast(tree, path):
        if isinstance(tree, Mapping):
            return {k: cast(v, path + (k,)) for k, v in tree.items()}
        return tree.astype(dtypes[path]) if path in dtypes and tree.dtype != dtypes[path] else tree

    return cast(loaded, ())


def _as_jax(tree):
    return {k: _as_jax(v) for k, v in tree.items()} if isinstance(tree, Mapping) else jnp.asarray(tree)
