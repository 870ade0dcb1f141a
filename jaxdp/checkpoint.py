"""Checkpoints: orbax, atomic, verified, in the strategy-independent canonical layout.

A checkpoint holds the canonical TrainState (full params and optimizer state,
as DDP keeps them) plus a JSON record of where training stands (epoch, step in
epoch, the data position, config fingerprint). Because the layout is canonical,
a run saved under one strategy or device count can resume under another: the
strategy re-shards on ``from_canonical``.

Three ways a checkpoint can be bad, and what happens:

- **partially written** (the process died while saving): orbax writes into
  ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` only when every
  process has finished, so it is never listed. Leftovers are removed (with a
  warning) when the next run opens the directory.
- **corrupted after the fact** (a truncated or garbled file): after each save,
  process 0 records every file's size and sha256 in ``<step>/jaxdp_manifest.json``.
  ``restore_latest`` checks them first and names the first file that differs;
  a checkpoint orbax cannot read counts as corrupted too. It then warns and
  falls back to the previous checkpoint (``max_to_keep`` keeps 3).
- **from another run** (different model, batch, seed...): not a corruption, so
  no fallback: the caller's ``check_meta`` raises ``CheckpointError``.

Multi-process: every process calls ``save`` (orbax coordinates: each writes its
shards, process 0 the metadata) and the directory must be on a filesystem that
all processes share.
"""

import hashlib
import json
import os
import shutil
import warnings
from typing import Callable, List, Optional, Tuple

import jax
import orbax.checkpoint as ocp

MANIFEST = "jaxdp_manifest.json"
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not match the run."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files are not what was written (or that orbax cannot read)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or a leftover removed; training goes on."""


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        if jax.process_index() == 0:
            self._remove_partial_saves()
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )

    def _remove_partial_saves(self) -> None:
        if not os.path.isdir(self.directory):
            return
        partial = sorted(name for name in os.listdir(self.directory) if _TMP_MARK in name)
        for name in partial:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        if partial:
            warnings.warn(f"removed {len(partial)} partially written checkpoint(s) left by an interrupted save: "
                          f"{', '.join(partial)} in {self.directory}", CheckpointWarning, stacklevel=3)

    # -- saving --------------------------------------------------------------------------------
    def save(self, global_step: int, state, meta: dict) -> None:
        """Write and wait: the caller may exit right after, and must not lose this step.

        A checkpoint of the same step is replaced (a run resumed from the end of an epoch
        saves that step again, now past the epoch's evaluation); an older one stays until
        the new one is complete, so a crash in between falls back to it.
        """
        if global_step in self.all_steps():
            self._manager.delete(global_step)
        self._manager.save(
            global_step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            self._write_manifest(global_step)

    def _write_manifest(self, step: int) -> None:
        root = self.step_dir(step)
        files = {rel: _describe(os.path.join(root, rel)) for rel in _files(root)}
        tmp = os.path.join(root, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": 1, "files": files}, f, indent=0, sort_keys=True)
        os.replace(tmp, os.path.join(root, MANIFEST))  # never a half-written manifest

    # -- finding and checking ------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def all_steps(self) -> List[int]:
        self._manager.reload()  # another process (or run) may have saved since
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> bool:
        """Raise ``CheckpointCorrupt`` naming the first file that differs from what was saved.

        Returns False when the checkpoint has no manifest (written by an older jaxdp, or the
        process died between orbax's rename and the manifest): orbax's own checks still apply.
        """
        root = self.step_dir(step)
        path = os.path.join(root, MANIFEST)
        if not os.path.exists(path):
            return False
        try:
            with open(path) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointCorrupt(f"checkpoint {root} is corrupt: its manifest {path} is unreadable ({e})") from None
        for rel, want in sorted(files.items()):
            full = os.path.join(root, rel)
            if not os.path.exists(full):
                raise CheckpointCorrupt(f"checkpoint {root} is corrupt: file {full} is missing")
            size = os.path.getsize(full)
            if size != want["size"]:
                raise CheckpointCorrupt(f"checkpoint {root} is corrupt: file {full} has {size} bytes, "
                                        f"{want['size']} were written (truncated?)")
            if _sha256(full) != want["sha256"]:
                raise CheckpointCorrupt(f"checkpoint {root} is corrupt: file {full} differs from what was "
                                        f"written (sha256 mismatch)")
        return True

    def read_meta(self, global_step: Optional[int] = None) -> Tuple[int, dict]:
        """The JSON record alone (cheap): check it before restoring arrays of the wrong shape."""
        step = self._step_or_latest(global_step)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:
            raise CheckpointCorrupt(f"checkpoint {self.step_dir(step)} has no readable record: "
                                    f"{_first_line(e)}") from e
        return step, restored["meta"]

    def _step_or_latest(self, global_step: Optional[int]) -> int:
        step = self.latest_step() if global_step is None else global_step
        if step is None:
            raise CheckpointError(f"no checkpoint to resume from in {self.directory}")
        return step

    # -- restoring -----------------------------------------------------------------------------
    def restore(self, like_state, global_step: Optional[int] = None) -> Tuple[object, dict]:
        """Restore into the shapes, dtypes and shardings of ``like_state``."""
        step = self._step_or_latest(global_step)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like_state)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
            )
        except Exception as e:  # orbax raises many types; name the checkpoint for the user
            raise CheckpointCorrupt(f"checkpoint {self.step_dir(step)} cannot be restored: {_first_line(e)}") from e
        return restored["state"], restored["meta"]

    def restore_latest(self, like_state, check_meta: Optional[Callable[[dict], None]] = None
                       ) -> Tuple[object, dict, int]:
        """(state, meta, step) of the newest checkpoint that verifies and restores.

        A corrupted one is skipped with a ``CheckpointWarning`` naming the bad file, and the
        previous one is tried. ``check_meta(meta)`` runs before the arrays are read; its
        ``CheckpointError`` (wrong run) is raised as is, without falling back.
        """
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint to resume from in {self.directory}")
        problems = []
        for step in reversed(steps):
            try:
                self.verify(step)
                _, meta = self.read_meta(step)
                if check_meta is not None:
                    check_meta(meta)
                state, meta = self.restore(like_state, step)
            except CheckpointCorrupt as e:
                problems.append(str(e))
                older = [s for s in steps if s < step]
                warnings.warn(f"{e}; {'falling back to step ' + str(older[-1]) if older else 'no older checkpoint'}",
                              CheckpointWarning, stacklevel=2)
                continue
            return state, meta, step
        raise CheckpointError(f"no usable checkpoint in {self.directory}: " + "; ".join(problems))

    def close(self) -> None:
        self._manager.close()


def _files(root: str) -> List[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if not rel.startswith(MANIFEST):
                out.append(rel)
    return sorted(out)


def _describe(path: str) -> dict:
    return {"size": os.path.getsize(path), "sha256": _sha256(path)}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
