"""ZeRO-3 starts and restores a model without ever building it whole (issue: sharded init).

The bound, per device: 1.1 x (16 Psi / N + the largest FSDP unit's gathered params), f32
Adam: params 4 + Adam's two moments 8 = 12 Psi / N at rest (16 leaves room for the
gradient), plus one unit gathered at a time. Measured from the compiled programs'
memory analysis (temp + outputs, plus what is already resident), never from the host.
"""

import jax
import numpy as np
import optax
import pytest

from jaxdp.runtime.mesh import make_mesh
from jaxdp.models import create_model, fsdp_units
from jaxdp.strategies import conversions, create_strategy
from jaxdp.strategies.sync.buckets import leaf_path
from jaxdp.strategies.units import in_unit
from jaxdp.loss.task import classifier

N = 8
EXAMPLE = {"image": np.zeros((1, 32, 32, 3), np.float32), "label": np.zeros((1,), np.int32)}


@pytest.fixture(scope="module")
def zero3():
    model = create_model("resnet18", width=16)
    strategy = create_strategy("zero3", model, classifier(model), optax.adam(1e-3), make_mesh(N),
                               units=fsdp_units(model))
    return model, strategy


def _bound(strategy):
    shapes = strategy.shapes
    psi = sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(shapes))
    unit_bytes = {}
    for path, s in jax.tree_util.tree_leaves_with_path(shapes):
        p = leaf_path(path)
        owner = next((u for u in strategy.unit_paths if p[:len(u)] == u), ()) if in_unit(p, strategy.unit_paths) else ()
        unit_bytes[owner] = unit_bytes.get(owner, 0) + int(np.prod(s.shape)) * 4
    return psi, 1.1 * (16 * psi / N + max(unit_bytes.values()))


def _resident_peak(*analyses_and_resident):
    return max(resident + m.temp_size_in_bytes + m.output_size_in_bytes for m, resident in analyses_and_resident)


def test_zero3_init_peak_per_device_is_within_the_bound(zero3):
    _, strategy = zero3
    init_params, init_opt = strategy.engine.init_programs(EXAMPLE)
    params_program = init_params.lower(jax.random.key(0)).compile()
    params_shapes = jax.eval_shape(init_params, jax.random.key(0))[0]
    opt_program = init_opt.lower(params_shapes).compile()
    m1, m2 = params_program.memory_analysis(), opt_program.memory_analysis()
    peak = _resident_peak((m1, 0), (m2, m1.output_size_in_bytes))
    psi, bound = _bound(strategy)
    print(f"init peak {peak / 2**20:.2f} MiB per device, bound {bound / 2**20:.2f} MiB (psi {psi})")
    assert peak <= bound
    # Each device generates its own slices: no collective moves any parameter.
    text = params_program.as_text() + opt_program.as_text()
    assert not any(op in text for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"))


@pytest.mark.production_compiler
def test_zero3_sharded_init_equals_an_unsharded_init(zero3):
    model, strategy = zero3
    state = strategy.engine.init(jax.random.key(3), EXAMPLE)
    reference = jax.jit(lambda k: model.init(k, EXAMPLE["image"], train=False))(jax.random.key(3))
    for got, want in zip(jax.tree_util.tree_leaves(jax.device_get(strategy.engine.canonical(state).params)),
                         jax.tree_util.tree_leaves(reference["params"])):
        np.testing.assert_array_equal(got, want)
    # Nothing is whole at rest: every sharded leaf holds 1/N of its (padded) size per device.
    for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state)):
        if leaf.ndim:
            assert leaf.addressable_shards[0].data.size * N == leaf.size


def test_zero3_restore_peak_per_device_is_within_the_bound(zero3):
    _, strategy = zero3
    target = strategy.engine.restore_target(EXAMPLE)
    program = jax.jit(conversions.padder(strategy), out_shardings=strategy.state_shardings(
        jax.eval_shape(conversions.padder(strategy), target))).lower(target).compile()
    m = program.memory_analysis()
    peak = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    _, bound = _bound(strategy)
    print(f"restore peak {peak / 2**20:.2f} MiB per device, bound {bound / 2**20:.2f} MiB")
    assert peak <= bound


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero1_zero2_init_shards_the_optimizer_state(name):
    model = create_model("resnet18", width=8, blocks=(1, 1, 1, 1))
    strategy = create_strategy(name, model, classifier(model), optax.adam(1e-3), make_mesh(N))
    state = strategy.engine.init(jax.random.key(0), EXAMPLE)
    moments = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim]
    assert moments and all(x.addressable_shards[0].data.size * N == x.size for x in moments)
