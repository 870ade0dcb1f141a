"""jaxdp: data-parallel training strategies in JAX, numerically faithful to PyTorch.

The public API (see ``jaxdp.api.trainer``)::

    trainer = jaxdp.Trainer(model, loss_fn, optax.adamw(3e-4), jaxdp.ZeRO(stage=3), jaxdp.make_mesh(data=4))

The strategies live side by side in ``jaxdp.strategies``; the models, data pipeline and
optimizers know nothing about which strategy runs.
"""

import importlib

__version__ = "0.2.0"

# Lazy: `import jaxdp` must not import jax (the CLI sets XLA_FLAGS first). Each name: its module.
_EXPORTS = {"Trainer": "api.trainer", "StrategySpec": "api.trainer", "DDP": "api.trainer", "ZeRO": "api.trainer",
            "HSDP": "api.trainer", "DataParallel": "api.trainer", "AsyncPS": "api.trainer", "classifier": "loss.task",
            "make_mesh": "runtime.mesh", "UsageError": "api.validate", "clip_by_global_norm": "loss.reductions",
            "global_mean": "loss.reductions"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jaxdp.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    """The public names too, before their first use (``dir(jaxdp)``, tab completion), importing nothing."""
    return sorted(set(globals()) | set(__all__))
