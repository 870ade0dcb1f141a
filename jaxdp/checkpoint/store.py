"""A directory of checkpoints: orbax, atomic, verified, sharded, in a strategy-independent layout.

A checkpoint holds the TrainState in the layout every strategy converts to and
from (``strategy.engine.stored``: params and per-parameter optimizer state in their
canonical shapes, sharded over the data axis along a dimension it divides) plus a JSON record
(its layout: ``jaxdp.checkpoint.saving``). Each device's chunks are written by the process that
owns them, and nothing is gathered to save. A run saved under one strategy or device count
resumes under another: the stored arrays have canonical shapes, orbax reads
them into the new count's shardings, and the strategy converts with
``from_stored``. Any change of shape is refused, naming the array.

A checkpoint becomes visible (a folder named by its step) only complete and with its manifest:
orbax writes into ``<step>.orbax-checkpoint-tmp-*``; when every process has finished, process 0
lets orbax commit it under a name that is still temporary, writes ``jaxdp_manifest.json`` there
(every file's size and sha256) and only then renames it to ``<step>``. Saving a step that exists
(a run resumed from the end of an epoch saves that step again) sets the old folder aside as
``<step>.jaxdp-replaced`` and removes it once the new one is in place; a run that died in between
finds it put back.

Nothing here deletes what another process may be writing: a reader (``Trainer.restore``, an
evaluation script on a live run) only reads. Partial saves are removed by ``remove_partial_saves``,
which only the directory's one writer calls (``jaxdp train``'s process 0, holding the run
directory's lock: ``jaxdp.run.lock``).

Ways a checkpoint can be bad, and what happens:

- **partially written** (the process died while saving): a temporary name, never listed;
  the next writer removes it (with a warning).
- **corrupted after the fact** (a truncated or garbled file): ``restore_latest`` checks the
  manifest first (on process 0, which tells the others), names the first file that differs,
  warns and falls back to the previous checkpoint (``max_to_keep`` keeps 3).
- **unverified** (no manifest: written by a jaxdp before the manifest came first, or copied
  without it): skipped like a corrupt one, in one line, unless the caller accepts unverified
  checkpoints (``accept_unverified``; ``jaxdp train --accept-unverified``), which then only
  orbax's own reading checks.
- **from another run** (different model, batch, seed...): not a corruption, so
  no fallback: the caller's ``check_meta`` raises ``CheckpointError``, and so
  does an array of another shape than the run needs.

A full disk during a save is ``DiskFull`` (``jaxdp.runtime.durable``), naming the checkpoint;
what it left has a temporary name.

Multi-process: every process calls ``save`` (orbax coordinates: each writes its
shards, process 0 the metadata) and the directory must be on a filesystem that
all processes share.
"""

import hashlib
import json
import logging
import os
import shutil
import warnings
from typing import Callable, List, Optional, Tuple

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.path import atomicity  # the commit's rename, which the manifest must precede

from jaxdp.runtime.distributed import barrier, share_from_first
from jaxdp.runtime.durable import DiskFull, disk_full, fault_point, sync_folder, write_atomically

MANIFEST = "jaxdp_manifest.json"
_TMP_MARK = ".orbax-checkpoint-tmp"
SET_ASIDE = ".jaxdp-replaced"  # a complete checkpoint of a step being saved again


# How a caller takes a checkpoint that has no manifest: named in every message that refuses one.
ACCEPT_UNVERIFIED = ("accept unverified checkpoints: jaxdp train --accept-unverified, "
                     "Trainer.restore(..., accept_unverified=True)")


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


def remove_partial_saves(directory: str) -> List[str]:
    """Remove what interrupted saves left in ``directory`` (temporary folders), put back a
    checkpoint set aside for a save of its step that never completed, and return the removed
    names (with a ``PartialSavesRemoved`` warning). Only the directory's one writer may call
    it: another process's save in flight has the same names."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(SET_ASIDE):
            step_dir = path[:-len(SET_ASIDE)]
            if not os.path.exists(step_dir):  # its replacement never became visible: it still counts
                os.rename(path, step_dir)
                continue
        elif _TMP_MARK not in name:
            continue
        shutil.rmtree(path)
        removed.append(name)
    if removed:
        warnings.warn(PartialSavesRemoved(f"removed {len(removed)} partially written checkpoint(s) left by an "
                                          f"interrupted save: {', '.join(removed)} in {directory}", removed),
                      stacklevel=2)
    return removed


class _VisibleWithManifest(atomicity.AtomicRenameTemporaryPath):
    """orbax's commit by rename, with the manifest written first: orbax commits the step's folder
    under a name that is still temporary, the manifest goes in, then the folder takes its step's
    name. (Each item's folder inside the step's, state/ and meta/, commits as orbax does.)"""

    async def finalize(self):
        final = self._final_path
        if not final.name.isdigit():
            return await super().finalize()
        staged = final.parent / f"{self._tmp_path.name}-complete"
        self._final_path = staged
        try:
            await super().finalize()
        finally:
            self._final_path = final
        fault_point("checkpoint_manifest")
        write_manifest(str(staged))
        os.rename(staged, final)
        sync_folder(str(final.parent))


class _QuietDiskFull(logging.Filter):
    """Drops orbax's log records of a full disk (a traceback each): the save raises ``DiskFull``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and disk_full(record.exc_info[1]))


class Checkpointer:
    """A checkpoint directory. Opening it changes nothing in it (readers share it with a
    writer): the writer removes partial saves itself (``remove_partial_saves``)."""

    def __init__(self, directory: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                                 temporary_path_class=_VisibleWithManifest),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )

    # -- saving --------------------------------------------------------------------------------
    def save(self, global_step: int, state, meta: dict) -> None:
        """Write and wait: the caller may exit right after, and must not lose this step.

        A checkpoint of the same step is replaced (a run resumed from the end of an epoch
        saves that step again, now past the epoch's evaluation): the old one is set aside and
        goes only once the new one is visible; an older one stays until the new one is
        complete, so a crash in between falls back to it. The fault points
        (``jaxdp.runtime.durable``) are the moments a kill can split a save at; a full disk is
        ``DiskFull``, naming the checkpoint.
        """
        aside = self._set_aside(global_step)
        quiet = _QuietDiskFull()
        logging.getLogger("absl").addFilter(quiet)  # orbax logs its thread's error whole: DiskFull says it
        try:
            self._manager.save(
                global_step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            fault_point("checkpoint_write")  # orbax writes on in its own thread, into its temporary folder
            self._manager.wait_until_finished()  # process 0's commit writes the manifest (_VisibleWithManifest)
        except Exception as e:
            if aside and not os.path.exists(self.step_dir(global_step)):
                os.rename(aside, self.step_dir(global_step))  # the old one stays the step's checkpoint
            if disk_full(e):
                raise DiskFull(f"checkpoint {global_step}", self.step_dir(global_step)) from e
            raise
        finally:
            logging.getLogger("absl").removeFilter(quiet)
        if jax.process_index() != 0:  # process 0 passed it in the commit, before the manifest
            fault_point("checkpoint_manifest")
        if aside:
            shutil.rmtree(aside)
        fault_point("checkpoint_done")

    def _set_aside(self, step: int) -> Optional[str]:
        """Rename an existing checkpoint of ``step`` out of orbax's sight (orbax saves no step
        twice); the path it went to, or None. Process 0 decides, for every process of a job."""
        there = jax.process_index() == 0 and step in self.all_steps()
        if not share_from_first(f"set aside {step}", "yes" if there else ""):
            return None
        aside = self.step_dir(step) + SET_ASIDE
        if jax.process_index() == 0:
            os.rename(self.step_dir(step), aside)
        barrier(f"set aside checkpoint {step}")
        self._manager.reload()
        return aside

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

        Returns False when the checkpoint has no manifest (unverified: written by an older jaxdp,
        or copied without it).
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

    def restore_latest(self, target, check_meta: Optional[Callable[[dict], None]] = None,
                       accept_unverified: bool = False) -> Tuple[object, dict, int]:
        """(state, meta, step) of the newest checkpoint that verifies and restores.

        A corrupted one is skipped with a ``CheckpointWarning`` naming the bad file, and the
        previous one is tried; so is an unverified one (no manifest), unless
        ``accept_unverified``: then it is restored with a warning, and counts as corrupted if
        orbax cannot read it. A verified checkpoint that fails to restore (out of memory, a
        filesystem error) is raised, not skipped: its files are as written.
        ``check_meta(meta)`` runs before the arrays are read; its ``CheckpointError`` (wrong
        run) is raised as is, without falling back.
        """
        steps = self.all_steps()
        if not steps:
            raise NoCheckpoint(f"no checkpoint to resume from in {self.directory}")
        problems, unverified = [], []
        for step in reversed(steps):
            older = [s for s in steps if s < step]
            fallback = "falling back to step " + str(older[-1]) if older else "no older checkpoint"
            try:
                has_manifest = self._verify_once(step)
                if not has_manifest and not accept_unverified:
                    unverified.append(step)
                    problems.append(f"checkpoint {self.step_dir(step)} is unverified")
                    warnings.warn(f"{self._unverified(step)}; {fallback}", CheckpointWarning, stacklevel=2)
                    continue
                if not has_manifest:
                    warnings.warn(f"{self._unverified(step)}: restoring it as accepted", CheckpointWarning, stacklevel=2)
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
                warnings.warn(f"{e}; {fallback}", CheckpointWarning, stacklevel=2)
                continue
            return state, meta, step
        hint = f" (to restore step {unverified[0]} as it is, {ACCEPT_UNVERIFIED})" if unverified else ""
        raise CheckpointError(f"no usable checkpoint in {self.directory}: " + "; ".join(problems) + hint)

    def restore_step(self, target, step: int, check_meta: Optional[Callable[[dict], None]] = None,
                     accept_unverified: bool = False) -> Tuple[object, dict]:
        """(state, meta) of checkpoint ``step``, verified as ``restore_latest`` verifies each: the
        step asked for, so a corrupt or unverified one is raised, never replaced by another."""
        steps = self.all_steps()
        if step not in steps:
            raise NoCheckpoint(f"no checkpoint of step {step} in {self.directory} (it has "
                               f"{', '.join(map(str, steps)) or 'none'})")
        if not self._verify_once(step):
            if not accept_unverified:
                raise CheckpointError(f"{self._unverified(step)}; to restore it as it is, {ACCEPT_UNVERIFIED}")
            warnings.warn(f"{self._unverified(step)}: restoring it as accepted", CheckpointWarning, stacklevel=2)
        if check_meta is not None:
            check_meta(self.read_meta(step)[1])
        return self.restore(target, step)

    def _unverified(self, step: int) -> str:
        return f"checkpoint {self.step_dir(step)} is unverified (it has no manifest to check its files against)"

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


def write_manifest(root: str) -> None:
    """Every file's size and sha256 under ``root``, in ``root/jaxdp_manifest.json``."""
    files = {rel: _describe(os.path.join(root, rel)) for rel in _files(root)}
    write_atomically(os.path.join(root, MANIFEST), json.dumps({"format": 1, "files": files}, indent=0,
                                                              sort_keys=True))  # never a half-written one


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
