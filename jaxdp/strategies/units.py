"""FSDP units for any Flax module: gather a unit's params just before it runs.

torch's FSDP2 is applied per submodule (``fully_shard(block)`` for every
transformer block, then on the root). Here the user names the units by module
class (``units=(Block,)``) or by module path (``units=("encoder/layer_*",)``,
fnmatch on the '/'-joined path); the outermost match wins, so units never
nest. Parameters outside every unit form the root unit, as in FSDP2.

How it runs without restating the model. The strategy hands the loss function
params in which every unit's leaves are still this device's *chunks*
(``layout.py``) and only the root's are gathered. While the loss function runs,
a Flax method interceptor (``nn.intercept_methods``) catches each unit's
``__call__`` before the unit reads a single parameter, and runs it instead as
``fsdp_unit``: all-gather the unit's params, apply an unbound copy of the unit
to them, and write the unit's mutated collections (BatchNorm stats) back into
the running model. Composing the units this way is ``model.apply`` itself, op
for op (tests/test_zero.py checks it bit for bit).

Random numbers: a unit that draws them (dropout) draws what it would draw under
a plain ``model.apply`` (``_unbound_call``), so units never change the masks.
"""

import contextlib
import fnmatch
from typing import Any, Callable, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.strategies.ties import after, floats, zero_of
from jaxdp.names import REMATS  # noqa: F401 (what a unit keeps for backward, ``fsdp_unit``: "unit" | "none")

Path = Tuple[str, ...]


class UnitError(ValueError):
    """The unit specification matches nothing, or is malformed."""


class Units:
    """Which modules are FSDP units: classes and/or path patterns."""

    def __init__(self, spec: Sequence[Any] = ()):
        spec = tuple(spec) if isinstance(spec, (list, tuple)) else (spec,)
        bad = [s for s in spec if not (isinstance(s, str) or (isinstance(s, type) and issubclass(s, nn.Module)))]
        if bad:
            raise UnitError(f"units are Flax module classes or path patterns like 'blocks_*', got {bad!r}")
        self.classes = tuple(s for s in spec if isinstance(s, type))
        self.patterns = tuple(s for s in spec if isinstance(s, str))

    def __bool__(self):
        return bool(self.classes or self.patterns)

    def matches(self, module: nn.Module) -> bool:
        if self.classes and isinstance(module, self.classes):
            return True
        path = "/".join(module.path)
        return any(fnmatch.fnmatchcase(path, p) for p in self.patterns)

    # What ZeRO asks of its units, Linen's or an NNX model's (nnx_units.NNXUnits): where they are, and
    # running each through ``gather_unit`` while a loss runs.
    def paths(self, init_fn: Callable, *args, with_shapes: Optional[list] = None) -> List[Path]:
        return unit_paths(self, init_fn, *args, with_shapes=with_shapes)

    def on_use(self, gather_unit: Callable):
        return gather_on_use(self, gather_unit)


def unit_paths(units: Units, init_fn: Callable, *args, with_shapes: Optional[list] = None) -> List[Path]:
    """The module paths of the outermost unit instances, found by tracing ``init_fn(*args)``
    abstractly (nothing is computed). ``with_shapes``: a list that receives ``init_fn``'s
    abstract output, so a caller that needs it too traces once."""
    found, depth = [], [0]

    def record(next_fun, a, kw, ctx):
        is_unit = ctx.method_name == "__call__" and units.matches(ctx.module)
        if is_unit and depth[0] == 0:
            found.append(tuple(ctx.module.path))
        depth[0] += is_unit
        try:
            return next_fun(*a, **kw)
        finally:
            depth[0] -= is_unit

    with nn.intercept_methods(record):  # a fresh function: a cached trace of init_fn would run no interceptor
        shapes = jax.eval_shape(lambda *a: init_fn(*a), *args)
    if with_shapes is not None:
        with_shapes.append(shapes)
    unique = list(dict.fromkeys(found))  # a unit called twice (shared weights) is one unit
    if units and not unique:
        raise UnitError(f"no module matches the FSDP units {units.classes + units.patterns}")
    return unique


def in_unit(path: Path, paths: Sequence[Path]) -> bool:
    return any(path[:len(p)] == p for p in paths)


@contextlib.contextmanager
def gather_on_use(units: Units, gather_unit: Callable):
    """While active, every outermost unit's ``__call__`` runs as ``gather_unit(module, call, variables,
    mutable, args, kwargs) -> (out, new collections)``; ``call(variables, *args, **kwargs)`` applies an
    unbound copy of the unit."""
    depth = [0]

    def intercept(next_fun, args, kwargs, ctx):
        module = ctx.module
        if depth[0] or ctx.method_name != "__call__" or not units.matches(module) or module.is_initializing():
            return next_fun(*args, **kwargs)
        depth[0] += 1
        try:
            variables = module.variables
            mutable = [c for c in variables if c != "params" and module.is_mutable_collection(c)]
            call = _unbound_call(module, mutable)

            out, updated = gather_unit(module, call, variables, mutable, args, kwargs)
            for collection, tree in updated.items():
                for name, value in tree.items():
                    module.put_variable(collection, name, value)
            return out
        finally:
            depth[0] -= 1

    with nn.intercept_methods(intercept):
        yield


def _unbound_call(module: nn.Module, mutable: Sequence[str]) -> Callable:
    """``call(variables, *args, **kwargs)``: ``module`` applied as an unbound copy that draws the
    random numbers the bound module would have drawn.

    A Flax scope's key for stream ``name`` is the root key with the scope's path folded in
    (a ``LazyRng``), and each draw folds in a per-scope counter. The copy gets the unit's
    ``LazyRng`` itself as its root key and starts from the unit's counters, so each
    dropout inside it folds in the same path and count as under ``model.apply``. Each call
    starts from the same counters (``fsdp_unit`` traces the unit again for backward and must
    draw the same masks); the bound unit's counters then advance as after one plain call,
    so a unit called twice (shared weights) draws fresh masks the second time.
    """
    rngs = dict(module.scope.rngs)
    start = _copy_counters(module.scope.rng_counters)
    after = []

    def run(m, *a, **kw):
        m.scope.rng_counters = _copy_counters(start)
        out = m(*a, **kw)
        after[:] = [_copy_counters(m.scope.rng_counters)]
        return out

    unbound = module.clone(parent=None)

    def call(v, *a, **kw):
        out = unbound.apply(v, *a, method=run, mutable=mutable or False, rngs=rngs or None, **kw)
        if after:
            _set_counters(module.scope.rng_counters, after[0])
        return out
    return call


def _copy_counters(counters: dict) -> dict:
    """A Flax scope's rng counters (ints, and child scopes' dicts under object keys), copied."""
    return {k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _set_counters(counters: dict, values: dict) -> None:
    """``counters`` updated in place to ``values`` (child scopes share their dicts by identity)."""
    for k, v in values.items():
        if isinstance(v, dict):
            _set_counters(counters.setdefault(k, {}), v)
        else:
            counters[k] = v




class Lead:
    """What one unit hands the next so that their collectives overlap compute, one unit ahead, in order.

    Two float scalars of value zero, carried as a data dependence (XLA reorders and combines
    collectives freely otherwise):

    - ``gather``, forward: made from the unit's input and its gathered params. The next unit's
      gather waits for it, so it starts as this unit starts computing (FSDP2's forward
      prefetch), never earlier (at most two units' params alive), and never before this unit's
      own gather is done (XLA's all-gather combiner cannot merge the two into one that waits for
      both). Backward, its cotangent comes from the next unit's backward *first thing* (made from
      that unit's output cotangent and re-gathered params): this unit's re-gather waits for it
      instead of its own output cotangent, so it runs while the next unit's backward computes
      (FSDP2's backward prefetch), one at a time;
    - ``scatter``: its cotangent comes from the next unit's reduce-scattered gradient: this
      unit's reduce-scatter waits for it, so the reduce-scatters run one per unit, each as its
      unit's backward ends, instead of one combined reduce-scatter after the whole backward.

    ``taken``: whether a later unit received it. Only then does its cotangent carry a dependence
    (else it is a constant zero, and a gather tied to it could be hoisted anywhere): a unit whose
    ``Lead`` nobody took, the last, re-gathers as its own forward ends instead.
    """

    def __init__(self, gather, scatter, root: bool = False):
        self.gather, self.scatter, self.taken, self.root = gather, scatter, False, root

    @classmethod
    def of_root(cls) -> "Lead":
        """The first unit's: no previous unit to follow (its gather may start at once). Backward, the first
        unit's input cotangent waits for its reduce-scatter, so that the root's reduce-scatter (after
        the stem's backward) follows every unit's: else XLA merges it with the last unit's, which then
        waits for the whole backward. (Tying the first unit's gather to the root's gathered params made
        XLA lay the stem's activations out anew: 227 more transposes, compiled for H100s.)"""
        return cls(zero_of([]), zero_of([]), root=True)

    def arrays(self):
        return (self.gather, self.scatter)


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
    passes (DESIGN.md section 9), and would still recompute the unit's elementwise ops.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
    arrays = [x for x, a in zip(leaves, is_array) if a]
    if lead is not None:
        lead.taken = True
    anchors = lead.arrays() if lead is not None else (jnp.zeros((), jnp.float32),) * 2
    produced = []  # this call's Lead, read by its backward (traced after every unit's forward)

    def apply(params, state, arrays):
        it = iter(arrays)
        a, kw = jax.tree_util.tree_unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, is_array)])
        out = call({"params": params, **state}, *a, **kw)
        return out if mutable else (out, {})

    def gathered(chunks, anchors):
        return gather(chunks if lead is None or lead.root else after(chunks, anchors[0]))

    def handed_on(arrays, params):
        """The next unit's ``Lead`` (forward values: zeros tied to this unit's input and params)."""
        return zero_of([first_float(arrays), *floats(params)]), zero_of([first_float(arrays)])

    def regather(chunks, done, d_anchors):
        """The params again, and the gather's transpose (a reduce-scatter): once the next unit's
        backward has started (``d_anchors``: its ``Lead``'s cotangents); the last unit, which has no
        next, once its own forward is ``done`` (a zero made from its output), so that the gather
        overlaps the head and the loss. Tied to its output's cotangent instead (FSDP2's default),
        XLA ran it synchronously: nothing is left to overlap once the cotangent exists. torchtitan
        keeps the last block's params from forward to backward for the same reason."""
        return jax.vjp(gather, after(chunks, d_anchors[0] if _taken(produced) else done))

    def scattered(scatter, d_params, d_arrays, d_anchors, params, dy):
        """The chunks' gradient, reduce-scattered after the next unit's; the input's cotangent; and the
        previous unit's ``Lead`` cotangents, zeros of its types: tied to this unit's ``dy`` and params
        (its re-gather may start) and to the reduce-scattered gradient (its reduce-scatter may start)."""
        if _taken(produced):
            d_params = after(d_params, d_anchors[1])
        d_chunks = scatter(d_params)[0]
        if lead is None or lead.root:  # no previous unit: the anchors were constants
            return d_chunks, d_arrays if lead is None else after(d_arrays, d_chunks), _zeros(anchors)
        return d_chunks, d_arrays, (zero_of([first_float(dy), *floats(params)], like=anchors[0]),
                                    zero_of(floats(d_chunks), like=anchors[1]))

    def forward(chunks, state, arrays, anchors):
        params = gathered(chunks, anchors)
        out = apply(params, state, arrays)
        return (out, handed_on(arrays, params)), zero_of([first_float(out[0])])

    @jax.custom_vjp
    def run(chunks, state, arrays, anchors):
        return forward(chunks, state, arrays, anchors)[0]

    def recompute_fwd(chunks, state, arrays, anchors):
        outputs, done = forward(chunks, state, arrays, anchors)
        return outputs, (chunks, state, arrays, anchors, done)  # no gathered params kept

    def recompute_bwd(residuals, cotangents):
        chunks, state, arrays, anchors, done = residuals
        (dy, _), d_anchors = cotangents  # mutated collections (BN running stats) carry no gradient
        params, scatter = regather(chunks, done, d_anchors)
        _, pullback = jax.vjp(lambda p, xs: apply(p, state, xs)[0], params, arrays)
        d_params, d_arrays = pullback(dy)
        d_chunks, d_arrays, d_lead = scattered(scatter, d_params, d_arrays, d_anchors, params, dy)
        return d_chunks, _zeros(state), d_arrays, d_lead

    pullback_shape = []  # set while tracing forward, read while tracing backward

    def keep_fwd(chunks, state, arrays, anchors):
        params = gathered(chunks, anchors)
        out, pullback, updated = jax.vjp(lambda p, xs: apply(p, state, xs), params, arrays, has_aux=True)
        saved, shape = _without_params(pullback, params)
        pullback_shape[:] = [shape]
        done = zero_of([first_float(out)])
        return ((out, updated), handed_on(arrays, params)), (chunks, state, saved, anchors, done)

    def keep_bwd(residuals, cotangents):
        chunks, state, saved, anchors, done = residuals
        (dy, _), d_anchors = cotangents
        params, scatter = regather(chunks, done, d_anchors)
        d_params, d_arrays = _with_params(saved, pullback_shape[0], params)(dy)
        d_chunks, d_arrays, d_lead = scattered(scatter, d_params, d_arrays, d_anchors, params, dy)
        return d_chunks, _zeros(state), d_arrays, d_lead

    # remat is checked where the strategy's options are (jaxdp.strategies.options): one of REMATS.
    run.defvjp(*{"unit": (recompute_fwd, recompute_bwd), "none": (keep_fwd, keep_bwd)}[remat])
    (out, updated), handed = run(chunks, state, arrays, anchors)
    produced.append(Lead(*handed))
    return out, updated, produced[0]


def _taken(produced: list) -> bool:
    return bool(produced) and produced[0].taken


def _zeros(tree):
    return jax.tree_util.tree_map(jnp.zeros_like, tree)


def first_float(xs):
    return next((x for x in jax.tree_util.tree_leaves(xs) if jnp.issubdtype(x.dtype, jnp.inexact)), None)


def _without_params(pullback, params):
    """A VJP's residuals with the gathered params left out (matched by identity: a residual
    that *is* a param tracer), and what ``_with_params`` needs to put them back."""
    index = {id(p): i for i, p in enumerate(jax.tree_util.tree_leaves(params))}
    residuals, treedef = jax.tree_util.tree_flatten(pullback)
    slots = [index.get(id(r)) for r in residuals]
    return [r for r, s in zip(residuals, slots) if s is None], (treedef, slots)


def _with_params(saved, shape, params):
    treedef, slots = shape
    param_leaves, it = jax.tree_util.tree_leaves(params), iter(saved)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if s is None else param_leaves[s] for s in slots])
