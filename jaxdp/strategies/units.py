"""How one FSDP unit runs: ``fsdp_unit``, gather before use and reduce-scatter after, as a ``custom_vjp``.

ZeRO-3 runs the user's loss on param *chunks* (``layout.py``); each unit (a submodule the user names,
found and caught on use by ``linen_units.py`` for Flax Linen and ``nnx_units.py`` for NNX) runs
through ``fsdp_unit``, in four parts, each its own function below:

- **the forward gather** (``gathered``): all-gather the unit's params just before it runs, once the
  previous unit's ``Lead`` (``lead.py``) says so, and hand the next unit its own;
- **the backward re-gather** (``regathered``): all-gather them again in backward, while the next
  unit's backward computes (the last unit: as its own forward ends);
- **the order of the reduce-scatters** (``scattered``): the gather's transpose reduce-scatters the
  param gradient, after the next unit's reduce-scatter, one per unit;
- **what ``remat`` keeps** for backward (``RULES``, a forward and backward rule per choice):
  ``"unit"``, the unit's inputs only (``recompute_fwd``/``recompute_bwd``); ``"none"``, its
  activations less the gathered params (``keep_fwd``/``keep_bwd``).

Nothing passes from the forward's trace to the backward's but the rule's residuals: which params
the kept activations leave out travels as their pytree's static data (``WithoutParams``), and
whether the next unit took this unit's ``Lead`` is whether its cotangent is a symbolic zero.
"""

from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jaxdp.names import REMATS
from jaxdp.parallel.protocol import varying_axes
from jaxdp.strategies.errors import UnitError  # noqa: F401 (re-exported: callers import the units' names here)
from jaxdp.strategies.lead import Lead
from jaxdp.strategies.linen_units import Path, Units, gather_on_use, in_unit, unit_paths  # noqa: F401 (the same)
from jaxdp.strategies.ties import after, floats, zero_of


def fsdp_unit(call: Callable, gather: Callable, chunks, state, args, kwargs, mutable: Sequence[str],
              remat: str = "unit", lead: Optional[Lead] = None):
    """Run one unit with FSDP's collectives; returns (output, updated mutable collections, ``Lead``
    for the next unit).

    forward: all-gather the unit's params (``gather(chunks)``) once ``lead``, the previous
    unit's ``Lead``, says so (``Lead``: one unit ahead; the first unit has none and may gather
    at once), and apply the unit. backward: all-gather them again (once the next unit's backward
    has started; the last unit, as its forward ends); the gather's transpose reduce-scatters the
    param gradient, after the next unit's reduce-scatter. ``remat`` says what forward keeps for backward:

    - ``"unit"``: only the unit's inputs; backward recomputes the unit (least memory).
    - ``"none"`` (FSDP2's default): the unit's activations, the residuals of its VJP,
      less the gathered params, which backward gathers again and puts back in their
      place. Nothing is recomputed; memory sits between DDP's and ``"unit"``'s. A param
      the unit uses only through a cast (bfloat16 compute on float32 params) leaves its
      cast copy among the residuals, not itself: that copy is kept to the backward (half
      the param's bytes, measured with ``--dtype bfloat16``).

    Why a ``custom_vjp`` and not ``jax.checkpoint``: a checkpoint's re-gather reads the same
    chunks as the forward's, and XLA's CPU pipeline drops the optimization barrier that
    keeps them apart before its last CSE pass, which then merges the two gathers: every
    unit's full params stayed alive from forward to backward (measured: 6 all-gathers
    instead of 12, more temp memory than DDP). Tying each gather to a value that exists
    only when it should run (``Lead``, the unit's output cotangent) is a data dependence no
    pass removes. A checkpoint policy that saves the dots (``dots_saveable``) meets the same
    passes, and would still recompute the unit's elementwise ops.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]

    def apply(params, state, arrays):
        """The unit on whole params: (output, updated mutable collections)."""
        it = iter(arrays)
        a, kw = jax.tree_util.tree_unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, is_array)])
        out = call({"params": params, **state}, *a, **kw)
        return out if mutable else (out, {})

    unit = Unit(apply, gather, lead)
    anchors = lead.arrays() if lead is not None else (jnp.zeros((), jnp.float32),) * 2
    rule = RULES[remat]  # remat is checked where the strategy's options are (jaxdp.strategies.options)
    run = jax.custom_vjp(lambda *inputs: forward(unit, *inputs)[0])
    run.defvjp(lambda *inputs: rule.fwd(unit, *custom_vjp_primal_tree_values(inputs)),
               lambda residuals, cotangents: rule.bwd(unit, residuals, *given(cotangents)), symbolic_zeros=True)
    (out, updated), handed = run(chunks, state, [x for x, a in zip(leaves, is_array) if a], anchors)
    return out, updated, Lead(*handed)


class Unit(NamedTuple):
    """One unit's call, as its forward and backward rules see it."""

    apply: Callable  # (params, state, arrays) -> (output, updated mutable collections)
    gather: Callable  # chunks -> whole params: an all-gather, whose transpose reduce-scatters
    lead: Optional[Lead]  # the previous unit's; None: a unit on its own, tied to nothing

    @property
    def first(self) -> bool:
        """No previous unit to wait for: its anchors are constants."""
        return self.lead is None or self.lead.root


# ----------------------------------------------------------------------------- the forward gather

def gathered(unit: Unit, chunks, anchors):
    """The unit's whole params, all-gathered once the previous unit's ``Lead`` exists (the first: at once)."""
    return unit.gather(chunks if unit.first else after(chunks, anchors[0]))


def handed_on(arrays, params):
    """The next unit's ``Lead`` (forward values: zeros tied to this unit's input and params)."""
    return zero_of([first_float(arrays), *floats(params)]), zero_of([first_float(arrays)])


def forward(unit: Unit, chunks, state, arrays, anchors):
    """Gather, apply, hand on: (((output, updated), the next unit's ``Lead``), ``done``, which the last
    unit's re-gather waits for: the ``Lead``'s gather zero (the unit's input and gathered params), so
    that it may overlap the unit's own forward, not only the head's few kernels)."""
    params = gathered(unit, chunks, anchors)
    out = unit.apply(params, state, arrays)
    handed = handed_on(arrays, params)
    return (out, handed), handed[0]


# ----------------------------------------------------------------------------- the backward re-gather

def regathered(unit: Unit, chunks, done, d_anchors, taken: bool):
    """The params again, and the gather's transpose (a reduce-scatter): once the next unit's
    backward has started (``d_anchors``: its ``Lead``'s cotangents, ``taken``: there is a next
    unit); the last unit, which has no next, once its own forward is ``done``, so that the gather
    overlaps the head and the loss. Tied to its output's cotangent instead (FSDP2's default),
    XLA ran it synchronously: nothing is left to overlap once the cotangent exists. torchtitan
    keeps the last block's params from forward to backward for the same reason."""
    return jax.vjp(unit.gather, after(chunks, d_anchors[0] if taken else done))


# ----------------------------------------------------------------------------- the reduce-scatters' order

def scattered(unit: Unit, scatter, d_params, d_arrays, anchors, d_anchors, taken: bool, params, dy):
    """The chunks' gradient, reduce-scattered after the next unit's; the input's cotangent; and the
    previous unit's ``Lead`` cotangents, zeros of its types: tied to this unit's ``dy`` and params
    (its re-gather may start) and to the reduce-scattered gradient (its reduce-scatter may start)."""
    if taken:
        d_params = after(d_params, d_anchors[1])
    d_chunks = scatter(d_params)[0]
    if unit.first:  # no previous unit: the anchors were constants
        return d_chunks, d_arrays if unit.lead is None else after(d_arrays, d_chunks), _zeros(anchors)
    return d_chunks, d_arrays, (zero_of([first_float(dy), *floats(params)], like=anchors[0]),
                                zero_of(floats(d_chunks), like=anchors[1]))


# ----------------------------------------------------------------------------- what remat keeps

class Rule(NamedTuple):
    """A ``custom_vjp``'s forward and backward rules for one ``remat`` choice."""

    fwd: Callable  # (unit, chunks, state, arrays, anchors) -> (outputs, residuals)
    bwd: Callable  # (unit, residuals, dy, d_anchors, taken) -> cotangents of the inputs


def recompute_fwd(unit: Unit, chunks, state, arrays, anchors):
    outputs, done = forward(unit, chunks, state, arrays, anchors)
    return outputs, (chunks, state, arrays, anchors, done)  # no gathered params kept


def recompute_bwd(unit: Unit, residuals, dy, d_anchors, taken: bool):
    chunks, state, arrays, anchors, done = residuals
    params, scatter = regathered(unit, chunks, done, d_anchors, taken)
    _, pullback = jax.vjp(lambda p, xs: unit.apply(p, state, xs)[0], params, arrays)
    d_params, d_arrays = pullback(dy)
    d_chunks, d_arrays, d_lead = scattered(unit, scatter, d_params, d_arrays, anchors, d_anchors, taken, params, dy)
    return d_chunks, _zeros(state), d_arrays, d_lead


def keep_fwd(unit: Unit, chunks, state, arrays, anchors):
    params = gathered(unit, chunks, anchors)
    out, pullback, updated = jax.vjp(lambda p, xs: unit.apply(p, state, xs), params, arrays, has_aux=True)
    saved = WithoutParams.of(pullback, params)
    handed = handed_on(arrays, params)
    return ((out, updated), handed), (chunks, state, saved, anchors, handed[0])


def keep_bwd(unit: Unit, residuals, dy, d_anchors, taken: bool):
    chunks, state, saved, anchors, done = residuals
    params, scatter = regathered(unit, chunks, done, d_anchors, taken)
    d_params, d_arrays = saved.with_params(params)(dy)
    d_chunks, d_arrays, d_lead = scattered(unit, scatter, d_params, d_arrays, anchors, d_anchors, taken, params, dy)
    return d_chunks, _zeros(state), d_arrays, d_lead


RULES = {"unit": Rule(recompute_fwd, recompute_bwd), "none": Rule(keep_fwd, keep_bwd)}
assert tuple(RULES) == REMATS


@jax.tree_util.register_pytree_node_class
class WithoutParams:
    """A VJP's pullback with the gathered params left out (matched by identity: a residual that
    *is* a param tracer): its other residuals are the leaves, and where the params sat is static
    data, so the backward gets both through the ``custom_vjp``'s residuals."""

    def __init__(self, saved: list, treedef, slots: tuple):
        self.saved, self.treedef, self.slots = saved, treedef, slots

    @classmethod
    def of(cls, pullback, params) -> "WithoutParams":
        index = {id(p): i for i, p in enumerate(jax.tree_util.tree_leaves(params))}
        residuals, treedef = jax.tree_util.tree_flatten(pullback)
        slots = tuple(index.get(id(r)) for r in residuals)
        return cls([r for r, s in zip(residuals, slots) if s is None], treedef, slots)

    def with_params(self, params):
        """The pullback, with ``params`` (gathered again) back in their places."""
        param_leaves, it = jax.tree_util.tree_leaves(params), iter(self.saved)
        return jax.tree_util.tree_unflatten(self.treedef, [next(it) if s is None else param_leaves[s]
                                                           for s in self.slots])

    def tree_flatten(self):
        return self.saved, (self.treedef, self.slots)

    @classmethod
    def tree_unflatten(cls, static, saved):
        return cls(list(saved), *static)


def given(cotangents):
    """The output cotangents as the rules take them: ``dy``, the ``Lead``'s cotangents, and whether a
    later unit took the ``Lead`` (else its cotangents are symbolic zeros); every symbolic zero made
    a zero array first thing, as ``custom_vjp`` does without ``symbolic_zeros``."""
    (_, _), d_anchors = cotangents  # mutated collections (BN running stats) carry no gradient
    taken = not any(isinstance(d, SymbolicZero) for d in d_anchors)
    (dy, _), d_anchors = jax.tree_util.tree_map(lambda d: _zero_of_type(d) if isinstance(d, SymbolicZero) else d,
                                                cotangents, is_leaf=lambda d: isinstance(d, SymbolicZero))
    return dy, d_anchors, taken


def _zero_of_type(d: SymbolicZero):
    """A zero array of a symbolic zero's type: its shape, dtype and the mesh axes it varies over."""
    if d.dtype == jax.dtypes.float0:
        return np.zeros(d.shape, d.dtype)
    axes = tuple(sorted(varying_axes(d)))
    zero = jnp.zeros(d.shape, d.dtype)
    return jax.lax.pcast(zero, axes, to="varying") if axes else zero


def _zeros(tree):
    return jax.tree_util.tree_map(jnp.zeros_like, tree)


def first_float(xs):
    return next((x for x in jax.tree_util.tree_leaves(xs) if jnp.issubdtype(x.dtype, jnp.inexact)), None)
