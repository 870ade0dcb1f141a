"""The rules that say which Flax variable a torch tensor is, as HF transformers converts
(``modeling_flax_pytorch_utils``): the torch model read as entries, and per entry the
candidates its module's class and its name give.

A torch tensor's module path ``a.b.0.c`` is matched against the Flax module path ``a/b_0/c``
or ``a/b/0/c`` (Linen names a list's modules ``b_0``, NNX's ``nnx.List`` ``b/0``). First by the
module's class:

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
``BatchNorm*.num_batches_    (none: torch counts forwards there; it    not copied
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

The torch model is read through its own methods (``named_modules``, ``named_parameters``,
``named_buffers``) and its classes by name (``torch_classes``): no torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from jaxdp.interop.torch_classes import is_torch

KERNEL = "kernel"  # a 2-D weight's layout, decided by ``kernels`` (classes, shapes, the squares' classes)
NORMS = ("LayerNorm", "GroupNorm", "RMSNorm")
CONVS = ("Conv1d", "Conv2d", "Conv3d")


@dataclass(frozen=True)
class Entry:
    """One tensor of the torch model's ``state_dict``, with the module that owns it."""

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


def torch_entries(model) -> Tuple[List[Entry], List[Tuple[Entry, str]]]:
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
            entry = Entry(prefix + leaf, module, leaf, tuple(t.shape), buffer, not buffer and not t.requires_grad)
            if id(t) in first:
                aliases.append((entry, first[id(t)]))
            else:
                first[id(t)] = entry.name
                entries.append(entry)
    return entries, aliases


def by_class(module) -> Dict[str, Tuple[str, str, str]]:
    """torch leaf -> (Flax collection, Flax leaf, layout) for ``module``'s class (HF's rules)."""
    affine = {"weight": ("params", "scale", "identity"), "bias": ("params", "bias", "identity")}
    if is_torch(module, "Linear"):
        return {"weight": ("params", "kernel", KERNEL), "bias": ("params", "bias", "identity")}
    if is_torch(module, *CONVS):
        return {"weight": ("params", "kernel", "conv"), "bias": ("params", "bias", "identity")}
    if is_torch(module, "Embedding"):
        return {"weight": ("params", "embedding", "identity")}
    if is_torch(module, "_BatchNorm"):
        return {**affine, "running_mean": ("batch_stats", "mean", "identity"),
                "running_var": ("batch_stats", "var", "identity")}
    if is_torch(module, *NORMS):
        return affine
    return {}


def by_name(entry: Entry) -> List[Tuple[Optional[str], str, str]]:
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
