"""Checkpoints: orbax, atomic, in the strategy-independent canonical layout.

A checkpoint holds the canonical TrainState (full params and optimizer state,
as DDP keeps them) plus a JSON record of where training stands (epoch, step in
epoch, config fingerprint). Orbax writes into a temporary directory and renames
it only when complete, so a half-written checkpoint is never listed. Because
the layout is canonical, a run saved under one strategy or device count can
resume under another: the strategy re-shards on ``from_canonical``.
"""

import os
from typing import Optional, Tuple

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not match the run."""


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )

    def save(self, global_step: int, state, meta: dict) -> None:
        """Write and wait: the caller may exit right after, and must not lose this step."""
        self._manager.save(
            global_step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._manager.wait_until_finished()

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def read_meta(self, global_step: Optional[int] = None) -> Tuple[int, dict]:
        """The JSON record alone (cheap): check it before restoring arrays of the wrong shape."""
        step = self._step_or_latest(global_step)
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return step, restored["meta"]

    def _step_or_latest(self, global_step: Optional[int]) -> int:
        step = self.latest_step() if global_step is None else global_step
        if step is None:
            raise CheckpointError(f"no checkpoint to resume from in {self.directory}")
        return step

    def restore(self, like_state, global_step: Optional[int] = None) -> Tuple[object, dict]:
        """Restore into the shapes, dtypes and shardings of ``like_state``."""
        step = self._step_or_latest(global_step)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like_state)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
            )
        except Exception as e:  # orbax raises many types; name the file for the user
            raise CheckpointError(
                f"checkpoint {os.path.join(self.directory, str(step))} cannot be restored: {str(e).splitlines()[0]}"
            ) from e
        return restored["state"], restored["meta"]

    def close(self) -> None:
        self._manager.close()
