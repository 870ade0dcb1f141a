"""Your own Flax NNX model with jaxdp: a tiny causal transformer LM, trained with ZeRO-3 on 4 devices.

    python examples/custom_model_nnx.py        # ~25 s on 2 CPU cores

NNX, the API Flax leads with: the model is an ``nnx.Module`` built eagerly with its params, and
the loss takes the module itself, ``loss_fn(model, batch, rng)``. jaxdp needs only the model, the
loss and which submodules are FSDP units (every ``Block``, or the attribute path ``"blocks/*"``):
each unit's params are gathered just before it runs and freed after. The same model in Flax
Linen, the same names (``blocks_0`` there for ``blocks/0`` here), trains the same numbers:
examples/custom_model.py (tests/test_nnx_units.py checks it bit for bit in float64). ``make_trainer``
gives its Trainer to ``jaxdp inspect --trainer`` (docs/api.md, ``trainer.inspect``).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxdp  # noqa: E402

VOCAB, SEQ, DIM = 32, 16, 64


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, attention_fn=nnx.dot_product_attention):
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(DIM, **kw)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=DIM, decode=False, attention_fn=attention_fn, **kw)
        self.ln2 = nnx.LayerNorm(DIM, **kw)
        self.fc1 = nnx.Linear(DIM, 4 * DIM, **kw)
        self.fc2 = nnx.Linear(4 * DIM, DIM, **kw)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class TinyLM(nnx.Module):
    """``attention_fn``: the blocks' attention (tests/test_nnx_units.py passes Linen's: NNX's default
    computes the softmax of float64 inputs in float32, through ``jax.nn.dot_product_attention``)."""

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, attention_fn=nnx.dot_product_attention):
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.embed = nnx.Embed(VOCAB, DIM, **kw)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (SEQ, DIM), param_dtype))
        self.blocks = nnx.List([Block(attention_fn=attention_fn, **kw) for _ in range(2)])
        self.ln_f = nnx.LayerNorm(DIM, **kw)
        self.head = nnx.Linear(DIM, VOCAB, **kw)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model, batch, rng):
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def batches(steps, batch_size=16, seed=0):
    """Sequences counting up mod VOCAB from a random start: learnable, and fully offline."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (batch_size, 1))
        yield {"tokens": ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)}


def train(strategy, steps=30, model=None):
    """The losses of ``steps`` steps, and the trained module."""
    model = TinyLM(rngs=nnx.Rngs(0)) if model is None else model
    trainer = jaxdp.Trainer(model, loss_fn, optax.adamw(3e-3, weight_decay=0.01), strategy, jaxdp.make_mesh(data=4))
    state = trainer.init(jax.random.key(0), next(batches(1)))
    losses = []
    for batch in batches(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, trainer.model(state)


def make_trainer():
    """(the LM's zero3 Trainer on this machine's devices, an example batch), for compiling its step for GPUs
    that are not here: ``trainer.inspect(batch, target="h100", devices=8)``, or from the command line
    ``PYTHONPATH=examples jaxdp inspect --target h100 --devices 8 --trainer custom_model_nnx:make_trainer``."""
    trainer = jaxdp.Trainer(TinyLM(rngs=nnx.Rngs(0)), loss_fn, optax.adamw(3e-3, weight_decay=0.01),
                            jaxdp.ZeRO(stage=3, units=(Block,)), jaxdp.make_mesh(data=jax.device_count()))
    return trainer, next(batches(1))


if __name__ == "__main__":
    losses, trained = train(jaxdp.ZeRO(stage=3, units=(Block,)))
    print(f"zero3 loss: {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    tokens = next(batches(1, batch_size=1, seed=1))["tokens"][:, :-1]
    print("next tokens:", np.asarray(jnp.argmax(trained(tokens), -1))[0, :8], "after", np.asarray(tokens)[0, :8])
