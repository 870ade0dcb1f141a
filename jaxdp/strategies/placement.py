"""Where each variable of the train state lives on the mesh: tensor parallelism's cut over
``model`` (``jaxdp.parallel.tensor``) composed with ZeRO's cut over ``data`` (``layout.py``).

Every rule here is a function of a variable's path and canonical shape only, so the same
placement serves init (built already sharded), the step's ``shard_map`` specs, the
conversions to and from the canonical layout (parity, export) and checkpoints.

The composition, as torchtitan applies ``parallelize_module`` and then ``fully_shard``:
tensor parallelism first cuts a variable into M model slices; ZeRO then cuts each device's
model slice N ways along the dimension ``layout.shard_dim`` picks *for the slice's shape*,
padding the slice if N does not divide it. When both cut the same dimension, its
PartitionSpec entry is ``("model", "data")`` (model-major) and each model block is padded
on its own. Without a model axis this is exactly ``layout.py``'s ZeRO layout.
"""

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxdp.parallel.tensor import TensorParallel, path_name
from jaxdp.strategies import layout


class Placement:
    def __init__(self, tp: Optional[TensorParallel], n: int, axis):
        self.tp, self.n, self.axis = tp, n, axis

    # -- one variable --------------------------------------------------------------------------
    def _tp_dim(self, path, shape):
        return None if self.tp is None else self.tp.dim(path, shape)

    def local_shape(self, path: str, shape):
        """The canonical shape as one model device holds it (``shape`` without a model axis)."""
        return tuple(shape) if self.tp is None else self.tp.local_shape(path, shape)

    def spec(self, path: str, shape, zero: bool) -> P:
        """The PartitionSpec of the variable of canonical ``shape``."""
        d_tp, local = self._tp_dim(path, shape), self.local_shape(path, shape)
        d_z = layout.shard_dim(local, self.n) if zero else None
        entries = [None] * len(shape)
        if d_tp is not None:
            entries[d_tp] = self.tp.axis
        if d_z is not None:
            entries[d_z] = (self.tp.axis, self.axis) if d_z == d_tp else self.axis
        return P(*entries)

    def state_shape(self, path: str, shape, zero: bool):
        """The shape the state holds: ZeRO's padding applied to each model slice."""
        if not zero:
            return tuple(shape)
        padded, d_tp = layout.padded_shape(self.local_shape(path, shape), self.n), self._tp_dim(path, shape)
        m = 1 if d_tp is None else self.tp.size
        return tuple(s * m if i == d_tp else s for i, s in enumerate(padded))

    def to_state(self, path: str, x, zero: bool):
        """Canonical value -> the state's: the model slices in device order, each padded."""
        x = x if self.tp is None else self.tp.to_state(path, x)
        return self.pad(path, x) if zero else x

    def pad(self, path: str, x):
        """ZeRO's padding of each model slice of a value already in the state's order."""
        return self._per_model_block(path, x, lambda b: layout.pad(b, self.n))

    def from_state(self, path: str, x, shape, zero: bool):
        """Inverse of ``to_state`` (``shape``: the canonical shape)."""
        if zero:
            local = self.local_shape(path, shape)
            x = self._per_model_block(path, x, lambda b: layout.unpad(b, local), shape)
        return x if self.tp is None else self.tp.from_state(path, x)

    def _per_model_block(self, path, x, fn, shape=None):
        """``fn`` on each model slice of ``x`` (the dim cut over ``model`` viewed as (M, slice))."""
        d = self._tp_dim(path, shape if shape is not None else np.shape(x))
        if d is None or self.tp.size == 1:
            return fn(x)
        m = self.tp.size
        blocks = x.reshape(x.shape[:d] + (m, x.shape[d] // m) + x.shape[d + 1:])
        moved = jnp.moveaxis(blocks, d, 0)  # (M, ...slice...)
        done = jnp.stack([fn(b) for b in moved])
        out = jnp.moveaxis(done, 0, d)
        return out.reshape(out.shape[:d] + (m * out.shape[d + 1],) + out.shape[d + 2:])

    # -- trees ---------------------------------------------------------------------------------
    def tree(self, fn, tree, prefix: str, *rest):
        """``fn(path, leaf, *rest_leaves)`` over a variables tree, paths like 'params/blocks/0/...'."""
        return jax.tree_util.tree_map_with_path(
            lambda p, x, *r: fn("/".join(filter(None, (prefix, path_name(p)))), x, *r), tree, *rest)

    def specs(self, tree, prefix: str, zero: bool, canonical=None):
        """Specs of ``tree`` (``canonical``: its canonical shapes, when ``tree`` is padded)."""
        ref = tree if canonical is None else canonical
        return self.tree(lambda path, x, c: self.spec(path, np.shape(c), zero), tree, prefix, ref)

    def variables_specs(self, variables, zero: bool, canonical=None):
        """Specs of a dict of collections (``model_state``: {"batch_stats": ...})."""
        return {c: self.specs(v, c, zero, None if canonical is None else canonical[c]) for c, v in variables.items()}

    def opt_specs(self, tx, opt_state, params_canonical, zero: bool):
        """The optimizer state's specs: each params-shaped part placed as the params are
        (``optax.tree_utils.tree_map_params``), everything else (step counts) replicated."""
        if self.tp is None:  # the shape decides (layout.py), so no need to find the params in it
            return layout.tree_specs(opt_state, self.n, self.axis) if zero else \
                jax.tree_util.tree_map(lambda _: P(), opt_state)
        param_specs = self.specs(params_canonical, "params", zero)
        return optax.tree_utils.tree_map_params(
            tx, lambda _, spec: spec, opt_state, param_specs,
            transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))

    def opt_map(self, tx, fn, opt_state, params_canonical, other=None):
        """``fn(path, leaf, canonical)`` on the optimizer state's params-shaped leaves, ``other``
        (default: unchanged) on the rest (step counts)."""
        paths = self.tree(lambda path, _: path, params_canonical, "params")
        return optax.tree_utils.tree_map_params(
            tx, lambda leaf, path, canonical: fn(path, leaf, canonical), opt_state, paths, params_canonical,
            transform_non_params=other)
