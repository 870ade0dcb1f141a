"""A directory of checkpoints: orbax, atomic, verified, sharded, in a strategy-independent layout.

A checkpoint holds the TrainState in the layout every strategy converts to and
from (``strategy.engine.stored``: params and per-parameter optimizer state in their
canonical shapes, sharded over the data axis along a dimension it divides) plus a JSON record
(its layout: ``jaxdp.checkpoint.saving``). Each device's chunks are written by the process that
owns them, and nothing is gathered to save. A run saved under one strategy or device count
resumes under another: the stored arrays have canonical shapes, orbax reads
them into the new count's shardings, and the strategy converts with
``from_stored``. Any change of shape is refused, naming the array.

Three ways a checkpoint can be bad, and what happens:

- **partially written** (the process died while saving): orbax writes into
  ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` only when every
  process has finished, so it is never listed. Leftovers are removed (with a
  warning) when the next run opens the directory.
- **corrupted after the fact** (a truncated or garbled file): after each save,
  process 0 records every file's size and sha256 in ``<step>/jaxdp_manifest.json``.
  ``restore_latest`` checks them first (on process 0, which tells the others)
  and names the first file that differs; a checkpoint without a manifest that
  orbax cannot read counts as corrupted too. It then warns and falls back to the
  previous checkpoint (``max_to_keep`` keeps 3).
- **from another run** (different model, batch, seed...): not a corruption, so
  no fallback: the caller's ``check_meta`` raises ``CheckpointError``, and so
  does an array of another shape than the run needs.

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

from jaxdp.runtime.distributed import share_from_first
from jaxdp.runtime.durable import fault_point, write_atomically

MANIFEST = "jaxdp_manifest.json"
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not match the run."""


class NoCheckpoint(CheckpointError):
    """The directory holds no complete checkpoint."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files are not what was written (or that orbax cannot read)."""


class CheckpointUnreadable(CheckpointError):
    """orbax could not read a checkpoint (corrupt, or another failure: see ``restore_latest``)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or a leftover removed; training goes on."""


class PartialSavesRemoved(CheckpointWarning):
    """Leftovers of interrupted saves were removed (``names``): nothing of a complete checkpoint."""

    def __init__(self, message: str, names: List[str]):
        super().__init__(message)
        self.names = names


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        if jax.process_index() == 0:
            self._remove_partial_saves()
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )

    def _remove_partial_saves(self) -> None:
        if not os.path.isdir(self.directory):
            return
        partial = sorted(name for name in os.listdir(self.directory) if _TMP_MARK in name)
        for name in partial:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        if partial:
            warnings.warn(PartialSavesRemoved(f"removed {len(partial)} partially written checkpoint(s) left by an "
                                              f"interrupted save: {', '.join(partial)} in {self.directory}", partial),
                          stacklevel=3)

    # -- saving --------------------------------------------------------------------------------
    def save(self, global_step: int, state, meta: dict) -> None:
        """Write and wait: the caller may exit right after, and must not lose this step.

        A checkpoint of the same step is replaced (a run resumed from the end of an epoch
        saves that step again, now past the epoch's evaluation); an older one stays until
        the new one is complete, so a crash in between falls back to it. The fault points
        (``jaxdp.runtime.durable``) are the moments a kill can split a save at.
        """
        if global_step in self.all_steps():
            self._manager.delete(global_step)
        self._manager.save(
            global_step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        fault_point("checkpoint_write")  # orbax writes on in its own thread, into its temporary folder
        self._manager.wait_until_finished()
        fault_point("checkpoint_manifest")
        if jax.process_index() == 0:
            self._write_manifest(global_step)
        fault_point("checkpoint_done")

    def _write_manifest(self, step: int) -> None:
        root = self.step_dir(step)
        files = {rel: _describe(os.path.join(root, rel)) for rel in _files(root)}
        write_atomically(os.path.join(root, MANIFEST), json.dumps({"format": 1, "files": files}, indent=0,
                                                                  sort_keys=True))  # never a half-written one

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
            raise NoCheckpoint(f"no checkpoint to resume from in {self.directory}")
        return step

    # -- restoring -----------------------------------------------------------------------------
    def restore(self, target, global_step: Optional[int] = None) -> Tuple[object, dict]:
        """Restore into ``target``'s shapes, dtypes and shardings (arrays or ShapeDtypeStructs).

        Every array must have the saved shape (the stored layout has canonical shapes, so
        only the sharding depends on the device count); a different shape is refused, never
        padded or truncated.
        """
        step = self._step_or_latest(global_step)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
        self._check_shapes(step, abstract)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract, strict=False), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many types; name the checkpoint for the user
            raise CheckpointUnreadable(f"checkpoint {self.step_dir(step)} cannot be restored: {_first_line(e)}") from e
        return restored["state"], restored["meta"]

    def _check_shapes(self, step: int, abstract) -> None:
        try:
            saved = {leaf.name: tuple(leaf.shape)
                     for leaf in jax.tree_util.tree_leaves(self._manager.item_metadata(step)["state"].tree)}
        except Exception as e:
            raise CheckpointUnreadable(f"checkpoint {self.step_dir(step)} has no readable array metadata: "
                                       f"{_first_line(e)}") from e
        wanted = {_leaf_name(path): tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(abstract)}
        for name in sorted(set(saved) | set(wanted)):
            have, want = saved.get(name), wanted.get(name)
            if have == want:
                continue
            raise CheckpointError(
                f"cannot restore {self.step_dir(step)}: its {name} is "
                f"{'absent' if have is None else 'shaped ' + str(have)}, this run needs "
                f"{'none' if want is None else str(want)} (a different model or strategy state)")

    def restore_latest(self, target, check_meta: Optional[Callable[[dict], None]] = None
                       ) -> Tuple[object, dict, int]:
        """(state, meta, step) of the newest checkpoint that verifies and restores.

        A corrupted one is skipped with a ``CheckpointWarning`` naming the bad file, and the
        previous one is tried. Corrupted means: a file differs from the manifest, or, for a
        checkpoint without a manifest (the writer died between orbax's rename and the
        manifest), orbax cannot read it. A verified checkpoint that fails to restore (out of
        memory, a filesystem error) is raised, not skipped: its files are as written.
        ``check_meta(meta)`` runs before the arrays are read; its ``CheckpointError`` (wrong
        run) is raised as is, without falling back.
        """
        steps = self.all_steps()
        if not steps:
            raise NoCheckpoint(f"no checkpoint to resume from in {self.directory}")
        problems = []
        for step in reversed(steps):
            try:
                has_manifest = self._verify_once(step)
                _, meta = self.read_meta(step)
                if check_meta is not None:
                    check_meta(meta)
                try:
                    state, meta = self.restore(target, step)
                except CheckpointUnreadable as e:
                    if has_manifest:
                        raise CheckpointError(str(e)) from e
                    raise CheckpointCorrupt(f"{e} (and it has no manifest to check its files against)") from e
            except CheckpointCorrupt as e:
                problems.append(str(e))
                older = [s for s in steps if s < step]
                warnings.warn(f"{e}; {'falling back to step ' + str(older[-1]) if older else 'no older checkpoint'}",
                              CheckpointWarning, stacklevel=2)
                continue
            return state, meta, step
        raise CheckpointError(f"no usable checkpoint in {self.directory}: " + "; ".join(problems))

    def _verify_once(self, step: int) -> bool:
        """``verify`` on process 0 only (one read of the files, not one per process); every
        process gets its verdict, so all of them resume from the same step."""
        verdict = ""
        if jax.process_index() == 0:
            try:
                verdict = "verified" if self.verify(step) else "no manifest"
            except CheckpointCorrupt as e:
                verdict = str(e)
        verdict = share_from_first(f"verify-{step}", verdict)
        if verdict not in ("verified", "no manifest"):
            raise CheckpointCorrupt(verdict)
        return verdict == "verified"

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


def _leaf_name(path) -> str:
    """A leaf's name as orbax records it: keys joined by dots (``params.conv1.kernel``)."""
    return ".".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The gist of an orbax/tensorstore error: its first line, without the spec dump, capped."""
    text = str(e).strip()
    line = text.splitlines()[0].split(" [tensorstore_spec=")[0] if text else type(e).__name__
    return line if len(line) <= limit else line[:limit] + "..."
