"""Where a run starts: a fresh state, or the newest usable checkpoint's state and the data
position that goes with it; and the record a checkpoint keeps of where the run stands.

A run checkpoints and resumes through its ``Trainer`` (``Trainer.save``/``Trainer.restore``,
the layout of ``jaxdp.checkpoint.saving``), with ``run_record`` as the checkpoint's record. A
checkpoint without one (a user's ``Trainer.save``) resumes at its global step's place in the
epochs, without the config check.

Data position and elastic resume. An epoch is one ordered list: the epoch's
permutation, padded by repeating its head to a multiple of the device count
(torch's DistributedSampler). Step ``s`` takes entries ``[s*G, (s+1)*G)`` of it,
``G`` the global batch, whatever the device count N: entry ``j`` of the step goes
to device ``j % N`` (that *is* DistributedSampler's ``indices[rank::N]`` with
per-device batches). A checkpoint records (epoch, step, ``s*G`` samples consumed,
N, the permutation's digest). Resumed on N' devices, step ``s`` continues with
entry ``s*G`` of the same permutation, now dealt over N': no sample of the epoch
is lost or repeated. Only the ragged tail can differ: the epoch ends after
``floor(ceil(n/N')*N' / G)`` steps, so the last partial global batch is dropped
and, when N' does not divide n, the list is padded with N''s head repeats
instead of N's (both only at the end of the epoch, which a mid-epoch checkpoint
has not reached). The global batch must stay the same (it is in the fingerprint).
"""

import hashlib
import os
import sys
import warnings

import jax
import numpy as np

from jaxdp.checkpoint import CheckpointError, NoCheckpoint, PartialSavesRemoved, remove_partial_saves
from jaxdp.config.tree import TrainConfig, TrainError, end_position
from jaxdp.data.sampler import epoch_permutation
from jaxdp.run.rundir import NOTHING_TO_RESUME, check_fingerprint, resuming_message


def run_record(cfg: TrainConfig, setup, epoch: int, step_in_epoch: int, evaluated: bool = True) -> dict:
    """What a checkpoint keeps of the run beside the state: its place in the epochs, the data
    position, the fingerprint of the options that change the numbers, and whether the state's
    evaluation is done (``evaluated``: False for a state saved as a stop interrupted it)."""
    return {"epoch": epoch, "step_in_epoch": step_in_epoch, "fingerprint": cfg.fingerprint(),
            "data": data_position(cfg, setup, epoch, step_in_epoch), "evaluated": evaluated}


def data_position(cfg: TrainConfig, setup, epoch: int, step_in_epoch: int) -> dict:
    """Where the sampler stands: enough to continue on any device count (module docstring)."""
    n = len(setup.train_set)
    return {"epoch": epoch, "step_in_epoch": step_in_epoch,
            "samples_consumed": step_in_epoch * cfg.global_batch_size,
            "global_batch": cfg.global_batch_size, "num_samples": n,
            "num_replicas": setup.strategy.num_devices, "batch_per_replica": setup.per_device,
            "steps_per_epoch": setup.steps_per_epoch, "processes": jax.process_count(),
            "seed": cfg.seed, "permutation_sha256": permutation_digest(n, cfg.seed, epoch)}


def permutation_digest(n: int, seed: int, epoch: int) -> str:
    """Short sha256 of an epoch's sample order: a resumed run must see the same one."""
    perm = np.ascontiguousarray(epoch_permutation(n, seed, epoch), dtype=np.int64)
    return hashlib.sha256(perm.tobytes()).hexdigest()[:16]


def start_state(cfg: TrainConfig, setup, checkpoints: str, example, is_main: bool):
    """(state, (epoch, steps of it done), global step, what the resume found, whether the state's
    evaluation is done) to train from;
    ``checkpoints``: the directory. What the resume found (None for a fresh run) is the start of
    the one line the run says about it: the checkpoint and its place, partial saves removed.
    ``is_main``: this process is the run directory's one writer (it holds its lock), the only one
    that removes partial saves."""
    if not cfg.resume:
        if is_main:
            remove_partial_saves(checkpoints)
        state = setup.trainer.init(jax.random.key(cfg.seed), example)  # each device builds its shards
        return state, (0, 0), 0, None, True

    def same_run(meta: dict) -> None:  # before any array is read
        if meta["record"] is not None:
            check_fingerprint(meta["record"]["fingerprint"], cfg.fingerprint(), os.path.abspath(checkpoints))

    # Into shapes and shardings only: a ZeRO-3 restore builds no full (or even fresh) state.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if is_main:
                remove_partial_saves(checkpoints)
            state, meta = setup.trainer.restore(checkpoints, example, check=same_run, with_meta=True,
                                                accept_unverified=cfg.accept_unverified)
        except NoCheckpoint:  # checkpoint folders, but none that orbax lists as complete
            raise TrainError(NOTHING_TO_RESUME.format(out=cfg.out)) from None
    removed = _said_in_the_line(caught)
    position, global_step = _resume_position(cfg, setup, meta, is_main)
    if finished(position, cfg, setup.steps_per_epoch, meta["record"]):
        raise TrainError(f"the run in {cfg.out} already finished its {_length(cfg)} (step {global_step}): "
                         f"nothing to resume")
    found = resuming_message(global_step, position, setup.steps_per_epoch, cfg.global_batch_size,
                             len(setup.train_set))
    if removed:
        found += f"; removed {len(removed)} partial save(s) ({', '.join(removed)})"
    return state, position, global_step, found, (meta["record"] or {}).get("evaluated", True)


def finished(position, cfg: TrainConfig, steps_per_epoch: int, record) -> bool:
    """Whether a checkpoint at ``position`` ends the run: its last step done and evaluated. A state
    saved at the last step as a stop interrupted its evaluation (a Ctrl-C, or a job's SIGTERM
    before its SIGKILL, exit 137) is not: the resumed run evaluates it."""
    end = end_position(cfg, steps_per_epoch)
    return position > end or (position == end and (record or {}).get("evaluated", True))


def _said_in_the_line(caught) -> list:
    """The names of the partial saves the restore removed, which the resume line says; every
    other warning goes on as it was raised."""
    removed = []
    for w in caught:
        if isinstance(w.message, PartialSavesRemoved):
            removed += w.message.names
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return removed


def _length(cfg: TrainConfig) -> str:
    return f"{cfg.max_steps} step(s)" if cfg.max_steps is not None else f"{cfg.epochs} epoch(s)"


def _resume_position(cfg: TrainConfig, setup, meta: dict, is_main: bool):
    """((epoch, step in epoch), global step) to continue from, on this run's device count."""
    steps_per_epoch = setup.steps_per_epoch
    record, global_step = meta["record"], meta["global_step"]
    if record is None:  # a Trainer.save checkpoint: its global step's place in this run's epochs
        position = divmod(global_step, steps_per_epoch)
        if is_main:
            print(f"jaxdp: the checkpoint of step {global_step} has no run record (Trainer.save wrote it): its "
                  f"options are not checked against this run's; it continues at epoch {position[0] + 1}, step "
                  f"{position[1]} of {steps_per_epoch}", file=sys.stderr, flush=True)
        return position, global_step
    epoch, step = record["epoch"], record["step_in_epoch"]
    saved = record.get("data")
    if saved is None:  # written before the data position was recorded
        return (epoch, min(step, steps_per_epoch)), global_step
    now = data_position(cfg, setup, epoch, step)
    if saved["permutation_sha256"] != now["permutation_sha256"] or saved["num_samples"] != now["num_samples"]:
        raise CheckpointError(
            f"cannot resume: epoch {epoch}'s sample order differs from the checkpoint's "
            f"({saved['num_samples']} samples, order {saved['permutation_sha256']} vs now "
            f"{now['num_samples']}, {now['permutation_sha256']}): the dataset or numpy's shuffle changed")
    if saved["num_replicas"] != now["num_replicas"] and is_main:
        print(f"jaxdp: resuming a run saved on {saved['num_replicas']} devices ({saved['processes']} process(es)) "
              f"on {now['num_replicas']} ({now['processes']}): epoch {epoch} continues after its first "
              f"{saved['samples_consumed']} samples, repartitioned over {now['num_replicas']} devices",
              file=sys.stderr)
    if saved["steps_per_epoch"] != steps_per_epoch:
        warnings.warn(f"steps per epoch change from {saved['steps_per_epoch']} to {steps_per_epoch} on "
                      f"{now['num_replicas']} devices (the dataset's {now['num_samples']} samples are padded to a "
                      f"multiple of the device count): the epoch's ragged tail and the schedule's length change")
    # A checkpoint at the very end of an epoch (before its evaluation) may lie past this
    # device count's last step when the padding shrank: that epoch is then done.
    return (epoch, min(step, steps_per_epoch)), global_step
