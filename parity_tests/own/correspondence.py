"""Which torch tensor is which Flax variable: the rules HF transformers converts by
(``modeling_flax_pytorch_utils``), derived from the torch model's module types and both
models' names and shapes, overridable where they cannot match.

Rules, per torch module (its path ``a.b.0.c`` is matched against the Flax module path
``a/b_0/c`` or ``a/b/0/c``: a trailing ``_N`` of a Flax name reads as torch's list index ``.N``):

===========================  ========================================  ==========================
torch module and tensor      Flax variable                             layout (numpy, both ways)
===========================  ========================================  ==========================
``Linear.weight`` (out, in)  ``params/.../kernel`` (in, out)           ``linear``: transposed
``Conv1d/2d/3d.weight``      ``params/.../kernel`` (*k, in, out)       ``conv``: (O, I, *k) ->
(O, I, *k)                                                             (*k, I, O)
``Embedding.weight``         ``params/.../embedding``                  ``identity``
``LayerNorm``, ``GroupNorm``,  ``params/.../scale`` and ``.../bias``   ``identity``
``RMSNorm``, ``BatchNorm*``
``.weight``, ``.bias``
``BatchNorm*.running_mean``  ``batch_stats/.../mean``, ``.../var``     ``identity``
and ``.running_var``
``BatchNorm*.num_batches_    (none: torch counts forwards there; it    not compared
tracked``                    changes no number in training)
any other parameter ``p``    ``params/.../p`` (the same name)          ``identity``
===========================  ========================================  ==========================

A torch *buffer* outside these rules (a causal mask registered as persistent, say) has no
rule; the user maps it, or says it has no counterpart (None: not compared). Every Flax
variable must get a torch tensor, every torch parameter a Flax variable, with the shapes
the layout gives: a correspondence that does not cover both sides is refused before
anything runs, in one message listing what is unmatched on each side, with shapes.

The layouts only move values, so every copy round-trips exactly (``check_round_trip``).
Torch is imported where a model is read; the rest is numpy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from jaxdp.models.errors import key_listing
from parity_tests.own.pair import PairError

Key = Tuple[str, ...]  # a Flax variable: (collection, *module path, leaf)


class CorrespondenceError(PairError):
    """Torch and Flax variables that do not correspond one to one: what is unmatched on each side."""


@dataclass(frozen=True)
class Layout:
    """How one tensor is laid out on each side: two numpy functions, inverse of each other."""

    name: str
    to_flax: Callable[[np.ndarray], np.ndarray]
    to_torch: Callable[[np.ndarray], np.ndarray]


def _conv_to_flax(w: np.ndarray) -> np.ndarray:  # (O, I, *k) -> (*k, I, O)
    return np.ascontiguousarray(np.transpose(w, tuple(range(2, w.ndim)) + (1, 0)))


def _conv_to_torch(k: np.ndarray) -> np.ndarray:  # (*k, I, O) -> (O, I, *k)
    return np.ascontiguousarray(np.transpose(k, (k.ndim - 1, k.ndim - 2) + tuple(range(k.ndim - 2))))


def _transposed(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.T)


def _same(x: np.ndarray) -> np.ndarray:
    return x


LAYOUTS = {
    "identity": Layout("identity", _same, _same),
    "linear": Layout("linear", _transposed, _transposed),  # Linear (out, in) <-> Dense (in, out)
    "conv": Layout("conv", _conv_to_flax, _conv_to_torch),  # OIHW <-> HWIO (any number of spatial dims)
}


@dataclass(frozen=True)
class Link:
    torch: str        # the torch state_dict name
    flax: Key         # (collection, *path, leaf)
    layout: Layout
    buffer: bool      # a torch buffer (compared as "buffers"), else a parameter
    shape: Tuple[int, ...] = ()  # torch's

    @property
    def flax_name(self) -> str:
        return "/".join(self.flax)


@dataclass
class Correspondence:
    """Every torch tensor's Flax variable (``links``, in torch's order), and the torch buffers
    with no counterpart (``ignored``: not copied to Flax, not compared)."""

    links: List[Link]
    ignored: List[str] = field(default_factory=list)

    def __post_init__(self):
        self.by_flax = {link.flax: link for link in self.links}
        self.by_torch = {link.torch: link for link in self.links}

    @property
    def torch_buffers(self) -> List[str]:
        """The torch buffers compared (running stats and whatever else has a Flax variable)."""
        return [link.torch for link in self.links if link.buffer]

    def to_flax(self, state_dict: Mapping[str, Any], dtype=None) -> Dict[str, Any]:
        """torch's ``{name: array}`` -> Flax variables ``{collection: nested dict}`` (numpy;
        cast to ``dtype`` if given)."""
        out: Dict[str, Any] = {}
        for link in self.links:
            x = link.layout.to_flax(np.array(_numpy(state_dict[link.torch]), copy=True))
            if dtype is not None and np.issubdtype(x.dtype, np.floating):
                x = x.astype(dtype)
            node = out
            for part in link.flax[:-1]:
                node = node.setdefault(part, {})
            node[link.flax[-1]] = x
        return out

    def to_torch(self, variables: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """Flax variables ``{collection: tree}`` -> ``{torch name: array}``, in torch's order."""
        flat = _flatten(variables)
        return {link.torch: link.layout.to_torch(np.asarray(flat[link.flax])) for link in self.links}

    def params_to_torch(self, tree) -> Dict[str, np.ndarray]:
        """A params-shaped tree (params, grads, optimizer moments) -> ``{torch name: array}``."""
        return self._named(tree, "params")

    def state_to_torch(self, model_state: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """The model state ``{collection: tree}`` (BatchNorm's batch_stats) -> ``{torch buffer: array}``."""
        flat = _flatten(model_state)
        return {link.torch: link.layout.to_torch(np.asarray(flat[link.flax])) for link in self.links
                if link.flax[0] != "params" and link.flax in flat}

    def _named(self, tree, collection: str) -> Dict[str, np.ndarray]:
        flat = _flatten({collection: tree})
        return {link.torch: link.layout.to_torch(np.array(flat[link.flax], copy=True)) for link in self.links
                if link.flax in flat}

    def check_round_trip(self, state_dict: Mapping[str, Any]) -> None:
        """Every layout returns the very values it was given (a user's own layout too)."""
        back = self.to_torch(self.to_flax(state_dict))
        for name, x in back.items():
            want = _numpy(state_dict[name])
            if x.shape != want.shape or not np.array_equal(x, want):
                link = self.by_torch[name]
                raise CorrespondenceError(f"layout {link.layout.name!r} of {name} -> {link.flax_name} does not "
                                          "round-trip: to_torch(to_flax(x)) is not x")


# ----------------------------------------------------------------------------- deriving it

def derive(torch_model, flax_variables: Mapping[str, Any], override=None) -> Correspondence:
    """The correspondence between ``torch_model`` and the Flax variables (arrays or
    ``ShapeDtypeStruct``s, ``{collection: tree}``), by the rules above and ``override``
    (a dict or a function, see ``ModelPair.correspondence``). ``CorrespondenceError`` in one
    message if it does not cover both sides."""
    flax_shapes = {k: tuple(np.shape(v)) for k, v in _flatten(flax_variables).items()}
    index = _flax_index(flax_shapes)
    links, ignored, torch_only, clashes = [], [], [], []
    for entry in _torch_entries(torch_model):
        link = _link(entry, override, index, flax_shapes, clashes)
        if link == "ignored":
            ignored.append(entry.name)
        elif link is None:
            if entry.leaf != "num_batches_tracked":
                torch_only.append(entry)
        elif link != "clash":  # a clash is in ``clashes`` already
            links.append(link)
    taken: Dict[Key, str] = {}
    for link in links:
        if link.flax in taken:
            clashes.append(f"{taken[link.flax]} and {link.torch} both map to {link.flax_name}")
        taken[link.flax] = link.torch
    flax_only = [k for k in flax_shapes if k not in taken]
    if torch_only or flax_only or clashes:
        raise CorrespondenceError(_refusal(torch_only, flax_only, flax_shapes, clashes))
    return Correspondence(links, ignored)


@dataclass(frozen=True)
class _Entry:
    name: str
    module: Any
    leaf: str
    shape: Tuple[int, ...]
    buffer: bool


def _torch_entries(model) -> List[_Entry]:
    """Every tensor of ``model.state_dict()``, with the module that owns it, in that order."""
    entries = []
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        for leaf, p in module.named_parameters(recurse=False):
            entries.append(_Entry(prefix + leaf, module, leaf, tuple(p.shape), False))
        persistent_off = getattr(module, "_non_persistent_buffers_set", set())
        for leaf, b in module.named_buffers(recurse=False):
            if leaf not in persistent_off:
                entries.append(_Entry(prefix + leaf, module, leaf, tuple(b.shape), True))
    return entries


def _rule(module) -> Dict[str, Tuple[str, str, str]]:
    """torch leaf -> (Flax collection, Flax leaf, layout) for ``module``'s type (HF's rules)."""
    from torch import nn

    norms = (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
    affine = {"weight": ("params", "scale", "identity"), "bias": ("params", "bias", "identity")}
    if isinstance(module, nn.Linear):
        return {"weight": ("params", "kernel", "linear"), "bias": ("params", "bias", "identity")}
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return {"weight": ("params", "kernel", "conv"), "bias": ("params", "bias", "identity")}
    if isinstance(module, nn.Embedding):
        return {"weight": ("params", "embedding", "identity")}
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return {**affine, "running_mean": ("batch_stats", "mean", "identity"),
                "running_var": ("batch_stats", "var", "identity")}
    if isinstance(module, norms):
        return affine
    return {}


_INDEX = re.compile(r"_(\d+)$")


def normalized(parts: Sequence[str]) -> str:
    """A module path as torch spells it: ``("blocks_0", "ln1")`` and ``"blocks.0.ln1"`` -> "blocks.0.ln1"."""
    out = []
    for part in parts:
        for piece in part.split("."):
            out.append(_INDEX.sub(r".\1", piece))
    return ".".join(p for p in out if p)


def _flax_index(flax_shapes: Mapping[Key, tuple]) -> Dict[Tuple[str, str, str], List[Key]]:
    """(collection, normalised module path, leaf) -> the Flax keys there (one, unless ambiguous)."""
    index: Dict[Tuple[str, str, str], List[Key]] = {}
    for key in flax_shapes:
        index.setdefault((key[0], normalized(key[1:-1]), key[-1]), []).append(key)
    return index


def _link(entry: _Entry, override, index, flax_shapes, clashes: List[str]):
    """``entry``'s Link, "ignored", or None (unmatched); a shape that disagrees goes to ``clashes``."""
    if isinstance(override, Mapping) and entry.name in override:
        return _user_link(entry, override[entry.name], flax_shapes, clashes)
    leaf_rule = _rule(entry.module).get(entry.leaf)
    if leaf_rule is None and not entry.buffer:
        leaf_rule = ("params", entry.leaf, "identity")  # a module's own nn.Parameter keeps its name
    found = None
    if leaf_rule is not None:
        collection, leaf, layout = leaf_rule
        module_path = entry.name[: -len(entry.leaf)].rstrip(".")
        keys = index.get((collection, normalized([module_path]), leaf), [])
        if len(keys) > 1:
            clashes.append(f"{entry.name} matches several Flax variables ({', '.join('/'.join(k) for k in keys)})")
            return None
        if keys:
            found = Link(entry.name, keys[0], LAYOUTS[layout], entry.buffer, entry.shape)
    if found is not None and _flax_shape(found, entry.shape) == flax_shapes[found.flax]:
        return found
    if callable(override) and not isinstance(override, Mapping):
        spec = override(entry.name, entry.shape)
        if spec is not None:
            return _user_link(entry, spec, flax_shapes, clashes)
    if found is not None:
        clashes.append(f"shapes disagree: {entry.name} {entry.shape} is {found.flax_name} "
                       f"{_flax_shape(found, entry.shape)} in Flax's layout ({found.layout.name}), Flax has "
                       f"{flax_shapes[found.flax]}")
        return "clash"
    return None


def _user_link(entry: _Entry, spec, flax_shapes, clashes: List[str]):
    """A link the user gave: a Flax path, (path, layout), or None (no counterpart: buffers only)."""
    if spec is None:
        if not entry.buffer:
            clashes.append(f"{entry.name} is a parameter: only a buffer may have no Flax counterpart (None)")
            return "clash"
        return "ignored"
    if isinstance(spec, tuple) and len(spec) == 2 and (isinstance(spec[1], Layout) or spec[1] in LAYOUTS):
        path, layout = spec
    else:  # a path alone: the layout the rules give this kind of tensor (a Linear's weight: transposed)
        path, layout = spec, _rule(entry.module).get(entry.leaf, (None, None, "identity"))[2]
    key = tuple(path.split("/")) if isinstance(path, str) else tuple(path)
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    if not isinstance(layout, Layout):
        clashes.append(f"{entry.name}: a layout is one of {', '.join(LAYOUTS)} or a Layout, got {layout!r}")
        return "clash"
    if key not in flax_shapes:
        clashes.append(f"{entry.name} is mapped to {'/'.join(key)}, which the Flax model does not have")
        return "clash"
    link = Link(entry.name, key, layout, entry.buffer, entry.shape)
    if _flax_shape(link, entry.shape) != flax_shapes[key]:
        clashes.append(f"shapes disagree: {entry.name} {entry.shape} is {link.flax_name} "
                       f"{_flax_shape(link, entry.shape)} in Flax's layout ({layout.name}), Flax has {flax_shapes[key]}")
        return "clash"
    return link


def _flax_shape(link: Link, torch_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    try:
        return tuple(link.layout.to_flax(np.empty(torch_shape, np.float32)).shape)
    except Exception:  # noqa: BLE001 - a layout that does not apply to this shape: it cannot match
        return ("?",)


def _refusal(torch_only: List[_Entry], flax_only: List[Key], flax_shapes, clashes: List[str]) -> str:
    parts = []
    if torch_only:
        parts.append("torch only: " + key_listing([f"{e.name} {e.shape}" for e in torch_only]))
    if flax_only:
        parts.append("flax only: " + key_listing([f"{'/'.join(k)} {flax_shapes[k]}" for k in flax_only]))
    if clashes:
        parts.append(key_listing(clashes))
    return ("the weight correspondence does not cover both models: " + "; ".join(parts) +
            " (map them with ModelPair(correspondence={torch name: 'collection/flax/path' | (path, layout) | None}))")


# ----------------------------------------------------------------------------- trees

def _flatten(tree) -> Dict[Key, Any]:
    """``{(collection, *path): leaf}`` of nested dicts (FrozenDicts too)."""
    from flax import traverse_util

    plain = _plain(tree)
    return {tuple(str(k) for k in key): v for key, v in traverse_util.flatten_dict(plain).items()} if plain else {}


def _plain(tree):
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
    return np.asarray(x)


# ----------------------------------------------------------------------------- FSDP units

def check_units(corr: Correspondence, flax_units: Sequence[Key], torch_units: Sequence[str]) -> Optional[str]:
    """None if the two sides' FSDP units hold the same parameters (through ``corr``), else one line
    naming a parameter the two cut differently. ``flax_units``: module paths (tuples);
    ``torch_units``: module names."""
    def unit_of_torch(name: str) -> Optional[str]:
        return next((u for u in torch_units if name.startswith(u + ".")), None)

    def unit_of_flax(key: Key) -> Optional[str]:
        path = key[1:]
        return next(("/".join(u) for u in flax_units if path[:len(u)] == tuple(u)), None)

    torch_groups: Dict[Optional[str], set] = {}
    flax_groups: Dict[Optional[str], set] = {}
    for link in corr.links:
        if link.buffer:
            continue
        torch_groups.setdefault(unit_of_torch(link.torch), set()).add(link.torch)
        flax_groups.setdefault(unit_of_flax(link.flax), set()).add(link.torch)
    params = [link for link in corr.links if not link.buffer]
    differ = [link for link in params
              if torch_groups[unit_of_torch(link.torch)] != flax_groups[unit_of_flax(link.flax)]]
    if not differ:
        return None
    # name a parameter that one side keeps in a unit and the other in the root, if there is one
    link = next((k for k in differ if (unit_of_torch(k.torch) is None) != (unit_of_flax(k.flax) is None)), differ[0])
    t, f = unit_of_torch(link.torch), unit_of_flax(link.flax)
    where = lambda u: f"unit {u}" if u else "the root"  # noqa: E731
    return (f"the FSDP units cut the two models differently: torch keeps {link.torch} in {where(t)} "
            f"({len(torch_groups[t])} params), Flax keeps {link.flax_name} in {where(f)} ({len(flax_groups[f])} "
            f"params); units: torch {list(torch_units) or 'none'}, flax {['/'.join(u) for u in flax_units] or 'none'}")
