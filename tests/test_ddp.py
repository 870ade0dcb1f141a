"""DDP against independent single-device references (float64)."""

import re

import jax
import numpy as np
import optax
import pytest
from helpers import TinyConvNet, as_batch, collectives_in_loops, init, max_rel_error, random_batch, run_steps, tiny_resnet

from jaxdp.runtime.mesh import make_mesh
from jaxdp.optim import make_optimizer
from jaxdp.strategies import create_strategy
from jaxdp.loss.task import classifier, cross_entropy

pytestmark = pytest.mark.float64  # exact comparisons in float64 (conftest turns x64 on)

STEPS = 3


def reference_ddp(model, variables, tx, batches, n):
    """One device, one shard at a time: average the shard gradients, keep shard 0's BN stats."""
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    @jax.jit  # compiled once: op-by-op dispatch of a ResNet's backward costs more than the strategy's test
    def shard_grad(p, bs, x, y):
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": bs}, x, train=True, mutable=["batch_stats"])
            return cross_entropy(logits, y), upd["batch_stats"]
        return jax.grad(loss_fn, has_aux=True)(p)

    update = jax.jit(tx.update)
    for x, y in batches:
        xs, ys = np.split(x, n), np.split(y, n)
        results = [shard_grad(params, stats, xs[r], ys[r]) for r in range(n)]
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / n, *[g for g, _ in results])
        stats = results[0][1]
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats, opt_state


def reference_full_batch(model, variables, tx, batches):
    """Plain single-device training on the whole global batch (what SyncBN must equal)."""
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)
    @jax.jit
    def grad_fn(params, stats, x, y):
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return cross_entropy(logits, y), upd["batch_stats"]
        return jax.grad(loss_fn, has_aux=True)(params)

    update = jax.jit(tx.update)
    for x, y in batches:
        grads, stats = grad_fn(params, stats, x, y)
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats, opt_state


def ddp(model, tx, n, **options):
    return create_strategy("ddp", model, classifier(model), tx, make_mesh(n), **options)


def run_strategy(model, variables, tx, batches, n, **options):
    strategy = ddp(model, tx, n, **options)
    state, history = run_steps(strategy, strategy.engine.init_state(variables), batches)
    return state, history[-1]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_ddp_equals_per_shard_reference(n):
    model = tiny_resnet()
    variables = init(model)
    # lr 0.1 on random labels makes the dynamics chaotic: 1e-14 summation-order noise grows
    # ~30x per step. At 0.01 it stays at 1e-14, and any real bug is still O(1) at step 1.
    tx = make_optimizer("sgd", 0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    # 4 samples per device: BN over 2 samples of a 1x1 map is too ill-conditioned for 1e-12.
    batches = [random_batch(4 * n, seed=s) for s in range(STEPS)]
    state, _ = run_strategy(model, variables, tx, batches, n, bucket_cap_mb=0.002)
    params, stats, opt_state = reference_ddp(model, variables, tx, batches, n)
    assert max_rel_error(state.params, params) <= 1e-12
    assert max_rel_error(state.model_state["batch_stats"], stats) <= 1e-12
    assert max_rel_error(state.opt_state, opt_state) <= 1e-12


def test_per_device_losses_are_each_shards_loss():
    model, n = tiny_resnet(), 4
    variables = init(model)
    x, y = random_batch(16)
    _, metrics = run_strategy(model, variables, optax.sgd(0.0), [(x, y)], n)
    expected = [
        cross_entropy(model.apply(variables, xs, train=True, mutable=["batch_stats"])[0], ys)
        for xs, ys in zip(np.split(x, n), np.split(y, n))
    ]
    np.testing.assert_allclose(metrics["loss_per_device"], expected, rtol=1e-13)
    np.testing.assert_allclose(metrics["loss"], np.mean(expected), rtol=1e-13)


def test_sync_bn_equals_single_device_full_batch():
    model = tiny_resnet()
    variables = init(model)
    tx = make_optimizer("adam", 1e-2)
    batches = [random_batch(16, seed=s) for s in range(STEPS)]
    state, _ = run_strategy(model, variables, tx, batches, 4, sync_bn=True)
    params, stats, _ = reference_full_batch(model, variables, tx, batches)
    assert max_rel_error(state.params, params) <= 1e-12
    assert max_rel_error(state.model_state["batch_stats"], stats) <= 1e-12


def test_accumulation_equals_one_large_batch():
    """K micro-batches with no_sync semantics make the same update as one K-times-larger batch."""
    model, k, n = TinyConvNet(), 4, 2
    variables = {"batch_stats": {}, **init(model)}
    tx = make_optimizer("sgd", 0.1, momentum=0.9)
    batches = [random_batch(32, seed=s) for s in range(STEPS)]
    state, _ = run_strategy(model, variables, tx, batches, n, accum_steps=k)
    params, _, _ = reference_full_batch(model, variables, tx, batches)
    assert max_rel_error(state.params, params) <= 1e-12


def test_accumulation_does_one_all_reduce_group_per_update():
    model, n = TinyConvNet(), 2
    variables = {"batch_stats": {}, **init(model)}
    x, y = random_batch(32)

    def compiled_hlo(k):
        strategy = ddp(model, optax.sgd(0.1), n, accum_steps=k)
        state = strategy.engine.init_state(variables)
        return strategy.engine.lower_step(state, strategy.engine.shard_batch(as_batch(x, y))).compile().as_text()

    inside_k1, outside_k1 = collectives_in_loops(compiled_hlo(1))
    inside_k4, outside_k4 = collectives_in_loops(compiled_hlo(4))
    assert inside_k1 == inside_k4 == {}, "no collective inside the micro-batch loop"
    assert outside_k4 == outside_k1 and outside_k1.get("all-reduce", 0) > 0


def torch_reduction_order(model_kw):
    """Names and byte sizes of the torch_ref twin's params in reverse ``named_parameters()`` order: DDP's."""
    from torch_ref.models import resnet as torch_resnet

    torch_model = torch_resnet("resnet18", **model_kw).double()
    names = [name for name, _ in torch_model.named_parameters()][::-1]
    sizes = [p.numel() * p.element_size() for _, p in torch_model.named_parameters()][::-1]
    return names, sizes


def torch_buckets(sizes, limits):
    """torch's own bucket assignment for tensors of these byte sizes, in this order."""
    import torch
    import torch.distributed as dist

    tensors = [torch.zeros(s, dtype=torch.int8) for s in sizes]
    return dist._compute_bucket_assignment_by_size(tensors, limits)[0]


def random_variables(model, seed=0):
    """Valid variables of the right shapes without running init (the bucket tests need no trained values)."""
    shapes = jax.eval_shape(lambda: init(model))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda s: rng.uniform(0.5, 1.5, s.shape).astype(s.dtype), shapes)


MIB_BYTES = 1024 * 1024


def test_plan_buckets_is_torchs_bucket_assignment():
    from jaxdp.strategies.sync.buckets import plan_buckets

    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(1, 40, rng.integers(1, 12)).tolist()
        limits = sorted(rng.integers(1, 60, rng.integers(1, 3)).tolist())
        assert plan_buckets(sizes, limits) == torch_buckets(sizes, limits), (sizes, limits)


def test_an_infinite_bucket_cap_is_one_bucket():
    from jaxdp.strategies.sync.buckets import bucket_limits, plan_buckets

    assert plan_buckets([3, 5, 7], bucket_limits(float("inf"))) == [[0, 1, 2]]
    assert len(plan_buckets([MIB_BYTES, MIB_BYTES], bucket_limits(1.0))) == 2  # a finite cap still cuts


def test_buckets_hold_grads_in_reverse_torch_parameter_order():
    """Grads as jax.grad returns them for a placed state (key-sorted dicts) go through ``bucketed``:
    each bucket must be the grads of torch's reversed ``named_parameters()``, cut where torch cuts."""
    from jaxdp.interop import param_name_map
    from jaxdp.strategies.sync.buckets import bucketed

    model = tiny_resnet()
    strategy = ddp(model, optax.sgd(0.1), 2)
    state = strategy.engine.init_state(random_variables(model))
    x, y = random_batch(4)

    def loss_fn(p):
        logits, _ = model.apply({"params": p, "batch_stats": state.model_state["batch_stats"]}, x, train=True,
                                mutable=["batch_stats"])
        return cross_entropy(logits, y)

    grads = jax.jit(jax.grad(loss_fn))(state.params)
    names, sizes = torch_reduction_order(dict(width=4, blocks=(1, 1, 1, 1)))
    path_of = param_name_map(grads)
    leaf = {".".join(path): np.asarray(g).ravel() for path, g in
            ((tuple(k.key for k in kp), g) for kp, g in jax.tree_util.tree_leaves_with_path(grads))}
    limits = [2000, 6000]  # bytes: the f64 tiny ResNet (~5k params) makes a handful of buckets
    expected = [np.concatenate([leaf[".".join(path_of[names[i]])] for i in b]) for b in torch_buckets(sizes, limits)]
    assert len(expected) > 3

    received = []
    strategy.learn_structure(as_batch(x, y))
    out = bucketed(grads, lambda bucket: received.append(np.concatenate([np.asarray(g).ravel() for g in bucket]))
                   or bucket, strategy.param_order, limits)
    assert len(received) == len(expected)
    for got, want in zip(received, expected):
        np.testing.assert_array_equal(got, want)
    assert max_rel_error(out, grads) == 0.0


def test_ddp_step_reduces_torch_sized_buckets():
    """Through the strategy's own step (traced only): one reduction per torch bucket, in torch's sizes."""
    seen = []
    model = tiny_resnet()
    strategy = ddp(model, optax.sgd(0.1), 2, bucket_cap_mb=4000 / 2**20)
    reduce_bucket = strategy.sync.reduce_bucket  # DDP's gradient sync is its AllReduce transform

    def recording(grads, axis, n):
        seen.append(sum(g.size * g.dtype.itemsize for g in grads))
        return reduce_bucket(grads, axis, n)

    strategy.sync.reduce_bucket = recording
    state = strategy.engine.init_state(random_variables(model))
    strategy.engine.lower_step(state, strategy.engine.shard_batch(as_batch(*random_batch(4))))
    _, sizes = torch_reduction_order(dict(width=4, blocks=(1, 1, 1, 1)))
    assert seen == [sum(sizes[i] for i in b) for b in torch_buckets(sizes, [4000])]


def test_bad_accumulation_is_a_clear_error():
    from jaxdp.strategies import StrategyError

    model = TinyConvNet()  # any model: the batch is refused while the step is traced
    with pytest.raises(StrategyError, match="not divisible by 3 accumulation steps"):
        run_strategy(model, init(model), optax.sgd(0.1), [random_batch(16)], 2, accum_steps=3)
