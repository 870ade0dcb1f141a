"""Flax NNX models through ``jaxdp.Trainer``: every data-parallel strategy against a plain
single-device NNX loop with no jaxdp in it (float64, <= 1e-12 after 5 steps), at N = 1..4 with
gradient accumulation 1 and 2, for a model with BatchNorm and a switched-off dropout; and the
documented rng streams of a model whose dropout is on (jaxdp.loss.nnx_task).

The reference is what a user writes: ``nnx.grad`` on a copy of the model per device's rows
(each copy updates its own BatchNorm statistics; device 0's are kept, as torch's DDP keeps
rank 0's buffers), micro-batch losses scaled by 1/K, the gradients averaged, then
``nnx.Optimizer.update``. Each strategy's test loops over N and K inside, one tiny program
each: 8 compiles a strategy.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import max_rel_error

import jaxdp

pytestmark = pytest.mark.float64

TOL = 1e-12
STEPS = 5
ROWS = 4  # per device and micro-batch: BatchNorm over fewer rows is too ill-conditioned for 1e-12
F64 = jnp.float64


def float64_stats(bn: nnx.BatchNorm) -> nnx.BatchNorm:
    """nnx.BatchNorm keeps its statistics in float32 whatever its param_dtype (docs/design-notes.md, "Flax NNX against Linen")."""
    bn.mean = nnx.BatchStat(bn.mean[...].astype(F64))
    bn.var = nnx.BatchStat(bn.var[...].astype(F64))
    return bn


class Block(nnx.Module):
    """Linear (no bias: BatchNorm removes it, and Adam would amplify its zero gradient's noise),
    BatchNorm, dropout."""

    def __init__(self, rate: float, rngs: nnx.Rngs, axis_name=None):
        self.lin = nnx.Linear(4, 4, use_bias=False, param_dtype=F64, rngs=rngs)
        self.bn = float64_stats(nnx.BatchNorm(4, momentum=0.9, param_dtype=F64, axis_name=axis_name, rngs=rngs))
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(nnx.relu(self.bn(self.lin(x))))


class Net(nnx.Module):
    def __init__(self, rate: float = 0.0, seed: int = 0, axis_name=None):
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        self.inp = nnx.Linear(3, 4, param_dtype=F64, rngs=rngs)
        self.blocks = nnx.List([Block(rate, rngs, axis_name) for _ in range(2)])
        self.out = nnx.Linear(4, 2, param_dtype=F64, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def loss_fn(model, batch, rng):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def tx():
    return optax.adam(1e-2)


def batches(n, accum, seed=0):
    rs = np.random.default_rng(seed)
    rows = ROWS * n * accum
    return [{"x": rs.normal(size=(rows, 3)), "y": rs.normal(size=(rows, 2))} for _ in range(STEPS)]


def fold_keys(model, index):
    """Device ``index``'s streams, as jaxdp.loss.nnx_task documents them: device 0 the model's own keys."""
    if index:
        for _, var in nnx.iter_graph(model):
            if isinstance(var, nnx.RngKey):
                var.set_value(jax.random.fold_in(var.get_value(), index))
    return model


@nnx.jit  # one program for every (N, K): a micro-batch always has ROWS rows
def micro_grad(model, micro, scale):
    return nnx.value_and_grad(lambda m: loss_fn(m, micro, None) * scale)(model)


def reference(n, accum, rate=0.0, fold=True, staleness=None):
    """A plain NNX loop on one device, no jaxdp: the final model and each step's mean loss
    (``fold``: each device's rng streams as jaxdp documents them, else all as device 0's;
    ``staleness``: (k, seed), device r reading the params of d updates ago, d drawn as
    jaxdp.strategies.async_ps documents it)."""
    model = Net(rate)
    opt = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    losses, history = [], []
    for t, batch in enumerate(batches(n, accum)):
        history.append(jax.tree_util.tree_map(jnp.copy, nnx.state(model, nnx.Param)))
        grads, kept, loss = None, None, 0.0
        for r in range(n):
            device = fold_keys(nnx.clone(model), r if fold else 0)
            if staleness is not None:
                k, seed = staleness
                d = int(jax.random.randint(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), t), r), (), 0,
                                           k + 1))
                nnx.update(device, history[max(0, t - d)])
            for k in range(accum):
                rows = slice((r * accum + k) * ROWS, (r * accum + k + 1) * ROWS)
                value, g = micro_grad(device, {key: v[rows] for key, v in batch.items()}, 1.0 / accum)
                grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
                loss += float(value) / n
            kept = kept or device
        nnx.update(model, nnx.state(kept, nnx.Any(nnx.BatchStat, nnx.RngCount)))
        opt.update(model, jax.tree_util.tree_map(lambda g: g / n, grads))
        losses.append(loss)
    return model, losses


@functools.lru_cache(maxsize=None)
def expected(n, accum, rate=0.0):
    model, losses = reference(n, accum, rate)
    return nnx.state(model, nnx.Not(nnx.RngKey)), losses


def trained(strategy, n, accum, rate=0.0):
    trainer = jaxdp.Trainer(Net(rate), loss_fn, tx(), strategy, jaxdp.make_mesh(data=n))
    state, losses = trainer.init(jax.random.key(0), batches(n, accum)[0]), []
    for batch in batches(n, accum):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return nnx.state(trainer.model(state), nnx.Not(nnx.RngKey)), losses


def assert_as_reference(got, want):
    (state, losses), (ref_state, ref_losses) = got, want
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(ref_state)
    assert max_rel_error(state, ref_state) <= TOL
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)


HSDP_SHAPES = {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2)}  # (replicas, shards): both kinds of degenerate group
FAST = {"compiler_options": "xla_backend_optimization_level=0"}  # 5 steps: compiling at level 2 costs 2x more
STRATEGIES = {
    "ddp": lambda n, k: jaxdp.DDP(accum_steps=k, bucket_cap_mb=1e-4, **FAST),  # a bucket per tensor or two
    "zero1": lambda n, k: jaxdp.ZeRO(stage=1, accum_steps=k, **FAST),
    "zero2": lambda n, k: jaxdp.ZeRO(stage=2, accum_steps=k, **FAST),
    "zero3-remat-unit": lambda n, k: jaxdp.ZeRO(stage=3, units=(Block,), remat="unit", accum_steps=k, **FAST),
    "zero3-remat-none": lambda n, k: jaxdp.ZeRO(stage=3, units=("blocks/*",), remat="none", accum_steps=k, **FAST),
    "hsdp": lambda n, k: jaxdp.HSDP(units=(Block,), mesh_shape=HSDP_SHAPES[n], accum_steps=k, **FAST),
    "dp": lambda n, k: jaxdp.DataParallel(accum_steps=k),  # pmap takes no compile options
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_trains_as_a_plain_nnx_loop(name):
    for n in (1, 2, 3, 4):
        for accum in (1, 2):
            got = trained(STRATEGIES[name](n, accum), n, accum)
            try:
                assert_as_reference(got, expected(n, accum))
            except AssertionError as e:
                raise AssertionError(f"{name} at N = {n}, accumulation {accum}: {e}") from None


def test_dropout_draws_from_the_models_own_streams_per_device():
    """Dropout on (rate 0.5, inside the ZeRO-3 units, recomputed in backward): device 0 draws the
    model's own streams, device d > 0 draws them folded with d, micro-batches continue the count;
    at N = 1 that is a plain NNX loop's draw exactly."""
    for strategy, n, accum in ((jaxdp.DDP(**FAST), 1, 1), (jaxdp.ZeRO(stage=3, units=(Block,), accum_steps=2, **FAST), 2, 2)):
        got = trained(strategy, n, accum, rate=0.5)
        assert_as_reference(got, expected(n, accum, 0.5))
        counts = [int(v) for v in jax.tree_util.tree_leaves(nnx.state(got[0], nnx.RngCount))]
        assert counts and all(c == STEPS * accum for c in counts)  # one draw per block per micro-batch
    # Had device 1 drawn device 0's masks, the run would be another one.
    _, same_masks = reference(2, 2, 0.5, fold=False)
    assert max(abs(a - b) / b for a, b in zip(same_masks, got[1])) > 1e-3


def test_the_trained_module_evaluates_and_the_given_one_is_left_as_it_was():
    model = Net()
    before = jax.tree_util.tree_map(np.asarray, nnx.state(model, nnx.Param))

    def eval_fn(m, batch):
        m.eval()  # this step's copy of the module: BatchNorm on its running statistics
        return {"sse": jnp.sum((m(batch["x"]) - batch["y"]) ** 2)}

    def loss_without_rng(m, batch):  # NNX's form without the key: jaxdp passes none
        return loss_fn(m, batch, None)

    trainer = jaxdp.Trainer(model, loss_without_rng, tx(), jaxdp.ZeRO(stage=3, units=(Block,)),
                            jaxdp.make_mesh(data=2), eval_fn=eval_fn)
    data = batches(2, 1)
    state = trainer.init(jax.random.key(0), data[0])
    state, _ = trainer.step(state, data[0])
    module = trainer.model(state)
    assert isinstance(module, Net) and module is not model
    jax.tree_util.tree_map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), before)
    module.eval()
    want = float(jnp.sum((module(jnp.asarray(data[1]["x"])) - data[1]["y"]) ** 2))
    got = float(trainer.evaluate(state, data[1])["sse"])
    assert abs(got - want) <= 1e-12 * want


def test_batchnorm_over_the_data_axis_trains_as_one_device_on_the_whole_batch():
    """SyncBN the NNX way: ``nnx.BatchNorm(axis_name="data")`` reduces over the devices itself (jaxdp's
    ``sync_bn`` swaps a Linen model's BatchNorm): ddp on 2 devices is one device on the whole batch."""
    data = batches(2, 1)
    model = Net()
    opt = nnx.Optimizer(model, tx(), wrt=nnx.Param)
    for batch in data:
        _, grads = micro_grad(model, batch, 1.0)
        opt.update(model, grads)
    trainer = jaxdp.Trainer(Net(axis_name="data"), loss_fn, tx(), jaxdp.DDP(**FAST), jaxdp.make_mesh(data=2))
    state = trainer.init(jax.random.key(0), data[0])
    for batch in data:
        state, _ = trainer.step(state, batch)
    assert max_rel_error(nnx.state(trainer.model(state), nnx.Not(nnx.RngKey)),
                         nnx.state(model, nnx.Not(nnx.RngKey))) <= TOL


def test_async_and_ddp_compression_train_an_nnx_model():
    """async with staleness 2 reads the params of up to 2 updates ago as its schedule says; DDP's bf16
    compression rounds the averaged gradient (bf16's 3e-3, not float64's 1e-16)."""
    stale = reference(2, 1, staleness=(2, 7))
    assert_as_reference(trained(jaxdp.AsyncPS(staleness=2, staleness_seed=7, **FAST), 2, 1),
                        (nnx.state(stale[0], nnx.Not(nnx.RngKey)), stale[1]))
    fresh = nnx.filter_state(expected(2, 1)[0], nnx.Param)
    assert max_rel_error(nnx.state(stale[0], nnx.Param), fresh) > 1e-3  # the stale reads change the run
    state, _ = trained(jaxdp.DDP(compress="bf16", **FAST), 2, 1)
    assert 1e-6 < max_rel_error(state, expected(2, 1)[0]) < 0.1
