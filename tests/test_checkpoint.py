"""Checkpointer rules on tiny states: a restore onto another device count (same shapes, new
shardings) and refused shape changes, and which failures fall back to an older checkpoint
(corruption) and which are raised (everything else).

The whole path (train, kill, corrupt, resume) is in test_fault_tolerance.py.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.checkpoint import MANIFEST, CheckpointError, Checkpointer, CheckpointWarning
from jaxdp.runtime.mesh import make_mesh
from jaxdp.strategies.state import TrainState
from jaxdp.strategies import layout


def state_on(n: int, w_shape=(8, 6), b_len: int = 10, stats_len: int = 3):
    """A TrainState in the checkpoint layout (``strategy.engine.stored``): canonical shapes, params
    cut over n devices along a dimension n divides (replicated where none does), the model
    state replicated."""
    mesh = make_mesh(n)

    def stored(x):
        cut = any(d % n == 0 for d in x.shape)
        return jax.device_put(x, NamedSharding(mesh, layout.spec(x.shape, n, "data") if cut else P()))
    return TrainState(
        step=jnp.int32(7),
        params={"w": stored(np.arange(float(np.prod(w_shape))).reshape(w_shape)),
                "b": stored(np.arange(float(b_len)))},
        model_state={"batch_stats": {"mean": jax.device_put(np.arange(stats_len, dtype=float),
                                                            NamedSharding(mesh, P()))}},
        opt_state=(), extra=None)


def target(state):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_sharded_arrays_restore_onto_any_device_count(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(4), {})  # (8, 6) cut along dim 0 over 4 devices
    want = np.arange(48.0).reshape(8, 6)
    for n, dim in ((2, 0), (3, 1), (8, 0), (1, 0)):  # 3 devices cut it along dim 1
        restored, _ = ckpt.restore(target(state_on(n)))
        w = restored.params["w"]
        np.testing.assert_array_equal(np.asarray(w), want)
        assert w.sharding.num_devices == n and w.sharding.spec == layout.spec(want.shape, n, "data")
        assert layout.shard_dim(want.shape, n) == dim
        np.testing.assert_array_equal(np.asarray(restored.params["b"]), np.arange(10.0))  # 10: cut on 2, 1
        np.testing.assert_array_equal(np.asarray(restored.model_state["batch_stats"]["mean"]), np.arange(3.0))
        assert int(restored.step) == 7
    ckpt.close()


def test_any_shape_change_is_an_error_naming_the_array(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(2), {})
    with pytest.raises(CheckpointError,
                       match=r"model_state\.batch_stats\.mean is shaped \(3,\), this run needs \(4,\)"):
        ckpt.restore(target(state_on(2, stats_len=4)))
    # Params too, vectors included: the stored layout has canonical shapes, which no device count
    # pads or cuts (a 10-class head's bias must not load into a 12-class model).
    with pytest.raises(CheckpointError, match=r"params\.w is shaped \(8, 6\), this run needs \(8, 5\)"):
        ckpt.restore(target(state_on(2, w_shape=(8, 5))))
    with pytest.raises(CheckpointError, match=r"params\.b is shaped \(10,\), this run needs \(12,\)"):
        ckpt.restore(target(state_on(2, b_len=12)))
    ckpt.close()


def _break_state_restore(ckpt, monkeypatch):
    """orbax fails on the arrays (as out of memory would) while the JSON record still reads."""
    real = ckpt._manager.restore

    def restore(step, args=None):
        if "state" in args.keys():
            raise MemoryError("RESOURCE_EXHAUSTED: out of memory")
        return real(step, args=args)

    monkeypatch.setattr(ckpt._manager, "restore", restore)


def test_a_verified_checkpoint_that_fails_to_restore_is_raised_not_skipped(tmp_path, monkeypatch):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(2, 6), {})
    ckpt.save(2, state_on(2, 6), {})
    _break_state_restore(ckpt, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # no silent fall-back to step 1
        with pytest.raises(CheckpointError, match=f"{tmp_path}/2 cannot be restored: RESOURCE_EXHAUSTED"):
            ckpt.restore_latest(target(state_on(2, 6)))
    ckpt.close()


# orbax's failed read of the garbage leaves a callback for its closed event loop (its own cleanup).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_without_a_manifest_an_unreadable_checkpoint_counts_as_corrupt(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(2, 6), {"step": 1})
    ckpt.save(2, state_on(2, 6), {"step": 2})
    os.remove(os.path.join(tmp_path, "2", MANIFEST))  # died between orbax's rename and the manifest
    state_dir = os.path.join(tmp_path, "2", "state")
    for root, _, files in os.walk(state_dir):  # and its array data is damaged
        for f in files:
            if os.path.basename(root) == "d":
                with open(os.path.join(root, f), "wb") as out:
                    out.write(b"garbage")
    with pytest.warns(CheckpointWarning, match=r"no manifest to check its files against\); falling back to step 1"):
        restored, meta, step = ckpt.restore_latest(target(state_on(2, 6)))
    assert (step, meta, int(restored.step)) == (1, {"step": 1}, 7)
    ckpt.close()
