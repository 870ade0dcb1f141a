"""What cannot train a Flax NNX model gets one line that names the fix, before anything compiles:
a loss in the other API's form (both ways), state the strategies cannot carry (host numpy arrays,
Variables of unknown kinds, bare arrays), a model that draws from ``nnx.Rngs`` it was not given,
a loss that returns the wrong thing, and model parallelism, SyncBN or ``jaxdp.classifier``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp

BATCH = {"x": np.ones((4, 2), np.float32)}


class Tiny(nnx.Module):
    def __init__(self, rngs=None):
        self.lin = nnx.Linear(2, 2, rngs=rngs or nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x)


def nnx_loss(model, batch, rng):
    return jnp.mean(model(batch["x"]) ** 2)


def trainer(module, loss=nnx_loss, strategy="ddp", **mesh):
    return jaxdp.Trainer(module, loss, optax.sgd(0.1), strategy, jaxdp.make_mesh(**(mesh or {"data": 2})))


def one_line(excinfo, pattern: str):
    text = str(excinfo.value)
    assert "\n" not in text, text
    assert excinfo.match(pattern)


def test_a_loss_in_the_other_apis_form_both_ways():
    def linen_loss(params, model_state, batch, rng):
        return 0.0, (model_state, {})

    with pytest.raises(jaxdp.UsageError) as e:
        trainer(Tiny(), linen_loss)
    one_line(e, r"^the model is an nnx.Module, whose loss is loss_fn\(model, batch, rng\) -> loss or \(loss, metrics\); "
                r"this loss_fn takes \(params, model_state, batch, rng\), the Flax Linen form")
    with pytest.raises(jaxdp.UsageError) as e:
        jaxdp.Trainer(Tiny(), nnx_loss, optax.sgd(0.1), "ddp", jaxdp.make_mesh(data=2),
                      eval_fn=lambda params, model_state, batch: {})
    one_line(e, r"^the model is an nnx.Module, whose eval_fn is eval_fn\(model, batch\) -> \{name: sum\}; this one "
                r"takes \(params, model_state, batch\), the Flax Linen form$")
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(nn.Dense(2), nnx_loss)
    one_line(e, r"^the model is a Flax Linen module, whose loss is loss_fn\(params, model_state, batch, rng\) .*; "
                r"this loss_fn takes \(model, batch, rng\), the NNX form")


class HostArray(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(np.ones((2, 2), np.float32))

    def __call__(self, x):
        return x @ self.w[...]


class Counter(nnx.Variable):
    pass


class UnknownKind(Tiny):
    def __init__(self):
        super().__init__()
        self.calls = Counter(jnp.zeros((), jnp.int32))


class BareArray(Tiny):
    def __init__(self):
        super().__init__()
        self.offset = nnx.data(jnp.ones(2))


@pytest.mark.parametrize("model,pattern", [
    (HostArray, r"^the model's nnx.Param at w holds a host numpy array: build it from a jax array"),
    (UnknownKind, r"^the model holds an nnx.Counter at calls, a kind of Variable jaxdp does not carry: .* make it one "
                  r"of those"),
    (BareArray, r"^the model holds a bare ArrayImpl at offset: jaxdp carries nnx.Param, nnx.BatchStat and nnx.Rngs' "
                r"state; wrap it in one of those"),
])
def test_state_the_strategies_cannot_carry(model, pattern):
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(model())
    one_line(e, pattern)


class Noisy(nnx.Module):
    """Draws from a stream its Rngs does not have."""

    def __init__(self):
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.rngs = nnx.Rngs(params=1)

    def __call__(self, x):
        return self.lin(x) + jax.random.normal(self.rngs.noise(), x.shape)


class DropoutWithoutRngs(Tiny):
    def __init__(self):
        super().__init__()
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x):
        return self.drop(super().__call__(x))


@pytest.mark.parametrize("model,said", [(Noisy, "No RngStream named 'noise'"),
                                        (DropoutWithoutRngs, "no `rngs` argument was provided to Dropout")])
def test_a_model_that_draws_from_rngs_it_was_not_given(model, said):
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(model()).init(jax.random.key(0), BATCH)
    one_line(e, rf"^the model draws random numbers from nnx.Rngs it was not given \(.*{said}.*\): build it with the "
                r"streams it draws \(nnx.Rngs\(params=0, dropout=1\)\), pass one in the call")


@pytest.mark.parametrize("loss,pattern", [
    (lambda model, batch, rng: (nnx_loss(model, batch, rng), ({}, {})),
     r"^loss_fn's metrics must be a dict of scalars, got tuple"),
    (lambda model, batch, rng: model(batch["x"]), r"^loss_fn's loss must be a scalar, got shape \(2, 2\)"),
    (lambda model, batch, rng: "loss", r"^loss_fn\(model, batch, rng\) -> loss or \(loss, metrics\); it returned a str"),
])
def test_a_loss_that_returns_the_wrong_thing(loss, pattern):
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(Tiny(), loss).init(jax.random.key(0), BATCH)
    one_line(e, pattern)


def test_model_parallelism_syncbn_and_the_classifier_are_refused():
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(Tiny(), data=2, model=2)
    one_line(e, r"^tensor and pipeline parallelism split Flax Linen models .*; train an nnx.Module data-parallel")
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(Tiny(), data=2, stage=2)
    one_line(e, r"^tensor and pipeline parallelism split Flax Linen models")
    with pytest.raises(jaxdp.UsageError) as e:
        trainer(Tiny(), strategy=jaxdp.DDP(sync_bn=True))
    one_line(e, r"^sync_bn swaps a Linen model's BatchNorm .*: build it with nnx.BatchNorm\(..., axis_name='data'\) and "
                r"leave sync_bn off$")
    with pytest.raises(jaxdp.UsageError) as e:
        model = Tiny()
        trainer(model, jaxdp.classifier(model))
    one_line(e, r"^jaxdp.classifier\(model\) applies a Flax Linen model; for an nnx.Module write loss_fn\(model, batch")
