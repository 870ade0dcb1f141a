"""An NNX model's FSDP units in the graph a step merges: each wrapped, once, at setup.

torch's FSDP2 wraps each block when the model is set up (``fully_shard(block)``), and the wrapper's
forward gathers the block's params before it runs. Here the same, by public Flax API only: when a
strategy with units is built, ``wrapped`` copies the user's module (``nnx.split``/``nnx.merge``) and
puts each unit, in its parent's attribute or ``nnx.List`` slot, inside a ``UnitWrapper`` that holds
it as ``unit``. The user's module is left as it is. Every Variable keeps the name it has in the
user's module (``names`` drops the wrapper's ``unit`` step from its path), so checkpoints,
placement and unit patterns read the wrapped model's state as the plain one's.

A step that gathers units gives each merged copy of the wrapped graph its ``run_unit``
(``arm``); a wrapper without one runs its unit plainly (a loss traced outside a ZeRO-3 step). With
one, the wrapper cuts the unit into its graphdef and variables, hands ``run_unit`` a ``call``
that applies a copy merged from given variables (``fsdp_unit`` calls it on the gathered params,
again in backward), and writes what the copy updated (BatchNorm statistics, rng counts) back into
the unit, as Linen's interceptor writes a unit's mutated collections back (``linen_units``).
"""

from typing import Any, Callable, NamedTuple, Sequence, Tuple

from flax import nnx

from jaxdp.loss.nnx_state import Parts

Path = Tuple[Any, ...]  # NNX's: attribute names and list indices
WRAPPED = "unit"  # the attribute a wrapper holds its unit under


class UnitAt(NamedTuple):
    """What ``run_unit`` reads of a unit: its path in the params tree (as Linen's ``module.path``)."""

    path: Tuple[str, ...]


class UnitWrapper(nnx.Module):
    """An FSDP unit in the step's graph: runs it through ``run_unit`` when the step gave one."""

    def __init__(self, unit: nnx.Module, path: Tuple[str, ...]):
        self.unit = unit
        self.path = path  # the unit's path in the user's module: its Variables' names start with it
        self.run_unit = None  # set on each merged copy of a step that gathers units (``arm``)

    def __call__(self, *args, **kwargs):
        if self.run_unit is None:
            return self.unit(*args, **kwargs)
        parts = Parts(self.unit, what=f"unit {'/'.join(self.path)}")
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

        out, updated = self.run_unit(UnitAt(self.path), call, variables, mutable, args, kwargs)
        if updated:
            nnx.update(self.unit, parts.state(updated))
        return out


def wrapped(module: nnx.Module, units: Sequence[Path]) -> Tuple[nnx.Module, Callable[[Path], Path]]:
    """A copy of ``module`` with the submodule at each of ``units`` (paths as ``nnx.iter_modules``
    gives them, none inside another) in a ``UnitWrapper``; and the function from a path in the copy
    to the name its Variable has in ``module``."""
    copy = nnx.merge(*nnx.split(module))
    for path in units:
        parent, key = _at(copy, path[:-1]), path[-1]
        wrapper = UnitWrapper(_child(parent, key), tuple(map(str, path)))
        if isinstance(key, int):
            parent[key] = wrapper
        else:
            setattr(parent, key, wrapper)
    at = [tuple(p) for p in units]

    def names(path: Path) -> Path:
        for p in at:
            if len(path) > len(p) and path[len(p)] == WRAPPED and path[:len(p)] == p:
                return path[:len(p)] + path[len(p) + 1:]
        return path
    return copy, names


def arm(module: nnx.Module, units: Sequence[Path], run_unit: Callable) -> None:
    """Give each wrapper of ``module`` (a merged copy of a ``wrapped`` graph) the step's ``run_unit``."""
    for path in units:
        _at(module, path).run_unit = run_unit


def _at(module, path: Path):
    for key in path:
        module = _child(module, key)
    return module


def _child(parent, key):
    return parent[key] if isinstance(key, int) else getattr(parent, key)
