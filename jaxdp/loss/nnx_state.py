"""A Flax NNX module's state as the variables the strategies carry, and back.

NNX keeps a model's arrays in ``nnx.Variable``s on the module itself. jaxdp's strategies carry a
model's state as Flax Linen lays it out, a dict of collections of nested dicts, and place and
shard it by name. ``nnx.split`` cuts a module into a static ``GraphDef`` and its Variables; each
kind of Variable goes to one collection:

=================  ===============  ==========================================================
NNX Variable       collection       what a step does with it
=================  ===============  ==========================================================
``nnx.Param``      ``params``       differentiated, and updated by the optimizer
``nnx.BatchStat``  ``batch_stats``  updated by the forward; device 0's kept (DDP's buffers)
``nnx.RngCount``   ``rng_counts``   advanced by each draw; carried as a buffer is
``nnx.RngKey``     none             constant: kept beside the state (``Parts.keys``)
=================  ===============  ==========================================================

Subclasses count as their base. Paths are the module's attribute paths with every part a
string, an ``nnx.List``'s index too (``blocks/0/...``, where Linen writes ``blocks_0/...``), so
placement, checkpoints and unit patterns read them as they read Linen's. Any other kind of
Variable, a bare array (``nnx.data``) and a Variable that holds a host numpy array are refused
in one line (``NNXStateError``): a step could neither place nor update them.
"""

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Path = Tuple[Any, ...]  # NNX's: attribute names and list indices
KINDS = ((nnx.Param, "params"), (nnx.BatchStat, "batch_stats"), (nnx.RngCount, "rng_counts"))
KEY = None  # the collection of an nnx.RngKey: none, the key is kept beside the state


class NNXStateError(ValueError):
    """A module whose state the strategies cannot carry: one line naming the variable and the fix."""


def is_nnx(model) -> bool:
    return isinstance(model, nnx.Module)


def path_name(path: Path) -> str:
    return "/".join(map(str, path))


def _collection(path: Path, var, what: str) -> Optional[str]:
    """The collection an NNX leaf goes to (``KEY`` for an rng key), or ``NNXStateError``."""
    if not isinstance(var, nnx.Variable):
        raise NNXStateError(f"{what} holds a bare {type(var).__name__} at {path_name(path)}: jaxdp carries "
                            "nnx.Param, nnx.BatchStat and nnx.Rngs' state; wrap it in one of those (a constant "
                            "buffer: nnx.BatchStat, which no gradient reaches)")
    if isinstance(var, nnx.RngKey):
        return KEY
    kind = next((name for cls, name in KINDS if isinstance(var, cls)), None)
    if kind is None:
        raise NNXStateError(f"{what} holds an nnx.{type(var).__name__} at {path_name(path)}, a kind of Variable "
                            "jaxdp does not carry: it trains nnx.Param and carries nnx.BatchStat and nnx.Rngs' "
                            "state; make it one of those (a buffer the forward updates: a subclass of nnx.BatchStat)")
    value = var.get_value()
    if isinstance(value, np.ndarray):
        raise NNXStateError(f"{what}'s nnx.{type(var).__name__} at {path_name(path)} holds a host numpy array: "
                            "build it from a jax array (jnp.asarray(...)), which the strategies can place")
    return kind


class Slot(NamedTuple):
    """One Variable of a module: where it sits in the module's graph, the name it is carried
    under (the same path, unless the graph holds wrappers: ``nnx_wrap``), and its collection."""

    at: Path
    name: Path
    var: Any
    kind: Optional[str]


class Parts:
    """A module cut into what stays fixed (its ``GraphDef``, each Variable's path and kind, the
    rng keys) and its variables ``{collection: nested dict}``; ``merge`` puts them back together.
    ``what`` names the module in errors; ``names`` maps a path in the module's graph to the name
    its Variable is carried under (default: the path itself)."""

    def __init__(self, module, what: str = "the model", names: Callable[[Path], Path] = tuple):
        self.what, self.names = what, names
        self.graphdef, state = nnx.split(module)
        self.slots: List[Slot] = [Slot(at, names(at), var, _collection(names(at), var, what))
                                  for at, var in nnx.to_flat_state(state)]
        self.keys = {s.name: s.var.get_value() for s in self.slots if s.kind is KEY}

    def variables(self, module=None) -> Dict[str, dict]:
        """``{collection: nested dict}`` of ``module``'s Variables (default: the values it was cut
        with); ``module`` must hold the same Variables at the same paths."""
        slots = self.slots if module is None else self._same_slots(module)
        out: Dict[str, dict] = {}
        for s in slots:
            if s.kind is not KEY:
                _put(out.setdefault(s.kind, {}), s.name, s.var.get_value())
        return out

    def merge(self, variables: Dict[str, dict], keys: Optional[dict] = None):
        """A module with these variables (and ``keys``, default the module's own rng keys)."""
        keys = self.keys if keys is None else keys
        leaves = [(s.at, s.var.copy(keys[s.name] if s.kind is KEY else _at(variables[s.kind], s.name)))
                  for s in self.slots]
        return nnx.merge(self.graphdef, nnx.from_flat_state(leaves))

    def state(self, variables: Dict[str, dict]):
        """An ``nnx.State`` of the Variables of the collections in ``variables`` (for ``nnx.update``)."""
        return nnx.from_flat_state([(s.at, s.var.copy(_at(variables[s.kind], s.name))) for s in self.slots
                                    if s.kind in variables])

    def _same_slots(self, module) -> List[Slot]:
        _, state = nnx.split(module)
        flat = list(nnx.to_flat_state(state))
        if [p for p, _ in flat] != [s.at for s in self.slots]:
            was, now = {s.name for s in self.slots}, {self.names(p) for p, _ in flat}
            changed = sorted(map(path_name, was ^ now))
            raise NNXStateError(f"{self.what}'s Variables changed while it ran ({', '.join(changed[:4])}"
                                f"{', ...' if len(changed) > 4 else ''} added or removed): a step carries a fixed "
                                "set; create every Variable in __init__ (sow intermediates outside the loss)")
        return [s._replace(var=var) for (_, var), s in zip(flat, self.slots)]


def keys_on_device(keys: dict, index) -> dict:
    """Each rng key as device ``index`` draws from it: the key itself on device 0 (so one device
    draws what a plain NNX loop draws), ``fold_in(key, index)`` on the others."""
    def one(key):
        folded = jax.random.key_data(jax.random.fold_in(key, index))
        data = jnp.where(index == 0, jax.random.key_data(key), folded)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
    return {path: one(key) for path, key in keys.items()}


def _put(tree: dict, path: Path, value) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(str(part), {})
    tree[str(path[-1])] = value


def _at(tree: dict, path: Path):
    for part in path:
        tree = tree[str(part)]
    return tree
