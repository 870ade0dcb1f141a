"""Your own model and loss on a model axis and on pipeline stages (examples/custom_model_parallel.py):
the protocol of jaxdp.parallel.protocol, a loss that receives the model jaxdp prepared, batch
keys of the user's choosing, equal to one device in float64; and one line for each way a
model or loss does not follow the protocol."""

import importlib.util
import os
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import max_rel_error
from jaxdp.loss.model_task import OuterModelError
from jaxdp.parallel.protocol import column_features, row_parallel
from jaxdp.parallel.tensor import Column, Row
from jaxdp.strategies import StrategyError

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_model_parallel.py")
SIZES = dict(dim=8, hidden=16, depth=1)
STEPS = 3


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_model_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_device(example):
    with jax.enable_x64(True):  # module fixtures are built before conftest's per-test x64 switch
        return example.train(jaxdp.make_mesh(data=1), steps=STEPS, dtype=jnp.float64, **SIZES)


@pytest.mark.float64
@pytest.mark.parametrize("axes", [dict(data=2, model=2), dict(data=2, stage=2)])
def test_your_own_model_and_loss_train_split_over_devices_as_on_one_device(axes, example, one_device):
    """Evaluation too: 6 held-out rows are 3 per data rank, which on stages run as 1 micro-batch."""
    losses, params, held_out = example.train(jaxdp.make_mesh(**axes), steps=STEPS, dtype=jnp.float64, **SIZES)
    ref_losses, ref_params, ref_held_out = one_device
    assert ref_losses[-1] < ref_losses[0]  # it learns
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=0)
    assert max_rel_error(params, ref_params) < 1e-12
    assert abs(held_out - ref_held_out) <= 1e-12 * ref_held_out
    assert params["block_0"]["fc1"]["kernel"].shape == (SIZES["dim"], SIZES["hidden"])  # the model's own tree


def plain_loss(params, model_state, batch, rng):  # closes over no model jaxdp could prepare
    return jnp.zeros(()), (model_state, {})


@pytest.mark.parametrize("axes,message", [
    (dict(data=1, model=2), r"^tensor parallelism and sync_bn run a model jaxdp prepares, which this loss_fn cannot "
                            r"receive: write it as loss_fn\(model, params, model_state, batch, rng\)"),
    (dict(data=1, stage=2), r"^pipeline stages run a model jaxdp cuts into stages, which this loss_fn cannot "
                            r"receive: write it as loss_fn\(model, params, model_state, batch, rng\)"),
])
def test_a_loss_that_cannot_receive_the_model_is_one_line(axes, message, example):
    with pytest.raises(StrategyError, match=message):
        jaxdp.Trainer(example.TokenMLP(**SIZES), plain_loss, optax.sgd(0.1), "ddp", jaxdp.make_mesh(**axes))


class Mlp(nn.Module):
    """fc1 -> fc2 with a plan; ``split``/``summed`` leave out one half of the protocol."""

    split: bool = True
    summed: bool = True
    model_axis: Optional[str] = None
    TP_PLAN = {"params/fc1/kernel": Column(), "params/fc1/bias": Column(), "params/fc2/kernel": Row()}

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(column_features(8, self.model_axis) if self.split else 8, name="fc1")(x)
        return nn.Dense(2, name="fc2", dot_general=row_parallel(self.model_axis) if self.summed else None)(h)


class NoAxis(nn.Module):
    TP_PLAN = Mlp.TP_PLAN

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="fc2")(nn.Dense(8, name="fc1")(x))


def mse(model, params, model_state, batch, rng):
    return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2), (model_state, {})


@pytest.mark.parametrize("model,message", [
    (Mlp(split=False), r"^Mlp does not split itself over model=2: params/fc1/kernel is \(3, 4\) on each device "
                       r"\(its plan's cut\), but the model builds it \(3, 8\); build column-parallel layers with "
                       r"column_features\(features, self.model_axis\)"),
    (Mlp(summed=False), r"^Mlp's output differs on each model device: a row-parallel layer's product is never "
                        r"summed over 'model'; build column-parallel layers"),
    (NoAxis(), r"^NoAxis cannot run split over the model axis: give it a field `model_axis: Optional\[str\] = None`"),
])
def test_a_model_that_does_not_split_itself_is_one_line_before_the_first_step(model, message):
    batch = {"x": np.zeros((4, 3), np.float32), "y": np.zeros((4, 2), np.float32)}
    with pytest.raises(StrategyError, match=message):
        trainer = jaxdp.Trainer(model, mse, optax.sgd(0.1), "ddp", jaxdp.make_mesh(data=2, model=2),
                                model_inputs=lambda b: (b["x"],))
        trainer.init(jax.random.key(0), batch)


def test_a_model_that_splits_itself_passes_the_check_and_takes_its_slices():
    """The check's other side: the same Mlp with both halves of the protocol starts and steps."""
    batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros((4, 2), np.float32)}
    trainer = jaxdp.Trainer(Mlp(), mse, optax.sgd(0.1), "ddp", jaxdp.make_mesh(data=2, model=2),
                            model_inputs=lambda b: (b["x"],))
    state = trainer.init(jax.random.key(0), batch)
    assert state.params["fc1"]["kernel"].sharding.shard_shape((3, 8)) == (3, 4)
    _, metrics = trainer.step(state, batch)
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("axes", [dict(data=1, model=2), dict(data=1, stage=2)])
def test_a_loss_that_applies_a_model_from_outside_is_one_line(axes, example):
    """The old habit, ``loss_fn(model, ...)`` calling the model it closes over: the params arrive
    cut for the prepared model, which the message names."""
    outer = example.TokenMLP(**SIZES)

    def loss_fn(model, params, model_state, batch, rng):
        return example.loss_fn(outer, params, model_state, batch, rng)

    trainer = jaxdp.Trainer(outer, loss_fn, optax.sgd(0.1), "ddp", jaxdp.make_mesh(**axes),
                            model_inputs=example.model_inputs)
    batch = next(example.batches(1, batch_size=2))
    state = trainer.init(jax.random.key(0), batch)
    with pytest.raises(OuterModelError, match=r"^the params arrive laid out for the model loss_fn receives: apply "
                                              r"that `model`, not one from outside it \("):
        trainer.step(state, batch)
