"""Train a ResNet with a PyTorch data-parallel strategy: the twin of ``jaxdp train``.

    torchrun --nproc_per_node 2 -m torch_ref.train --strategy zero3 --width 4 \\
        --blocks 1,1,1,1 --synthetic-size 256,64 --global-batch-size 32 --epochs 1 --out runs/t
    python -m torch_ref.train --strategy ddp ...        # without torchrun: one process
    python -m torch_ref.train --strategy dp ...         # nn.DataParallel over the local GPUs
    ... --backend gloo                                  # auto (default) | nccl | gloo

``--backend`` (``auto`` defers to ``JAXDP_TORCH_BACKEND`` when set; see ``torch_ref.dist``):
under nccl rank r computes on ``cuda:LOCAL_RANK`` (torchrun sets it), under gloo on the CPU.

Everything a run sees is shared with jaxdp: the options (``jaxdp.cli.command.add_train_args``
into ``jaxdp.config.tree.TrainConfig``), the numpy data pipeline (rank r loads only its rows,
``epoch_batches(..., ranks=[r])``; NHWC is transposed to NCHW here), the lr formula
(``jaxdp.optim.torch_lr_lambda`` in ``LambdaLR``), and the ``metrics.jsonl`` records.
``--devices`` is the world size, which torchrun sets; for ``dp`` it is the number of GPUs.
The step itself is ``torch_ref.step_api.Runner``'s, the same code the parity harness runs.

Checkpoints (``OUT/checkpoints/step_<N>.pt``: each epoch, and every ``--checkpoint-every``
steps) hold full, strategy-independent state plus the data position, so ``--resume``
continues mid-epoch exactly, under any strategy or world size that keeps the math
(``TrainConfig.fingerprint``). See ``torch_ref.checkpoint``.

The smoke run above (8 steps, 2 ranks) takes ~15 s on 2 CPU cores, nearly all of it
process start-up and imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from jaxdp.cli.command import add_train_args, config_from_args
from jaxdp.config.tree import (TrainConfig, TrainError, batchnorm_batch_error, check_choice, check_config, end_position,
                          epoch_length, per_device_batch, total_steps)
from jaxdp.data import DatasetError, Prefetcher, epoch_batches, eval_batches, load_dataset
from jaxdp.run.interrupts import DeferredInterrupt, exit_status, interrupted_message
from jaxdp.run.progress import Throughput, progress_bar, say
from jaxdp.run.rundir import MetricsLog, check_fingerprint, refuse_earlier_run, remove_run_files, write_config
from torch_ref import checkpoint as ckpt
from torch_ref import dist as tdist
from torch_ref.step_api import DTYPES, Runner, build, to_torch_batch
from jaxdp.names import OPTIMIZERS, SCHEDULES
from torch_ref.strategies import STRATEGIES, TWINS, StrategyError


# ----------------------------------------------------------------------------- set-up

def runner_config(cfg: TrainConfig, steps_per_epoch: int) -> dict:
    """The ``step_api`` config for a ``TrainConfig``."""
    defaults = TrainConfig()
    if cfg.allreduce != defaults.allreduce:
        raise TrainError(f"--allreduce {cfg.allreduce} has no torch counterpart: DDP all-reduces each "
                         "bucket with the backend's own algorithm (NCCL picks ring or tree)")
    if cfg.staleness != defaults.staleness:
        raise TrainError("--staleness (asynchronous parameter server) has no torch_ref strategy")
    out = dict(strategy=cfg.strategy, model=cfg.model, width=cfg.width, blocks=cfg.blocks,
               stem=cfg.stem, dtype=cfg.dtype, optimizer=cfg.optimizer, lr=cfg.lr,
               momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
               schedule=cfg.schedule, total_steps=total_steps(cfg, steps_per_epoch),
               **cfg.schedule_options(steps_per_epoch),
               accum_steps=cfg.accum_steps, sync_bn=cfg.sync_bn, seed=cfg.seed,
               bucket_cap_mb=cfg.bucket_cap_mb, compress=cfg.compress,
               powersgd_rank=cfg.powersgd_rank, powersgd_start_iter=cfg.powersgd_start_iter,
               mesh_shape=cfg.mesh_shape)
    if cfg.strategy in TWINS and "devices" in TWINS[cfg.strategy].options:  # nn.DataParallel's GPUs
        out["devices"] = cfg.devices
    return out


def data_layout(cfg: TrainConfig):
    """(replicas, this process's rows of each batch or None for all).

    One rank per replica, each loading only its own rows; ``dp`` is one process feeding
    every replica (GPU) of ``nn.DataParallel``."""
    world, rank = tdist.world_size(), tdist.rank()
    if cfg.strategy in TWINS and TWINS[cfg.strategy].one_process:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return (cfg.devices or max(gpus, 1)), None
    if cfg.devices is not None and cfg.devices != world:
        raise TrainError(f"--devices {cfg.devices} but {world} process(es): torch_ref runs one process "
                         f"per device; launch with torchrun --nproc_per_node {cfg.devices} -m torch_ref.train")
    return world, [rank]


def _setup(cfg: TrainConfig, speed: Optional[dict] = None):
    """As ``jaxdp.run.setup.build``: everything that can be refused is, before the dataset
    loads and before anything is written."""
    if cfg.dtype not in DTYPES:
        raise TrainError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    check_choice("strategy", cfg.strategy, STRATEGIES)
    check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    check_choice("schedule", cfg.schedule, SCHEDULES)
    replicas, rows = data_layout(cfg)
    per_device = per_device_batch(cfg, replicas)
    _check_model(cfg, replicas)
    train_set, test_set = load_dataset(cfg.dataset, cfg.data_dir, cfg.download, tuple(cfg.synthetic_size), cfg.seed)
    steps = epoch_length(len(train_set), replicas, per_device)
    runner = build({**runner_config(cfg, steps), **(speed or {})})  # torch init under manual_seed(seed)
    return runner, train_set, test_set, replicas, rows, per_device, steps


def _check_model(cfg: TrainConfig, replicas: int) -> None:
    """The model's options, and BatchNorm's need for more than one value per channel,
    checked on the meta device (shapes only). Only a micro-batch of one image can fall
    short (see ``jaxdp.run.setup._check_batchnorm_batch``); torch would raise at the first step."""
    from torch_ref.models import resnet

    with torch.device("meta"):
        try:
            model = resnet(cfg.model, width=cfg.width, blocks=cfg.blocks, stem=cfg.stem)
        except ValueError as e:  # unknown model or stem, bad width or blocks
            raise TrainError(str(e)) from None
        micro_batch = cfg.global_batch_size // (replicas * cfg.accum_steps)
        if micro_batch > 1 or (cfg.sync_bn and replicas > 1):
            return
        try:
            model.train()(torch.empty(micro_batch, 3, 32, 32))
        except ValueError as e:  # "Expected more than 1 value per channel when training, ..."
            raise batchnorm_batch_error(cfg, replicas, e) from None


def batch_to_torch(runner: Runner, images: np.ndarray, labels: np.ndarray):
    """(replicas or 1, b, H, W, C) numpy -> this process's NCHW batch.

    For dp with accumulation the rows are ordered so that micro-batch k holds each
    replica's k-th micro-batch: DataParallel then scatters replica g exactly its own rows,
    as a DDP rank would see them."""
    k = runner.config["accum_steps"]
    r, b = labels.shape
    if r > 1 and k > 1:
        images = images.reshape(r, k, b // k, *images.shape[2:]).swapaxes(0, 1)
        labels = labels.reshape(r, k, b // k).swapaxes(0, 1)
    images = images.reshape(-1, *images.shape[-3:])
    labels = labels.reshape(-1)
    return to_torch_batch(images, labels, runner.parallel.device, runner.dtype)


# ----------------------------------------------------------------------------- evaluation and logs

def evaluate(runner: Runner, test_set, replicas: int, rows, per_device: int) -> dict:
    """Loss and accuracy over every test sample exactly once (``eval_batches``' mask drops
    the padding), with rank 0's BN running stats on every rank, summed over ranks."""
    par = runner.parallel
    totals = torch.zeros(3, dtype=torch.float64)
    with par.evaluating() as model:
        for batch in eval_batches(test_set, num_replicas=replicas, batch_per_replica=per_device, ranks=rows):
            x, y = to_torch_batch(batch.images.reshape(-1, *batch.images.shape[2:]),
                                  batch.labels.reshape(-1), par.device, runner.dtype)
            mask = torch.from_numpy(batch.mask.reshape(-1)).to(par.device, torch.float64)
            logits = model(x)
            losses = F.cross_entropy(logits.float(), y, reduction="none").double()
            correct = (logits.argmax(-1) == y).double()
            totals += torch.stack([(losses * mask).sum(), (correct * mask).sum(), mask.sum()]).cpu()
    totals = tdist.all_reduce_sum(totals.tolist(), par.device)
    return {"loss": float(totals[0] / totals[2]), "accuracy": float(totals[1] / totals[2]),
            "count": int(totals[2])}


# ----------------------------------------------------------------------------- the loop

def train(cfg: TrainConfig, *, stop_after_steps: Optional[int] = None, speed: Optional[dict] = None) -> dict:
    """Train ``cfg`` in the current process group (world 1 if none is initialised);
    returns a summary. ``stop_after_steps`` simulates an interruption: checkpoint, return.
    ``speed``: ``step_api``'s speed settings (``{"compile": "inductor"}``, ``{"tuned": True}``).
    Ctrl-C and SIGTERM in a world of one: as ``jaxdp.run.train.train`` (see ``jaxdp.run.interrupts``)."""

    tdist.init()
    check_config(cfg)
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    earlier = ckpt.checkpoints(ckpt_dir)
    earlier_run = refuse_earlier_run(cfg, earlier[-1][0] if earlier else None)
    # Under torchrun the ranks stop at different points, and a gathering save could wait forever.
    interrupt = DeferredInterrupt("torch_ref") if tdist.world_size() == 1 else _NoInterrupts()
    with interrupt:
        runner, train_set, test_set, replicas, rows, per_device, steps_per_epoch = _setup(cfg, speed)
        is_main = tdist.rank() == 0
        if earlier_run and is_main:  # --overwrite, and the new run is valid: only now delete the old one
            remove_run_files(cfg.out)
        os.makedirs(cfg.out, exist_ok=True)
        fingerprint = dict(json.loads(json.dumps(cfg.fingerprint())), steps_per_epoch=steps_per_epoch)

        start_epoch, start_step = 0, 0
        restored = None
        if cfg.resume:
            restored = ckpt.restore_newest(
                ckpt_dir, runner.parallel, runner.optimizer, runner.scheduler,
                check=lambda m, path: check_fingerprint(m.get("fingerprint", {}), fingerprint, path),
                say=lambda text: print(f"torch_ref: {text}", file=sys.stderr, flush=True) if is_main else None)
        if restored is not None:
            meta = restored[1]
            start_epoch, start_step = meta["epoch"], meta["step_in_epoch"]
            runner.steps = meta["global_step"]
        global_step = start_epoch * steps_per_epoch + start_step
        if is_main:
            write_config(cfg.out, dataclasses.replace(cfg, devices=replicas))
        log = MetricsLog(cfg.out, is_main, global_step if cfg.resume else 0, tensorboard=cfg.tensorboard)
        position = (start_epoch, start_step)  # (epoch, steps of it done) of the state in hand
        saved = (global_step, position)  # what the newest checkpoint holds
        unlogged = None  # (epoch, loss, correct, lr) of a step whose record is not written yet
        throughput = Throughput(cfg.global_batch_size)
        end_epoch, end_step = end_position(cfg, steps_per_epoch)

        def save():
            nonlocal saved
            meta = {"epoch": position[0], "step_in_epoch": position[1], "global_step": global_step,
                    "fingerprint": fingerprint}
            ckpt.save(ckpt_dir, global_step, runner.parallel, runner.optimizer, runner.scheduler, meta, keep=cfg.keep)
            saved = (global_step, position)

        def write_record(bar):
            """The record of the step in hand (a collective: the loss is averaged over ranks)."""
            nonlocal unlogged
            epoch, loss, correct, lr = unlogged
            loss_sum, correct_sum = tdist.all_reduce_sum([float(loss), float(correct)], runner.parallel.device)
            ips = throughput.tick()
            record = log.train(global_step, epoch, float(loss_sum) / tdist.world_size(),
                               float(correct_sum) / cfg.global_batch_size, lr, ips)
            unlogged = None
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}", **({"img_s": f"{ips:,.0f}"} if ips else {}))
                bar.update(1)

        def evaluate_now(epoch):
            result = evaluate(runner, test_set, replicas, rows, per_device)
            log.eval(global_step, epoch, result)
            if is_main:
                say(f"step {global_step} (epoch {epoch + 1}): eval loss {result['loss']:.4f} "
                    f"accuracy {result['accuracy']:.4f}")
            summary["eval"] = result

        def stop_if_asked():
            if interrupt.requested:
                e = interrupt.exception()
                e.checkpointed_step = global_step if saved[0] == global_step else None
                raise e

        summary = {"steps": 0, "eval": None, "interrupted": False}
        t_start = time.perf_counter()
        try:
            stop_if_asked()  # a Ctrl-C while the model was built: nothing trained yet
            for epoch in range(start_epoch, end_epoch + 1):
                last = end_step if epoch == end_epoch else steps_per_epoch
                first = start_step if epoch == start_epoch else 0
                batches = Prefetcher(
                    epoch_batches(train_set, num_replicas=replicas, batch_per_replica=per_device,
                                  epoch=epoch, seed=cfg.seed, start_step=first, ranks=rows),
                    transform=lambda b: batch_to_torch(runner, b.images, b.labels))
                bar = progress_bar(steps_per_epoch, first, f"epoch {epoch + 1}/{end_epoch + 1}",
                                   cfg.progress and is_main)
                throughput.restart()  # the first interval holds the warm-up, or the last evaluation
                for step_in_epoch, (x, y) in enumerate(batches, start=first):
                    loss, correct, lr = runner.forward_backward(x, y)
                    runner.update()
                    global_step += 1  # at once: the state in hand is this step's (see jaxdp.run.train)
                    position = (epoch, step_in_epoch + 1)
                    unlogged = (epoch, loss, correct, lr)
                    write_record(bar)
                    epoch_done = step_in_epoch + 1 == last  # the epoch's own evaluation and save follow
                    if cfg.eval_every and global_step % cfg.eval_every == 0 and not epoch_done:
                        evaluate_now(epoch)
                        throughput.restart()
                    if cfg.checkpoint_every and global_step % cfg.checkpoint_every == 0 and not epoch_done:
                        save()
                    stop_here = stop_after_steps is not None and global_step >= stop_after_steps
                    # At the epoch's last step its evaluation and save come first, then the stop below
                    # (as jaxdp.run.train): a stop must not cost the epoch its evaluation.
                    if stop_here or (interrupt.requested and not epoch_done):
                        bar.close()
                        batches.close()
                        save()
                        stop_if_asked()
                        summary.update(interrupted=True, steps=global_step)
                        return summary
                    if epoch_done:
                        break
                bar.close()
                batches.close()
                evaluate_now(epoch)
                position = (epoch + 1, 0) if last == steps_per_epoch else (epoch, last)
                save()
                if epoch < end_epoch:  # a stop asked for during the run's last step: the run is done, not stopped
                    stop_if_asked()
        except KeyboardInterrupt as e:
            # One process: the state in hand is consistent, keep it.
            if tdist.world_size() == 1 and getattr(e, "checkpointed_step", None) is None:
                if unlogged is not None:
                    write_record(None)
                if saved != (global_step, position):
                    save()
                e.checkpointed_step = global_step
            summary["interrupted"] = True
            raise
        finally:
            log.close()
    summary.update(steps=global_step, seconds=time.perf_counter() - t_start, runner=runner)
    return summary


class _NoInterrupts:
    """Several ranks: signals keep their default actions (torchrun stops the job)."""

    requested = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


# ----------------------------------------------------------------------------- command line

def add_backend_arg(parser: argparse.ArgumentParser) -> None:
    """``--backend``: torch_ref's process-group backend (the parity CLI has the same)."""
    parser.add_argument(
        "--backend", choices=tdist.BACKENDS, default="auto",
        help=f"torch process-group backend. auto (default): ${tdist.BACKEND_ENV} if set, else nccl when "
             "CUDA has a GPU for every rank on this host, else gloo. nccl: rank r on cuda:LOCAL_RANK "
             "(an error without enough GPUs). gloo: CPU tensors, also on a GPU host")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch_ref.train", description=__doc__.splitlines()[0],
        epilog="Launch N ranks with: torchrun --nproc_per_node N -m torch_ref.train ...")
    add_train_args(parser)
    add_backend_arg(parser)
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="torch.compile the wrapped model with this backend (inductor; default: eager)")
    parser.add_argument("--tuned", action="store_true",
                        help="on CUDA: channels_last model and inputs, cudnn.benchmark (fastest, not deterministic)")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> TrainConfig:
    return config_from_args(build_parser().parse_args(argv))


def _user_errors():
    return (TrainError, StrategyError, ckpt.CheckpointError, DatasetError, tdist.BackendError)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    is_main = True
    try:
        tdist.init(backend=args.backend)
        is_main = tdist.rank() == 0
        summary = train(cfg, speed={"compile": args.compile, "tuned": args.tuned})
    except _user_errors() as e:
        if is_main:
            print(f"torch_ref: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if is_main:
            print(f"torch_ref: {interrupted_message(e)}", file=sys.stderr)
        return exit_status(e)
    finally:
        tdist.shutdown()
    if is_main:
        ev = summary.get("eval") or {}
        print(f"done: {summary['steps']} steps in {summary.get('seconds', 0):.1f}s; "
              f"eval accuracy {ev.get('accuracy', float('nan')):.4f}; run in {cfg.out}")
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: freeing the DDP/FSDP objects at exit would
    # destroy ProcessGroupGloo while holding the GIL, and its destructor joins gloo worker
    # threads that may need the GIL to release their last tensors (a rare deadlock at exit,
    # torch 2.13; see torch_ref/launcher.py). Every file is closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
