"""FSDP units for a Flax NNX model: the same gather-on-use as Linen's (``units.py``), found and
intercepted the NNX way.

The user names the units by ``nnx.Module`` class (``units=(Block,)``) or by attribute path
(``units=("blocks/*",)``, fnmatch on the '/'-joined path, an ``nnx.List``'s index a part of
it); the outermost match wins, so units never nest, and the params outside every unit form
the root unit. The units are found by walking the module's graph (``nnx.iter_modules``):
an NNX module is built already, so nothing is traced.

How a unit runs. ``jaxdp.loss.nnx_task`` merges the step's module from param *chunks*
(``layout.py``; the root's are gathered) and, before the user's loss runs, hands it to
``on_use``'s hook. There every unit instance's class is swapped, for the duration of the
loss, for a subclass whose ``__call__`` runs the unit through the strategy's
``gather_unit``, the callback Linen's interceptor calls (``units.gather_on_use``): with
``call(variables, *args, **kwargs)`` applying a copy of the unit merged from the gathered
params, and ``variables`` the unit's own ``{"params": chunks, "batch_stats": ...,
"rng_counts": ...}`` (``jaxdp.loss.nnx_state``). So ``fsdp_unit`` (gather before use, re-gather
in backward, ``remat``, prefetch) is the same function for both APIs. What the copy's forward
updated (BatchNorm statistics, rng counts) is written back into the running module.

Random numbers: the unit's rng counts enter ``fsdp_unit`` as state, so a unit run again in
backward (``remat="unit"``) draws the masks its forward drew.
"""

import contextlib
import fnmatch
import types
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import jax
from flax import nnx

from jaxdp.loss import nnx_task
from jaxdp.loss.nnx_state import Parts, path_name
from jaxdp.strategies.errors import UnitError
from jaxdp.strategies.linen_units import Units

Path = Tuple[str, ...]


class UnitAt(NamedTuple):
    """What ``gather_unit`` reads of a unit: its path in the params tree (as Linen's ``module.path``)."""

    path: Path


class NNXUnits:
    """Which submodules of an NNX model are FSDP units: classes and/or attribute path patterns."""

    def __init__(self, spec: Sequence[Any], model: nnx_task.NNXModel):
        spec = tuple(spec) if isinstance(spec, (list, tuple)) else (spec,)
        bad = [s for s in spec if not (isinstance(s, str) or (isinstance(s, type) and issubclass(s, nnx.Module)))]
        if bad:
            raise UnitError(f"units of an nnx.Module are nnx.Module classes or attribute paths like 'blocks/*', "
                            f"got {bad!r}")
        self.classes = tuple(s for s in spec if isinstance(s, type))
        self.patterns = tuple(s for s in spec if isinstance(s, str))
        self.model = model

    def __bool__(self):
        return bool(self.classes or self.patterns)

    def matches(self, path: Path, module) -> bool:
        return (bool(self.classes) and isinstance(module, self.classes)) or any(
            fnmatch.fnmatchcase("/".join(path), p) for p in self.patterns)

    def paths(self, init_fn: Callable, *args, with_shapes: Optional[list] = None) -> List[Path]:
        """The paths of the outermost unit instances, in the order NNX walks the model; like
        ``units.unit_paths``, ``with_shapes`` receives ``init_fn(*args)``'s abstract output."""
        if with_shapes is not None:
            with_shapes.append(jax.eval_shape(lambda *a: init_fn(*a), *args))
        found = outermost(self, self.model.module)
        if self and not found:
            named = [getattr(s, "__name__", s) for s in self.classes + self.patterns]
            raise UnitError(f"no submodule of the nnx.Module matches the FSDP units {named} (attribute paths read "
                            f"like {_example_paths(self.model.module)})")
        return [path for path, _ in found]

    @contextlib.contextmanager
    def on_use(self, gather_unit: Callable):
        """While active, every unit of each module a loss merges runs as ``gather_unit(UnitAt(path),
        call, variables, mutable, args, kwargs) -> (out, updated collections)``: the callback
        ``units.gather_on_use`` takes."""
        def hook(module):
            return _intercepting(outermost(self, module), gather_unit)
        with nnx_task.on_merge(hook):
            yield


def outermost(units: NNXUnits, module) -> List[Tuple[Path, Any]]:
    """(path, instance) of each outermost submodule ``units`` match, in NNX's walking order."""
    matched = [(p, m) for p, m in ((tuple(map(str, p)), m) for p, m in nnx.iter_modules(module))
               if p and units.matches(p, m)]
    return [(p, m) for p, m in matched if not any(len(q) < len(p) and p[:len(q)] == q for q, _ in matched)]


_RUNNING = {}  # id(unit instance) -> (its path, gather_unit), while a loss runs under ``on_use``
_GATHERING = {}  # a unit class -> its gathering subclass (made once: NNX registers each class it meets)


@contextlib.contextmanager
def _intercepting(units: List[Tuple[Path, Any]], gather_unit: Callable):
    """Each unit instance's class swapped for one whose ``__call__`` gathers on use, until the end
    (``object.__setattr__``: NNX's own would take ``__class__`` for an attribute of the module)."""
    swapped = []
    try:
        for path, unit in units:
            _RUNNING[id(unit)] = (path, gather_unit)
            swapped.append((unit, type(unit)))
            object.__setattr__(unit, "__class__", _gathering_class(type(unit)))
        yield
    finally:
        for unit, cls in swapped:
            object.__setattr__(unit, "__class__", cls)
            _RUNNING.pop(id(unit), None)


def _gathering_class(cls):
    if cls not in _GATHERING:
        _GATHERING[cls] = types.new_class(cls.__name__, (cls,), {"pytree": cls._pytree__is_pytree}, lambda ns: ns.update(
            __call__=_gathering_call, __module__=cls.__module__, __qualname__=cls.__qualname__))
    return _GATHERING[cls]


def _gathering_call(unit, *args, **kwargs):
    """A unit's ``__call__`` with FSDP's gather: the unit, back in its own class while it runs (a
    unit that calls itself runs plainly), split into its graphdef and variables, and run through
    ``gather_unit`` as a merged copy; what the copy updated is written back into the unit."""
    path, gather_unit = _RUNNING[id(unit)]
    gathering = type(unit)
    object.__setattr__(unit, "__class__", gathering.__mro__[1])
    try:
        parts = Parts(unit, what=f"unit {'/'.join(path)}")
        variables = parts.variables()
        mutable = [c for c in variables if c != "params"]

        def call(v, *a, **kw):
            copy = parts.merge(v)
            out = copy(*a, **kw)
            if not mutable:
                return out
            updated = parts.variables(copy)
            updated.pop("params", None)
            return out, updated

        out, updated = gather_unit(UnitAt(path), call, variables, mutable, args, kwargs)
        if updated:
            nnx.update(unit, parts.state(updated))
        return out
    finally:
        object.__setattr__(unit, "__class__", gathering)


def units_for(model, spec: Sequence[Any]):
    """The units of ``model``: ``NNXUnits`` for an NNX model, Linen's ``Units`` otherwise."""
    return NNXUnits(spec, model) if isinstance(model, nnx_task.NNXModel) else Units(spec)


def _example_paths(module, count: int = 4) -> str:
    paths = sorted(path_name(p) for p, _ in nnx.iter_modules(module) if p)[:count]
    return ", ".join(paths) or "(no submodules)"
