"""How one tensor is laid out on each side, as two numpy functions inverse of each other.

Both frameworks compute cross-correlation (neither flips a kernel), so converting a weight is a
pure axis permutation, never arithmetic, and every round trip is bit-exact:

- ``conv``: torch keeps a convolution's weight (out, in, *k) for channels-first inputs, Flax's
  ``Conv`` (*k, in, out) for channels-last: OIHW -> HWIO is ``transpose(2, 3, 1, 0)``, and the
  same for any number of spatial dims;
- ``linear``: torch's ``Linear`` computes ``x @ W.T + b`` with W (out, in), Flax's ``Dense``
  ``x @ K + b`` with K (in, out), so K = W.T;
- ``identity``: everything else (norm scales and biases, embeddings, HF's ``Conv1D``, which
  stores (in, out) already).

The functions return C-contiguous arrays, which ``torch.from_numpy`` and jax take without
surprises (a transposed view would carry its strides along). No torch import: a tensor is read
through ``as_numpy``'s duck typing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


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


def as_numpy(x: Any) -> np.ndarray:
    """A numpy view of a torch tensor (any device; bfloat16 read as float32, numpy has no
    bfloat16), a jax array or a numpy array, without importing torch."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
    return np.asarray(x)


def fresh_numpy(x: Any) -> np.ndarray:
    """A writable copy (``as_numpy``'s). Always a copy: a ``state_dict()``'s tensors share storage
    with the live parameters, so a view would change at the next ``optimizer.step()`` (and jax
    hands out read-only views)."""
    return np.array(as_numpy(x), copy=True)
