"""XLA compile options for the training step: a default per platform, overridable, ``none`` for XLA's own.

A strategy compiles its step with ``jax.jit(..., compiler_options=...)`` (``Strategy(compiler_options=...)``):
``None`` takes ``DEFAULTS`` for the mesh's platform, ``"none"`` (or ``{}``) passes nothing, and a
dict or ``"key=value key=value"`` passes exactly those. They are compile options, not
``XLA_FLAGS``: XLA refuses an unknown compile option by name ("No such compile option"),
while an unknown token in ``XLA_FLAGS`` silently stops its flag parsing.

``DEFAULTS`` is empty on every platform: see docs/benchmarks.md for the YNNPACK fusion options
measured inside jaxdp's strategies (``YNN_DOTS_AND_REDUCES``) and why they are not the default yet.
"""

from typing import Dict, Mapping, Optional, Union

# XLA:CPU's YNNPACK fusions without convolutions: a measured lead for ResNets (docs/benchmarks.md).
YNN_DOTS_AND_REDUCES = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                                                               "LIBRARY_FUSION_TYPE_REDUCE"}
DEFAULTS: Dict[str, Dict[str, str]] = {"cpu": {}, "gpu": {}}  # never anything CPU-only on a GPU

Options = Union[None, str, Mapping[str, object]]


class CompileOptionsError(ValueError):
    """Compile options written wrong (one line on the command line)."""


def parse(text: str) -> Dict[str, str]:
    """``"key=value key2=value2"`` (space- or semicolon-separated; values may hold commas) -> a dict;
    ``"none"`` -> {}."""
    if text.strip().lower() == "none":
        return {}
    options = {}
    for item in text.replace(";", " ").split():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CompileOptionsError(f"compile options are key=value pairs (or none), got {item!r}")
        options[key] = value
    return options


def resolve(options: Options, platform: str) -> Optional[Dict[str, object]]:
    """What the step's ``jax.jit`` gets: None (XLA's own) or a dict of compile options."""
    if options is None:
        chosen = DEFAULTS.get(platform, {})
    elif isinstance(options, str):
        chosen = parse(options)
    else:
        chosen = dict(options)
    return dict(chosen) or None
