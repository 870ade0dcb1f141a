"""XLA compile options for the training step: a default per platform, overridable, ``none`` for XLA's own.

A strategy compiles its step with ``jax.jit(..., compiler_options=...)`` (``Strategy(compiler_options=...)``):
``None`` takes the environment's ``JAXDP_COMPILER_OPTIONS`` if set, else ``DEFAULTS`` for the
mesh's platform; ``"none"`` (or ``{}``) passes nothing; a dict or ``"key=value key=value"``
passes exactly those. They are compile options, not ``XLA_FLAGS``: XLA refuses an unknown
compile option by name ("No such compile option"), while an unknown token in ``XLA_FLAGS``
silently stops its flag parsing.

The CPU default keeps convolutions out of XLA:CPU's YNNPACK fusions (dots and reductions
stay in). Measured inside jaxdp's DDP step, one core, interleaved (docs/benchmarks.md,
benchmarks/RESULTS.md): ResNet-18 width 64 0.76x the default's step time at batch 16 and
0.64x at batch 32. It changes f32 and f64 results by an ulp (other kernels), so the test
suite (conftest.py) leaves it out: its bit-for-bit comparisons against plain ``jax.jit``
references keep XLA's own kernels (it sets ``JAXDP_COMPILER_OPTIONS`` to
``xla_backend_optimization_level=2`` alone: the step optimised, every other program at its
level 0). GPUs get nothing, and nor does ``dp``: ``jax.pmap`` takes no compile options.
"""

import os
from typing import Dict, Mapping, Optional, Union

# XLA:CPU's YNNPACK fusions without convolutions: a measured lead for ResNets (docs/benchmarks.md).
YNN_DOTS_AND_REDUCES = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                                                               "LIBRARY_FUSION_TYPE_REDUCE"}
DEFAULTS: Dict[str, Dict[str, str]] = {"cpu": YNN_DOTS_AND_REDUCES, "gpu": {}}  # never CPU options on a GPU
ENV = "JAXDP_COMPILER_OPTIONS"  # the process's override of DEFAULTS, e.g. "none"

Options = Union[None, str, Mapping[str, object]]


class CompileOptionsError(ValueError):
    """Compile options written wrong (one line on the command line)."""


def parse(text: str) -> Dict[str, object]:
    """``"key=value key2=value2"`` (space- or semicolon-separated; values may hold commas) -> a dict;
    ``"none"`` -> {}. ``true``/``false`` (any case) become bools."""
    if text.strip().lower() == "none":
        return {}
    options = {}
    for item in text.replace(";", " ").split():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CompileOptionsError(f"compile options are key=value pairs (or none), got {item!r}")
        options[key] = _SWITCHES.get(value.lower(), value)
    return options


# XLA takes a switch only as Python's bool (or the text "True"/"False"): "true", as XLA_FLAGS spells it,
# was refused ("'true' is not a valid bool value"). Other values travel as text, which XLA parses.
_SWITCHES = {"true": True, "false": False}


def resolve(options: Options, platform: str) -> Optional[Dict[str, object]]:
    """What the step's ``jax.jit`` gets: None (XLA's own) or a dict of compile options."""
    if options is None:
        env = os.environ.get(ENV)
        chosen = DEFAULTS.get(platform, {}) if env is None else parse(env)
    elif isinstance(options, str):
        chosen = parse(options)
    else:
        chosen = dict(options)
    return dict(chosen) or None
