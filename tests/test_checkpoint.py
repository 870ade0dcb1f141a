"""Checkpointer rules on tiny states: which shape changes a restore accepts, and which
failures fall back to an older checkpoint (corruption) and which are raised (everything else).

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
from jaxdp.mesh import make_mesh
from jaxdp.state import TrainState


def state_on(n: int, flat_len: int, stats_len: int = 3):
    """A TrainState shaped like the checkpoint layout: params flat and sharded over n devices."""
    mesh = make_mesh(n)
    flat = np.zeros(flat_len)
    flat[:5] = np.arange(1.0, 6.0)  # 5 real elements, then padding
    return TrainState(
        step=jnp.int32(7),
        params={"w": jax.device_put(flat, NamedSharding(mesh, P("data")))},
        batch_stats={"mean": jax.device_put(np.arange(stats_len, dtype=float), NamedSharding(mesh, P()))},
        opt_state=(), extra=None)


def target(state):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_flat_arrays_take_the_new_device_counts_padding(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(4, 8), {})  # 5 elements padded to 8 for 4 devices
    for n, length in ((2, 6), (8, 8), (1, 5)):
        restored, _ = ckpt.restore(target(state_on(n, length)))
        np.testing.assert_array_equal(np.asarray(restored.params["w"]), np.pad(np.arange(1.0, 6.0), (0, length - 5)))
        assert restored.params["w"].sharding.num_devices == n
        assert int(restored.step) == 7
    ckpt.close()


def test_any_other_shape_change_is_an_error_naming_the_array(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(2, 6), {})
    with pytest.raises(CheckpointError, match=r"batch_stats\.mean is shaped \(3,\), this run needs \(4,\)"):
        ckpt.restore(target(state_on(2, 6, stats_len=4)))
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
