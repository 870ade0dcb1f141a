"""The training loop: data -> Trainer.step -> records, evaluation and checkpoints.

It knows nothing about which strategy runs; it drives a ``jaxdp.Trainer`` as a user would:
init or restore, step, evaluate, save (``Trainer.save``, with the run's record). What it builds
first is in ``setup``, where it starts from (fresh or a checkpoint) in ``resume``, the run
directory's files in ``rundir``, signals in ``interrupts``, MFU, memory and profiling in
``perf``.

Multi-process (``jaxdp launch``, ``srun``): every process runs this same loop. Each loads
only its own rows of every batch (its devices' ranks) and
``make_array_from_process_local_data`` stitches them into the global batch; process 0
alone writes records and progress; all of them take part in each checkpoint save, and a
preemption (SIGTERM to any of them) stops all of them at one agreed step.
"""

import os
import sys
import time
from typing import Callable, Optional

import jax
import numpy as np

from jaxdp.config.tree import TrainConfig, TrainError, check_config, end_position
from jaxdp.data.loader import eval_batches
from jaxdp.runtime.distributed import barrier, distributed_env, preemption_sync_point
from jaxdp.run.feed import flat_rows as _flat
from jaxdp.run.feed import make_feed
from jaxdp.run.flops import train_flops_per_image
from jaxdp.run.interrupts import DeferredInterrupt
from jaxdp.run.lock import RunDirInUse, RunLock
from jaxdp.runtime.durable import DiskFull, fault_point
from jaxdp.runtime.mesh import process_ranks
from jaxdp.run.perf import ProfileWindow, StepCost, Utilisation, peak_flops
from jaxdp.run.progress import Throughput, progress_bar, say
from jaxdp.run.resume import run_record, start_state
from jaxdp.run.rundir import (TENSORBOARD_DIR, MetricsLog, SampleLog, checkpoint_dir, latest_orbax_step,
                              refuse_earlier_run, refuse_foreign_dir, remove_run_files, write_config)
from jaxdp.run.setup import build, example_batch, startup_header


def train(cfg: TrainConfig, *, stop_after_steps: Optional[int] = None,
          on_step: Optional[Callable] = None) -> dict:
    """Train ``cfg``; returns a summary. ``stop_after_steps`` simulates an interruption
    (checkpoint, then return) so resume can be tested without killing processes.

    Ctrl-C or SIGTERM (from the very start: see ``jaxdp.run.interrupts``) finish the step in
    flight, write its records, checkpoint it and raise ``KeyboardInterrupt`` (``Preempted``
    for SIGTERM) carrying ``checkpointed_step``."""
    check_config(cfg)
    refuse_earlier_run(cfg, latest_orbax_step(cfg.out))  # before any work (again under the lock)
    refuse_foreign_dir(cfg)
    t_start = time.perf_counter()
    lock = None
    try:
        with DeferredInterrupt("jaxdp", job=distributed_env() is not None) as interrupt:
            setup = build(cfg)  # checks every name and size; writes nothing
            lock = _hold_run_dir(cfg)
            run = _Run(cfg, setup, refuse_earlier_run(cfg, latest_orbax_step(cfg.out)), interrupt)
            try:
                _loop(run, stop_after_steps, on_step, t_start)
            except KeyboardInterrupt as e:
                run.keep_step_in_hand(e)
                raise
            finally:
                run.close()
    except DiskFull as e:
        newest = latest_orbax_step(cfg.out)
        raise TrainError(f"{e}; the newest complete checkpoint: "
                         f"{'none yet' if newest is None else f'step {newest} in {checkpoint_dir(cfg.out)}'}") from None
    finally:
        if lock is not None:
            lock.release()
            if lock.made_out and os.path.isdir(cfg.out) and not os.listdir(cfg.out):  # it wrote nothing there
                os.rmdir(cfg.out)
    rates = run.records_in_flight.rates if run.records_in_flight is not None else []
    return dict(run.summary, steps=run.global_step, seconds=time.perf_counter() - t_start, state=run.state,
                images_per_sec=float(np.median(rates)) if rates else None)


def _hold_run_dir(cfg: TrainConfig) -> Optional[RunLock]:
    """The run directory's lock (``jaxdp.run.lock``), held by the job's process 0, its one writer;
    a fresh run never starts in a folder of someone else's files."""
    job = distributed_env()
    if job is not None and job.process_id != 0:
        return None
    refuse_foreign_dir(cfg)  # again: another run may have written there meanwhile
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise TrainError(f"--out {cfg.out} is a file, not a directory: pick another --out")
    made_out = not os.path.isdir(cfg.out)
    os.makedirs(cfg.out, exist_ok=True)
    try:
        return RunLock(cfg.out, made_out)
    except RunDirInUse as e:
        raise TrainError(str(e)) from None


def _loop(run: "_Run", stop_after_steps: Optional[int], on_step: Optional[Callable], t_start: float) -> None:
    cfg = run.cfg
    steps_per_epoch = run.setup.steps_per_epoch
    end_epoch, end_step = end_position(cfg, steps_per_epoch)
    run.stop_if_asked()  # a Ctrl-C while the state was built (a compile): nothing trained yet
    throughput = Throughput(cfg.global_batch_size)
    records = _PendingRecords(run, throughput, t_start)
    for epoch in range(run.position[0], end_epoch + 1):
        last = end_step if epoch == end_epoch else steps_per_epoch  # --max-steps may end an epoch early
        first = run.position[1] if epoch == run.position[0] else 0
        batches = run.batches(epoch, first)
        records.start_epoch(progress_bar(steps_per_epoch, first, f"epoch {epoch + 1}/{run.epochs}",
                                         cfg.progress and run.is_main))
        throughput.restart()  # the first interval holds the compile, or the last evaluation
        # first == last: resumed from the run's last step, saved before its evaluation: only that is left
        for step_in_epoch, (batch, ids) in enumerate(batches if first < last else (), start=first):
            records.before_step(batch)
            run.state, metrics = run.trainer.step(run.state, batch)
            # Bookkeeping at once, so that from here on the state in hand and its step number
            # agree wherever an exception lands (the loop spends its time in records.write).
            run.step_done(epoch, step_in_epoch + 1)
            fault_point("step")
            records.add(run.global_step, epoch, float(run.setup.schedule(run.global_step - 1)), metrics)
            run.sample_log.write(run.global_step, epoch, step_in_epoch, run.ranks, ids)
            records.write(keep_newest=1)  # waits for the previous step; this one is queued
            run.profile.after_step(run.global_step, metrics)
            if on_step is not None:
                on_step(run.global_step, run.state, metrics)
            epoch_done = step_in_epoch + 1 == last  # the epoch's own evaluation and save follow
            if cfg.eval_every and run.global_step % cfg.eval_every == 0 and not epoch_done:
                records.write()
                run.evaluate(epoch)
                throughput.restart()
            if cfg.checkpoint_every and run.global_step % cfg.checkpoint_every == 0 and not epoch_done:
                run.save()
            if stop_after_steps is not None and run.global_step >= stop_after_steps:
                batches.close()
                run.save()
                run.summary["interrupted"] = True
                return
            # Asked at every step (in a job, every process must reach each sync point); at the
            # epoch's last step the epoch's evaluation and save come first, then the stop below.
            if run.should_stop() and not epoch_done:
                batches.close()
                run.save()
                run.stop_if_asked()
            if epoch_done:
                break
        records.write()
        records.end_epoch()
        batches.close()
        run.evaluate(epoch)
        run.position = (epoch + 1, 0) if last == steps_per_epoch else (epoch, last)
        run.save()
        if epoch < end_epoch:  # a stop asked for during the run's last step: the run is done, not stopped
            run.stop_if_asked()


class _Run:
    """The state in hand, its step and data position, and the run directory it writes to."""

    def __init__(self, cfg: TrainConfig, setup, overwrite: bool, interrupt):
        self.cfg, self.setup, self.interrupt = cfg, setup, interrupt
        self.trainer, self.strategy = setup.trainer, setup.strategy
        self.is_main = jax.process_index() == 0
        self.job = jax.process_count() > 1
        self.ranks = process_ranks(self.strategy.mesh, self.strategy.batch_axes)  # this process's rows
        self.epochs = end_position(cfg, setup.steps_per_epoch)[0] + 1
        if overwrite and self.is_main:  # --overwrite, and the new run is valid: only now delete the old one
            remove_run_files(cfg.out)
        os.makedirs(cfg.out, exist_ok=True)
        self.checkpoints = checkpoint_dir(cfg.out)  # written and read by the Trainer (Trainer.save/restore)
        self.state, self.position, self.global_step, found, evaluated = start_state(
            cfg, setup, self.checkpoints, example_batch(self.strategy.model), self.is_main)
        self.evaluated_at = self.global_step if evaluated else None  # the step of the latest evaluation
        self.saved = (self.global_step, self.position)  # what the newest checkpoint holds
        self.first_step = self.global_step  # where this run started (0, or the checkpoint's step)
        barrier("init")  # the processes finish compiling the init at different times (see distributed.barrier)
        if self.is_main and cfg.progress:
            print(startup_header(cfg, self.strategy, self.state, setup.per_device), file=sys.stderr, flush=True)
        tp = self.strategy.model_split
        if self.is_main and tp is not None and tp.note:  # a layer left unsplit: said even without progress
            print(f"tensor parallelism: {tp.note}", file=sys.stderr, flush=True)
        self.feed, feed_line = make_feed(cfg, setup, self.ranks)  # the training set on the devices, or the host
        if self.is_main and cfg.progress:
            print(feed_line, file=sys.stderr, flush=True)
        if self.is_main:
            write_config(cfg.out, cfg)
        keep = self.global_step if cfg.resume else 0
        # A checkpoint at an epoch's end taken before the epoch's evaluation: the resumed run evaluates again.
        evaluates_again = self.position[1] >= setup.steps_per_epoch or not evaluated
        self.log = MetricsLog(cfg.out, self.is_main, keep, tensorboard=cfg.tensorboard, evaluates_again=evaluates_again)
        self.sample_log = SampleLog(cfg.out, cfg.log_sample_ids, keep, jax.process_index(), jax.process_count())
        if self.is_main and found is not None:  # one line: where it resumes, what it removed, kept and dropped
            print("jaxdp: " + "; ".join([found, *self.log.resumed(), *self.sample_log.resumed()]), file=sys.stderr,
                  flush=True)
        self.profile = ProfileWindow(cfg.profile_steps, os.path.join(cfg.out, TENSORBOARD_DIR))
        self.summary = {"steps": 0, "eval": None, "interrupted": False, "process_index": jax.process_index()}

    def batches(self, epoch: int, first: int):
        """This process's rows of the epoch's batches from step ``first``, placed on the mesh, with their ids."""
        return self.feed.epoch(epoch, first)

    def step_done(self, epoch: int, steps_done: int) -> None:
        """The state in hand is one update further, at (epoch, steps of it done)."""
        self.global_step += 1
        self.position = (epoch, steps_done)

    def save(self) -> None:
        """Checkpoint the state in hand, as a user's ``Trainer.save`` does, with where the run stands.

        Its rows first, on disk: a resume keeps the rows a checkpoint covers, so a checkpoint must
        never cover a step whose row is still queued (``_PendingRecords``) or only in the OS's cache.
        A state already checkpointed where it stands (a stop right after a --checkpoint-every save)
        is not written again."""
        if self.saved == (self.global_step, self.position):
            return
        if self.records_in_flight is not None:
            self.records_in_flight.write()
        self.log.sync()
        self.sample_log.sync()
        at_end = self.position == end_position(self.cfg, self.setup.steps_per_epoch)
        evaluated = not at_end or self.evaluated_at == self.global_step  # the run's last evaluation is done
        self.trainer.save(self.checkpoints, self.state, keep=self.cfg.keep,
                          record=run_record(self.cfg, self.setup, *self.position, evaluated=evaluated))
        self.saved = (self.global_step, self.position)

    def evaluate(self, epoch: int) -> None:
        barrier("evaluate")
        result = evaluate(self.trainer, self.state, self.setup.test_set, self.setup.per_device, self.ranks)
        self.log.eval(self.global_step, epoch, result)
        self.evaluated_at = self.global_step
        if self.is_main:
            say(f"step {self.global_step} (epoch {epoch + 1}): eval loss {result['loss']:.4f} "
                f"accuracy {result['accuracy']:.4f}")
        self.summary["eval"] = result

    def should_stop(self) -> bool:
        """Ctrl-C or SIGTERM here; in a job, whether every process stops at this step.

        JAX's sync manager counts calls: it stops the job at the call after the furthest process's
        latest, a notice before any call meaning the 1st. So it is given this run's steps (1, 2, ...),
        not the global step: a resumed job preempted while it started would wait for step 1 forever."""
        if self.job and preemption_sync_point(self.global_step - self.first_step):
            self.interrupt.preempted_now()
        return self.interrupt.requested

    def stop_if_asked(self) -> None:
        """After the state in hand was checkpointed (or nothing was trained): raise the interrupt."""
        if self.interrupt.requested:
            e = self.interrupt.exception()
            e.checkpointed_step = self.global_step if self.saved[0] == self.global_step else None
            raise e

    def keep_step_in_hand(self, e: KeyboardInterrupt) -> None:
        """An interrupt raised elsewhere than between steps: one process checkpoints the
        consistent state in hand (a job checkpoints only all together, at a sync point)."""
        self.summary["interrupted"] = True
        if self.job or getattr(e, "checkpointed_step", None) is not None:
            return
        self.save()
        e.checkpointed_step = self.global_step

    records_in_flight = None  # the loop's _PendingRecords, set when it starts

    def close(self) -> None:
        self.feed.close()
        self.profile.close()
        self.log.close()
        self.sample_log.close()


def evaluate(trainer, state, test_set, per_device: int, ranks=None) -> dict:
    """Loss and accuracy over the whole test set; ``ranks``: the rows this process feeds."""
    totals = np.zeros(3)
    for batch in eval_batches(test_set, num_replicas=trainer.strategy.num_devices, batch_per_replica=per_device,
                              ranks=ranks):
        out = trainer.evaluate(state, {"image": _flat(batch.images), "label": _flat(batch.labels),
                                       "mask": _flat(batch.mask)})
        totals += [float(out["loss_sum"]), float(out["correct"]), float(out["count"])]
    return {"loss": totals[0] / totals[2], "accuracy": totals[1] / totals[2], "count": int(totals[2])}


class _PendingRecords:
    """Train records whose metrics are still being computed: the loop writes a step's
    record once the next step is queued, so reading its loss never stalls the device.

    The first step of the run also fixes what the records say about the compiled step
    (FLOPs for MFU, memory) and the time to the first step."""

    def __init__(self, run: _Run, throughput: Throughput, t_start: float):
        self.run, self.throughput, self.t_start = run, throughput, t_start
        self.pending, self.bar, self.utilisation = [], None, None
        self.rates = []  # every step's images/s (the run's median goes in the summary)
        run.records_in_flight = self

    def start_epoch(self, bar) -> None:
        self.bar = bar

    def end_epoch(self) -> None:
        self.bar.close()

    def before_step(self, batch) -> None:
        run = self.run
        if self.utilisation is None:
            self.utilisation = _utilisation(run, batch)
        run.profile.before_step(run.global_step + 1)

    def add(self, step: int, epoch: int, lr: float, metrics) -> None:
        self.pending.append((step, epoch, lr, metrics))

    def write(self, keep_newest: int = 0) -> None:
        """Write the records, oldest first, but the newest ``keep_newest``. A record leaves
        the queue only once written, so an interruption here loses none of them."""
        while len(self.pending) > keep_newest:
            _report(self.pending[0], self)
            self.pending.pop(0)


def _utilisation(run: _Run, batch):
    """Compile the first step ahead of time (the steps then run that program) for its memory;
    the model's FLOPs per image (``jaxdp.run.flops``) for MFU, counted only where there is a peak."""
    compiled = run.strategy.engine.compile_step(run.state, batch)
    barrier("step compiled")  # see distributed.barrier: the first step's collectives find everyone
    device = next(d for d in run.strategy.mesh.devices.flat if d.process_index == jax.process_index())
    peak = peak_flops(device.device_kind, run.cfg.dtype, run.cfg.peak_flops)
    return Utilisation(StepCost(compiled), device, peak, run.strategy.mesh.devices.size,
                       _flops_per_image(run.strategy) if peak else None)


def _flops_per_image(strategy):
    """The strategy's model's training FLOPs on one example (the image shape every dataset
    has, whatever form the step's batch takes); None (MFU n/a) for a model the count cannot
    trace."""
    try:
        one = example_batch(strategy.model)
        return train_flops_per_image(strategy.init_model, *strategy.task.model_inputs(one),
                                     apply_kwargs=strategy.task.init_kwargs)
    except Exception as e:  # a custom model the abstract trace cannot follow: say so, train on
        say(f"MFU n/a: the model's FLOPs could not be counted ({type(e).__name__}: {e})")
        return None


def _report(pending, records: _PendingRecords) -> None:
    step, epoch, lr, metrics = pending
    loss = float(metrics["loss"])  # waits for that step only; the next is already queued
    ips = records.throughput.tick()  # None for a step whose time holds the compile
    if ips is not None:
        records.rates.append(ips)
    extra = {**_other_scalars(metrics), **records.utilisation.fields(ips)}
    if records.t_start is not None:  # the run's first step: how long until training really began
        extra["time_to_first_step_s"] = time.perf_counter() - records.t_start
        if records.run.is_main and records.run.cfg.progress:
            say(f"first step after {extra['time_to_first_step_s']:.1f} s (start-up and compile); "
                f"{records.utilisation.describe()}")
        records.t_start = None
    records.run.log.train(step, epoch, loss, float(metrics["accuracy"]), lr, ips, **extra)
    records.bar.set_postfix(loss=f"{loss:.4f}", **({"img_s": f"{ips:,.0f}"} if ips else {}))
    records.bar.update(1)


def _other_scalars(metrics) -> dict:
    """A strategy's further 0-d metrics (e.g. a gradient norm), for the records as they are."""
    return {k: float(v) for k, v in metrics.items()
            if k not in ("loss", "accuracy") and getattr(v, "ndim", None) == 0}
