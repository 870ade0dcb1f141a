"""The PyTorch DDP tutorial's ``ToyMpModel`` ("Combining DDP with model parallelism"):
``Linear(10, 10) -> ReLU -> Linear(10, 5)``, its two halves on two devices.

Here the two halves are two pipeline stages (``jaxdp.parallel.pipeline``): ``net1`` with its
ReLU on stage 0, ``net2`` on stage 1; ``examples/ddp_model_parallel.py`` trains it with DDP
over the data axis. Linear layers keep torch's init (U(+-1/sqrt(fan_in))), so the torch
twin (``torch_ref/pipeline.py``) can start from the same weights.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxdp.models.resnet import linear_bias_init, linear_kernel_init
from jaxdp.parallel.pipeline import Layer

IN_FEATURES, HIDDEN, OUT_FEATURES = 10, 10, 5


class ToyMpModel(nn.Module):
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.nowrap
    def _linear(self, features: int, fan_in: int, name=None):
        return nn.Dense(features, kernel_init=linear_kernel_init, bias_init=linear_bias_init(fan_in),
                        dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(self._linear(HIDDEN, IN_FEATURES, "net1")(x.astype(self.dtype)))
        return self._linear(OUT_FEATURES, HIDDEN, "net2")(x)

    @nn.nowrap
    def pipeline_layers(self):
        """net1 + ReLU, then net2: the tutorial's split between its two devices."""
        net1, net2 = self._linear(HIDDEN, IN_FEATURES), self._linear(OUT_FEATURES, HIDDEN)
        return [Layer("net1", (("net1",),), lambda p, x: nn.relu(net1.apply({"params": p[0]}, x.astype(self.dtype)))),
                Layer("net2", (("net2",),), lambda p, x: net2.apply({"params": p[0]}, x))]
