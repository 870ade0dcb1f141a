"""Which torch tensor is which Flax variable: the rules HF transformers converts by
(``modeling_flax_pytorch_utils``), derived from the torch model's modules and both models'
names and shapes, overridable where they cannot match.

Rules, per torch tensor (its module's path ``a.b.0.c`` is matched against the Flax module path
``a/b_0/c`` or ``a/b/0/c``: a trailing ``_N`` of a Flax name reads as torch's list index ``.N``).
First by the module's type:

===========================  ========================================  ==========================
torch module and tensor      Flax variable                             layout (numpy, both ways)
===========================  ========================================  ==========================
``Linear.weight`` (out, in)  ``params/.../kernel``                     ``linear`` (transposed)
                                                                       against a ``Dense``; else
                                                                       ``kernels`` decides
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
===========================  ========================================  ==========================

then, for a module of any other class (a custom norm, HF's ``Conv1D``), by name and rank as
HF's converter renames, the first that Flax has at that path:

===========================  ========================================  ==========================
any tensor ``p``             ``.../p``, the same name, in whichever    ``identity``
(a parameter or a buffer)    collection holds it (its own kind's
                             first: params for a parameter)
``weight``, 2-D              ``params/.../embedding``; else            ``identity``; a kernel's
                             ``params/.../kernel``                     as ``kernels`` decides
``weight``, 1-D / >= 3-D     ``params/.../scale`` / ``.../kernel``     ``identity`` / ``conv``
``gamma``, ``beta``          ``params/.../scale``, ``.../bias``        ``identity``
===========================  ========================================  ==========================

A 2-D weight's kernel is transposed or not as ``kernels`` decides: the two module classes
where both are known, else the shapes, and a square weight as its classes' other weights in
this model (HF's ``Conv1D`` stores (in, out), Flax's ``Dense`` too, HF's ``FlaxConv1D`` (out,
in)); a square weight nothing decides is refused, both candidates named.

A tensor torch holds under two names (tied weights, ``lm_head.weight = wte.weight``) is one
tensor under the first, as ``named_parameters()`` names it (``tied``: the second names); a
tie on one side only is refused in those words. A torch buffer or a parameter with
``requires_grad=False`` does not train, whatever Flax holds it as (``held``: compared as a
value); a torch parameter that trains must be a Flax param. A persistent buffer with no
counterpart is mapped by the user, or said to have none (None: not compared); non-persistent
buffers are not in the state_dict and not matched. Every Flax variable must get a torch
tensor, every torch parameter a Flax variable, with the shapes the layout gives: a
correspondence that does not cover both sides is refused before anything runs, in one message
listing what is unmatched on each side, with shapes.

The layouts only move values, so every copy round-trips exactly (``check_round_trip``).
Torch is imported where a model is read; the rest is numpy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from jaxdp.models.errors import key_listing
from parity_tests.own import kernels
from parity_tests.own.held import HELD
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
    frozen: bool = False  # a torch parameter with requires_grad=False

    @property
    def flax_name(self) -> str:
        return "/".join(self.flax)

    @property
    def trains(self) -> bool:
        """A torch parameter with a gradient (and so a Flax param): compared as grads, params, optimizer state."""
        return not (self.buffer or self.frozen)

    @property
    def held(self) -> bool:
        """A value that does not train in torch but is a Flax param: jaxdp holds it out of its params
        (``parity_tests.own.held``), and it is compared as a buffer."""
        return not self.trains and self.flax[0] == "params"


@dataclass
class Correspondence:
    """Every torch tensor's Flax variable (``links``, in torch's order), the torch buffers with no
    counterpart (``ignored``: not copied to Flax, not compared), and torch's second names of tied
    tensors (``tied``: {alias: the name ``named_parameters()`` gives the tensor})."""

    links: List[Link]
    ignored: List[str] = field(default_factory=list)
    tied: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.by_flax = {link.flax: link for link in self.links}
        self.by_torch = {link.torch: link for link in self.links}

    @property
    def torch_buffers(self) -> List[str]:
        """The torch buffers compared (running stats and whatever else has a Flax variable)."""
        return [link.torch for link in self.links if link.buffer]

    @property
    def torch_frozen(self) -> List[str]:
        """The torch parameters that do not train, compared as values (as buffers) at every step."""
        return [link.torch for link in self.links if link.frozen]

    @property
    def held(self) -> List[Key]:
        """The Flax params that do not train (torch buffers or frozen parameters): jaxdp holds them out."""
        return [link.flax for link in self.links if link.held]

    def jax_key(self, link: Link) -> Key:
        """Where jaxdp's state keeps ``link``'s variable: its Flax key, or under ``held`` if held out of params."""
        return (HELD,) + link.flax[1:] if link.held else link.flax

    def to_flax(self, state_dict: Mapping[str, Any], dtype=None) -> Dict[str, Any]:
        """torch's ``{name: array}`` -> Flax variables ``{collection: nested dict}`` (numpy;
        cast to ``dtype`` if given)."""
        out: Dict[str, Any] = {}
        for link in self.links:
            x = link.layout.to_flax(np.array(as_numpy(state_dict[link.torch]), copy=True))
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
        """jaxdp's model state ``{collection: tree}`` (BatchNorm's batch_stats, the held params) ->
        ``{torch buffer (or frozen parameter): array}``: every value that does not train."""
        flat = _flatten(model_state)
        return {link.torch: link.layout.to_torch(np.asarray(flat[self.jax_key(link)])) for link in self.links
                if not link.trains and self.jax_key(link) in flat}

    def _named(self, tree, collection: str) -> Dict[str, np.ndarray]:
        flat = _flatten({collection: tree})
        return {link.torch: link.layout.to_torch(np.array(flat[link.flax], copy=True)) for link in self.links
                if link.flax in flat}

    def check_round_trip(self, state_dict: Mapping[str, Any]) -> None:
        """Every layout returns the very values it was given (a user's own layout too)."""
        back = self.to_torch(self.to_flax(state_dict))
        for name, x in back.items():
            want = as_numpy(state_dict[name])
            if x.shape != want.shape or not np.array_equal(x, want):
                link = self.by_torch[name]
                raise CorrespondenceError(f"layout {link.layout.name!r} of {name} -> {link.flax_name} does not "
                                          "round-trip: to_torch(to_flax(x)) is not x")


# ----------------------------------------------------------------------------- deriving it

def derive(torch_model, flax_variables: Mapping[str, Any], override=None,
           flax_classes: Optional[Mapping[Sequence[str], type]] = None) -> Correspondence:
    """The correspondence between ``torch_model`` and the Flax variables (arrays or
    ``ShapeDtypeStruct``s, ``{collection: tree}``), by the rules above and ``override``
    (a dict or a function, see ``ModelPair.correspondence``). ``flax_classes``: the Flax module
    class at each module path, where traced (``kernels``: a square 2-D weight's layout).
    ``CorrespondenceError`` in one message if it does not cover both sides."""
    flax_shapes = {k: tuple(np.shape(v)) for k, v in _flatten(flax_variables).items()}
    m = _Matcher(flax_shapes, override, flax_classes)
    entries, aliases = _torch_entries(torch_model)
    slots = [m.link(entry) for entry in entries]
    slots = [m.square(s) if isinstance(s, _Square) else s for s in slots]  # rule 3, once the rest is known
    links = [s for s in slots if isinstance(s, Link)]
    ignored = [e.name for e, s in zip(entries, slots) if s == "ignored"]
    torch_only = [e for e, s in zip(entries, slots) if s is None and e.leaf != "num_batches_tracked"]
    m.clashes.extend(filter(None, (_kinds(link) for link in links)))
    taken: Dict[Key, str] = {}
    for link in links:
        if link.flax in taken:
            m.clashes.append(f"{taken[link.flax]} and {link.torch} both map to {link.flax_name}")
        taken[link.flax] = link.torch
    flax_only = [k for k in flax_shapes if k not in taken]
    torch_tied, flax_tied = m.ties_on_one_side(aliases, torch_only, flax_only, links)
    torch_only = [e for e in torch_only if e.name not in torch_tied]
    flax_only = [k for k in flax_only if k not in flax_tied]
    if torch_only or flax_only or m.clashes:
        raise CorrespondenceError(_refusal(torch_only, flax_only, flax_shapes, m.clashes))
    return Correspondence(links, ignored, {alias.name: name for alias, name in aliases})


@dataclass(frozen=True)
class _Entry:
    name: str
    module: Any
    leaf: str
    shape: Tuple[int, ...]
    buffer: bool
    frozen: bool = False  # a parameter with requires_grad=False

    @property
    def module_path(self) -> str:
        return self.name[: -len(self.leaf)].rstrip(".")

    @property
    def path(self) -> str:
        """Its module's path as the Flax index spells it (``normalized``)."""
        return normalized([self.module_path])


def _torch_entries(model) -> Tuple[List[_Entry], List[Tuple[_Entry, str]]]:
    """Every tensor of ``model.state_dict()``, with the module that owns it, in that order; a
    tensor met again under a second name (tied weights: ``lm_head.weight = wte.weight``) is
    one entry under its first name, as ``named_parameters()`` gives it, and the second name
    goes to the aliases ``[(entry, first name)]``."""
    entries, aliases, first = [], [], {}
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        persistent_off = getattr(module, "_non_persistent_buffers_set", set())
        tensors = [(leaf, p, False) for leaf, p in module.named_parameters(recurse=False)]
        tensors += [(leaf, b, True) for leaf, b in module.named_buffers(recurse=False) if leaf not in persistent_off]
        for leaf, t, buffer in tensors:
            entry = _Entry(prefix + leaf, module, leaf, tuple(t.shape), buffer, not buffer and not t.requires_grad)
            if id(t) in first:
                aliases.append((entry, first[id(t)]))
            else:
                first[id(t)] = entry.name
                entries.append(entry)
    return entries, aliases


KERNEL = "kernel"  # a 2-D weight's layout, decided by ``kernels`` (classes, shapes, the squares' classes)


def _rule(module) -> Dict[str, Tuple[str, str, str]]:
    """torch leaf -> (Flax collection, Flax leaf, layout) for ``module``'s type (HF's rules)."""
    from torch import nn

    norms = (nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
    affine = {"weight": ("params", "scale", "identity"), "bias": ("params", "bias", "identity")}
    if isinstance(module, nn.Linear):
        return {"weight": ("params", "kernel", KERNEL), "bias": ("params", "bias", "identity")}
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


def _by_name(entry: _Entry) -> List[Tuple[Optional[str], str, str]]:
    """What a tensor of a module of any class may be in Flax, by its name and rank, as HF's
    converter renames (a custom norm's ``weight`` is a ``scale``, a custom projection's 2-D
    ``weight`` a ``kernel``, ``gamma``/``beta`` are ``scale``/``bias``), its own name first.
    A collection of None: whichever collection holds it (a buffer may be a Flax param)."""
    same = [(None, entry.leaf, "identity")]
    if entry.leaf == "weight":
        rank = len(entry.shape)
        kernel = KERNEL if rank == 2 else "conv" if rank >= 3 else None
        return same + [("params", leaf, layout) for leaf, layout, fits in (
            ("embedding", "identity", rank == 2), ("scale", "identity", rank == 1), ("kernel", kernel, kernel))
            if fits]
    renamed = {"gamma": "scale", "beta": "bias"}.get(entry.leaf)
    return same + ([("params", renamed, "identity")] if renamed else [])


_INDEX = re.compile(r"_(\d+)$")


def normalized(parts: Sequence[str]) -> str:
    """A module path as torch spells it: ``("blocks_0", "ln1")`` and ``"blocks.0.ln1"`` -> "blocks.0.ln1"."""
    out = []
    for part in parts:
        for piece in part.split("."):
            out.append(_INDEX.sub(r".\1", piece))
    return ".".join(p for p in out if p)


def spellings(parts: Sequence[str]) -> List[str]:
    """The torch spellings of a Flax module path: ``normalized``, and with a list that lives in a
    module of its own name read as torch's list (Flax names ``self.layer = [...]`` in a module
    called ``layer`` ``layer/layer_0``; torch's ``nn.Sequential`` there is ``layer.0``)."""
    out: List[str] = []
    for part in parts:
        index = _INDEX.search(part)
        if out and index and part[: index.start()] == out[-1]:
            out[-1] = f"{out[-1]}.{index.group(1)}"
        else:
            out.append(part)
    plain, collapsed = normalized(parts), normalized(out)
    return [plain] if collapsed == plain else [plain, collapsed]


@dataclass
class _Square:
    """A square 2-D weight whose layout waits for what its classes' other weights say."""

    entry: _Entry
    key: Key
    flax_cls: Any


class _Matcher:
    """The rules applied to one torch tensor at a time, against one Flax model."""

    def __init__(self, flax_shapes: Mapping[Key, tuple], override, flax_classes):
        self.flax_shapes, self.override = flax_shapes, override
        self.traced = flax_classes is not None
        self.classes = {spelt: cls for path, cls in (flax_classes or {}).items() for spelt in spellings(path)}
        self.index: Dict[Tuple[str, str], List[Key]] = {}  # (module path as torch spells it, leaf) -> keys
        for key in flax_shapes:
            for spelt in spellings(key[1:-1]):
                self.index.setdefault((spelt, key[-1]), []).append(key)
        self.clashes: List[str] = []
        self.squares = kernels.Squares()

    def link(self, entry: _Entry):
        """``entry``'s Link, a ``_Square``, "ignored", "clash" (in ``clashes``) or None (unmatched)."""
        if isinstance(self.override, Mapping) and entry.name in self.override:
            return _user_link(entry, self.override[entry.name], self.flax_shapes, self.clashes)
        found = self._by_rules(entry, self.clashes)
        if isinstance(found, (_Square, str)):
            return found
        if found is not None and _flax_shape(found, entry.shape) == self.flax_shapes[found.flax]:
            return found
        return self._by_function(entry) or self._shape_clash(entry, found)

    def square(self, sq: _Square):
        """Rule 3 for a square weight: its classes' other weights, else (untraced) torch's class, else refused."""
        layout = self.squares.layout(sq.entry.module, sq.flax_cls)
        if layout is None and not self.traced:
            layout = kernels.known(sq.entry.module, None, traced=False)
        if layout is not None:
            return Link(sq.entry.name, sq.key, LAYOUTS[layout], sq.entry.buffer, sq.entry.shape, sq.entry.frozen)
        by_user = self._by_function(sq.entry)
        if by_user is not None:
            return by_user
        self.clashes.append(kernels.Squares.refusal(sq.entry.name, sq.entry.shape, "/".join(sq.key), sq.entry.module,
                                                    sq.flax_cls))
        return "clash"

    def _by_rules(self, entry: _Entry, clashes: List[str]):
        typed = _rule(entry.module).get(entry.leaf)
        for collection, leaf, layout in ([typed] if typed else []) + _by_name(entry):
            keys = self._keys(entry, collection, leaf)
            if len(keys) > 1:
                clashes.append(f"{entry.name} matches several Flax variables ({', '.join('/'.join(k) for k in keys)})")
                return "clash"
            if keys:
                return self._with_layout(entry, keys[0], layout)
        return None

    def _keys(self, entry: _Entry, collection: Optional[str], leaf: str) -> List[Key]:
        keys = self.index.get((entry.path, leaf), [])
        if collection is not None:
            return [k for k in keys if k[0] == collection]
        # any collection: the one of the tensor's own kind first (a parameter's params, a buffer's state)
        own = [k for k in keys if (k[0] == "params") != entry.buffer]
        return own or keys

    def _with_layout(self, entry: _Entry, key: Key, layout: str):
        if layout == KERNEL:
            flax_cls = self.classes.get(entry.path)
            decided = ((kernels.known(entry.module, flax_cls, traced=True) if self.traced else None)
                       or kernels.by_shapes(entry.shape, self.flax_shapes[key]))
            if decided is None and len(set(entry.shape)) == 1 and self.flax_shapes[key] == entry.shape:
                return _Square(entry, key, flax_cls)
            if decided is not None:  # what the squares of these two classes will follow
                self.squares.learn(entry.module, flax_cls, decided)
            layout = decided or kernels.TRANSPOSED  # shapes that fit neither way: refused as they disagree
        return Link(entry.name, key, LAYOUTS[layout], entry.buffer, entry.shape, entry.frozen)

    def _by_function(self, entry: _Entry):
        if callable(self.override) and not isinstance(self.override, Mapping):
            spec = self.override(entry.name, entry.shape)
            if spec is not None:
                return _user_link(entry, spec, self.flax_shapes, self.clashes)
        return None

    def ties_on_one_side(self, aliases, torch_only: List[_Entry], flax_only: List[Key], links: List[Link]):
        """Tied weights on one side only, said in those words (in ``clashes``); returns the torch names
        and Flax keys they explain. torch ties: a second name whose own rule finds a Flax variable no
        tensor took. Flax ties (one variable used twice): a torch parameter whose module holds no
        Flax variable at all, of the shape of a variable another torch tensor took."""
        torch_tied, flax_tied = set(), set()
        for alias, name in aliases:
            found = self._by_rules(alias, [])  # where the rules would put it: no refusal of its own
            key = found.key if isinstance(found, _Square) else getattr(found, "flax", None)
            if key in flax_only:
                self.clashes.append(f"{alias.name} is tied to {name} in torch (one tensor), but Flax has its own "
                                    f"{'/'.join(key)} {self.flax_shapes[key]}: tie them in Flax too, or untie torch's")
                flax_tied.add(key)
        flax_modules = {path for path, _ in self.index}
        unmatched_shapes = {self.flax_shapes[k] for k in flax_only}
        for entry in torch_only:
            twins = [link for link in links if link.shape == entry.shape and link.trains]
            could_be_unmatched = {entry.shape, entry.shape[::-1]} & unmatched_shapes  # a name the rules missed
            if entry.buffer or entry.path in flax_modules or not twins or could_be_unmatched:
                continue
            self.clashes.append(
                f"torch {entry.name} {entry.shape} has no Flax variable and is not tied in torch: if Flax ties it to "
                f"{' or '.join(f'{t.flax_name} (torch {t.torch}, the same shape)' for t in twins)}, tie them in torch "
                f"too ({entry.name} = {twins[0].torch}); else give Flax its own")
            torch_tied.add(entry.name)
        return torch_tied, flax_tied

    def _shape_clash(self, entry: _Entry, found: Optional[Link]):
        if found is None:
            return None
        self.clashes.append(f"shapes disagree: {entry.name} {entry.shape} is {found.flax_name} "
                            f"{_flax_shape(found, entry.shape)} in Flax's layout ({found.layout.name}), Flax has "
                            f"{self.flax_shapes[found.flax]}")
        return "clash"


def _kinds(link: Link) -> Optional[str]:
    """A torch parameter that trains must be a Flax param; a value that does not train may be either."""
    if link.trains and link.flax[0] != "params":
        return (f"{link.torch} is a torch parameter that trains, and {link.flax_name} is Flax "
                f"'{link.flax[0]}' state, which does not: make it a buffer or requires_grad=False in torch, or a "
                "param in Flax")
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
    if layout == KERNEL:  # a 2-D weight: as its shapes say, else as its torch class stores it against a Dense
        layout = (kernels.by_shapes(entry.shape, flax_shapes.get(key, ())) or kernels.known(entry.module, None, False)
                  or "identity")
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    if not isinstance(layout, Layout):
        clashes.append(f"{entry.name}: a layout is one of {', '.join(LAYOUTS)} or a Layout, got {layout!r}")
        return "clash"
    if key not in flax_shapes:
        clashes.append(f"{entry.name} is mapped to {'/'.join(key)}, which the Flax model does not have")
        return "clash"
    link = Link(entry.name, key, layout, entry.buffer, entry.shape, entry.frozen)
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


def as_numpy(x) -> np.ndarray:
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
        if not link.trains:  # a value that does not train: no FSDP unit shards it on jaxdp's side
            continue
        torch_groups.setdefault(unit_of_torch(link.torch), set()).add(link.torch)
        flax_groups.setdefault(unit_of_flax(link.flax), set()).add(link.torch)
    params = [link for link in corr.links if link.trains]
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
