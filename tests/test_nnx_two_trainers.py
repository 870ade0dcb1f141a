"""Two Trainers of one NNX model class in one process train independently: ZeRO-3 sets each one's
FSDP units up when it is built (``jaxdp.loss.nnx_wrap``), on its own copy of the graph, and a step
tells its loss what it needs in arguments, so nothing one Trainer sets up or traces reaches the
other. Each gives, step by step, the losses it gives alone, bit for bit, and the modules given to
them are left as they were."""

import jax
import numpy as np
import pytest
from flax import nnx
from test_nnx import FAST, Block, Net, batches, loss_fn, tx

import jaxdp

pytestmark = pytest.mark.float64

N, STEPS = 2, 3
SPECS = {  # the same class, other units and remat, other dropout streams
    "a": (lambda: Net(0.5, seed=0), lambda: jaxdp.ZeRO(stage=3, units=(Block,), remat="unit", **FAST)),
    "b": (lambda: Net(0.5, seed=7), lambda: jaxdp.ZeRO(stage=3, units=("blocks/*",), remat="none", **FAST)),
}


def trainer(name):
    model, strategy = SPECS[name]
    return jaxdp.Trainer(model(), loss_fn, tx(), strategy(), jaxdp.make_mesh(data=N))


def alone(name):
    t = trainer(name)
    data = batches(N, 1, seed=3)[:STEPS]
    state, losses = t.init(jax.random.key(0), data[0]), []
    for batch in data:
        state, metrics = t.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def test_two_trainers_of_one_nnx_class_train_as_each_alone():
    want = {name: alone(name) for name in SPECS}
    modules = {name: SPECS[name][0]() for name in SPECS}
    before = {name: jax.tree_util.tree_map(np.asarray, nnx.state(m, nnx.Not(nnx.RngKey)))
              for name, m in modules.items()}
    trainers = {name: jaxdp.Trainer(modules[name], loss_fn, tx(), SPECS[name][1](), jaxdp.make_mesh(data=N))
                for name in SPECS}  # both built before either traces a step
    data = batches(N, 1, seed=3)[:STEPS]
    states = {name: t.init(jax.random.key(0), data[0]) for name, t in trainers.items()}
    got = {name: [] for name in SPECS}
    for batch in data:  # stepped in turn: each step of one traced between two of the other's
        for name, t in trainers.items():
            states[name], metrics = t.step(states[name], batch)
            got[name].append(float(metrics["loss"]))
    assert got == want and want["a"] != want["b"]
    for name, m in modules.items():
        jax.tree_util.tree_map(np.testing.assert_array_equal, nnx.state(m, nnx.Not(nnx.RngKey)), before[name])
        assert all(type(sub).__module__ != "jaxdp.loss.nnx_wrap" for _, sub in nnx.iter_modules(m))
