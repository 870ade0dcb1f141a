"""One rng stream whatever the layout: dropout masks depend on the key given to ``Trainer.init``,
the step, the device's block of the global batch and the micro-batch, never on the strategy or
on ZeRO-3's units.

Each run is checked against a one-device loop that draws the documented keys itself
(``contract_keys``): DDP, ZeRO-3 with units and HSDP at the same N then draw equal masks,
and the loop is what a user writes to reproduce a run on one device. The stream's root is
the key given to ``Trainer.init`` (``key(7)`` here), not the strategy's ``seed=`` option (0).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp

pytestmark = pytest.mark.float64

ROOT_SEED, LR, STEPS, BATCH = 7, 0.01, 3, 8


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.Dropout(0.5, deterministic=not train)(nn.gelu(nn.Dense(8, param_dtype=jnp.float64)(x)))
        return x + nn.Dense(4, param_dtype=jnp.float64)(h)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        shared = Block()  # called twice: its second call must draw fresh masks under units too
        x = shared(Block()(x, train), train)
        x = shared(x, train)
        return nn.Dense(1, param_dtype=jnp.float64)(nn.Dropout(0.25, deterministic=not train)(x))[:, 0]


model = Net()


def loss_fn(params, model_state, batch, rng):
    pred = model.apply({"params": params}, batch["x"], rngs={"dropout": rng})
    return jnp.mean((pred - batch["y"]) ** 2), (model_state, {})


def batches():
    rs = np.random.default_rng(0)
    return [{"x": rs.normal(size=(BATCH, 4)), "y": rs.normal(size=(BATCH,))} for _ in range(STEPS)]


def trained(strategy, n):
    trainer = jaxdp.Trainer(model, loss_fn, optax.sgd(LR), strategy, jaxdp.make_mesh(data=n),
                            model_inputs=lambda b: (b["x"],), init_kwargs={"train": False})
    data = batches()
    state = trainer.init(jax.random.key(ROOT_SEED), data[0])
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), trainer.canonical(state).params


def contract_keys(root, step, blocks, accum_steps):
    """The documented stream: block b's micro-batch k at ``step`` sees this key."""
    return [jax.random.split(jax.random.fold_in(jax.random.fold_in(root, step), b), accum_steps)
            for b in range(blocks)]


@functools.lru_cache(maxsize=None)
def one_device(blocks, accum_steps):
    """Plain optax on one device: the global batch cut into ``blocks`` x ``accum_steps`` pieces,
    each with its key from ``contract_keys``, the loss their mean (DDP's)."""
    data = batches()
    root = jax.random.key(ROOT_SEED)
    params = model.init(root, data[0]["x"], train=False)["params"]
    tx = optax.sgd(LR)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch, step):
        keys = contract_keys(root, step, blocks, accum_steps)
        pieces = jax.tree_util.tree_map(lambda x: x.reshape(blocks, accum_steps, -1, *x.shape[1:]), batch)

        def mean_loss(p):
            losses = [loss_fn(p, {}, jax.tree_util.tree_map(lambda x: x[b, k], pieces), keys[b][k])[0]
                      for b in range(blocks) for k in range(accum_steps)]
            return sum(losses) / len(losses)
        loss, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for i, batch in enumerate(data):
        params, opt, loss = step(params, opt, batch, i)
        losses.append(float(loss))
    return np.array(losses), params


@pytest.mark.parametrize("strategy,n,accum", [
    (jaxdp.DDP(), 1, 1),
    (jaxdp.DDP(), 2, 1),
    (jaxdp.ZeRO(stage=3, units=(Block,)), 2, 1),
    # 2 replicas x 2 shards (the block is r * 2 + s); units that keep their activations
    (jaxdp.HSDP(units=(Block,), remat="none", accum_steps=2), 4, 2),
], ids=["one-device", "ddp2", "zero3-units2", "hsdp4-units-accum2"])
def test_dropout_masks_follow_the_documented_stream(strategy, n, accum):
    losses, params = trained(strategy, n)
    want_losses, want_params = one_device(n, accum)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-13)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14), params, want_params)

