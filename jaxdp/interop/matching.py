"""``derive``: the correspondence between a torch model and a Flax model's variables, by the
rules (``jaxdp.interop.rules``) and the user's ``override``, refused in one message if it does not
cover both sides.

A 2-D weight's kernel is transposed or not as ``kernels`` decides: the two module classes
where both are known, else the shapes, and a square weight as its classes' other weights in
this model (HF's ``Conv1D`` stores (in, out), Flax's ``Dense`` too, HF's ``FlaxConv1D`` (out,
in)); a square weight nothing decides is refused, both candidates named.

A tensor torch holds under two names (tied weights, ``lm_head.weight = wte.weight``) is one
tensor under the first, as ``named_parameters()`` names it (``tied``: the second names); a
tie on one side only is refused in those words. A torch buffer or a parameter with
``requires_grad=False`` does not train, whatever Flax holds it as; a torch parameter that
trains must be a Flax param. A persistent buffer with no counterpart is mapped by the user, or
said to have none (None: not copied); non-persistent buffers are not in the state_dict and not
matched. Every Flax variable must get a torch tensor, every torch parameter a Flax variable,
with the shapes the layout gives: a correspondence that does not cover both sides is refused
in one message listing what is unmatched on each side, with shapes.

``override``: a dict ``{torch name: "collection/flax/path" | (path, layout) | None}`` (a layout
is a name of ``LAYOUTS`` or a ``Layout``; None for a buffer with no counterpart), or a function
``(torch name, shape) -> that or None`` asked for what the rules leave unmatched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from jaxdp.interop import kernels
from jaxdp.interop.correspondence import Correspondence, CorrespondenceError, Key, Link, flatten
from jaxdp.interop.layouts import LAYOUTS, Layout
from jaxdp.interop.rules import KERNEL, Entry, by_class, by_name, spellings, torch_entries
from jaxdp.models.errors import key_listing

HOW_TO_MAP = "map them with override={torch name: 'collection/flax/path' | (path, layout) | None}"


class Unmatched(CorrespondenceError):
    """A correspondence that does not cover both sides; ``problems`` is what, without the remedy."""

    def __init__(self, problems: str):
        super().__init__(f"{problems} ({HOW_TO_MAP})")
        self.problems = problems


def derive(torch_model, flax_variables: Mapping[str, Any], override=None,
           flax_classes: Optional[Mapping[Sequence[str], type]] = None) -> Correspondence:
    """The correspondence between ``torch_model`` and the Flax variables (arrays or
    ``ShapeDtypeStruct``s, ``{collection: tree}``), by the rules and ``override`` (above).
    ``flax_classes``: the Flax module class at each module path, where traced (``kernels``: a
    square 2-D weight's layout). ``Unmatched`` in one message if it does not cover both sides."""
    flax_shapes = {k: tuple(np.shape(v)) for k, v in flatten(flax_variables).items()}
    m = _Matcher(flax_shapes, override, flax_classes)
    entries, aliases = torch_entries(torch_model)
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
        raise Unmatched(_problems(torch_only, flax_only, flax_shapes, m.clashes))
    return Correspondence(links, ignored, {alias.name: name for alias, name in aliases})


@dataclass
class _Square:
    """A square 2-D weight whose layout waits for what its classes' other weights say."""

    entry: Entry
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

    def link(self, entry: Entry):
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

    def _by_rules(self, entry: Entry, clashes: List[str]):
        typed = by_class(entry.module).get(entry.leaf)
        for collection, leaf, layout in ([typed] if typed else []) + by_name(entry):
            keys = self._keys(entry, collection, leaf)
            if len(keys) > 1:
                clashes.append(f"{entry.name} matches several Flax variables ({', '.join('/'.join(k) for k in keys)})")
                return "clash"
            if keys:
                return self._with_layout(entry, keys[0], layout)
        return None

    def _keys(self, entry: Entry, collection: Optional[str], leaf: str) -> List[Key]:
        keys = self.index.get((entry.path, leaf), [])
        if collection is not None:
            return [k for k in keys if k[0] == collection]
        # any collection: the one of the tensor's own kind first (a parameter's params, a buffer's state)
        own = [k for k in keys if (k[0] == "params") != entry.buffer]
        return own or keys

    def _with_layout(self, entry: Entry, key: Key, layout: str):
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

    def _by_function(self, entry: Entry):
        if callable(self.override) and not isinstance(self.override, Mapping):
            spec = self.override(entry.name, entry.shape)
            if spec is not None:
                return _user_link(entry, spec, self.flax_shapes, self.clashes)
        return None

    def ties_on_one_side(self, aliases, torch_only: List[Entry], flax_only: List[Key], links: List[Link]):
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

    def _shape_clash(self, entry: Entry, found: Optional[Link]):
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


def _user_link(entry: Entry, spec, flax_shapes, clashes: List[str]):
    """A link the user gave: a Flax path, (path, layout), or None (no counterpart: buffers only)."""
    if spec is None:
        if not entry.buffer:
            clashes.append(f"{entry.name} is a parameter: only a buffer may have no Flax counterpart (None)")
            return "clash"
        return "ignored"
    if isinstance(spec, tuple) and len(spec) == 2 and (isinstance(spec[1], Layout) or spec[1] in LAYOUTS):
        path, layout = spec
    else:  # a path alone: the layout the rules give this kind of tensor (a Linear's weight: transposed)
        path, layout = spec, by_class(entry.module).get(entry.leaf, (None, None, "identity"))[2]
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


def _problems(torch_only: List[Entry], flax_only: List[Key], flax_shapes, clashes: List[str]) -> str:
    parts = []
    if torch_only:
        parts.append("torch only: " + key_listing([f"{e.name} {e.shape}" for e in torch_only]))
    if flax_only:
        parts.append("flax only: " + key_listing([f"{'/'.join(k)} {flax_shapes[k]}" for k in flax_only]))
    if clashes:
        parts.append(key_listing(clashes))
    return "the weight correspondence does not cover both models: " + "; ".join(parts)


