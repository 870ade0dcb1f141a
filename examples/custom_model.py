"""Your own model with jaxdp: a tiny causal transformer LM, trained with ZeRO-3 on 4 devices.

    python examples/custom_model.py            # ~30 s on 2 CPU cores

No BatchNorm, a dict batch {"tokens": int32[B, T]}, and the user's own loss: jaxdp needs
only the model, a loss_fn and which submodules are FSDP units (every ``Block``).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402

VOCAB, SEQ, DIM = 32, 16, 64


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(nn.LayerNorm(name="ln1")(x), mask=mask)
        return x + nn.Dense(DIM, name="fc2")(nn.gelu(nn.Dense(4 * DIM, name="fc1")(nn.LayerNorm(name="ln2")(x))))


class TinyLM(nn.Module):  # its NNX twin, the same names but blocks/0 for blocks_0: examples/custom_model_nnx.py
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM, name="embed")(tokens) + self.param("pos", nn.initializers.normal(0.02), (SEQ, DIM))
        for i in range(2):
            x = Block(name=f"blocks_{i}")(x)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln_f")(x))


model = TinyLM()


def loss_fn(params, model_state, batch, rng):
    logits = model.apply({"params": params}, batch["tokens"][:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()
    return loss, (model_state, {})


def batches(steps, batch_size=16, seed=0):
    """Sequences counting up mod VOCAB from a random start: learnable, and fully offline."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (batch_size, 1))
        yield {"tokens": ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)}


def train(strategy, steps=30):
    trainer = jaxdp.Trainer(model, loss_fn, optax.adamw(3e-3, weight_decay=0.01), strategy, jaxdp.make_mesh(data=4),
                            model_inputs=lambda batch: (batch["tokens"][:, :-1],))
    state = trainer.init(jax.random.key(0), next(batches(1)))
    losses = []
    for batch in batches(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


if __name__ == "__main__":
    losses = train(jaxdp.ZeRO(stage=3, units=(Block,)))
    print(f"zero3 loss: {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
