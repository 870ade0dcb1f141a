"""DDP against independent single-device references (float64)."""

import re

import jax
import numpy as np
import optax
import pytest
from helpers import TinyConvNet, init, max_rel_error, random_batch, tiny_resnet

from jaxdp.mesh import make_mesh
from jaxdp.optim import make_optimizer
from jaxdp.strategies import create_strategy
from jaxdp.strategies.base import cross_entropy

STEPS = 3


def reference_ddp(model, variables, tx, batches, n):
    """One device, one shard at a time: average the shard gradients, keep shard 0's BN stats."""
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    def shard_grad(p, bs, x, y):
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": bs}, x, train=True, mutable=["batch_stats"])
            return cross_entropy(logits, y), upd["batch_stats"]
        return jax.grad(loss_fn, has_aux=True)(p)

    losses = []
    for x, y in batches:
        xs, ys = np.split(x, n), np.split(y, n)
        results = [shard_grad(params, stats, xs[r], ys[r]) for r in range(n)]
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / n, *[g for g, _ in results])
        stats = results[0][1]
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats, opt_state


def reference_full_batch(model, variables, tx, batches):
    """Plain single-device training on the whole global batch (what SyncBN must equal)."""
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)
    for x, y in batches:
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return cross_entropy(logits, y), upd["batch_stats"]
        grads, stats = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats, opt_state


def run_strategy(model, variables, tx, batches, n, **options):
    strategy = create_strategy("ddp", model, tx, make_mesh(n), **options)
    state = strategy.init_state(variables)
    for x, y in batches:
        state, metrics = strategy.step(state, *strategy.shard_batch(x, y))
    return state, metrics


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
    assert max_rel_error(state.batch_stats, stats) <= 1e-12
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
    assert max_rel_error(state.batch_stats, stats) <= 1e-12


def test_accumulation_equals_one_large_batch():
    """K micro-batches with no_sync semantics make the same update as one K-times-larger batch."""
    model, k, n = TinyConvNet(), 4, 2
    variables = {"batch_stats": {}, **init(model)}
    tx = make_optimizer("sgd", 0.1, momentum=0.9)
    batches = [random_batch(32, seed=s) for s in range(STEPS)]
    state, _ = run_strategy(model, variables, tx, batches, n, accum_steps=k)
    params, _, _ = reference_full_batch(model, variables, tx, batches)
    assert max_rel_error(state.params, params) <= 1e-12


def _all_reduces_by_computation(hlo: str):
    """{computation name: number of all-reduce ops in it} and the while-loop body names."""
    counts, bodies, current = {}, set(), None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = header.group(1)
            counts[current] = 0
        elif current and re.search(r"=\s*\S+\s+all-reduce(-start)?\(", line):
            counts[current] += 1
        bodies.update(re.findall(r"body=%?([\w.\-]+)", line))
    return counts, bodies


def test_accumulation_does_one_all_reduce_group_per_update():
    model, n = TinyConvNet(), 2
    variables = {"batch_stats": {}, **init(model)}
    x, y = random_batch(32)

    def compiled_hlo(k):
        strategy = create_strategy("ddp", model, optax.sgd(0.1), make_mesh(n), accum_steps=k)
        state = strategy.init_state(variables)
        return strategy.lower_step(state, *strategy.shard_batch(x, y)).compile().as_text()

    counts_k1, _ = _all_reduces_by_computation(compiled_hlo(1))
    counts_k4, bodies = _all_reduces_by_computation(compiled_hlo(4))
    assert bodies, "accumulation should compile to a loop over micro-batches"
    assert sum(counts_k4[b] for b in bodies if b in counts_k4) == 0, "no collective inside the micro-batch loop"
    assert sum(counts_k4.values()) == sum(counts_k1.values()) > 0


def test_buckets_follow_reverse_definition_order_and_cap():
    from jaxdp.strategies.buckets import definition_order_paths, plan_buckets

    params = init(tiny_resnet())["params"]
    paths = definition_order_paths(params)
    assert paths[0] == ("conv1", "kernel") and paths[-1] == ("fc", "bias")
    assert plan_buckets([4, 4, 4, 10, 1], cap_bytes=8) == [[0, 1], [2], [3], [4]]


def test_bad_accumulation_is_a_clear_error():
    from jaxdp.strategies import StrategyError

    model = tiny_resnet()
    with pytest.raises(StrategyError, match="not divisible by 3 accumulation steps"):
        run_strategy(model, init(model), optax.sgd(0.1), [random_batch(16)], 2, accum_steps=3)
