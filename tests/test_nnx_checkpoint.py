"""``Trainer.save`` / ``Trainer.restore`` for a Flax NNX model, in the one checkpoint format: a ZeRO-3
state saved on 4 devices comes back bit for bit under DDP on 2 and ZeRO-1 on 3 (params, Adam's
moments, BatchNorm statistics, rng counts); a resumed run with dropout on draws what the
uninterrupted run draws; a Flax Linen model's checkpoint is refused by an NNX model of another
structure, in one line."""

import importlib.util
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_nnx import FAST, Block, Net, batches, loss_fn, tx

import jaxdp
from jaxdp.checkpoint import CheckpointError

pytestmark = pytest.mark.float64


def trainer(strategy, n, model=None):
    return jaxdp.Trainer(Net() if model is None else model, loss_fn, tx(), strategy, jaxdp.make_mesh(data=n))


def leaves(tree):
    return jax.tree_util.tree_leaves(jax.device_get(tree))


def test_save_under_zero3_restore_under_ddp_and_zero1_bit_exact(tmp_path):
    saver = trainer(jaxdp.ZeRO(stage=3, units=(Block,), **FAST), 4)
    data = batches(4, 1)  # 16 rows: 8 per device at N = 2, padded chunks at N = 3 (rows do not matter here)
    state = saver.init(jax.random.key(5), data[0])
    for batch in data[:2]:
        state, _ = saver.step(state, batch)
    want = jax.device_get(saver.canonical(state))
    assert saver.save(str(tmp_path), state) == 2
    assert set(want.model_state) == {"batch_stats", "rng_counts"}

    for strategy, n in ((jaxdp.DDP(**FAST), 2), (jaxdp.ZeRO(stage=1, **FAST), 3)):
        restorer = trainer(strategy, n)
        restored = restorer.restore(str(tmp_path), {k: v[:12] for k, v in data[0].items()})  # no init
        got = jax.device_get(restorer.canonical(restored))
        assert int(got.step) == 2
        for name in ("params", "model_state", "opt_state"):
            for a, b in zip(leaves(getattr(got, name)), leaves(getattr(want, name)), strict=True):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(jax.random.key_data(restorer.strategy.rng_root),
                                      jax.random.key_data(jax.random.key(5)))
        module = restorer.model(restored)  # the restored module holds the saved state
        for a, b in zip(leaves(nnx.state(module, nnx.Not(nnx.RngKey))), leaves(
                nnx.state(saver.model(state), nnx.Not(nnx.RngKey))), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_resumed_run_draws_what_the_uninterrupted_run_draws(tmp_path):
    """Dropout on: the rng counts come back with the state and the keys with the model, built again
    from the same seeds."""
    data = batches(2, 1)[:4]
    one = trainer(jaxdp.DDP(**FAST), 2, Net(rate=0.5))
    state = one.init(jax.random.key(0), data[0])
    for batch in data:
        state, _ = one.step(state, batch)
    first = trainer(jaxdp.DDP(**FAST), 2, Net(rate=0.5))
    part = first.init(jax.random.key(0), data[0])
    for batch in data[:2]:
        part, _ = first.step(part, batch)
    first.save(str(tmp_path), part)
    second = trainer(jaxdp.DDP(**FAST), 2, Net(rate=0.5))
    resumed = second.restore(str(tmp_path), data[0])
    for batch in data[2:]:
        resumed, _ = second.step(resumed, batch)
    for a, b in zip(leaves(second.canonical(resumed)), leaves(one.canonical(state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_linen_checkpoint_is_not_loaded_into_an_nnx_model_of_another_structure(tmp_path):
    """The Linen LM and its NNX twin differ only in blocks_0 against blocks/0: one line names it."""
    def example(name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "..",
                                                                         "examples", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    linen_lm, nnx_lm = example("custom_model"), example("custom_model_nnx")
    batch = next(linen_lm.batches(1, batch_size=4))
    linen = jaxdp.Trainer(linen_lm.model, linen_lm.loss_fn, optax.sgd(0.1), "ddp", jaxdp.make_mesh(data=2),
                          model_inputs=lambda b: (b["tokens"][:, :-1],))
    linen.save(str(tmp_path), linen.init(jax.random.key(0), batch))
    twin = jaxdp.Trainer(nnx_lm.TinyLM(rngs=nnx.Rngs(0)), nnx_lm.loss_fn, optax.sgd(0.1), "ddp",
                         jaxdp.make_mesh(data=2))
    with pytest.raises(CheckpointError, match=r"^cannot restore .*/0: its params\.blocks\.0\.\S+ is absent, this run "
                                              r"needs \(\d+(, \d+)*\) \(a different model or strategy state\)$"):
        twin.restore(str(tmp_path), batch)
