"""The gradient syncs as transforms (jaxdp.strategies.sync), each against a numpy average of the
devices' gradients: ZeRO-2's reduce-scatter, ZeRO-3/HSDP's gather-on-use average, DDP's all-reduce."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdp.runtime.mesh import make_mesh  # noqa: E402
from jaxdp.strategies.layout import padded_shape, shard_dim  # noqa: E402
from jaxdp.strategies.sync import Where  # noqa: E402
from jaxdp.strategies.sync.allreduce import AllReduce  # noqa: E402
from jaxdp.strategies.sync.buckets import bucket_groups  # noqa: E402
from jaxdp.strategies.sync.sharded import GatherOnUse, ReduceScatter, all_gather  # noqa: E402

pytestmark = pytest.mark.float64

N = 4
SHAPES = {"b": (5,), "k": (6, 3), "s": ()}  # a vector to pad, a matrix, a scalar (summed whole)


def device_grads(n=N, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(n, *s)) for k, s in SHAPES.items()}


def numpy_chunk(x, i, n=N):
    """Device i's chunk of x: cut along the layout's shard dim after padding (zeros) to a multiple of n."""
    d = shard_dim(x.shape, n)
    if d is None:
        return x
    padded = np.zeros(padded_shape(x.shape, n))
    padded[tuple(slice(0, s) for s in x.shape)] = x
    return np.split(padded, n, axis=d)[i]


def per_device(fn, mesh, axes, grads):
    spec = P(axes)
    specs = jax.tree_util.tree_map(lambda _: spec, grads)
    return jax.jit(jax.shard_map(lambda g: jax.tree_util.tree_map(lambda x: x[None], fn(
        jax.tree_util.tree_map(lambda x: x[0], g))), mesh=mesh, in_specs=(specs,), out_specs=specs))(grads)


def where(groups=()):
    return Where(step=0, axis="data", n=N, order=[(k,) for k in SHAPES], shards=N, groups=groups)


def test_every_sync_has_the_transform_state_half():
    for sync in (AllReduce(), ReduceScatter(), GatherOnUse("replica")):
        assert sync.init({"k": np.zeros(3)}, N) is None and sync.specs("data") is None
        assert sync.stored(None) is None and sync.from_stored(None, N) is None and not sync.stateful


def test_all_reduce_gives_every_device_the_mean():
    grads = device_grads()
    out = per_device(lambda g: AllReduce().update(g, None, where())[0], make_mesh(N), "data", grads)
    for k, g in grads.items():
        np.testing.assert_allclose(out[k], np.broadcast_to(g.mean(0), g.shape), rtol=1e-15)


def test_reduce_scatter_gives_each_device_its_chunk_of_the_mean_bucket_by_bucket():
    grads = device_grads()
    local = {k: jax.ShapeDtypeStruct(s, np.float64) for k, s in SHAPES.items()}
    groups = bucket_groups(local, [(k,) for k in SHAPES], [48])  # 48-byte buckets: more than one collective
    assert len(groups) > 1
    chunks = per_device(lambda g: ReduceScatter().update(g, None, where(groups))[0], make_mesh(N), "data", grads)
    for k, g in grads.items():
        for i in range(N):
            np.testing.assert_allclose(chunks[k][i], numpy_chunk(g.mean(0), i), rtol=1e-15, atol=1e-16)
    # ... and all_gather is the way back: every device holds the whole mean again
    shapes = [SHAPES[k] for k in sorted(SHAPES)]
    whole = per_device(lambda g: all_gather(ReduceScatter().update(g, None, where(groups))[0], shapes, groups,
                                            "data", N), make_mesh(N), "data", grads)
    for k, g in grads.items():
        np.testing.assert_allclose(whole[k], np.broadcast_to(g.mean(0), g.shape), rtol=1e-15)


def test_gather_on_use_divides_by_n_and_sums_hsdp_replicas():
    """The chunks arrive summed over the shard group (the gathers' transposes); the sync divides by
    all N devices and, under HSDP, sums the replicas' chunks: device (r, s) gets sum_r g[r, s] / N."""
    grads = device_grads()
    mesh = make_mesh(replica=2, data=2)
    out = per_device(lambda g: GatherOnUse("replica").update(g, None, where())[0], mesh, ("replica", "data"), grads)
    for k, g in grads.items():
        by_replica = g.reshape(2, 2, *g.shape[1:])
        expected = np.concatenate([by_replica.sum(0) / N] * 2)
        np.testing.assert_allclose(out[k], expected, rtol=1e-15)
    plain = per_device(lambda g: GatherOnUse().update(g, None, where())[0], make_mesh(N), "data", grads)
    for k, g in grads.items():
        np.testing.assert_allclose(plain[k], g / N, rtol=1e-15)
