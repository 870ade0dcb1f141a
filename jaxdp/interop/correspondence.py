"""A correspondence: which torch tensor is which Flax variable, with its layout, and the copies
both ways it gives.

A ``Correspondence`` is a list of ``Link``s, one per torch tensor, in torch's ``state_dict``
order. ``derive`` (``jaxdp.interop.derive``) builds one from a torch model and a Flax model's
variables; jaxdp's own ResNet and ViT build theirs from their key grammars
(``jaxdp.interop.builtin``). Either way the copies are the same:

- ``to_flax(state_dict)``: torch's ``{name: tensor}`` (numpy arrays or torch tensors) -> Flax
  variables ``{collection: nested dict}`` of numpy arrays, for Linen's ``apply`` or an NNX
  module's ``nnx.update``;
- ``to_torch(variables)``: back, ``{torch name: numpy array}`` in torch's order, for
  ``load_state_dict``;
- ``params_to_torch(tree)``: any params-shaped tree (gradients, optimizer moments) by torch name.

Layouts only move values, so ``to_torch(to_flax(sd)) == sd`` exactly (``check_round_trip``).
numpy only at import: no torch, no jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from jaxdp.interop.layouts import Layout, as_numpy, fresh_numpy

Key = Tuple[str, ...]  # a Flax variable: (collection, *module path, leaf)


class CorrespondenceError(ValueError):
    """Torch and Flax variables that do not correspond one to one: what is unmatched on each side."""


@dataclass(frozen=True)
class Link:
    torch: str        # the torch state_dict name
    flax: Key         # (collection, *path, leaf)
    layout: Layout
    buffer: bool      # a torch buffer, else a parameter
    shape: Tuple[int, ...] = ()  # torch's
    frozen: bool = False  # a torch parameter with requires_grad=False

    @property
    def flax_name(self) -> str:
        return "/".join(self.flax)

    @property
    def trains(self) -> bool:
        """A torch parameter with a gradient (and so a Flax param)."""
        return not (self.buffer or self.frozen)

    @property
    def non_trainable_param(self) -> bool:
        """A value that does not train in torch (a buffer, a frozen parameter) but is a Flax param."""
        return not self.trains and self.flax[0] == "params"


@dataclass
class Correspondence:
    """Every torch tensor's Flax variable (``links``, in torch's order), the torch buffers with no
    counterpart (``ignored``: not copied to Flax), and torch's second names of tied tensors
    (``tied``: {alias: the name ``named_parameters()`` gives the tensor})."""

    links: List[Link]
    ignored: List[str] = field(default_factory=list)
    tied: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.by_flax = {link.flax: link for link in self.links}
        self.by_torch = {link.torch: link for link in self.links}

    @property
    def torch_buffers(self) -> List[str]:
        """The torch buffers that have a Flax variable (running stats and the like)."""
        return [link.torch for link in self.links if link.buffer]

    @property
    def torch_frozen(self) -> List[str]:
        """The torch parameters that do not train (``requires_grad=False``)."""
        return [link.torch for link in self.links if link.frozen]

    @property
    def non_trainable_params(self) -> List[Key]:
        """The Flax params that do not train in torch (torch buffers or frozen parameters)."""
        return [link.flax for link in self.links if link.non_trainable_param]

    def to_flax(self, state_dict: Mapping[str, Any], dtype=None) -> Dict[str, Any]:
        """torch's ``{name: array}`` -> Flax variables ``{collection: nested dict}`` (numpy;
        floating arrays cast to ``dtype`` if given)."""
        out: Dict[str, Any] = {}
        for link in self.links:
            x = link.layout.to_flax(fresh_numpy(state_dict[link.torch]))
            if dtype is not None and np.issubdtype(x.dtype, np.floating):
                x = x.astype(dtype)
            node = out
            for part in link.flax[:-1]:
                node = node.setdefault(part, {})
            node[link.flax[-1]] = x
        return out

    def to_torch(self, variables: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """Flax variables ``{collection: tree}`` -> ``{torch name: array}``, in torch's order. A tied
        tensor comes once, under its first name (``tied`` has the others)."""
        flat = flatten(variables)
        return {link.torch: link.layout.to_torch(np.asarray(flat[link.flax])) for link in self.links}

    def params_to_torch(self, tree) -> Dict[str, np.ndarray]:
        """A params-shaped tree (params, grads, optimizer moments) -> ``{torch name: array}``."""
        flat = flatten({"params": tree})
        return {link.torch: link.layout.to_torch(fresh_numpy(flat[link.flax])) for link in self.links
                if link.flax in flat}

    def state_to_torch(self, model_state: Mapping[str, Any],
                       key: Optional[Callable[[Link], Key]] = None) -> Dict[str, np.ndarray]:
        """A model state ``{collection: tree}`` (BatchNorm's batch_stats, ...) -> ``{torch buffer (or
        frozen parameter): array}``: every value that does not train and that the state holds.
        ``key(link)``: where the state keeps ``link``'s value, if not at its Flax key."""
        where = key or (lambda link: link.flax)
        flat = flatten(model_state)
        return {link.torch: link.layout.to_torch(np.asarray(flat[where(link)])) for link in self.links
                if not link.trains and where(link) in flat}

    def check_round_trip(self, state_dict: Mapping[str, Any]) -> None:
        """Every layout returns the very values it was given (a user's own layout too)."""
        back = self.to_torch(self.to_flax(state_dict))
        for name, x in back.items():
            want = as_numpy(state_dict[name])
            if x.shape != want.shape or not np.array_equal(x, want):
                link = self.by_torch[name]
                raise CorrespondenceError(f"layout {link.layout.name!r} of {name} -> {link.flax_name} does not "
                                          "round-trip: to_torch(to_flax(x)) is not x")


def flatten(tree) -> Dict[Key, Any]:
    """``{(collection, *path): leaf}`` of nested mappings (FrozenDicts too); empty ones drop out."""
    out: Dict[Key, Any] = {}

    def walk(node, path):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, path + (str(k),))
        else:
            out[path] = node

    walk(tree, ())
    return out
