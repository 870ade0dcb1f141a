"""Bench levers: ``--levers default,command-buffers-off,autotune-0`` gives every strategy row
one jaxdp row per lever (torch_ref is timed once, on the first lever's row: no lever touches
it). Each lever is XLA compile options laid over the platform's default
(``jaxdp.runtime.compile_options``, per jitted step, so one process measures them all; XLA_FLAGS
would be fixed at jax's start) or a switch of the step itself. The bare jax step gets the
same lever, so each row's overhead is against a like step.

The GPU levers were written without a GPU: XLA:CPU accepts their names (every DebugOptions
field is known to every backend) but ignores them, so their effect is still to measure.

Jax- and torch-free at import.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

from jaxdp.runtime import compile_options

# name -> {"compile_options": {...}} and/or {"donate": False}
LEVERS: Dict[str, dict] = {
    "default": {},
    # XLA's CUDA graphs: every kind off (the default captures fusions, cuBLAS, custom calls...)
    "command-buffers-off": {"compile_options": {"xla_gpu_enable_command_buffer": ""}},
    # the autotuner: 0 off (heuristic picks), 4 XLA's default (every candidate, with checks)
    "autotune-0": {"compile_options": {"xla_gpu_autotune_level": "0"}},
    "autotune-2": {"compile_options": {"xla_gpu_autotune_level": "2"}},
    # overlap collectives with compute: a scheduler that models their latency
    "latency-hiding": {"compile_options": {"xla_gpu_enable_latency_hiding_scheduler": True}},
    # the step without buffer donation: the state is copied, not updated in place
    "no-donation": {"donate": False},
}


def levers(text: str) -> List[str]:
    """``--levers default,autotune-0``: known lever names, in order."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in LEVERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--levers takes {', '.join(LEVERS)}, got {text!r}")
    return names


def compiler_options(lever: Optional[str], platform: str) -> Optional[dict]:
    """The step's compile options under ``lever``: the platform's default with the lever's on top."""
    base = compile_options.resolve(None, platform) or {}
    return {**base, **LEVERS[lever or "default"].get("compile_options", {})} or None


def donates(lever: Optional[str]) -> bool:
    return LEVERS[lever or "default"].get("donate", True)
