"""Tensor parallelism on the ``model`` axis: Megatron's column- and row-parallel layers.

A transformer MLP ``fc2(gelu(fc1(x)))`` on M devices: ``fc1`` is **column-parallel** (each
device holds 1/M of its output features, its kernel's last dim), the GELU runs on that slice,
``fc2`` is **row-parallel** (each device holds the matching 1/M of its input features, its
kernel's dim -2) and produces a partial sum of the output, which one all-reduce (``psum``
over ``model``) completes; ``fc2``'s bias is added once, after the sum. Attention is the same
with heads for features: ``qkv`` column-parallel by heads, ``proj`` row-parallel. Per layer
pair: one all-reduce of the activations in forward, one in backward.

The backward collective needs no code. Inside ``shard_map`` (``check_vma=True``) the
activation entering a column-parallel layer is the same on every model device
("invariant"); multiplying it by a kernel slice that differs per device makes JAX cast it to
"varying", and the transpose of that cast is a ``psum``: Megatron's backward all-reduce.
The forward ``psum``'s transpose is the identity. Replicated parameters (LayerNorm,
embeddings, the head) see identical values on every model device and get identical,
complete gradients.

Layout. A plan maps variable paths (fnmatch on ``collection/module/.../name``) to ``Column``
or ``Row``. A split variable keeps its canonical (single-device, torch-twin) shape in the
train state, cut along one dim over ``model``; a fused projection such as ``qkv`` (q, k and
v concatenated, ``Column(groups=3)``) is stored with its groups interleaved by device, so
that device j's contiguous block is [q_j, k_j, v_j], the heads it owns. ``to_state`` and
``from_state`` convert; checkpoints and parity comparisons use the canonical order.
"""

import fnmatch
import functools
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from jaxdp.runtime.mesh import MODEL_AXIS, axis_size


class TensorParallelError(ValueError):
    """A model or mesh that cannot be split as asked."""


@dataclass(frozen=True)
class Column:
    """Output features split over ``model``: the last dim (Dense (in, out), Conv HWIO, biases,
    per-channel BatchNorm variables). ``groups``: the output is ``groups`` projections
    concatenated (qkv: 3), each split on its own."""

    groups: int = 1
    dim: int = -1


@dataclass(frozen=True)
class Row:
    """Input features split over ``model``: dim -2 (Dense (in, out), Conv HWIO). The layer's
    output is a partial sum, completed by ``psum`` over ``model`` (``summed_over``)."""

    groups: int = 1
    dim: int = -2


@functools.lru_cache(maxsize=None)
def summed_over(axis: str, op=jax.lax.dot_general):
    """``op`` (``dot_general`` for ``flax.linen.Dense(dot_general=...)``, or
    ``conv_general_dilated`` for ``nn.Conv(conv_general_dilated=...)``) with its product
    all-reduced over ``axis``: the row-parallel layer. The layer adds its bias after it, once.
    Cached, so that two modules built for the same axis compare equal."""

    def summed(*args, **kwargs):
        return jax.lax.psum(op(*args, **kwargs), axis)
    return summed


def model_axis_size(axis: Optional[str]) -> int:
    """How many ways a layer is split: the axis size inside ``shard_map``, 1 for no axis."""
    return 1 if axis is None else jax.lax.axis_size(axis)


def path_name(path) -> str:
    """'params/blocks/0/attn/qkv/kernel' for a tree path."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


class TensorParallel:
    """One model's plan on a mesh's ``model`` axis of ``size`` devices."""

    def __init__(self, plan: Mapping[str, object], size: int, axis: str = MODEL_AXIS, note: Optional[str] = None):
        bad = {p: r for p, r in plan.items() if not isinstance(r, (Column, Row))}
        if bad:
            raise TensorParallelError(f"a tensor-parallel plan maps paths to Column() or Row(), got {bad!r}")
        self.plan, self.size, self.axis = dict(plan), size, axis
        self.note = note  # one line for the user (the trainer prints it), e.g. a layer left whole

    def rule(self, path: str):
        for pattern, rule in self.plan.items():
            if fnmatch.fnmatchcase(path, pattern):
                return rule
        return None

    def dim(self, path: str, shape: Sequence[int]) -> Optional[int]:
        """The dim ``path`` is split along (non-negative), or None if replicated on ``model``."""
        rule = self.rule(path)
        return None if rule is None or not len(shape) else rule.dim % len(shape)

    def local_shape(self, path: str, shape: Sequence[int]) -> Tuple[int, ...]:
        d = self.dim(path, shape)
        return tuple(s // self.size if i == d else s for i, s in enumerate(shape))

    # -- canonical order <-> state order ---------------------------------------------------------
    def to_state(self, path: str, x):
        """Canonical -> state order: a grouped dim's groups interleaved by device."""
        return self._regroup(path, x, to_state=True)

    def from_state(self, path: str, x):
        return self._regroup(path, x, to_state=False)

    def _regroup(self, path, x, to_state: bool):
        rule, d = self.rule(path), self.dim(path, np.shape(x))
        if d is None or rule.groups == 1 or self.size == 1:
            return x
        g, m = rule.groups, self.size
        shape = x.shape
        r = shape[d] // (g * m)
        first = (g, m, r) if to_state else (m, g, r)  # canonical: [group][device][rows]
        y = x.reshape(shape[:d] + first + shape[d + 1:])
        y = jax.numpy.swapaxes(y, d, d + 1)
        return y.reshape(shape)

    def check(self, variables) -> None:
        """Every split dim divides into ``size`` (x groups) pieces, and every rule matches a variable."""
        used = set()
        for collection, tree in variables.items():
            for p, x in jax.tree_util.tree_leaves_with_path(tree):
                path = f"{collection}/{path_name(p)}"
                rule, d = self.rule(path), self.dim(path, np.shape(x))
                if rule is None or d is None:
                    continue
                used.update(pat for pat in self.plan if fnmatch.fnmatchcase(path, pat))
                if np.shape(x)[d] % (self.size * rule.groups):
                    raise TensorParallelError(
                        f"{path} has {np.shape(x)[d]} features along dim {d}, which do not split "
                        f"{self.size} ways{f' in {rule.groups} groups' if rule.groups > 1 else ''} "
                        f"(mesh model={self.size})")
        unused = sorted(set(self.plan) - used)
        if unused:
            raise TensorParallelError(f"tensor-parallel rules match no variable: {', '.join(unused)}")


def plan_of(model, size: int):
    """The plan the model declares for ``size`` model devices: on itself (a ``tp_plan(size)``
    method or a ``TP_PLAN`` class attribute: a user's model, ``jaxdp.parallel.protocol``) or
    beside its class, in its module (``tp_plan(model, size)`` where the plan depends on the
    model's sizes, else ``TP_PLAN``: jaxdp's models); or None."""
    own = getattr(type(model), "tp_plan", None)
    if callable(own):
        return own(model, size)
    if getattr(type(model), "TP_PLAN", None) is not None:
        return type(model).TP_PLAN
    make = beside(model, "tp_plan")
    return make(model, size) if make is not None else beside(model, "TP_PLAN")


def beside(model, name: str):
    """What the model's class module declares as ``name`` (its tensor-parallel facts), or None."""
    return getattr(sys.modules.get(type(model).__module__), name, None)


def for_mesh(model, mesh, plan=None) -> Optional[TensorParallel]:
    """``model``'s tensor parallelism on ``mesh``: None without a ``model`` axis of size > 1. The
    model takes one (its plan, its ``model_axis`` field): ``jaxdp.parallel.supports`` checked it."""
    size = axis_size(mesh, MODEL_AXIS)
    if size == 1:
        return None
    plan = plan if plan is not None else plan_of(model, size)
    note = model.model_split_note(size) if hasattr(model, "model_split_note") else None
    return TensorParallel(plan, size, note=note)
