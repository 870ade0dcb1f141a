"""The names a user picks from on the command line, importable without jax.

The CLI must build its parser (and print ``--help``) before jax starts: ``--devices N``
sets XLA's simulated-device count first. So the choices are read from the jax-free tables:
``jaxdp.names`` (models, stems, dtypes, datasets, optimizers, schedules, the sync's options)
and ``jaxdp.registry`` (``STRATEGIES``, read when asked).
"""

from jaxdp import names, registry

MODELS = names.MODELS
STEMS = names.STEMS
DTYPES = names.DTYPES
DATASETS = names.DATASETS
OPTIMIZERS = names.OPTIMIZERS
SCHEDULES = names.SCHEDULES
ALLREDUCES = names.ALLREDUCES
COMPRESSIONS = names.COMPRESSIONS
REMATS = names.REMATS
REDUCE_DTYPES = names.REDUCE_DTYPES
ACCUM_REDUCES = names.ACCUM_REDUCES


def __getattr__(name):
    if name == "STRATEGIES":  # the names registered now (a strategy registered later too)
        return registry.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def listing(values) -> str:
    """``{a,b,c}``: the names in --help, as argparse shows choices. (Not ``choices=``: the
    library checks names itself, with one-line errors, in the CLI and the Python API alike.)"""
    return "{" + ",".join(values) + "}"
