"""FSDP units of a Flax Linen module: found by tracing its init, run through ``fsdp_unit`` on use.

torch's FSDP2 is applied per submodule (``fully_shard(block)`` for every transformer block, then on
the root). Here the user names the units by module class (``units=(Block,)``) or by module path
(``units=("encoder/layer_*",)``, fnmatch on the '/'-joined path); the outermost match wins, so units
never nest. Parameters outside every unit form the root unit, as in FSDP2.

How it runs without restating the model. The strategy hands the loss function params in which every
unit's leaves are still this device's *chunks* (``layout.py``) and only the root's are gathered.
While the loss function runs, a Flax method interceptor (``nn.intercept_methods``) catches each
unit's ``__call__`` before the unit reads a single parameter, and runs it instead through the
strategy's ``gather_unit`` (``units.fsdp_unit``): all-gather the unit's params, apply an unbound
copy of the unit to them, and write the unit's mutated collections (BatchNorm stats) back into the
running model. Composing the units this way is ``model.apply`` itself, op for op
(tests/test_zero.py checks it bit for bit).

Random numbers: a unit that draws them (dropout) draws what it would draw under a plain
``model.apply`` (``_unbound_call``), so units never change the masks.
"""

import contextlib
import fnmatch
from typing import Any, Callable, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax

from jaxdp.strategies.errors import UnitError

Path = Tuple[str, ...]


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
