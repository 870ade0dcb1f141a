"""``Trainer.save`` / ``Trainer.restore``: a state to and from a checkpoint directory.

The directory is the one ``jaxdp train`` writes under ``<out>/checkpoints`` (``checkpoint.py``):
one orbax step folder per saved step, holding the state in the stored layout (canonical shapes,
cut over the data axis), so a state saved under one strategy, mesh and device count restores
under any other, each device reading only its part. A save also records the root of the losses'
rng stream (``Strategy.use_rng``), so a restored run draws the masks the saved run would have.
"""

from typing import Optional

import jax
import numpy as np

RNG_KEY = "trainer_rng"  # the record's entry for the rng stream's root


def save(strategy, path: str, state) -> int:
    """Write ``state`` as checkpoint step ``state.step`` in ``path``; returns the step."""
    from jaxdp.run.checkpoint import Checkpointer

    step = int(state.step)
    meta = {"global_step": step}
    if strategy.rng_root is not None:
        meta[RNG_KEY] = {"impl": str(jax.random.key_impl(strategy.rng_root)),
                         "data": np.asarray(jax.random.key_data(strategy.rng_root)).tolist()}
    ckpt = Checkpointer(path)
    try:
        ckpt.save(step, strategy.stored(state), meta)
    finally:
        ckpt.close()
    return step


def restore(strategy, path: str, example_batch, step: Optional[int] = None):
    """The newest usable checkpoint in ``path`` (or ``step``) as ``strategy``'s state.

    Read into shapes and shardings only (``abstract_state``): nothing whole is built, and a
    corrupt newest checkpoint falls back to the one before (``Checkpointer.restore_latest``).
    """
    from jaxdp.run.checkpoint import Checkpointer

    target = strategy.stored_target(strategy.abstract_state(example_batch))
    ckpt = Checkpointer(path)
    try:
        if step is None:
            stored, meta, _ = ckpt.restore_latest(target)
        else:
            stored, meta = ckpt.restore(target, step)
    finally:
        ckpt.close()
    if RNG_KEY in meta:
        saved = meta[RNG_KEY]
        strategy.use_rng(jax.random.wrap_key_data(np.asarray(saved["data"], np.uint32), impl=saved["impl"]))
    return strategy.from_stored(stored)
