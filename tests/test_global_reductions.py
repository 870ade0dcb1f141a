"""Global reductions under every layout (``jaxdp.loss.reductions``): the sharding-aware clip, the refusal
of optax transforms that would reduce over a device's chunk only, and ``jaxdp.global_mean``.

Each case runs a tiny float64 MLP with the public API against a plain single-device optax loop
on the same global batch: the reference is the math itself, not another strategy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.strategies import StrategyError


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(5, param_dtype=jnp.float64, dtype=jnp.float64)(x))  # 5 over 2 or 3: padded
        return nn.Dense(3, param_dtype=jnp.float64, dtype=jnp.float64)(x)


MODEL = MLP()
STRATEGIES = {"ddp": jaxdp.DDP(), "zero1": jaxdp.ZeRO(stage=1), "zero2": jaxdp.ZeRO(stage=2),
              "zero3": jaxdp.ZeRO(stage=3), "hsdp": jaxdp.HSDP()}


def batches(n_rows, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(n_rows, 4)), "y": rng.normal(size=(n_rows, 3)),
             "w": rng.integers(0, 4, size=n_rows).astype(np.float64)} for _ in range(steps)]


def mean_loss(params, model_state, batch, rng):
    err = MODEL.apply({"params": params}, batch["x"]) - batch["y"]
    return jnp.mean(err ** 2), (model_state, {})


def weighted_loss(params, model_state, batch, rng):
    per_example = jnp.sum((MODEL.apply({"params": params}, batch["x"]) - batch["y"]) ** 2, axis=-1)
    return jaxdp.global_mean(per_example, batch["w"]), (model_state, {})


def reference(loss_fn, tx, params, data):
    """One device, the whole global batch, plain optax (``global_mean`` is the local weighted mean here)."""
    state = tx.init(params)
    losses = []
    for batch in data:
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, {}, batch, None)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, losses


def trained(strategy, loss_fn, tx, data, devices, **options):
    spec = jaxdp.StrategySpec(STRATEGIES[strategy].name, {**STRATEGIES[strategy].options, **options})
    trainer = jaxdp.Trainer(MODEL, loss_fn, tx, spec, jaxdp.make_mesh(data=devices), model_inputs=lambda b: (b["x"],))
    state = trainer.init(jax.random.key(0), data[0])
    start = jax.device_get(trainer.canonical(state).params)
    losses = []
    for batch in data:
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return start, jax.device_get(trainer.canonical(state).params), losses


def max_rel(a, b):
    return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in
               zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


# ----------------------------------------------------------------------------- clipping

@pytest.mark.float64
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "hsdp"])  # ddp: parity_tests' clip pairs
def test_clip_by_global_norm_is_the_global_clip_under_every_layout(strategy):
    tx = optax.chain(jaxdp.clip_by_global_norm(0.05), optax.sgd(0.1))
    data = batches(12, 2)
    start, params, losses = trained(strategy, mean_loss, tx, data, devices=3 if strategy != "hsdp" else 4)
    want, want_losses = reference(mean_loss, tx, start, data)
    # The clip is active: the reference's gradients are far above 0.05.
    grads = jax.grad(lambda p: mean_loss(p, {}, data[0], None)[0])(start)
    assert float(optax.tree.norm(grads)) > 4 * 0.05
    assert max_rel(params, want) < 1e-13
    np.testing.assert_allclose(losses, want_losses, rtol=1e-13)


@pytest.mark.float64
def test_optax_global_clip_is_refused_under_zero_and_exact_under_ddp(monkeypatch):
    """The issue's scenario: optax.chain(optax.clip_by_global_norm(0.05), sgd) moved ZeRO's params
    1.33 relative off the reference after 2 steps (each device clipped by its own chunk's norm)."""
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
    data = batches(12, 2)
    start, params, _ = trained("ddp", mean_loss, tx, data, devices=3)
    assert max_rel(params, reference(mean_loss, tx, start, data)[0]) < 1e-13  # whole grads: exact
    with monkeypatch.context() as m:  # what the refusal prevents: zero3 without the check
        m.setattr("jaxdp.strategies.base.Strategy.refuse_unshardable_tx", lambda self: None)
        start, params, _ = trained("zero3", mean_loss, tx, data, devices=3)
    assert max_rel(params, reference(mean_loss, tx, start, data)[0]) > 0.1
    for strategy in ("zero1", "zero2", "zero3", "hsdp"):
        with pytest.raises(StrategyError, match=r"reduces over whole tensors \(reduce_sum\).*"
                                                r"jaxdp\.clip_by_global_norm") as e:
            trained(strategy, mean_loss, tx, data, devices=2)
        assert "\n" not in str(e.value)


@pytest.mark.float64
@pytest.mark.parametrize("tx", [optax.adaptive_grad_clip(0.1), optax.lamb(1e-3), optax.lars(1e-3),
                                optax.apply_if_finite(optax.sgd(0.1), 3)],
                         ids=["adaptive_grad_clip", "lamb", "lars", "apply_if_finite"])
def test_whole_tree_transforms_are_refused_under_zero(tx):
    with pytest.raises(StrategyError, match="reduces over whole tensors"):
        trained("zero2", mean_loss, tx, batches(4, 1), devices=2)


@pytest.mark.float64
@pytest.mark.parametrize("tx", [optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10), weight_decay=1e-2),
                                optax.chain(optax.clip(1.0), optax.sgd(0.1, momentum=0.9, nesterov=True)),
                                optax.chain(jaxdp.clip_by_global_norm(1.0), optax.adam(1e-3))],
                         ids=["adamw-warmup-cosine", "elementwise-clip", "jaxdp-clip"])
def test_elementwise_transforms_pass_the_check(tx):
    """A schedule's own reductions (join_schedules sums over its boundaries) are not over the params."""
    from jaxdp.loss.reductions import StepContext, check_shardable

    params = jax.eval_shape(MODEL.init, jax.random.key(0), jnp.zeros((2, 4)))["params"]
    check_shardable(tx, params, "zero3", StepContext("data", 2, 1, lambda tree: jnp.ones(())))


# ----------------------------------------------------------------------------- the loss

@pytest.mark.float64
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "hsdp"])
def test_global_mean_is_the_global_weighted_mean(strategy):
    """N = 3 (HSDP: 1 x 3 would be ZeRO-3, so 2 x 3 on 6 devices), accum_steps = 2: the loss and
    the params match one device's weighted mean over the whole batch."""
    tx = optax.sgd(0.1, momentum=0.9)
    devices = 6 if strategy == "hsdp" else 3
    data = batches(4 * devices, 3, seed=1)
    start, params, losses = trained(strategy, weighted_loss, tx, data, devices, accum_steps=2)
    want, want_losses = reference(weighted_loss, tx, start, data)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-13)
    assert max_rel(params, want) < 1e-13
    if strategy != "hsdp":
        return
    # What the default (a mean of per-device weighted means) gives is measurably off.
    def per_device_mean(params, model_state, batch, rng):
        per_example = jnp.sum((MODEL.apply({"params": params}, batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(per_example * batch["w"]) / jnp.maximum(jnp.sum(batch["w"]), 1.0), (model_state, {})
    _, naive, _ = trained(strategy, per_device_mean, tx, data, devices, accum_steps=2)
    assert max_rel(naive, want) > 1e-3


def test_global_mean_outside_a_step_is_the_weighted_mean():
    values, weights = jnp.array([1.0, 2.0, 4.0]), jnp.array([1.0, 0.0, 3.0])
    assert float(jaxdp.global_mean(values, weights)) == pytest.approx(13 / 4)
    assert float(jaxdp.global_mean(values)) == pytest.approx(7 / 3)


@pytest.mark.float64
def test_jaxdp_clip_on_part_of_the_tree_is_one_clear_error_where_grads_are_cut():
    tx = optax.chain(optax.masked(jaxdp.clip_by_global_norm(1.0), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                     optax.sgd(0.1))
    with pytest.raises(StrategyError, match="needs the whole gradient tree: put it in the top-level optax.chain"):
        trained("zero2", mean_loss, tx, batches(4, 1), devices=2)


def test_optax_global_clip_is_refused_beside_a_model_axis():
    """Under tensor parallelism even ddp's optimizer sees slices. (jaxdp's clip there sums squares
    with the same function as the logged grad_norm, which test_grad_norm.py holds to the whole
    gradient's norm on data=2 x model=2 under ddp and zero3.)"""
    from jaxdp.models.vit import ViT

    model = ViT(num_classes=10, image_size=8, patch=4, dim=8, depth=1, heads=2, mlp_dim=16)
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(4, 8, 8, 3)).astype(np.float32), "label": rng.integers(0, 10, 4)}
    trainer = jaxdp.Trainer(model, jaxdp.classifier(model), optax.chain(optax.clip_by_global_norm(0.05),
                                                                      optax.sgd(0.1)),
                            jaxdp.DDP(), jaxdp.make_mesh(data=2, model=2))
    with pytest.raises(StrategyError, match="reduces over whole tensors.*ddp with a model or stage axis"):
        trainer.init(jax.random.key(0), batch)


@pytest.mark.float64
def test_global_mean_pass_over_the_micro_batches_is_compiled_away():
    """With accum_steps=2 under zero3, the forward-only pass that collects the weight sums adds
    no gather and no matmul to the step: only W's one scalar all-reduce."""
    def plain(params, model_state, batch, rng):
        per_example = jnp.sum((MODEL.apply({"params": params}, batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(per_example * batch["w"]), (model_state, {})

    def counts(loss_fn):
        trainer = jaxdp.Trainer(MODEL, loss_fn, optax.sgd(0.1), jaxdp.ZeRO(stage=3, accum_steps=2),
                                jaxdp.make_mesh(data=2), model_inputs=lambda b: (b["x"],))
        data = batches(8, 1)
        state = trainer.init(jax.random.key(0), data[0])
        text = trainer.strategy.engine.lower_step(state, trainer.strategy.engine.shard_batch(data[0])).as_text()
        return {op: text.count(op) for op in ("all_gather", "dot_general", "all_reduce")}
    with_mean, without = counts(weighted_loss), counts(plain)
    assert with_mean["all_gather"] == without["all_gather"] > 0
    assert with_mean["dot_general"] == without["dot_general"] > 0
    assert with_mean["all_reduce"] == without["all_reduce"] + 1
