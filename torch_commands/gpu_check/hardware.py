"""What gpu-check finds on the host: torch's GPUs, JAX's, whether JAX computes float64 there,
and the versions installed. Imports jax and torch only when asked."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "numpy")


def torch_gpus() -> List[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def jax_gpus() -> Tuple[str, List[str]]:
    """(JAX's default backend, its GPU device kinds)."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend (CPU-only jaxlib, or JAX_PLATFORMS=cpu)
        gpus = []
    return jax.default_backend(), [d.device_kind for d in gpus]


def jax_float64_ok() -> Tuple[bool, str]:
    """Whether JAX computes float64 on its default (GPU) device: a tiny matmul, with 64-bit
    types on inside this call only (each pair sets its own: ``parity_tests.jax_side.run_jax``)."""
    import jax
    import numpy as np

    try:
        with jax.enable_x64(True):
            x = jax.device_put(np.arange(4.0).reshape(2, 2))
            got = np.asarray(jax.jit(lambda a: a @ a)(x))
        ok = got.dtype == np.float64 and np.array_equal(got, np.array([[2.0, 3.0], [6.0, 11.0]]))
        return ok, "" if ok else f"float64 matmul returned {got.dtype} {got.tolist()}"
    except Exception as e:  # pragma: no cover - depends on the device
        return False, f"{type(e).__name__}: {e}"


def versions() -> Dict[str, Optional[str]]:
    """The installed jax, jaxlib, flax, optax, orbax and torch (what this host's image ships)."""
    from importlib import metadata

    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
