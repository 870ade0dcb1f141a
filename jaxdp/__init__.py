"""jaxdp: data-parallel training strategies in JAX, numerically faithful to PyTorch.

The strategies live side by side in ``jaxdp.strategies``; the model, data pipeline,
optimizers and trainer know nothing about which strategy runs.
"""

__version__ = "0.1.0"
