"""Which way round a 2-D weight is stored on each side, (out, in) or (in, out): so whether its
copy to a Flax ``kernel`` is transposed.

torch's ``Linear`` stores (out, in) and Hugging Face's ``Conv1D`` (in, out); Flax's ``Dense``
keeps its kernel (in, out), HF's ``FlaxConv1D`` (out, in). A weight is decided, in this order:

1. both module classes are known (``TORCH_STORES``, ``FLAX_STORES``): their layouts say it
   (``Linear`` -> ``Dense`` transposed, ``Conv1D`` -> ``Dense`` as is);
2. its shape is not square: torch (a, b) against a kernel (b, a) is transposed, (a, b) as is
   (HF's converter decides by shapes too);
3. a square weight follows what the other weights of the same two module classes say in this
   model (GPT-2's square ``c_proj`` as its ``c_attn``), else the torch class's known layout
   against Flax's ``Dense`` when the Flax classes were not traced, else it is refused with both
   candidates named.

Torch is never imported (``torch_classes``); the Flax classes arrive as classes.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import flax.linen as nn

from jaxdp.interop.torch_classes import is_torch

OUT_IN, IN_OUT = "(out, in)", "(in, out)"
TRANSPOSED, AS_IS = "linear", "identity"  # layouts.LAYOUTS' names


def torch_stores(module) -> Optional[str]:
    """How ``module`` stores its 2-D ``weight``, if its class says: Linear (out, in), HF's Conv1D
    (in, out: ``nx`` inputs, ``nf`` outputs, recognised by those attributes)."""
    if is_torch(module, "Linear"):
        return OUT_IN
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    if weight is not None and weight.ndim == 2 and tuple(weight.shape) == (nx, nf):
        return IN_OUT
    return None


def flax_stores(cls) -> Optional[str]:
    """How a Flax module class keeps its 2-D ``kernel``, if known: Dense and DenseGeneral (in, out)."""
    return IN_OUT if isinstance(cls, type) and issubclass(cls, (nn.Dense, nn.DenseGeneral)) else None


def known(torch_module, flax_cls, traced: bool) -> Optional[str]:
    """The layout both classes give (rule 1), or with no traced Flax classes, torch's against Dense."""
    ours = torch_stores(torch_module)
    theirs = flax_stores(flax_cls) if traced else IN_OUT
    if ours is None or theirs is None:
        return None
    return AS_IS if ours == theirs else TRANSPOSED


def by_shapes(torch_shape: Tuple[int, ...], flax_shape: Tuple[int, ...]) -> Optional[str]:
    """The layout a non-square weight's shapes give (rule 2); None if square or if neither fits."""
    if len(torch_shape) != 2 or torch_shape[0] == torch_shape[1]:
        return None
    if tuple(flax_shape) == tuple(torch_shape):
        return AS_IS
    if tuple(flax_shape) == tuple(reversed(torch_shape)):
        return TRANSPOSED
    return None


class Squares:
    """Rule 3: what the decided weights of each (torch class, Flax class) say, for its squares."""

    def __init__(self):
        self.seen: Dict[Tuple[Any, Any], set] = {}

    def learn(self, torch_module, flax_cls, layout: str) -> None:
        self.seen.setdefault((type(torch_module), flax_cls), set()).add(layout)

    def layout(self, torch_module, flax_cls) -> Optional[str]:
        said = self.seen.get((type(torch_module), flax_cls), set())
        return next(iter(said)) if len(said) == 1 else None

    @staticmethod
    def refusal(name: str, shape, flax_name: str, torch_module, flax_cls) -> str:
        flax_class = getattr(flax_cls, "__name__", "an unknown Flax module")
        return (f"{name} {tuple(shape)} is square, so its shape cannot tell its layout, and neither can its classes "
                f"({type(torch_module).__name__} -> {flax_class}: no known layout, no other weight of theirs in "
                f"this model): map it as ('{flax_name}', 'linear') (transposed) or ('{flax_name}', 'identity')")
