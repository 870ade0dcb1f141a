"""``Trainer.save`` / ``Trainer.restore``: a ZeRO-3 state saved on 4 devices comes back bit for
bit under DDP on 2 and ZeRO-1 on 3 (padded chunks), with the rng stream of ``init``'s key; the
caller's record, and the older layouts. (``jaxdp train``'s checkpoints both ways: test_train.py.)"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.checkpoint import CheckpointError, Checkpointer

pytestmark = pytest.mark.float64


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(4, param_dtype=jnp.float64)(nn.tanh(nn.Dense(6, param_dtype=jnp.float64)(x)))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, param_dtype=jnp.float64)(Block()(Block()(x)))[:, 0]


model = Net()


def loss_fn(params, model_state, batch, rng):
    return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2), (model_state, {})


def trainer(strategy, n):
    return jaxdp.Trainer(model, loss_fn, optax.adam(1e-2), strategy, jaxdp.make_mesh(data=n),
                         model_inputs=lambda b: (b["x"],))


def batch(seed):
    rs = np.random.default_rng(seed)
    return {"x": rs.normal(size=(12, 4)), "y": rs.normal(size=(12,))}


def test_save_under_zero3_restore_under_ddp_and_zero1_bit_exact(tmp_path):
    saver = trainer(jaxdp.ZeRO(stage=3, units=(Block,)), 4)
    state = saver.init(jax.random.key(5), batch(0))
    for seed in (1, 2):
        state, _ = saver.step(state, batch(seed))
    want = jax.device_get(saver.canonical(state))
    assert saver.save(str(tmp_path), state) == 2
    after, _ = saver.step(state, batch(3))
    want_after = jax.device_get(saver.canonical(after).params)

    for strategy, n in ((jaxdp.DDP(), 2), (jaxdp.ZeRO(stage=1), 3)):
        restorer = trainer(strategy, n)
        restored = restorer.restore(str(tmp_path), batch(0))  # no init: shapes come from the batch
        got = jax.device_get(restorer.canonical(restored))
        assert int(got.step) == 2
        for name in ("params", "opt_state"):
            for a, b in zip(jax.tree_util.tree_leaves(getattr(got, name)), jax.tree_util.tree_leaves(getattr(want, name))):
                np.testing.assert_array_equal(a, b)
        # init's key came back with the state: the losses' rng stream continues from it
        np.testing.assert_array_equal(jax.random.key_data(restorer.strategy.rng_root),
                                      jax.random.key_data(jax.random.key(5)))
        restored, _ = restorer.step(restored, batch(3))  # and trains on as the saved run does
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15),
                               jax.device_get(restorer.canonical(restored).params), want_after)


def test_the_record_comes_back_and_check_refuses_before_reading(tmp_path):
    """``save(record=...)`` keeps the caller's JSON beside the state (``jaxdp train`` keeps its run
    position there); ``check`` sees the checkpoint's meta first and may refuse it."""
    saver = trainer(jaxdp.DDP(), 2)
    state = saver.init(jax.random.key(5), batch(0))
    saver.save(str(tmp_path), state, record={"epoch": 3, "note": "mine"})
    restored, meta = trainer(jaxdp.DDP(), 2).restore(str(tmp_path), batch(0), with_meta=True)
    assert meta == {"format": 2, "global_step": 0, "record": {"epoch": 3, "note": "mine"},
                    "rng": {"impl": str(jax.random.key_impl(jax.random.key(5))),
                            "data": np.asarray(jax.random.key_data(jax.random.key(5))).tolist()}}

    def refuse(m):
        raise ValueError(f"not this one: epoch {m['record']['epoch']}")

    with pytest.raises(ValueError, match="not this one: epoch 3"):
        trainer(jaxdp.DDP(), 2).restore(str(tmp_path), batch(0), check=refuse)


def test_the_old_trainer_save_layout_restores_and_a_newer_format_is_one_line(tmp_path):
    """jaxdp 0.2's ``Trainer.save`` record (``"trainer_rng"``) restores with its rng stream; a record
    from a newer jaxdp is refused, saying so."""
    saver = trainer(jaxdp.DDP(), 2)
    state = saver.init(jax.random.key(5), batch(0))
    key = {"impl": str(jax.random.key_impl(jax.random.key(7))),
           "data": np.asarray(jax.random.key_data(jax.random.key(7))).tolist()}
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(0, saver.strategy.engine.stored(state), {"global_step": 0, "trainer_rng": key})
    ckpt.save(1, saver.strategy.engine.stored(state), {"format": 3, "global_step": 1})
    ckpt.close()
    restorer = trainer(jaxdp.DDP(), 2)
    restored, meta = restorer.restore(str(tmp_path), batch(0), step=0, with_meta=True)
    assert meta == {"format": 2, "global_step": 0, "rng": key, "record": None}
    np.testing.assert_array_equal(jax.random.key_data(restorer.strategy.rng_root),
                                  jax.random.key_data(jax.random.key(7)))
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(restored)), jax.tree_util.tree_leaves(jax.device_get(state))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(CheckpointError, match=r"^this checkpoint's record has format 3, written by a newer jaxdp "
                                              r"\(this one reads formats 1-2\): upgrade jaxdp to restore it$"):
        restorer.restore(str(tmp_path), batch(0))


def test_a_step_asked_for_is_verified_as_the_newest_would_be(tmp_path):
    """``restore(path, batch, step=N)`` checks N's manifest, as a resume checks the newest: a flipped
    byte is raised naming the file (it was restored as read), a checkpoint without its manifest
    needs ``accept_unverified`` (it was restored without a word), a step that is not there names
    the steps that are. Never another step instead of the one asked for."""
    import os
    import warnings

    from jaxdp.checkpoint import MANIFEST, CheckpointCorrupt, CheckpointWarning, NoCheckpoint

    saver = trainer(jaxdp.DDP(), 2)
    state = saver.init(jax.random.key(5), batch(0))
    saver.save(str(tmp_path), state)
    state, _ = saver.step(state, batch(1))
    saver.save(str(tmp_path), state)
    data = max((os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "1") for f in fs if f != MANIFEST),
               key=os.path.getsize)  # the largest array file
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorrupt, match=rf"checkpoint {tmp_path}/1 is corrupt: file {data} differs"):
        saver.restore(str(tmp_path), batch(0), step=1)
    os.remove(tmp_path / "0" / MANIFEST)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {tmp_path}/0 is unverified .* accept_unverified=True\)$"):
        saver.restore(str(tmp_path), batch(0), step=0)
    with pytest.warns(CheckpointWarning, match="restoring it as accepted"):
        restored = saver.restore(str(tmp_path), batch(0), step=0, accept_unverified=True)
    assert int(restored.step) == 0
    with pytest.raises(NoCheckpoint, match=rf"^no checkpoint of step 7 in {tmp_path} \(it has 0, 1\)$"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            saver.restore(str(tmp_path), batch(0), step=7)
