"""Model pieces against formulas: torch's BatchNorm rules, dtypes, and the factory's errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init, random_batch, tiny_resnet

from jaxdp.models import BatchNorm, ModelError, create_model


@pytest.mark.float64
def test_batchnorm_follows_torch_formulas():
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(4, 5, 5, 3))
    bn = BatchNorm(dtype=jnp.float64, param_dtype=jnp.float64)
    variables = bn.init(jax.random.key(0), x, train=False)
    y, updated = bn.apply(variables, x, train=True, mutable=["batch_stats"])

    n = 4 * 5 * 5
    mean = x.reshape(n, 3).mean(0)
    biased = ((x.reshape(n, 3) - mean) ** 2).mean(0)
    np.testing.assert_allclose(y, (x - mean) / np.sqrt(biased + 1e-5), rtol=1e-12, atol=1e-12)
    stats = updated["batch_stats"]
    np.testing.assert_allclose(stats["mean"], 0.9 * 0 + 0.1 * mean, rtol=1e-13)
    np.testing.assert_allclose(stats["var"], 0.9 * 1 + 0.1 * biased * n / (n - 1), rtol=1e-13)

    y_eval = bn.apply({"params": variables["params"], "batch_stats": stats}, x, train=False)
    np.testing.assert_allclose(y_eval, (x - stats["mean"]) / np.sqrt(stats["var"] + 1e-5), rtol=1e-12)


def test_bfloat16_computes_in_bf16_with_float32_params():
    x, _ = random_batch(4, seed=1, dtype=np.float32)
    f32, bf16 = tiny_resnet("float32"), tiny_resnet("bfloat16")
    variables = init(f32)
    assert {p.dtype for p in jax.tree_util.tree_leaves(init(bf16))} == {jnp.dtype("float32")}
    ref = f32.apply(variables, x, train=False)
    out = bf16.apply(variables, x, train=False)
    assert out.dtype == jnp.float32  # logits leave in float32 so the loss is not bf16
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()
    hlo = jax.jit(lambda v, x: bf16.apply(v, x, train=False)).lower(variables, x).as_text()
    assert "bf16" in hlo


def test_resnet_parameter_counts_match_torchvision():
    def count(model, size):
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, size, size, 3)), train=False))
        return sum(x.size for x in jax.tree_util.tree_leaves(shapes["params"]))

    assert count(create_model("resnet18"), 32) == 11_173_962
    assert count(create_model("resnet34", num_classes=1000, stem="imagenet"), 64) == 21_797_672
    assert count(create_model("resnet50", num_classes=1000, stem="imagenet"), 64) == 25_557_032


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="resnet9"), "unknown model 'resnet9'; choose one of resnet18, resnet34, resnet50"),
    (dict(stem="tiny"), "unknown stem"),
    (dict(dtype="float16"), "unknown dtype"),
    (dict(blocks=(1, 1)), "four positive counts"),
])
def test_bad_model_options_are_clear(kwargs, message):
    with pytest.raises(ModelError, match=message):
        create_model(**kwargs)
