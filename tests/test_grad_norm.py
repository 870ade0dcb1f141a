"""The trainer's ``grad_norm``: the global L2 norm of the averaged gradient, whichever layout
the strategy holds it in (whole, ZeRO chunks with padding, tensor-parallel slices)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp.runtime.mesh import make_mesh
from jaxdp.models.vit import EncoderBlock, ViT
from jaxdp.strategies import create_strategy
from jaxdp.loss.task import classifier

VIT = dict(num_classes=10, image_size=16, patch=8, dim=12, depth=1, heads=2, mlp_dim=24)  # 12 over 3: padded


@pytest.mark.float64
@pytest.mark.parametrize("name,axes", [("ddp", {"data": 2}), ("zero1", {"data": 3}), ("zero2", {"data": 3}),
                                       ("zero3", {"data": 3}), ("async", {"data": 2}),
                                       ("zero3", {"data": 2, "model": 2}), ("ddp", {"data": 2, "model": 2})])
def test_grad_norm_is_the_norm_of_the_averaged_gradient(name, axes):
    model = ViT(**VIT, dtype=jnp.float64, param_dtype=jnp.float64)
    options = {"units": (EncoderBlock,)} if name == "zero3" else {}
    strategy = create_strategy(name, model, classifier(model), optax.sgd(0.1), make_mesh(**axes), return_grads=True,
                               log_grad_norm=True, **options)
    rng = np.random.default_rng(0)
    n = 4 * axes["data"]
    batch = {"image": rng.normal(size=(n, 16, 16, 3)), "label": rng.integers(0, 10, n).astype(np.int32)}
    state = strategy.engine.init(jax.random.key(0), batch)
    _, metrics = strategy.engine.step(state, strategy.engine.shard_batch(batch))
    grads = jax.device_get(metrics["grads"])  # whole, the reference
    want = np.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree_util.tree_leaves(grads)))
    assert abs(float(metrics["grad_norm"]) - want) <= 1e-12 * want


def test_grad_norm_is_off_unless_asked():
    model = ViT(**VIT)
    strategy = create_strategy("ddp", model, classifier(model), optax.sgd(0.1), make_mesh(data=2))
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(4, 16, 16, 3)).astype(np.float32), "label": rng.integers(0, 10, 4)}
    state = strategy.engine.init(jax.random.key(0), batch)
    assert "grad_norm" not in strategy.engine.step(state, strategy.engine.shard_batch(batch))[1]
