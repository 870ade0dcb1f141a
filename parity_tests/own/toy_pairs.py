"""Small pairs the tests run beside the example's language model (examples/parity_own_model.py):
an MLP classifier with BatchNorm (buffers: torch's running stats against jaxdp's BatchNorm,
which has torch's semantics), and the same with dropout switched on, on one side or both
(the Flax side in Linen, or in NNX: ``nnx_dropout_pair``), which the harness refuses.

    run_pair("parity_tests.own.toy_pairs:batchnorm_pair", PairRun(strategy="ddp", devices=2))
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

FEATURES, HIDDEN, CLASSES = 6, 8, 3


def _torch_mlp(dropout: float):
    import torch
    from torch import nn

    class TorchMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(FEATURES, HIDDEN)
            self.bn = nn.BatchNorm1d(HIDDEN)
            self.drop = nn.Dropout(dropout)
            self.fc2 = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x):
            return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))

    return TorchMLP()


def _flax_mlp(dropout: float):
    import flax.linen as nn
    import jax.numpy as jnp

    from jaxdp.models.batchnorm import BatchNorm  # torch's semantics: momentum 0.1, unbiased running var

    class FlaxMLP(nn.Module):
        dtype: Any = jnp.float32  # compute; the harness sets both to the run's
        param_dtype: Any = jnp.float32  # BatchNorm keeps its running stats in it

        @nn.compact
        def __call__(self, x, train: bool):
            h = nn.Dense(HIDDEN, dtype=self.dtype, name="fc1")(x)
            h = BatchNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="bn")(h, train)
            h = nn.Dropout(dropout, deterministic=not train)(nn.relu(h))
            return nn.Dense(CLASSES, dtype=self.dtype, name="fc2")(h)

    return FlaxMLP()


def sample_batch(rng: np.random.Generator, rows: int) -> dict:
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    return {"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)}


def _inputs(batch):
    return (batch["x"],)


def _flax_loss(logits, batch):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def _torch_loss(logits, batch):
    import torch.nn.functional as F

    return F.cross_entropy(logits, batch["y"])


def mlp_pair(flax_dropout: float = 0.0, torch_dropout: float = 0.0, init_from: str = "torch"):
    from parity_tests.own import ModelPair

    return ModelPair(flax_model=_flax_mlp(flax_dropout), torch_model=_torch_mlp(torch_dropout),
                     sample_batch=sample_batch, flax_loss=_flax_loss, torch_loss=_torch_loss, flax_inputs=_inputs,
                     flax_kwargs={"train": True}, init_from=init_from, name="MLP with BatchNorm")


batchnorm_pair = functools.partial(mlp_pair)
flax_init_pair = functools.partial(mlp_pair, init_from="flax")
dropout_pair = functools.partial(mlp_pair, flax_dropout=0.1, torch_dropout=0.1)
torch_dropout_pair = functools.partial(mlp_pair, torch_dropout=0.1)



def _nnx_mlp(dropout: float):
    from flax import nnx

    class NNXMLP(nnx.Module):
        def __init__(self, rngs=None):
            rngs = rngs or nnx.Rngs(params=0, dropout=1)
            self.fc1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
            self.bn = nnx.BatchNorm(HIDDEN, momentum=0.9, rngs=rngs)
            self.drop = nnx.Dropout(dropout, rngs=rngs)
            self.fc2 = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x)))))

    return NNXMLP()


def nnx_dropout_pair():
    """The MLP with its Flax side an nnx.Module whose dropout draws (the harness refuses it)."""
    from parity_tests.own import ModelPair

    return ModelPair(flax_model=_nnx_mlp(0.1), torch_model=_torch_mlp(0.0), sample_batch=sample_batch,
                     flax_loss=_flax_loss, torch_loss=_torch_loss, flax_inputs=_inputs, name="NNX MLP with dropout")
