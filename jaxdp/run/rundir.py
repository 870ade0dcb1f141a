"""A run directory's bookkeeping: metrics and sample-id records, earlier runs, the resume
checks. Shared by jaxdp's and torch_ref's trainers; no jax, no torch.

    OUT/config.json             the options (``--resume OUT`` reads them back)
    OUT/metrics.jsonl           one JSON record per step ("train") and evaluation ("eval")
    OUT/tensorboard/            the same numbers as TensorBoard scalars (``jaxdp.run.scalars``)
    OUT/sample_ids.p<k>.jsonl   --log-sample-ids: the dataset ids process k fed, per step
    OUT/checkpoints/            the trainer's own format (orbax for jaxdp, torch.save for torch_ref)
    OUT/jaxdp.lock              who writes the run now (``jaxdp.run.lock``: one writer per directory)

Resumed, every record file keeps what the checkpoint covers and continues after it, so it
reads like one uninterrupted run, whatever moment a kill interrupted (each file's rule:
docs/checkpoints-and-faults.md, "What a kill leaves").
"""

import json
import os
import shutil
import sys
from typing import Callable, Optional, Tuple

from jaxdp.config.tree import TrainConfig, TrainError
from jaxdp.runtime.durable import DiskFull, disk_full, fault_point, write_atomically
from jaxdp.run.lock import NAME as LOCK_NAME
from jaxdp.run.scalars import open_scalar_writer

NOTHING_TO_RESUME = ("--resume: {out} holds no checkpoint to resume from (check --out, or drop --resume "
                     "to start a new run there)")
EARLIER_RUN = ("{out} already holds checkpoints of an earlier run (latest step {step}): pass --resume to "
               "continue it, --overwrite to start over, or another --out")
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"


# ----------------------------------------------------------------------------- records

class JsonLines:
    """An append-only JSON-lines file; ``enabled=False`` writes nothing (not process 0).

    ``covers``: on resume, the rows the checkpoint covers (``checkpoint_covers``); None: a fresh
    run, which keeps none. Rows are appended in step order, so the covered ones are the file's
    first rows: the file is cut after them, in place, by one truncate. A kill before it leaves the
    file as it was (the next resume cuts it), a kill after it has dropped only rows no checkpoint
    covers; the kept rows are never rewritten, so no kill can lose them. ``kept`` and ``dropped``
    count the rows."""

    def __init__(self, path: str, enabled: bool, covers: Optional[Callable[[dict], bool]] = None):
        self.path, self.enabled = path, enabled
        self._file = None
        self.kept = self.dropped = 0
        if enabled:
            size, self.kept, self.dropped = _covered_prefix(path, covers or (lambda row: False))
            fault_point("log_rewrite")
            with open(path, "ab") as f:
                f.truncate(size)
                os.fsync(f.fileno())
            self._file, self._size = _open_append(path), size

    def write(self, record: dict) -> None:
        if self._file:
            text = json.dumps(record) + "\n"
            try:
                self._file.write(text)
                self._file.flush()  # in the OS's hands: a killed process loses none of it
            except OSError as e:
                self._cut_torn_row()
                if disk_full(e):
                    raise DiskFull(f"a row of {os.path.basename(self.path)}", self.path) from e
                raise
            self._size += len(text.encode())

    def _cut_torn_row(self) -> None:
        """A write that failed part-way (a full disk): the file ends with its last whole row
        again, and takes no more (cutting needs no space)."""
        try:
            self._file.close()
        except OSError:
            pass  # the rest of the row, still buffered, fails again: it goes with the file
        self._file = None
        os.truncate(self.path, self._size)

    def sync(self) -> None:
        """On disk, not only in the OS's cache: before a checkpoint that covers these rows."""
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())

    def resumed(self) -> str:
        return f"{os.path.basename(self.path)} kept {self.kept} row(s), dropped {self.dropped}"

    def close(self) -> None:
        if self._file:
            self._file.close()


def _open_append(path: str):
    """The file a JsonLines appends to (a test puts a full disk here)."""
    return open(path, "a")


def _covered_prefix(path: str, covers: Callable[[dict], bool]) -> Tuple[int, int, int]:
    """(bytes, rows) of the whole rows at the start of ``path`` that ``covers`` accepts, up to the
    first it does not, and how many rows follow them (a torn last row among them)."""
    size = kept = dropped = 0
    if not os.path.exists(path):
        return size, kept, dropped
    with open(path, "rb") as f:
        for line in f:
            if dropped == 0 and line.endswith(b"\n") and (not line.strip() or _covered(line, covers)):
                size += len(line)
                kept += bool(line.strip())
            else:
                dropped += 1
    return size, kept, dropped


def _covered(line: bytes, covers: Callable[[dict], bool]) -> bool:
    try:
        return covers(json.loads(line))
    except ValueError:  # not a row (cut short by a power cut): it and what follows go
        return False


def checkpoint_covers(step: int, evaluates_again: bool = False) -> Callable[[dict], bool]:
    """The rows a checkpoint of ``step`` covers: every row of an earlier step and the step's own,
    except its evaluation's when the resumed run evaluates that step again (a checkpoint taken at
    an epoch's end before the epoch's evaluation)."""
    def covers(row: dict) -> bool:
        at = row.get("step", 0)
        return at < step or (at == step and not (evaluates_again and row.get("kind") == "eval"))
    return covers


class MetricsLog:
    """``metrics.jsonl`` and its TensorBoard twin, written by the main process only. Both
    trainers write the same records through it.

    ``keep_through_step``: the step of the checkpoint resumed from (0: a fresh run), whose rows are
    kept (``checkpoint_covers``; ``evaluates_again``: but not its evaluation's)."""

    def __init__(self, out: str, enabled: bool, keep_through_step: int, tensorboard: bool = True,
                 evaluates_again: bool = False):
        self._lines = JsonLines(os.path.join(out, "metrics.jsonl"), enabled,
                                _covers(keep_through_step, evaluates_again))
        self._scalars = (open_scalar_writer(os.path.join(out, TENSORBOARD_DIR), keep_through_step)
                         if enabled and tensorboard else None)

    def train(self, step: int, epoch: int, loss: float, accuracy: float, lr: float,
              images_per_sec: Optional[float], **extra) -> dict:
        """A training step's record; ``epoch`` counts from 0 (written from 1)."""
        return self.write({"kind": "train", "epoch": epoch + 1, "step": step, "loss": loss, "accuracy": accuracy,
                           "lr": lr, "images_per_sec": images_per_sec, **extra})

    def eval(self, step: int, epoch: int, result: dict) -> dict:
        return self.write({"kind": "eval", "epoch": epoch + 1, "step": step, **result})

    def write(self, record: dict) -> dict:
        self._lines.write(record)
        if self._scalars is not None:
            self._scalars.write(record)
        fault_point("metrics_row")
        return record

    def sync(self) -> None:
        self._lines.sync()
        if self._scalars is not None:
            self._scalars.sync()

    def resumed(self) -> list:
        """What the resume kept and dropped of the log, one phrase (process 0; none elsewhere)."""
        return [self._lines.resumed()] if self._lines.enabled else []

    def close(self) -> None:
        self._lines.close()
        if self._scalars is not None:
            self._scalars.close()


class SampleLog:
    """Opt-in (``--log-sample-ids``): each step's dataset ids, as this process fed them.

    Every process writes its own ``sample_ids.p<process>.jsonl``: one record per step,
    ``{"step", "epoch", "step_in_epoch", "ranks", "ids"}`` with ``ids[i]`` the ids of
    rank ``ranks[i]``. The union of an epoch's ids is what the model was trained on.
    On resume each file keeps the steps the checkpoint (of step ``keep_through_step``) covers.
    """

    def __init__(self, out: str, enabled: bool, keep_through_step: int, process_index: int, process_count: int):
        self._file, self._cut = None, []
        if not enabled:
            return
        covers = _covers(keep_through_step)
        if process_index == 0:  # files of processes this run does not have: from a larger run
            for name in sorted(os.listdir(out)):
                p = _sample_log_process(name)
                if p is not None and p >= process_count:
                    self._cut.append(JsonLines(os.path.join(out, name), True, covers))
                    self._cut[-1].close()
        self._file = JsonLines(sample_log_path(out, process_index), True, covers)

    def write(self, step: int, epoch: int, step_in_epoch: int, ranks, ids) -> None:
        if self._file:
            self._file.write({"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                              "ranks": [int(r) for r in ranks], "ids": ids.tolist()})
            fault_point("sample_row")

    def sync(self) -> None:
        if self._file:
            self._file.sync()

    def resumed(self) -> list:
        """What the resume kept and dropped of this process's file (and of a larger run's), one phrase each."""
        return [f.resumed() for f in ([self._file] if self._file else []) + self._cut]

    def close(self) -> None:
        if self._file:
            self._file.close()


def sample_log_path(out: str, process_index: int) -> str:
    return os.path.join(out, f"sample_ids.p{process_index}.jsonl")


def _sample_log_process(name: str) -> Optional[int]:
    if name.startswith("sample_ids.p") and name.endswith(".jsonl"):
        middle = name[len("sample_ids.p"):-len(".jsonl")]
        return int(middle) if middle.isdigit() else None
    return None


def _covers(keep_through_step: int, evaluates_again: bool = False) -> Optional[Callable[[dict], bool]]:
    return checkpoint_covers(keep_through_step, evaluates_again) if keep_through_step else None


def write_config(out: str, cfg: TrainConfig) -> None:
    """Replaced whole: ``--resume OUT`` reads it back, so a kill must never leave half of it."""
    write_atomically(os.path.join(out, "config.json"), cfg.to_json(), point="config")


# ----------------------------------------------------------------------------- earlier runs and resume

def refuse_earlier_run(cfg: TrainConfig, latest_step: Optional[int]) -> bool:
    """Whether ``cfg.out`` holds an earlier run that this fresh run may replace (--overwrite);
    without --resume or --overwrite, that is an error: a later --resume would restore it.
    ``--resume`` with nothing to resume is an error too."""
    if cfg.resume and latest_step is None:
        raise TrainError(NOTHING_TO_RESUME.format(out=cfg.out))
    if cfg.resume or latest_step is None:
        return False
    if not cfg.overwrite:
        raise TrainError(EARLIER_RUN.format(out=cfg.out, step=latest_step))
    return True


def remove_run_files(out: str) -> None:
    """Delete what a run writes in ``out`` (checkpoints/, tensorboard/, metrics, config,
    sample ids) and nothing else: ``out`` may hold the user's own files. A symlink among them
    goes as a link: what it points to, outside the run, stays. What cannot be removed stops it,
    in one line."""
    for name in sorted(os.listdir(out)):
        if name in (CHECKPOINTS_DIR, TENSORBOARD_DIR, "metrics.jsonl", "config.json") or \
                _sample_log_process(name) is not None:
            _remove(os.path.join(out, name))


def _remove(path: str) -> None:
    def refuse(_function, failed, _info):
        error = sys.exc_info()[1]
        raise TrainError(f"--overwrite: cannot remove {failed} ({getattr(error, 'strerror', None) or error}); "
                         f"the earlier run in {os.path.dirname(path)} is partly removed: remove the rest by hand, or "
                         f"pick another --out") from None
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, onerror=refuse)
        else:
            os.remove(path)  # a file, or a link (never what it points to)
    except OSError:
        refuse(os.remove, path, None)


def is_jaxdp_run(out: str) -> bool:
    """Whether ``out`` holds a jaxdp run: its lock file, its checkpoints, or a config.json of
    jaxdp's options."""
    if os.path.exists(os.path.join(out, LOCK_NAME)) or latest_orbax_step(out) is not None:
        return True
    try:
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "out" in saved and set(saved) <= set(TrainConfig.__dataclass_fields__)


def refuse_foreign_dir(cfg: TrainConfig) -> None:
    """A fresh run writes only into a new or empty directory, or an earlier jaxdp run's: never
    into a folder of someone's own files (its config.json, metrics.jsonl would be replaced)."""
    if cfg.resume or not os.path.isdir(cfg.out) or not os.listdir(cfg.out) or is_jaxdp_run(cfg.out):
        return
    raise TrainError(f"--out {cfg.out} is not empty and holds no jaxdp run (no config.json of one): jaxdp writes "
                     f"runs into new or empty directories only; pick another --out")


def check_fingerprint(saved: dict, current: dict, where: str) -> None:
    """Refuse to resume a checkpoint whose run differs from this one in anything that
    changes the math (``TrainConfig.fingerprint``, plus what a trainer adds to it).

    Options added since the checkpoint was written count as their defaults; what the
    checkpoint records that ``current`` no longer has is not compared."""
    saved = {**TrainConfig().fingerprint(), **saved}
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {current[k]!r}"
             for k in sorted(current) if saved.get(k) != current[k]]
    if diffs:
        raise TrainError(f"cannot resume from {where}: the config differs ({'; '.join(diffs)})")


def resuming_message(step: int, position, steps_per_epoch: int, global_batch: int, num_samples: int) -> str:
    """``resuming from step S (epoch E, sample K of N)``, E counted from 1."""
    epoch, done = position
    if done >= steps_per_epoch:  # saved at the very end of an epoch: the next one starts
        epoch, done = epoch + 1, 0
    return f"resuming from step {step} (epoch {epoch + 1}, sample {done * global_batch} of {num_samples})"


def checkpoint_dir(out: str) -> str:
    return os.path.join(out, CHECKPOINTS_DIR)


def latest_orbax_step(out: str) -> Optional[int]:
    """The newest complete jaxdp (orbax) checkpoint's step in ``out``, from the folder names:
    orbax names a complete save by its step; one in progress has a temporary suffix."""
    directory = checkpoint_dir(out)
    if not os.path.isdir(directory):
        return None
    steps = [int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n))]
    return max(steps, default=None)
