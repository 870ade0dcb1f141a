"""FSDP units for a Flax NNX model: the same gather-on-use as Linen's (``linen_units.py``), set up
the NNX way, once, when the strategy is built.

The user names the units by ``nnx.Module`` class (``units=(Block,)``) or by attribute path
(``units=("blocks/*",)``, fnmatch on the '/'-joined path, an ``nnx.List``'s index a part of
it); the outermost match wins, so units never nest, and the params outside every unit form
the root unit. The units are found by walking the module's graph (``nnx.iter_modules``):
an NNX module is built already, so nothing is traced.

How a unit runs. As FSDP2's ``fully_shard`` wraps each block at setup, ``prepared`` gives the
strategy's task a model whose graph holds each unit inside a wrapper (``jaxdp.loss.nnx_wrap``:
public Flax API only, every Variable under its own name). In a ZeRO-3 step, ``on_use`` hands the
task the strategy's ``gather_unit`` (the callback Linen's interceptor calls,
``linen_units.gather_on_use``), and each wrapper of the module the loss is given runs its unit
through it: with ``call(variables, *args, **kwargs)`` applying a copy of the unit merged from the
gathered params, and ``variables`` the unit's own ``{"params": chunks, "batch_stats": ...,
"rng_counts": ...}`` (``jaxdp.loss.nnx_state``). So ``fsdp_unit`` (gather before use, re-gather
in backward, ``remat``, prefetch) is the same function for both APIs. What the copy's forward
updated (BatchNorm statistics, rng counts) is written back into the running module.

Random numbers: the unit's rng counts enter ``fsdp_unit`` as state, so a unit run again in
backward (``remat="unit"``) draws the masks its forward drew.
"""

import contextlib
import fnmatch
from typing import Any, Callable, List, Sequence, Tuple

import jax
from flax import nnx

from jaxdp.loss import nnx_task
from jaxdp.loss.nnx_state import path_name
from jaxdp.strategies.errors import UnitError
from jaxdp.strategies.linen_units import Units

Path = Tuple[str, ...]


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
        self.found = outermost(self, model.module)

    def __bool__(self):
        return bool(self.classes or self.patterns)

    def matches(self, path: Path, module) -> bool:
        return (bool(self.classes) and isinstance(module, self.classes)) or any(
            fnmatch.fnmatchcase("/".join(path), p) for p in self.patterns)

    def paths(self) -> List[Path]:
        """The paths of the outermost unit instances, in the order NNX walks the model."""
        if self and not self.found:
            named = [getattr(s, "__name__", s) for s in self.classes + self.patterns]
            raise UnitError(f"no submodule of the nnx.Module matches the FSDP units {named} (attribute paths read "
                            f"like {_example_paths(self.model.module)})")
        return [tuple(map(str, path)) for path in self.found]

    def locate(self, init_fn: Callable, *args) -> Tuple[List[Path], Any]:
        """The units' paths, and ``init_fn(*args)``'s abstract output (``linen_units.Units.locate``'s)."""
        return self.paths(), jax.eval_shape(lambda *a: init_fn(*a), *args)

    def prepared(self, task):
        """``task`` on this model with each unit wrapped (``jaxdp.loss.nnx_wrap``), once; unchanged without units."""
        return task.with_model(self.model.with_units(self.found)) if self.found else task

    @contextlib.contextmanager
    def on_use(self, task, gather_unit: Callable):
        """``task`` (``prepared``'s) with every unit of the module a loss merges run as
        ``gather_unit(nnx_wrap.UnitAt(path), call, variables, mutable, args, kwargs) -> (out, updated
        collections)``: the callback ``linen_units.gather_on_use`` takes."""
        yield task.running_units(gather_unit)


def outermost(units: NNXUnits, module) -> List[Any]:
    """The path (as ``nnx.iter_modules`` gives it) of each outermost submodule ``units`` match, in
    NNX's walking order."""
    matched = [p for p, m in nnx.iter_modules(module) if p and units.matches(tuple(map(str, p)), m)]
    return [p for p in matched if not any(len(q) < len(p) and p[:len(q)] == q for q in matched)]


def units_for(model, spec: Sequence[Any]):
    """The units of ``model``: ``NNXUnits`` for an NNX model, Linen's ``Units`` otherwise."""
    return NNXUnits(spec, model) if isinstance(model, nnx_task.NNXModel) else Units(spec)


def _example_paths(module, count: int = 4) -> str:
    paths = sorted(path_name(p) for p, _ in nnx.iter_modules(module) if p)[:count]
    return ", ".join(paths) or "(no submodules)"
