"""Ring collectives (ppermute) against XLA's own collectives, numpy sums, and the ring traffic formula."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdp.strategies.sync.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter  # noqa: E402
from jaxdp.runtime.mesh import make_mesh  # noqa: E402

pytestmark = pytest.mark.float64  # exact comparisons in float64 (conftest turns x64 on)

LENGTH = 37  # odd, and not a multiple of any N in 3..8: every case pads


def _per_device(fn, n):
    """fn(local (L,)) run on each of n devices; input and output stacked over devices."""
    mesh = make_mesh(n)
    return jax.jit(jax.shard_map(lambda x: fn(x[0])[None], mesh=mesh, in_specs=P("data"),
                                 out_specs=P("data"), check_vma=False))


def permute_bytes(hlo: str):
    """Bytes each collective-permute in the compiled module moves per device (its operand size)."""
    sizes = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "bf16": 2, "f16": 2}
    out = []
    for m in re.finditer(r"=\s*(\w+)\[([\d,]*)\]\{?[^}]*\}?\s+collective-permute(?:-start)?\(", hlo):
        dims = [int(d) for d in m.group(2).split(",") if d]
        out.append(sizes[m.group(1)] * int(np.prod(dims)))
    return out


def all_reduce_sizes(hlo: str):
    """Element count of every all-reduce result (each part of a tuple-shaped one)."""
    sizes = []
    for line in hlo.splitlines():
        if re.search(r"\sall-reduce(?:-start)?\(", line):
            result_type = line.split("=", 1)[1].split("all-reduce")[0]
            sizes += [int(np.prod([int(d) for d in dims.split(",") if d]))
                      for dims in re.findall(r"\w+\[([\d,]*)\]", result_type)]
    return sizes


@pytest.mark.parametrize("n", range(2, 9))
def test_ring_all_reduce_equals_psum_and_sends_2_n_minus_1_over_n(n):
    rng = np.random.default_rng(n)
    ints = rng.integers(-10**6, 10**6, size=(n, LENGTH))
    floats = rng.normal(size=(n, LENGTH))

    ring = _per_device(lambda x: ring_all_reduce(x, "data"), n)
    out = np.asarray(ring(ints))
    np.testing.assert_array_equal(out, np.broadcast_to(ints.sum(0), out.shape))  # exact on integers

    psum = _per_device(lambda x: jax.lax.psum(x, "data"), n)
    got, want = np.asarray(ring(floats)), np.asarray(psum(floats))
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()

    # Traffic, read from the compiled program: 2(N-1) hops, each one padded chunk.
    chunk = -(-LENGTH // n)
    sent = permute_bytes(ring.lower(floats).compile().as_text())
    assert len(sent) == 2 * (n - 1)
    padded_bytes = chunk * n * 8
    assert sum(sent) == 2 * (n - 1) * padded_bytes // n
    assert sum(sent) == pytest.approx(2 * (n - 1) / n * LENGTH * 8, rel=(chunk * n - LENGTH) / LENGTH + 1e-12)


@pytest.mark.parametrize("n", [3, 8])
def test_reduce_scatter_and_all_gather_match_xla_layouts(n):
    x = np.random.default_rng(0).integers(-1000, 1000, size=(n, n * 5))
    rs = np.asarray(_per_device(lambda v: ring_reduce_scatter(v, "data"), n)(x))
    want = np.asarray(_per_device(lambda v: jax.lax.psum_scatter(v, "data", tiled=True), n)(x))
    np.testing.assert_array_equal(rs.reshape(want.shape), want)

    ag_fn = _per_device(lambda v: ring_all_gather(v, "data").ravel(), n)
    ag = np.asarray(ag_fn(x[:, :5]))
    np.testing.assert_array_equal(ag, np.broadcast_to(x[:, :5].ravel(), ag.shape))
    sent = permute_bytes(ag_fn.lower(x[:, :5]).compile().as_text())
    assert len(sent) == n - 1 and sum(sent) == (n - 1) * 5 * 8  # (N-1)/N of the gathered buffer


def test_ddp_ring_equals_per_shard_reference():
    import optax
    from helpers import TinyConvNet, init, max_rel_error, random_batch

    from jaxdp.strategies import create_strategy
    from jaxdp.loss.task import classifier, cross_entropy

    model, n = TinyConvNet(), 4
    variables = init(model)  # params only: a BN-free model's model_state is {}
    tx = optax.sgd(0.1, momentum=0.9)
    batches = [random_batch(16, seed=s) for s in range(2)]
    # A small cap: several buckets (conv kernel | conv bias + dense ...), each its own ring.
    strategy = create_strategy("ddp", model, classifier(model), tx, make_mesh(n), allreduce="ring",
                               bucket_cap_mb=0.0002)
    state = strategy.engine.init_state(variables)
    assert state.model_state == {}
    for x, y in batches:
        state, _ = strategy.engine.step(state, strategy.engine.shard_batch({"image": x, "label": y}))

    params, opt_state = variables["params"], tx.init(variables["params"])
    for x, y in batches:
        grads = [jax.grad(lambda p: cross_entropy(model.apply({"params": p}, xs), ys))(params)
                 for xs, ys in zip(np.split(x, n), np.split(y, n))]
        mean = jax.tree_util.tree_map(lambda *g: sum(g) / n, *grads)
        updates, opt_state = tx.update(mean, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert max_rel_error(state.params, params) <= 1e-12

    x, y = batches[0]
    hlo = strategy.engine.lower_step(state, strategy.engine.shard_batch({"image": x, "label": y})).compile().as_text()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    sent = permute_bytes(hlo)
    assert len(sent) > 2 * (n - 1)  # more than one bucket, each a ring
    assert sum(sent) >= 2 * (n - 1) / n * n_params * 8  # the gradients went round the ring ...
    assert max(all_reduce_sizes(hlo)) <= n  # ... and not through XLA's all-reduce (metrics only)
