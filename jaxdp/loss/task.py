"""The contract between a model and a strategy: a loss function and an evaluation function.

A strategy trains any

    loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))

- ``batch``: any pytree whose leaves share a leading batch dimension (split over the data axes);
- ``model_state``: the model's mutable collections, e.g. ``{"batch_stats": ...}``, or ``{}``;
- ``metrics``: the user's own scalars, averaged over the data axes by the strategy;
- ``rng``: a key unique to the step, the device and the micro-batch (for dropout).

and evaluates with any ``eval_fn(params, model_state, batch) -> {name: per-device sum}``,
which the strategy sums over the data axes.

``classifier(model)`` builds both for a Flax image classifier called as
``model(images, train=...)`` with batches ``{"image", "label"}`` (and ``"mask"`` for
evaluation, 0 on padding): torch's ``cross_entropy(reduction="mean")`` and accuracy.
"""

from typing import Any, Callable, Dict

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits, labels):
    """Mean cross-entropy, as torch.nn.functional.cross_entropy(reduction='mean')."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Classifier:
    """``loss_fn``/``eval_fn`` for a Flax classifier; ``with_model`` rebinds them (SyncBN swaps in a
    model whose BatchNorm reduces over the data axes)."""

    def __init__(self, model):
        self.model = model

    def with_model(self, model) -> "Classifier":
        return Classifier(model)

    @staticmethod
    def model_inputs(batch):
        return (batch["image"],)

    init_kwargs = {"train": False}

    def loss_fn(self, params, model_state, batch, rng=None):
        mutable = list(model_state)
        out = self.model.apply({"params": params, **model_state}, batch["image"], train=True,
                               mutable=mutable or False)
        logits, new_state = out if mutable else (out, {})
        loss, accuracy = loss_and_accuracy(logits, batch["label"])
        return loss, (dict(new_state), {"accuracy": accuracy})

    def eval_fn(self, params, model_state, batch) -> Dict[str, Any]:
        logits = self.model.apply({"params": params, **model_state}, batch["image"], train=False)
        return eval_sums(logits, batch)


def loss_and_accuracy(logits, labels):
    """A classifier's training loss (torch's mean cross-entropy) and accuracy on a batch of logits."""
    return cross_entropy(logits, labels), (jnp.argmax(logits, -1) == labels).mean(dtype=logits.dtype)


def eval_sums(logits, batch) -> Dict[str, Any]:
    """A classifier's evaluation sums over a batch of logits (``mask``: 0 on padding)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    weight = batch["mask"].astype(losses.dtype) if "mask" in batch else jnp.ones_like(losses)
    correct = (jnp.argmax(logits, -1) == batch["label"]).astype(losses.dtype)
    return {"loss_sum": (losses * weight).sum(), "correct": (correct * weight).sum(), "count": weight.sum()}


def classifier(model) -> Classifier:
    return Classifier(model)


def as_task(loss_fn: Callable, eval_fn=None, model_inputs=None, init_kwargs=None):
    """Wrap a user's plain functions in the same shape as ``Classifier``."""
    return _Task(loss_fn, eval_fn, model_inputs or (lambda batch: (batch,)), dict(init_kwargs or {}))


class _Task:
    def __init__(self, loss_fn, eval_fn, model_inputs, init_kwargs):
        self.loss_fn, self.eval_fn, self.model_inputs, self.init_kwargs = loss_fn, eval_fn, model_inputs, init_kwargs

    def with_model(self, model):
        raise ValueError("tensor parallelism and sync_bn run a model jaxdp prepares, which this loss_fn cannot "
                         "receive: write it as loss_fn(model, params, model_state, batch, rng) and apply that model")


def batch_size(batch) -> int:
    """The leading dimension every leaf of ``batch`` shares; ValueError if they differ."""
    sizes = {x.shape[0] if jnp.ndim(x) else None for x in jax.tree_util.tree_leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every leaf of a batch needs the same leading batch dimension, got {sorted(map(str, sizes))}")
    return sizes.pop()
