"""jaxdp: data-parallel training strategies in JAX, numerically faithful to PyTorch.

The public API (see ``jaxdp.trainer``)::

    trainer = jaxdp.Trainer(model, loss_fn, optax.adamw(3e-4), jaxdp.ZeRO(stage=3), jaxdp.make_mesh(data=4))

The strategies live side by side in ``jaxdp.strategies``; the models, data pipeline and
optimizers know nothing about which strategy runs.
"""

__version__ = "0.2.0"


def __getattr__(name):
    # Lazy: `import jaxdp` must not import jax (the CLI sets XLA_FLAGS first).
    import importlib

    mesh, task, trainer = (importlib.import_module(f"jaxdp.{m}") for m in ("mesh", "task", "trainer"))

    exports = {"Trainer": trainer.Trainer, "StrategySpec": trainer.StrategySpec, "DDP": trainer.DDP,
               "ZeRO": trainer.ZeRO, "HSDP": trainer.HSDP, "DataParallel": trainer.DataParallel,
               "AsyncPS": trainer.AsyncPS, "classifier": task.classifier, "make_mesh": mesh.make_mesh}
    if name in exports:
        globals()[name] = exports[name]
        return exports[name]
    raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")
