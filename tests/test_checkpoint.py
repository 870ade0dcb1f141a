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


# ----------------------------------------------------------------------------- readers, manifests, replacing

def steps_on_disk(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def test_a_reader_opened_during_a_save_deletes_nothing(tmp_path, monkeypatch):
    """An evaluation script restoring from a live run while the run saves: the save in flight
    (orbax's temporary folder) is not the reader's to remove; before, every open removed it."""
    from jaxdp.checkpoint import store

    writer = Checkpointer(str(tmp_path))
    writer.save(1, state_on(2, 6), {"step": 1})
    seen = {}

    def read_now(name):
        if name == "checkpoint_write":  # orbax writes on in its thread, into its temporary folder
            seen["in flight"] = [n for n in os.listdir(tmp_path) if ".orbax-checkpoint-tmp" in n]
            reader = Checkpointer(str(tmp_path))
            restored, meta, step = reader.restore_latest(target(state_on(2, 6)))
            reader.close()
            seen["read"] = (step, meta)

    monkeypatch.setattr(store, "fault_point", read_now)
    writer.save(2, state_on(2, 6), {"step": 2})
    writer.close()
    assert seen["in flight"] and seen["read"] == (1, {"step": 1})
    assert os.listdir(tmp_path) == ["1", "2"] or sorted(os.listdir(tmp_path)) == ["1", "2"]
    assert Checkpointer(str(tmp_path)).verify(2)


def test_a_checkpoint_becomes_visible_only_with_its_manifest(tmp_path, monkeypatch):
    from jaxdp.checkpoint import store

    real, seen = store.write_manifest, []

    def write_manifest(root):
        seen.append((os.path.basename(root), steps_on_disk(tmp_path)))
        real(root)

    monkeypatch.setattr(store, "write_manifest", write_manifest)
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(2, 6), {})
    assert len(seen) == 1 and ".orbax-checkpoint-tmp" in seen[0][0] and seen[0][1] == []  # not yet a step
    assert steps_on_disk(tmp_path) == [1] and ckpt.verify(1)
    ckpt.close()


def test_an_unverified_checkpoint_is_skipped_in_one_line_unless_accepted(tmp_path):
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(2, 6), {"step": 1})
    ckpt.save(2, state_on(2, 6), {"step": 2})
    os.remove(os.path.join(tmp_path, "2", MANIFEST))  # copied without it, or written by an older jaxdp
    with pytest.warns(CheckpointWarning, match=rf"^checkpoint {tmp_path}/2 is unverified \(it has no manifest to "
                                               r"check its files against\); falling back to step 1$"):
        _, meta, step = ckpt.restore_latest(target(state_on(2, 6)))
    assert (step, meta) == (1, {"step": 1})
    with pytest.warns(CheckpointWarning, match=r"unverified .*: restoring it as accepted"):
        _, meta, step = ckpt.restore_latest(target(state_on(2, 6)), accept_unverified=True)
    assert (step, meta) == (2, {"step": 2})
    os.remove(os.path.join(tmp_path, "1", MANIFEST))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match=r"is unverified \(to restore step 2 as it is, accept unverified "
                                                  r"checkpoints: jaxdp train --accept-unverified"):
            ckpt.restore_latest(target(state_on(2, 6)))
    ckpt.close()


def test_saving_a_step_again_keeps_the_old_one_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    from jaxdp.checkpoint import store

    ckpt = Checkpointer(str(tmp_path), max_to_keep=1)
    ckpt.save(5, state_on(2, 6), {"v": "old"})
    during = []
    monkeypatch.setattr(store, "fault_point", lambda name: during.append((name, sorted(os.listdir(tmp_path)))))
    ckpt.save(5, state_on(2, 6), {"v": "new"})
    written = dict(during)["checkpoint_write"]
    assert "5" + store.SET_ASIDE in written  # the old one, whole, while the new one is written
    assert sorted(os.listdir(tmp_path)) == ["5"] and ckpt.read_meta(5) == (5, {"v": "new"}) and ckpt.verify(5)
    # a run killed in between: the next writer puts the old one back
    os.rename(os.path.join(tmp_path, "5"), os.path.join(tmp_path, "5" + store.SET_ASIDE))
    os.makedirs(os.path.join(tmp_path, "5.orbax-checkpoint-tmp-123"))
    with pytest.warns(CheckpointWarning, match="removed 1 partially written checkpoint"):
        assert store.remove_partial_saves(str(tmp_path)) == ["5.orbax-checkpoint-tmp-123"]
    assert sorted(os.listdir(tmp_path)) == ["5"] and ckpt.read_meta(5) == (5, {"v": "new"})
    ckpt.close()


def test_a_full_disk_in_a_checkpoint_names_it_and_leaves_the_older_ones(tmp_path, monkeypatch):
    import errno

    from jaxdp.checkpoint import store
    from jaxdp.runtime.durable import DiskFull

    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state_on(2, 6), {})

    def full(root):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write_manifest", full)
    with pytest.raises(DiskFull, match=rf"^no space left on the device writing checkpoint 2 to {tmp_path}/2$"):
        ckpt.save(2, state_on(2, 6), {})
    assert steps_on_disk(tmp_path) == [1] and ckpt.verify(1)
    ckpt.close()


def test_write_atomically_uses_its_own_temporary_file_and_removes_it_when_the_disk_is_full(tmp_path, monkeypatch):
    import errno

    from jaxdp.runtime import durable

    path = tmp_path / "config.json"
    durable.write_atomically(str(path), "old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(durable.DiskFull, match=rf"^no space left on the device writing config.json to {path}$"):
        durable.write_atomically(str(path), "new")
    assert os.listdir(tmp_path) == ["config.json"] and path.read_text() == "old"


def test_a_checkpoint_record_with_an_rng_jax_cannot_make_is_one_line():
    from jaxdp.checkpoint.saving import _rng_key

    with pytest.raises(CheckpointError, match=r"^checkpoint in /ck: its rng record \{'impl': 'bogus', 'data': \[0, 1\]\} "
                                              r"is not a key this jax can make \(unrecognized PRNG implementation"):
        _rng_key({"impl": "bogus", "data": [0, 1]}, "/ck")
