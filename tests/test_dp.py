"""Classic DataParallel (pmap) against a single-device full-batch reference, and its HLO pattern."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import math  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from helpers import TinyBNNet, TinyConvNet, as_batch, max_rel_error, numpy_init as init, random_batch  # noqa: E402

from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.optim import make_optimizer  # noqa: E402
from jaxdp.strategies import create_strategy  # noqa: E402
from jaxdp.loss.task import classifier  # noqa: E402

pytestmark = pytest.mark.float64  # exact comparisons in float64 (conftest turns x64 on)


def reference_data_parallel(model, variables, tx, batches, n):
    """nn.DataParallel's math on one device: per-chunk BN, loss = mean over the FULL batch.

    One jax.grad of the full-batch loss sum_i sum(losses of chunk i) / B: the
    gradient the ReduceAdd onto device 0 produces. Running stats: chunk 0's.
    """
    @jax.jit
    def step(params, stats, opt_state, x, y):
        def full_batch_loss(p):
            total, new_stats = 0.0, []
            for xs, ys in zip(jnp.split(x, n), jnp.split(y, n)):
                logits, upd = model.apply({"params": p, "batch_stats": stats}, xs, train=True,
                                          mutable=["batch_stats"])
                total = total + optax.softmax_cross_entropy_with_integer_labels(logits, ys).sum()
                new_stats.append(upd["batch_stats"])
            return total / x.shape[0], new_stats[0]

        (loss, stats), grads = jax.value_and_grad(full_batch_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    params, stats = variables["params"], variables["batch_stats"]
    opt_state, losses = tx.init(params), []
    for x, y in batches:
        params, stats, opt_state, loss = step(params, stats, opt_state, x, y)
        losses.append(float(loss))
    return params, stats, opt_state, losses


def dp(model, tx, n):
    return create_strategy("dp", model, classifier(model), tx, make_mesh(n))


def test_dp_equals_full_batch_mean_reference():
    model, n = TinyBNNet(), 4
    variables = init(model)
    tx = make_optimizer("sgd", 0.1, momentum=0.9, weight_decay=1e-4)
    batches = [random_batch(16, seed=s) for s in range(2)]
    strategy = dp(model, tx, n)
    state = strategy.engine.init_state(variables)
    losses = []
    for x, y in batches:
        state, metrics = strategy.engine.step(state, strategy.engine.shard_batch(as_batch(x, y)))
        losses.append(float(metrics["loss"]))
    params, stats, opt_state, ref_losses = reference_data_parallel(model, variables, tx, batches, n)
    canonical = strategy.engine.canonical(state)
    assert max_rel_error(canonical.params, params) <= 1e-12
    assert max_rel_error(canonical.model_state["batch_stats"], stats) <= 1e-12
    assert max_rel_error(canonical.opt_state, opt_state) <= 1e-12
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-13)
    # Every device holds device 0's params and BN stats after the broadcast.
    for leaf in jax.tree_util.tree_leaves((state.params, state.model_state)):
        np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(np.asarray(leaf)[0], leaf.shape))


def _collectives(hlo):
    """[(op, result element count, source_target_pairs or None)] for every collective in the module."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
                      r"(?:-start)?\(", line)
        if m:
            size = max(int(np.prod([int(d) for d in dims.split(",") if d]))
                       for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1)))  # largest tuple part
            pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
            found.append((m.group(2), size, set(re.findall(r"\{(\d+),(\d+)\}", pairs.group(0))) if pairs else None))
    return found


def test_dp_program_gathers_to_device_0_and_broadcasts():
    for n in (3, 4):  # 3: the broadcast tree is not a full binary tree
        model = TinyConvNet()
        variables = init(model)
        strategy = dp(model, optax.adam(1e-3), n)
        state = strategy.engine.init_state(variables)
        hlo = strategy.engine.lower_step(state, strategy.engine.shard_batch(as_batch(*random_batch(4 * n)))).compile().as_text()
        grad_size = sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))
        ops = _collectives(hlo)

        gathers = [pairs for op, size, pairs in ops if op == "collective-permute" and size == grad_size
                   and all(dst == "0" for _, dst in pairs)]
        assert sorted(gathers, key=sorted) == [{(str(j), "0")} for j in range(1, n)]  # j -> 0, each once
        broadcasts = [pairs for op, size, pairs in ops
                      if op == "collective-permute" and all(dst != "0" for _, dst in pairs)]
        assert len(broadcasts) == math.ceil(math.log2(n))
        reached = {"0"}
        for pairs in broadcasts:  # a tree rooted at device 0 that reaches every device
            assert all(src in reached for src, _ in pairs)
            reached |= {dst for _, dst in pairs}
        assert reached == {str(j) for j in range(n)}
        assert all(size <= n for op, size, _ in ops if op == "all-reduce")  # metrics only, no gradient all-reduce
        assert not [op for op, _, _ in ops if op in ("all-gather", "reduce-scatter", "all-to-all")]
        assert re.search(r"\sconditional\(", hlo)  # the update runs on device 0 only


def test_dp_trains_evaluates_and_round_trips_canonical():
    model, n = TinyConvNet(), 2
    variables = init(model)
    strategy = dp(model, optax.sgd(0.1), n)
    x, y = random_batch(8)
    state = strategy.engine.init_state(variables)
    state, _ = strategy.engine.step(state, strategy.engine.shard_batch(as_batch(x, y)))
    again = strategy.engine.from_canonical(jax.tree_util.tree_map(np.asarray, strategy.engine.canonical(state)))
    assert max_rel_error(again.params, state.params) == 0.0
    out = strategy.engine.evaluate(again, strategy.engine.shard_batch(as_batch(x, y, np.ones(8, bool))))
    logits = model.apply({"params": strategy.engine.canonical(state).params}, jnp.asarray(x))
    want = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()
    np.testing.assert_allclose(float(out["loss_sum"]), float(want), rtol=1e-13)
    assert float(out["count"]) == 8
