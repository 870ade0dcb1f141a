"""Your own model and loss, split over devices: tensor parallelism and pipeline stages.

    python examples/custom_model_parallel.py     # ~1 min on 2 CPU cores (three runs of 20 steps)

A small token MLP (embedding, pre-norm residual MLP blocks, a head) with its own loss and a
batch {"tokens": int32[B, T + 1]} trains on one device, on ``data=2,model=2`` (each block's
hidden features split Megatron-style) and on ``data=2,stage=2`` (its layers cut into two
pipeline stages), and the three runs follow the same losses. What the model adds for this
(the protocol in docs/strategies.md, "Model parallelism for your own model"):

- ``model_axis`` (a field) and ``TP_PLAN``: ``fc1`` column-parallel, ``fc2`` row-parallel; the
  layers split themselves with ``column_features`` and ``row_parallel``;
- ``pipeline_layers()``: its forward as an ordered list of layers;
- a loss whose first parameter is ``model``: it receives the copy jaxdp prepared.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

from typing import Any, Optional  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.parallel.pipeline import Layer  # noqa: E402
from jaxdp.parallel.protocol import column_features, row_parallel  # noqa: E402
from jaxdp.parallel.tensor import Column, Row  # noqa: E402

VOCAB, SEQ = 16, 8


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): fc1's hidden features are split over ``model_axis``,
    fc2 sums its partial products over it."""

    dim: int
    hidden: int
    dtype: Any = jnp.float32
    model_axis: Optional[str] = None

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=self.dtype)
        h = nn.LayerNorm(name="norm", **kw)(x)
        h = nn.gelu(nn.Dense(column_features(self.hidden, self.model_axis), name="fc1", **kw)(h))
        return x + nn.Dense(self.dim, dot_general=row_parallel(self.model_axis), name="fc2", **kw)(h)


class TokenMLP(nn.Module):
    dim: int = 32
    hidden: int = 64
    depth: int = 2
    dtype: Any = jnp.float32
    model_axis: Optional[str] = None  # jaxdp sets it to "model" inside the step

    # Which variables split how over the model axis (fnmatch on collection/module/.../name).
    TP_PLAN = {"params/block_*/fc1/kernel": Column(), "params/block_*/fc1/bias": Column(),
               "params/block_*/fc2/kernel": Row()}

    @nn.nowrap
    def parts(self, named: bool):
        """The layers: named children in ``__call__``, unbound copies for ``pipeline_layers``."""
        kw = dict(dtype=self.dtype, param_dtype=self.dtype)
        name = (lambda n: n) if named else (lambda n: None)  # noqa: E731
        blocks = [Block(self.dim, self.hidden, self.dtype, self.model_axis, name=name(f"block_{i}"))
                  for i in range(self.depth)]
        return (nn.Embed(VOCAB, self.dim, name=name("embed"), **kw), blocks, nn.LayerNorm(name=name("norm"), **kw),
                nn.Dense(VOCAB, name=name("head"), **kw))

    @nn.compact
    def __call__(self, tokens):
        embed, blocks, norm, head = self.parts(named=True)
        x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (SEQ, self.dim), self.dtype)
        for block in blocks:
            x = block(x)
        return head(norm(x))

    @nn.nowrap
    def pipeline_layers(self):
        """embed + pos, each block, norm + head: the stages take contiguous runs of these."""
        embed, blocks, norm, head = self.parts(named=False)

        def embedded(p, tokens):
            return embed.apply({"params": p[0]}, tokens) + p[1]

        def blocked(block):
            return lambda p, x: block.apply({"params": p[0]}, x)

        def logits(p, x):
            return head.apply({"params": p[1]}, norm.apply({"params": p[0]}, x))

        return ([Layer("embed", (("embed",), ("pos",)), embedded)]
                + [Layer(f"block_{i}", ((f"block_{i}",),), blocked(block)) for i, block in enumerate(blocks)]
                + [Layer("head", (("norm",), ("head",)), logits)])


def loss_fn(model, params, model_state, batch, rng):
    """Next-token cross-entropy. ``model`` is the one jaxdp prepared: split, staged or as given."""
    tokens = batch["tokens"]
    logits = model.apply({"params": params}, tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss, (model_state, {})


def eval_fn(model, params, model_state, batch):
    """Per-device sums, which jaxdp sums over the data axes: summed token losses and the token count."""
    tokens = batch["tokens"]
    logits = model.apply({"params": params}, tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return {"loss_sum": losses.sum(), "tokens": jnp.asarray(losses.size, losses.dtype)}


def model_inputs(batch):
    return (batch["tokens"][:, :-1],)


def batches(steps, batch_size=8, seed=0):
    """Sequences counting up mod VOCAB from a random start: learnable, and fully offline."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (batch_size, 1))
        yield {"tokens": ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)}


def train(mesh, steps=20, dtype=jnp.float32, strategy="ddp", **sizes):
    """Every step's loss, the final params (the model's own tree, whatever the layout) and the
    mean token loss on 6 held-out sequences."""
    model = TokenMLP(dtype=dtype, **sizes)
    trainer = jaxdp.Trainer(model, loss_fn, optax.adam(3e-3), strategy, mesh, eval_fn=eval_fn,
                            model_inputs=model_inputs)
    state = trainer.init(jax.random.key(0), next(batches(1)))
    losses = []
    for batch in batches(steps):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    sums = trainer.evaluate(state, next(batches(1, batch_size=6, seed=1)))
    return losses, trainer.canonical(state).params, float(sums["loss_sum"] / sums["tokens"])


if __name__ == "__main__":
    for axes in (dict(data=1), dict(data=2, model=2), dict(data=2, stage=2)):
        losses, _, held_out = train(jaxdp.make_mesh(**axes))
        layout = ",".join(f"{k}={v}" for k, v in axes.items())
        print(f"{layout:16s} loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps, held out {held_out:.4f}")
