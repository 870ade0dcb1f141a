"""The names a user picks from on the command line, importable without jax.

The CLI must build its parser (and print ``--help``) before jax starts: ``--devices N``
sets XLA's simulated-device count first. So the choices live here, as plain tuples; each
is the same list as its source of truth (``jaxdp.models.MODELS``, ...), which
tests/test_cli.py checks. ``STRATEGIES`` is read from the jax-free ``jaxdp.registry`` when asked.
"""

from jaxdp import registry

MODELS = ("resnet18", "resnet34", "resnet50", "vit-tiny", "vit-small")
STEMS = ("cifar", "imagenet")
DTYPES = ("float32", "bfloat16", "float64")
DATASETS = ("synthetic", "cifar10", "digits")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "multistep", "warmup_cosine")
ALLREDUCES = ("psum", "ring")
COMPRESSIONS = ("bf16", "fp16", "powersgd")
REMATS = ("unit", "none")  # FSDP units (jaxdp.strategies.units): keep the input and recompute, or keep activations


def __getattr__(name):
    if name == "STRATEGIES":  # the names registered now (a strategy registered later too)
        return registry.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def listing(names) -> str:
    """``{a,b,c}``: the names in --help, as argparse shows choices. (Not ``choices=``: the
    library checks names itself, with one-line errors, in the CLI and the Python API alike.)"""
    return "{" + ",".join(names) + "}"
