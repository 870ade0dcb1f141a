"""Parity mode: the settings under which jaxdp and torch_ref pick comparable GPU kernels.

On a GPU each framework chooses its own cuDNN convolution engines. XLA autotunes: it times
every engine cuDNN offers (FFT and Winograd ones included) and keeps the fastest. torch,
without ``cudnn.benchmark``, takes cuDNN's heuristic first choice. Two engines round
differently, and a ResNet-18 of width 64 amplifies that through its BatchNorms: 1.9e-2 apart
in float32 at step 0 on an H200 where the width-4 model is 1.4e-6 apart. Parity mode makes
both sides take cuDNN's heuristic, deterministic choice:

- XLA (``XLA_FLAGS``, read once when jax creates its GPU backend):
  ``--xla_gpu_deterministic_ops=true`` (deterministic engines and scatters only; the
  autotuner takes the first working config instead of the fastest) and
  ``--xla_gpu_autotune_level=0`` (no timing runs at all: cuDNN's and cuBLAS's first choice;
  also no "Delay kernel timed out" noise), and ``--xla_gpu_enable_triton_gemm=false``: matmuls
  by cuBLAS, as torch's, not by XLA's Triton GEMM kernels. Without autotuning a Triton GEMM
  gets one fixed tiling, and for the ViT's attention projection (4160 = 64 x 65 rows) XLA then
  fails to compile the step ("Couldn't find output tile sizes", jax 0.10.2, compiled for an
  H100: ``tests/test_gpu_check_compiles.py``). All three exist in jax 0.10 and 0.11's XLA
  (``xla/debug_options_flags.cc``); XLA aborts on an unknown flag, so none is guessed.
- ``TF_ENABLE_WINOGRAD_NONFUSED=0``: XLA's cuDNN wrapper (stream_executor ``cuda_dnn.cc``)
  drops engines with cuDNN's Winograd numerical note when it is 0 (default: kept).
- ``NVIDIA_TF32_OVERRIDE=0`` and, in jax, ``jax_default_matmul_precision="highest"``
  (``jax_side.configure_precision``): no TF32.
- torch, in every rank (``torch_rank_setup``, run by the rank itself: ranks come from a
  forkserver that does not see this process's settings): ``cudnn.deterministic = True``,
  ``cudnn.benchmark = False`` (cuDNN's heuristic, deterministic engine), TF32 off for
  matmuls and cuDNN. ``cudnn=False`` (``jaxdp parity --torch-cudnn off``) turns cuDNN off
  in torch altogether: its own CUDA convolutions, a slow reference for the engine question.

Only ``jaxdp parity`` (``parity_tests.command``) and ``make gpu-check``
(``torch_commands.gpu_check``) enable it; ``jaxdp train`` and ``jaxdp bench`` keep XLA's
autotuner and torch's defaults. On CPU none of it changes a number.

Jax- and torch-free at import.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, MutableMapping, Optional

from jaxdp.runtime.startup import backend_started

XLA_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=false")
ENV = {"TF_ENABLE_WINOGRAD_NONFUSED": "0", "NVIDIA_TF32_OVERRIDE": "0"}
# torch.backends attribute -> value in every parity rank on CUDA
TORCH = {"cudnn.deterministic": True, "cudnn.benchmark": False, "cudnn.allow_tf32": False,
         "cuda.matmul.allow_tf32": False}

_late: Optional[bool] = None  # None: enable() never ran; True: it ran after jax's backend existed


def env_updates(environ: MutableMapping[str, str]) -> Dict[str, str]:
    """What parity mode adds to ``environ``: its XLA flags appended to ``XLA_FLAGS`` (a flag
    already given, with any value, is left as the user set it) and ``ENV``."""
    flags = environ.get("XLA_FLAGS", "").split()
    given = {f.split("=", 1)[0] for f in flags}
    added = [f for f in XLA_FLAGS if f.split("=", 1)[0] not in given]
    return {"XLA_FLAGS": " ".join(flags + added), **ENV}


def enable(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Put parity mode's variables into the environment; True if that came before jax's backend
    started (so XLA reads them). Call it before anything touches a jax device."""
    global _late
    environ = os.environ if environ is None else environ
    _late = backend_started()
    environ.update(env_updates(environ))
    return not _late


def xla_flags_in_effect() -> bool:
    """Whether this process's jax backend was created with parity mode's XLA flags."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return all(f in flags for f in XLA_FLAGS) and _late is not True


def summary() -> dict:
    """For the report: what parity mode set on the jax side and whether XLA saw it."""
    return {"xla_flags": list(XLA_FLAGS), "xla_flags_in_effect": xla_flags_in_effect(),
            "env": {k: os.environ.get(k) for k in ENV}}


def torch_rank_setup(device, cudnn: bool = True) -> None:
    """In a torch rank on CUDA: ``TORCH``'s settings, and cuDNN off when ``cudnn`` is False.
    (Flags torch reads on CUDA only; on CPU they are set all the same, changing nothing.)"""
    import torch

    for name, value in TORCH.items():
        *path, attr = name.split(".")
        setattr(functools.reduce(getattr, path, torch.backends), attr, value)
    torch.backends.cudnn.enabled = bool(cudnn)
    if torch.device(device).type == "cuda":
        os.environ.update(ENV)


def torch_settings() -> dict:
    """This process's torch values of ``TORCH`` and ``cudnn.enabled`` (for each rank's report)."""
    import torch

    names = (*TORCH, "cudnn.enabled")
    return {n: bool(functools.reduce(getattr, n.split("."), torch.backends)) for n in names}
