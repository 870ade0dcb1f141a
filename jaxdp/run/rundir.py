"""A run directory's bookkeeping: metrics and sample-id records, earlier runs, the resume
checks. Shared by jaxdp's and torch_ref's trainers; no jax, no torch.

    OUT/config.json             the options (``--resume OUT`` reads them back)
    OUT/metrics.jsonl           one JSON record per step ("train") and evaluation ("eval")
    OUT/tensorboard/            the same numbers as TensorBoard scalars (``jaxdp.run.scalars``)
    OUT/sample_ids.p<k>.jsonl   --log-sample-ids: the dataset ids process k fed, per step
    OUT/checkpoints/            the trainer's own format (orbax for jaxdp, torch.save for torch_ref)

Resumed, every record file keeps what the checkpoint covers and continues after it, so it
reads like one uninterrupted run.
"""

import json
import os
import shutil
from typing import Optional

from jaxdp.config.tree import TrainConfig, TrainError
from jaxdp.run.scalars import open_scalar_writer

NOTHING_TO_RESUME = ("--resume: {out} holds no checkpoint to resume from (check --out, or drop --resume "
                     "to start a new run there)")
EARLIER_RUN = ("{out} already holds checkpoints of an earlier run (latest step {step}): pass --resume to "
               "continue it, --overwrite to start over, or another --out")
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"


# ----------------------------------------------------------------------------- records

class JsonLines:
    """A JSON-lines file; ``enabled=False`` writes nothing (not process 0).

    ``keep_through_step``: the records up to that step are kept and appended after
    (0 for a fresh run): on resume this drops what the checkpoint does not cover."""

    def __init__(self, path: str, enabled: bool, keep_through_step: int):
        self.path = path
        self._file = None
        if enabled:
            kept = self._records_through(keep_through_step)
            self._file = open(path, "w")
            for record in kept:
                self.write(record)

    def _records_through(self, step: int) -> list:
        if step == 0 or not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        return [r for r in records if r.get("step", 0) <= step]

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


class MetricsLog:
    """``metrics.jsonl`` and its TensorBoard twin, written by the main process only. Both
    trainers write the same records through it."""

    def __init__(self, out: str, enabled: bool, keep_through_step: int, tensorboard: bool = True):
        self._lines = JsonLines(os.path.join(out, "metrics.jsonl"), enabled, keep_through_step)
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
        return record

    def close(self) -> None:
        self._lines.close()
        if self._scalars is not None:
            self._scalars.close()


class SampleLog:
    """Opt-in (``--log-sample-ids``): each step's dataset ids, as this process fed them.

    Every process writes its own ``sample_ids.p<process>.jsonl``: one record per step,
    ``{"step", "epoch", "step_in_epoch", "ranks", "ids"}`` with ``ids[i]`` the ids of
    rank ``ranks[i]``. The union of an epoch's ids is what the model was trained on.
    """

    def __init__(self, out: str, enabled: bool, keep_through_step: int, process_index: int, process_count: int):
        self._file = None
        if not enabled:
            return
        if process_index == 0:  # files of processes this run does not have: from a larger run
            for name in os.listdir(out):
                p = _sample_log_process(name)
                if p is not None and p >= process_count:
                    JsonLines(os.path.join(out, name), True, keep_through_step).close()
        self._file = JsonLines(sample_log_path(out, process_index), True, keep_through_step)

    def write(self, step: int, epoch: int, step_in_epoch: int, ranks, ids) -> None:
        if self._file:
            self._file.write({"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                              "ranks": [int(r) for r in ranks], "ids": ids.tolist()})

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


def write_config(out: str, cfg: TrainConfig) -> None:
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write(cfg.to_json())


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
    sample ids) and nothing else: ``out`` may hold the user's own files."""
    for name in (CHECKPOINTS_DIR, TENSORBOARD_DIR):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    for name in os.listdir(out):
        if name in ("metrics.jsonl", "config.json") or _sample_log_process(name) is not None:
            os.remove(os.path.join(out, name))


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
