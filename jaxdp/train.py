"""The training loop: data -> strategy.step -> metrics, eval and checkpoints.

It knows nothing about which strategy runs; it only asks the strategy to place
the state and batches, step, evaluate, and convert to the checkpoint layout for
checkpoints.

Multi-process (``jaxdp launch``, ``srun``): every process runs this same loop.
Each loads only its own rows of every batch (its devices' ranks) and
``make_array_from_process_local_data`` stitches them into the global batch;
process 0 alone writes metrics, config and progress; all of them take part in
each checkpoint save.

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

import json
import os
import sys
import time
from typing import Callable, Optional

import numpy as np

from jaxdp.config import TrainConfig


class TrainError(ValueError):
    """A configuration that cannot be trained, caught before any work is done."""


# ----------------------------------------------------------------------------- set-up

def _setup(cfg: TrainConfig):
    import jax

    from jaxdp.data import load_dataset
    from jaxdp.data.loader import steps_per_epoch
    from jaxdp.mesh import make_mesh
    from jaxdp.models import create_model
    from jaxdp.optim import make_optimizer, make_schedule
    from jaxdp.strategies import create_strategy

    join_job(cfg)  # before anything asks jax for its devices
    if cfg.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    model = create_model(cfg.model, width=cfg.width, blocks=cfg.blocks, stem=cfg.stem, dtype=cfg.dtype)
    mesh = make_mesh(cfg.devices)
    n = mesh.size
    if cfg.global_batch_size % (n * cfg.accum_steps):
        raise TrainError(
            f"global batch {cfg.global_batch_size} is not divisible by devices x accumulation steps"
            f" = {n} x {cfg.accum_steps}; pick a multiple of {n * cfg.accum_steps}"
        )
    train_set, test_set = load_dataset(cfg.dataset, cfg.data_dir, cfg.download, tuple(cfg.synthetic_size), cfg.seed)
    per_device = cfg.global_batch_size // n
    steps = steps_per_epoch(len(train_set), n, per_device)
    schedule = make_schedule(cfg.schedule, cfg.lr, steps * cfg.epochs, warmup_steps=cfg.warmup_steps)
    tx = make_optimizer(cfg.optimizer, schedule, momentum=cfg.momentum, nesterov=cfg.nesterov,
                        weight_decay=cfg.weight_decay)
    strategy = create_strategy(cfg.strategy, model, tx, mesh, accum_steps=cfg.accum_steps,
                               sync_bn=cfg.sync_bn, **strategy_options(cfg))
    return strategy, schedule, train_set, test_set, per_device, steps


def join_job(cfg: TrainConfig) -> None:
    """Join the multi-process job this process was started in, if any (``jaxdp launch`` or
    SLURM's variables, see ``jaxdp.mesh.distributed_env``)."""
    import jax

    from jaxdp.mesh import distributed_env, initialize_distributed

    env = distributed_env()
    if env is None or jax.distributed.is_initialized():
        return
    initialize_distributed(env.coordinator, env.num_processes, env.process_id,
                           timeout_s=cfg.init_timeout, heartbeat_timeout_s=cfg.heartbeat_timeout)


def strategy_options(cfg: TrainConfig) -> dict:
    """The options ``cfg.strategy`` takes; a changed option it does not take is an error."""
    import inspect

    from jaxdp.strategies import REGISTRY, StrategyError

    if cfg.strategy not in REGISTRY:
        return {}  # create_strategy names the valid choices
    accepted = inspect.signature(REGISTRY[cfg.strategy].__init__).parameters
    defaults = TrainConfig()
    options = {}
    for name in TrainConfig.STRATEGY_OPTIONS:
        value = getattr(cfg, name)
        if name in accepted:
            options[name] = value
        elif value != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            raise StrategyError(f"{flag} does not apply to strategy {cfg.strategy!r}")
    return options


def init_variables(model, seed: int, image_shape=(32, 32, 3)):
    """Initial params and BN buffers (torch's init distributions, see models.resnet).

    Compiled once per (model, image shape) and process: the init's ~20 normal samplers
    take XLA's CPU compiler tens of seconds, so a second run in the same process (a
    resume, a test) reuses it.
    """
    import jax

    return _compiled_init()(model, tuple(image_shape), jax.random.key(seed))


_INIT = None


def _compiled_init():
    global _INIT
    if _INIT is None:
        import jax
        import jax.numpy as jnp

        def init(model, image_shape, key):
            return model.init(key, jnp.zeros((1, *image_shape), model.dtype), train=False)

        _INIT = jax.jit(init, static_argnums=(0, 1))
    return _INIT


# ----------------------------------------------------------------------------- the loop

class _Log:
    """Metrics as JSON lines, written by process 0 only."""

    def __init__(self, path: str, enabled: bool, keep_through_step: int):
        """Keep the records up to ``keep_through_step`` (0 for a fresh run) and append after them.

        On resume this drops what the checkpoint does not cover, so the file reads like one run.
        """
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


class _SampleLog:
    """Opt-in (``--log-sample-ids``): each step's dataset ids, as this process fed them.

    Every process writes its own ``sample_ids.p<process>.jsonl``: one record per step,
    ``{"step", "epoch", "step_in_epoch", "ranks", "ids"}`` with ``ids[i]`` the ids of
    rank ``ranks[i]``. On resume each file keeps the records the checkpoint covers
    (like metrics.jsonl), so the files read like one uninterrupted run: the union of
    an epoch's ids is what the model was trained on.
    """

    def __init__(self, out: str, enabled: bool, keep_through_step: int):
        import jax

        self._file = None
        if not enabled:
            return
        index, count = jax.process_index(), jax.process_count()
        if index == 0:  # files of processes this run does not have: from a larger run
            for name in os.listdir(out):
                p = _sample_log_process(name)
                if p is not None and p >= count:
                    _Log(os.path.join(out, name), True, keep_through_step).close()
        self._file = _Log(sample_log_path(out, index), True, keep_through_step)

    def write(self, step: int, epoch: int, step_in_epoch: int, ranks, ids: np.ndarray) -> None:
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


def evaluate(strategy, state, test_set, per_device: int, ranks=None) -> dict:
    """Loss and accuracy over the whole test set; ``ranks``: the rows this process feeds."""
    from jaxdp.data.loader import eval_batches

    totals = np.zeros(3)
    for batch in eval_batches(test_set, num_replicas=strategy.num_devices, batch_per_replica=per_device,
                              ranks=ranks):
        images, labels, mask = strategy.shard_batch(
            _flat(batch.images), _flat(batch.labels), _flat(batch.mask)
        )
        out = strategy.evaluate(state, images, labels, mask)
        totals += [float(out["loss_sum"]), float(out["correct"]), float(out["count"])]
    return {"loss": totals[0] / totals[2], "accuracy": totals[1] / totals[2], "count": int(totals[2])}


def _flat(a: np.ndarray) -> np.ndarray:
    """(replicas, b, ...) -> (replicas * b, ...): device r gets rows [r*b, (r+1)*b)."""
    return a.reshape(-1, *a.shape[2:])


def permutation_digest(n: int, seed: int, epoch: int) -> str:
    """Short sha256 of an epoch's sample order: a resumed run must see the same one."""
    import hashlib

    from jaxdp.data.sampler import epoch_permutation

    perm = np.ascontiguousarray(epoch_permutation(n, seed, epoch), dtype=np.int64)
    return hashlib.sha256(perm.tobytes()).hexdigest()[:16]


def train(cfg: TrainConfig, *, stop_after_steps: Optional[int] = None,
          on_step: Optional[Callable] = None) -> dict:
    """Train ``cfg``; returns a summary. ``stop_after_steps`` simulates an interruption
    (checkpoint, then return) so resume can be tested without killing processes."""
    import jax
    from tqdm.auto import tqdm

    from jaxdp.checkpoint import Checkpointer
    from jaxdp.data import Prefetcher, epoch_batches
    from jaxdp.mesh import barrier, process_ranks

    strategy, schedule, train_set, test_set, per_device, steps_per_epoch = _setup(cfg)

    is_main = jax.process_index() == 0
    ranks = process_ranks(strategy.mesh, strategy.batch_axes)  # this process's rows of each batch
    os.makedirs(cfg.out, exist_ok=True)
    variables = init_variables(strategy.model, cfg.seed)
    barrier("init")  # the processes finish compiling the init at different times (see mesh.barrier)
    state = strategy.init_state(variables)
    ckpt = Checkpointer(os.path.join(cfg.out, "checkpoints"))
    fingerprint = cfg.fingerprint()

    def data_position(epoch, step_in_epoch):
        """Where the sampler stands: enough to continue on any device count (module docstring)."""
        return {"epoch": epoch, "step_in_epoch": step_in_epoch,
                "samples_consumed": step_in_epoch * cfg.global_batch_size,
                "global_batch": cfg.global_batch_size, "num_samples": len(train_set),
                "num_replicas": strategy.num_devices, "batch_per_replica": per_device,
                "steps_per_epoch": steps_per_epoch, "processes": jax.process_count(),
                "seed": cfg.seed, "permutation_sha256": permutation_digest(len(train_set), cfg.seed, epoch)}

    start_epoch, start_step, global_step = 0, 0, 0
    if cfg.resume and ckpt.latest_step() is not None:
        stored, meta, _ = ckpt.restore_latest(
            strategy.stored_target(state),
            check_meta=lambda m: _check_fingerprint(m["fingerprint"], fingerprint, ckpt.directory))
        state = strategy.from_stored(stored)
        start_epoch, start_step, global_step = _resume_position(meta, data_position, steps_per_epoch, is_main)
    start_global_step = global_step
    if is_main:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            f.write(cfg.to_json())
    keep = global_step if cfg.resume else 0
    log = _Log(os.path.join(cfg.out, "metrics.jsonl"), is_main, keep)
    sample_log = _SampleLog(cfg.out, cfg.log_sample_ids, keep)
    position = (start_epoch, start_step)  # (epoch, steps of it done) of the state in hand

    def save():
        meta = {"epoch": position[0], "step_in_epoch": position[1], "global_step": global_step,
                "fingerprint": fingerprint, "data": data_position(*position),
                "rng": {"init_seed": cfg.seed, "augment": "stateless: keyed by (seed, epoch, sample id)"}}
        ckpt.save(global_step, strategy.stored(state), meta)

    def shard(batch):
        return (*strategy.shard_batch(_flat(batch.images), _flat(batch.labels)), batch.indices)

    summary = {"steps": 0, "eval": None, "interrupted": False, "process_index": jax.process_index()}
    t_start = time.perf_counter()
    try:
        for epoch in range(start_epoch, cfg.epochs):
            first = start_step if epoch == start_epoch else 0
            batches = Prefetcher(
                epoch_batches(train_set, num_replicas=strategy.num_devices, batch_per_replica=per_device,
                              epoch=epoch, seed=cfg.seed, start_step=first, ranks=ranks),
                transform=shard,
            )
            bar = tqdm(total=steps_per_epoch, initial=first, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       disable=not (cfg.progress and is_main), unit="step", dynamic_ncols=True)
            pending = None  # metrics of the previous step: read them while the next one runs
            t_last = time.perf_counter()
            for step_in_epoch, (images, labels, ids) in enumerate(batches, start=first):
                if global_step == start_global_step and jax.process_count() > 1:
                    strategy.lower_step(state, images, labels).compile()  # jit reuses it
                    barrier("step compiled")
                state, metrics = strategy.step(state, images, labels)
                if pending is not None:
                    t_last = _report(pending, log, bar, cfg.global_batch_size, t_last)
                global_step += 1
                position = (epoch, step_in_epoch + 1)
                sample_log.write(global_step, epoch, step_in_epoch, ranks, ids)
                pending = (global_step, epoch, float(schedule(global_step - 1)), metrics)
                if on_step is not None:
                    on_step(global_step, state, metrics)
                last = step_in_epoch + 1 == steps_per_epoch  # the epoch's own save follows its evaluation
                if cfg.checkpoint_every and global_step % cfg.checkpoint_every == 0 and not last:
                    save()
                if stop_after_steps is not None and global_step >= stop_after_steps:
                    _report(pending, log, bar, cfg.global_batch_size, t_last)
                    batches.close()
                    save()
                    summary.update(interrupted=True, steps=global_step)
                    return summary
            if pending is not None:
                _report(pending, log, bar, cfg.global_batch_size, t_last)
            bar.close()
            batches.close()
            barrier("evaluate")
            result = evaluate(strategy, state, test_set, per_device, ranks)
            log.write({"kind": "eval", "epoch": epoch + 1, "step": global_step, **result})
            if is_main:
                tqdm.write(f"epoch {epoch + 1}: eval loss {result['loss']:.4f} accuracy {result['accuracy']:.4f}")
            summary["eval"] = result
            position = (epoch + 1, 0)
            save()
    except KeyboardInterrupt:
        # Keep every completed step: the state in hand is consistent. Not in a multi-process
        # job: the processes may stand at different steps, and a save needs all of them at one.
        if jax.process_count() == 1:
            save()
        summary["interrupted"] = True
        raise
    finally:
        log.close()
        sample_log.close()
        ckpt.close()
    summary.update(steps=global_step, seconds=time.perf_counter() - t_start, state=state)
    return summary


def _resume_position(meta: dict, data_position, steps_per_epoch: int, is_main: bool):
    """(epoch, step in epoch, global step) to continue from, on this run's device count."""
    import warnings

    from jaxdp.checkpoint import CheckpointError

    epoch, step = meta["epoch"], meta["step_in_epoch"]
    global_step = meta.get("global_step", epoch * steps_per_epoch + step)
    saved = meta.get("data")
    if saved is None:  # written before the data position was recorded
        return epoch, min(step, steps_per_epoch), global_step
    now = data_position(epoch, step)
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
    return epoch, min(step, steps_per_epoch), global_step


def _report(pending, log, bar, global_batch, t_last):
    step, epoch, lr, metrics = pending
    loss = float(metrics["loss"])  # waits for that step only; the next is already queued
    now = time.perf_counter()
    ips = global_batch / max(now - t_last, 1e-9)
    log.write({"kind": "train", "epoch": epoch + 1, "step": step, "loss": loss,
               "accuracy": float(metrics["accuracy"]), "lr": lr, "images_per_sec": ips})
    bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{ips:,.0f}")
    bar.update(1)
    return now


def _check_fingerprint(saved: dict, current: dict, where: str) -> None:
    saved = {k: v for k, v in saved.items() if k != "steps_per_epoch"}  # older checkpoints: now in "data"
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        from jaxdp.checkpoint import CheckpointError

        raise CheckpointError(f"cannot resume from {where}: the config differs ({'; '.join(diffs)})")
