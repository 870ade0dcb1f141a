"""Bounded-staleness parameter server: k = 0 is DDP; k > 0 against a plain Python-loop reference."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from helpers import as_batch, max_rel_error, random_batch, run_steps  # noqa: E402
from helpers import TinyBNNet, numpy_init as init  # noqa: E402

from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.optim import make_optimizer  # noqa: E402
from jaxdp.strategies import StrategyError, create_strategy  # noqa: E402
from jaxdp.strategies.async_ps import AsyncPS  # noqa: E402
from jaxdp.strategies.ddp import DDP  # noqa: E402
from jaxdp.loss.task import classifier, cross_entropy  # noqa: E402

pytestmark = pytest.mark.float64  # exact comparisons in float64 (conftest turns x64 on)

STEPS = 6


def delay_table(k, seed, steps, n):
    """d[t, i]: the documented schedule, drawn here one worker and round at a time."""
    def draw(t, i):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), t), i)
        return int(jax.random.randint(key, (), 0, k + 1))
    return np.array([[draw(t, i) for i in range(n)] for t in range(steps)])


def reference_stale_sgd(model, variables, tx, batches, delays):
    """The schedule, literally: update t averages the N shard gradients, shard i's taken at
    theta_{max(0, t - delays[t, i])}; the optimizer steps the current params; BN running
    stats are the server's, moved by shard 0's batch statistics (at shard 0's params)."""
    @jax.jit
    def shard_grad(p, stats, x, y):
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            loss = cross_entropy(logits, y)
            return loss, (loss, upd["batch_stats"])
        return jax.grad(loss_fn, has_aux=True)(p)

    n = delays.shape[1]
    update = jax.jit(tx.update)
    history = [variables["params"]]  # history[t] = theta_t
    stats, opt_state, losses = variables["batch_stats"], tx.init(variables["params"]), []
    for t, (x, y) in enumerate(batches):
        results = [shard_grad(history[max(0, t - delays[t, i])], stats, xs, ys)
                   for i, (xs, ys) in enumerate(zip(np.split(x, n), np.split(y, n)))]
        grads = jax.tree_util.tree_map(lambda *g: sum(g) / n, *[g for g, _ in results])
        losses.append([float(loss) for _, (loss, _) in results])
        stats = results[0][1][1]
        updates, opt_state = update(grads, opt_state, history[t])
        history.append(optax.apply_updates(history[t], updates))
    return history, stats, opt_state, np.array(losses)


def make(name, model, tx, n, **options):
    return create_strategy(name, model, classifier(model), tx, make_mesh(n), **options)


def run(name, model, variables, tx, batches, n, **options):
    strategy = make(name, model, tx, n, **options)
    state, history = run_steps(strategy, strategy.engine.init_state(variables), batches)
    return strategy, state, history


def test_staleness_zero_is_ddp_exactly():
    """k = 0 runs async's own step (its params_read, its update), not DDP's: bit for bit DDP's
    state and metrics, the averaged gradients included."""
    model, n = TinyBNNet(), 4
    variables = init(model)
    tx = make_optimizer("sgd", 0.1, momentum=0.9, weight_decay=1e-3)
    batches = [random_batch(16, seed=s) for s in range(3)]
    _, ddp, ddp_history = run("ddp", model, variables, tx, batches, n, return_grads=True)
    ps_strategy, ps, ps_history = run("async", model, variables, tx, batches, n, staleness=0, return_grads=True)
    # Its own code path: not DDP's class, nor its step.
    assert isinstance(ps_strategy, AsyncPS) and not isinstance(ps_strategy, DDP)
    assert type(ps_strategy).local_step is AsyncPS.local_step and AsyncPS.local_step is not DDP.local_step
    assert ps.extra is None  # k = 0 keeps no history
    assert jax.tree_util.tree_structure(ddp) == jax.tree_util.tree_structure(ps)
    for a, b in zip(jax.tree_util.tree_leaves(ddp), jax.tree_util.tree_leaves(ps)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(ddp_history) == len(ps_history) == 3
    for m, r in zip(ps_history, ddp_history):
        assert set(m) == set(r) >= {"loss", "loss_per_device", "accuracy", "grads"}
        for a, b in zip(jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(r)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# (k, workers, seed): k = 1 and 2 on 2 workers, and k = 3 on 4 workers with every delay 0..3 in play.
@pytest.mark.parametrize("k,n,seed", [(1, 2, 0), (2, 2, 0), (3, 4, 1)])
def test_stale_gradients_match_python_loop_reference(k, n, seed):
    model = TinyBNNet()
    variables = init(model)
    tx = make_optimizer("sgd", 0.1, momentum=0.9, weight_decay=1e-3)
    batches = [random_batch(4 * n, seed=s) for s in range(STEPS)]
    delays = delay_table(k, seed, STEPS, n)
    # The schedule must exercise what it claims: stale reads, and workers of one round at different versions.
    assert delays.max() == k and (delays.min(axis=1) != delays.max(axis=1)).any(), delays
    if n == 4:
        assert set(delays.ravel()) == set(range(k + 1)), delays

    strategy = make("async", model, tx, n, staleness=k, staleness_seed=seed)
    state, losses = strategy.engine.init_state(variables), []
    for i, (x, y) in enumerate(batches):
        state, metrics = strategy.engine.step(state, strategy.engine.shard_batch(as_batch(x, y)))
        losses.append(np.asarray(metrics["loss_per_device"]))
        if i == 1:  # a checkpoint round trip mid-run, ring buffer included
            state = strategy.engine.from_canonical(jax.tree_util.tree_map(np.asarray, strategy.engine.canonical(state)))
    history, stats, opt_state, ref_losses = reference_stale_sgd(model, variables, tx, batches, delays)
    np.testing.assert_allclose(np.array(losses), ref_losses, rtol=1e-12)  # each worker read its own version
    assert max_rel_error(state.params, history[-1]) <= 1e-12
    assert max_rel_error(state.model_state["batch_stats"], stats) <= 1e-12
    assert max_rel_error(state.opt_state, opt_state) <= 1e-12
    # The ring buffer holds the last k versions theta_{STEPS-k} .. theta_{STEPS-1}, theta_v in slot v mod k.
    assert jax.tree_util.tree_leaves(state.extra["history"])[0].shape[0] == k
    for v in range(STEPS - k, STEPS):
        slot = jax.tree_util.tree_map(lambda h: h[v % k], state.extra["history"])
        assert max_rel_error(slot, history[v]) <= 1e-12


def test_staleness_must_be_non_negative():
    with pytest.raises(StrategyError, match="staleness"):
        make("async", TinyBNNet(), optax.sgd(0.1), 2, staleness=-1)
