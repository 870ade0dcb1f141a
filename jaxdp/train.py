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

from jaxdp.config import TrainConfig, TrainError, check_choice, check_config
from jaxdp.progress import Throughput, progress_bar, say


IMAGE_SHAPE = (32, 32, 3)  # CIFAR-10 and the synthetic set


# ----------------------------------------------------------------------------- set-up

def _setup(cfg: TrainConfig):
    """Everything but the state. Names, devices and the model's needs are checked before
    the dataset loads (CIFAR-10's md5 alone takes seconds), all of it before anything is
    written."""
    import jax

    from jaxdp.data import load_dataset
    from jaxdp.models import create_model, fsdp_units
    from jaxdp.optim import OPTIMIZERS, SCHEDULES, make_optimizer, make_schedule
    from jaxdp.strategies import STRATEGIES, create_strategy
    from jaxdp.strategies import options_of as options_of_strategy
    from jaxdp.task import classifier

    join_job(cfg)  # before anything asks jax for its devices
    if cfg.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    model = create_model(cfg.model, width=cfg.width, blocks=cfg.blocks, stem=cfg.stem, dtype=cfg.dtype)
    check_choice("strategy", cfg.strategy, STRATEGIES)
    check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    check_choice("schedule", cfg.schedule, SCHEDULES)
    options = strategy_options(cfg)
    mesh = _make_mesh(cfg.devices)
    n = mesh.size
    per_device = per_device_batch(cfg, n)
    _check_batchnorm_batch(model, cfg, n)
    train_set, test_set = load_dataset(cfg.dataset, cfg.data_dir, cfg.download, tuple(cfg.synthetic_size), cfg.seed)
    steps = epoch_length(len(train_set), n, per_device)
    schedule = make_schedule(cfg.schedule, cfg.lr, steps * cfg.epochs, **cfg.schedule_options(steps))
    tx = make_optimizer(cfg.optimizer, schedule, momentum=cfg.momentum, nesterov=cfg.nesterov,
                        weight_decay=cfg.weight_decay)
    if "units" in options_of_strategy(cfg.strategy):
        options["units"] = fsdp_units(model)  # the model family's FSDP units (jaxdp.models)
    strategy = create_strategy(cfg.strategy, model, classifier(model), tx, mesh, accum_steps=cfg.accum_steps,
                               sync_bn=cfg.sync_bn, seed=cfg.seed, **options)
    return strategy, schedule, train_set, test_set, per_device, steps


def _make_mesh(devices: Optional[int]):
    """``make_mesh``, saying so when ``--devices N`` could not simulate N CPU devices
    because XLA_FLAGS already fixed their count."""
    import jax

    from jaxdp.mesh import MeshError, make_mesh

    available = jax.devices()
    preset = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if f.startswith("--xla_force_host_platform_device_count=")]
    if devices and devices > len(available) and preset and available[0].platform == "cpu":
        raise MeshError(f"asked for {devices} devices but only {len(available)} are available: XLA_FLAGS "
                        f"sets {preset[-1]}, which --devices does not override; change or unset it")
    return make_mesh(devices)


def per_device_batch(cfg: TrainConfig, devices: int) -> int:
    if cfg.global_batch_size % (devices * cfg.accum_steps):
        raise TrainError(
            f"global batch {cfg.global_batch_size} is not divisible by devices x accumulation steps"
            f" = {devices} x {cfg.accum_steps}; pick a multiple of {devices * cfg.accum_steps}"
        )
    return cfg.global_batch_size // devices


def epoch_length(num_samples: int, devices: int, per_device: int) -> int:
    """Steps per epoch; a training set smaller than one global batch is an error."""
    from jaxdp.data.loader import steps_per_epoch

    try:
        return steps_per_epoch(num_samples, devices, per_device)
    except ValueError as e:
        raise TrainError(str(e)) from None  # names the sizes and what to lower


def _check_batchnorm_batch(model, cfg: TrainConfig, devices: int) -> None:
    """BatchNorm in training needs more than one value per channel, and it sees
    micro-batch x height x width values: only a micro-batch of one image can fall short
    (with the imagenet stem, the last stage is 1x1 on 32x32 images). Trace the model
    (shapes only, no compile) so that this is refused now, not at the first step."""
    import functools

    import jax

    from jaxdp.models import ModelError

    micro_batch = cfg.global_batch_size // (devices * cfg.accum_steps)
    if micro_batch > 1 or (cfg.sync_bn and devices > 1):  # SyncBN counts every device's images
        return
    try:
        jax.eval_shape(functools.partial(model.init, train=True), jax.random.key(0),
                       jax.ShapeDtypeStruct((micro_batch, *IMAGE_SHAPE), model.dtype))
    except ModelError as e:
        raise batchnorm_batch_error(cfg, devices, e) from None


def batchnorm_batch_error(cfg: TrainConfig, devices: int, reason) -> TrainError:
    """The one-line error for a micro-batch too small for BatchNorm (both trainers)."""
    where = "per device" + (" and micro-batch" if cfg.accum_steps > 1 else "")
    return TrainError(f"1 image {where} is too few for --stem {cfg.stem}: {reason}; pass "
                      f"--global-batch-size {2 * devices * cfg.accum_steps} or more")


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
    from jaxdp.strategies import REGISTRY, StrategyError, options_of

    if cfg.strategy not in REGISTRY:
        return {}  # create_strategy names the valid choices
    accepted = options_of(cfg.strategy)
    defaults = TrainConfig()
    options = {}
    for name in TrainConfig.STRATEGY_OPTIONS:
        value = getattr(cfg, name)
        if name == "powersgd_start_iter" and "powersgd_options" in accepted:
            options["powersgd_options"] = {"start_iter": value}  # PowerSGD's own name for it
        elif name in accepted:
            options[name] = value
        elif value != getattr(defaults, name):
            flag = "--" + name.replace("_", "-")
            raise StrategyError(f"{flag} does not apply to strategy {cfg.strategy!r}")
    return options


def example_batch(model, image_shape=IMAGE_SHAPE) -> dict:
    """A batch of shapes only, for ``Strategy.init``/``abstract_state`` (params do not depend on the values)."""
    return {"image": np.zeros((1, *image_shape), np.dtype(model.dtype)), "label": np.zeros((1,), np.int32)}


def init_variables(model, seed: int, image_shape=IMAGE_SHAPE):
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
        out = strategy.evaluate(state, strategy.shard_batch(
            {"image": _flat(batch.images), "label": _flat(batch.labels), "mask": _flat(batch.mask)}))
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
    (checkpoint, then return) so resume can be tested without killing processes.

    Ctrl-C (one process) finishes the step in flight, writes its records, checkpoints it
    and raises ``KeyboardInterrupt``; a second Ctrl-C raises ``TrainingAborted`` at once,
    without a checkpoint."""
    import jax

    from jaxdp.checkpoint import Checkpointer
    from jaxdp.data import Prefetcher, epoch_batches
    from jaxdp.mesh import barrier, process_ranks

    check_config(cfg)
    latest = latest_jaxdp_checkpoint(cfg.out)
    if cfg.resume and latest is None:
        raise TrainError(NOTHING_TO_RESUME.format(out=cfg.out))
    earlier_run = refuse_earlier_run(cfg, latest)
    strategy, schedule, train_set, test_set, per_device, steps_per_epoch = _setup(cfg)

    is_main = jax.process_index() == 0
    ranks = process_ranks(strategy.mesh, strategy.batch_axes)  # this process's rows of each batch
    if earlier_run and is_main:  # --overwrite, and the new run is valid: only now delete the old one
        remove_run_files(cfg.out)
    os.makedirs(cfg.out, exist_ok=True)
    example = example_batch(strategy.model)
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
        # Into shapes and shardings only: a ZeRO-3 restore builds no full (or even fresh) state.
        stored, meta, _ = ckpt.restore_latest(
            strategy.stored_target(strategy.abstract_state(example)),
            check_meta=lambda m: _check_fingerprint(m["fingerprint"], fingerprint, ckpt.directory))
        state = strategy.from_stored(stored)
        start_epoch, start_step, global_step = _resume_position(meta, data_position, steps_per_epoch, is_main)
        if start_epoch >= cfg.epochs or (start_epoch == cfg.epochs - 1 and start_step >= steps_per_epoch):
            raise TrainError(f"the run in {cfg.out} already finished its {cfg.epochs} epoch(s) (step "
                             f"{global_step}): nothing to resume")
        if is_main:
            epoch, done = (start_epoch + 1, 0) if start_step >= steps_per_epoch else (start_epoch, start_step)
            print(f"jaxdp: resuming from step {global_step} (epoch {epoch + 1}, sample "
                  f"{done * cfg.global_batch_size} of {len(train_set)})", file=sys.stderr, flush=True)
    elif cfg.resume:  # checkpoint folders, but none restorable
        raise TrainError(NOTHING_TO_RESUME.format(out=cfg.out))
    else:
        # Each device creates only its own shards (see Strategy.init).
        state = strategy.init(jax.random.key(cfg.seed), example)
    barrier("init")  # the processes finish compiling the init at different times (see mesh.barrier)
    if is_main and cfg.progress:
        print(startup_header(cfg, strategy, state, per_device), file=sys.stderr, flush=True)
    start_global_step = global_step
    if is_main:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            f.write(cfg.to_json())
    keep = global_step if cfg.resume else 0
    log = _Log(os.path.join(cfg.out, "metrics.jsonl"), is_main, keep)
    sample_log = _SampleLog(cfg.out, cfg.log_sample_ids, keep)
    position = (start_epoch, start_step)  # (epoch, steps of it done) of the state in hand
    saved = (global_step, position)  # what the newest checkpoint holds

    def save():
        nonlocal saved
        meta = {"epoch": position[0], "step_in_epoch": position[1], "global_step": global_step,
                "fingerprint": fingerprint, "data": data_position(*position),
                "rng": {"init_seed": cfg.seed, "augment": "stateless: keyed by (seed, epoch, sample id)"}}
        ckpt.save(global_step, strategy.stored(state), meta)
        saved = (global_step, position)

    def shard(batch):
        return strategy.shard_batch({"image": _flat(batch.images), "label": _flat(batch.labels)}), batch.indices

    summary = {"steps": 0, "eval": None, "interrupted": False, "process_index": jax.process_index()}
    # A job checkpoints only all together, and its processes may stand at different steps.
    interrupt = DeferredInterrupt("jaxdp", enabled=jax.process_count() == 1)
    records = None
    throughput = Throughput(cfg.global_batch_size)
    t_start = time.perf_counter()
    try:
        with interrupt:
            for epoch in range(start_epoch, cfg.epochs):
                first = start_step if epoch == start_epoch else 0
                batches = Prefetcher(
                    epoch_batches(train_set, num_replicas=strategy.num_devices, batch_per_replica=per_device,
                                  epoch=epoch, seed=cfg.seed, start_step=first, ranks=ranks),
                    transform=shard,
                )
                bar = progress_bar(steps_per_epoch, first, f"epoch {epoch + 1}/{cfg.epochs}", cfg.progress and is_main)
                throughput.restart()  # the first interval holds the compile, or the last evaluation
                records = _PendingRecords(log, bar, throughput)
                for step_in_epoch, (batch, ids) in enumerate(batches, start=first):
                    if global_step == start_global_step and jax.process_count() > 1:
                        strategy.lower_step(state, batch).compile()  # jit reuses it
                        barrier("step compiled")
                    state, metrics = strategy.step(state, batch)
                    # Bookkeeping at once, so that from here on the state in hand and its step number
                    # agree wherever an exception lands (the loop spends its time in records.write).
                    global_step += 1
                    position = (epoch, step_in_epoch + 1)
                    records.add(global_step, epoch, float(schedule(global_step - 1)), metrics)
                    sample_log.write(global_step, epoch, step_in_epoch, ranks, ids)
                    records.write(keep_newest=1)  # waits for the previous step; this one is queued
                    if on_step is not None:
                        on_step(global_step, state, metrics)
                    last = step_in_epoch + 1 == steps_per_epoch  # the epoch's own save follows its evaluation
                    if cfg.checkpoint_every and global_step % cfg.checkpoint_every == 0 and not last:
                        save()
                    stop_here = stop_after_steps is not None and global_step >= stop_after_steps
                    if stop_here or interrupt.requested:
                        records.write()
                        batches.close()
                        save()
                        if interrupt.requested:
                            raise interrupt.exception()
                        summary.update(interrupted=True, steps=global_step)
                        return summary
                records.write()
                bar.close()
                batches.close()
                barrier("evaluate")
                result = evaluate(strategy, state, test_set, per_device, ranks)
                log.write({"kind": "eval", "epoch": epoch + 1, "step": global_step, **result})
                if is_main:
                    say(f"epoch {epoch + 1}: eval loss {result['loss']:.4f} accuracy {result['accuracy']:.4f}")
                summary["eval"] = result
                position = (epoch + 1, 0)
                save()
                if interrupt.requested:
                    raise interrupt.exception()
    except KeyboardInterrupt as e:
        # Keep every completed step: the state in hand is consistent, unless a second Ctrl-C
        # aborted (perhaps inside a step). Not in a multi-process job: see ``interrupt``.
        if jax.process_count() == 1 and not isinstance(e, TrainingAborted):
            if saved != (global_step, position):
                if records is not None:
                    records.write()
                save()
            e.checkpointed_step = global_step
        summary["interrupted"] = True
        raise
    finally:
        log.close()
        sample_log.close()
        ckpt.close()
    summary.update(steps=global_step, seconds=time.perf_counter() - t_start, state=state)
    return summary


def startup_header(cfg: TrainConfig, strategy, state, per_device: int) -> str:
    """Versions, devices, mesh, batch, parameter count and the model state each device
    holds (measured: the bytes of device 0's shards of the state just built)."""
    from importlib.metadata import PackageNotFoundError, version

    import jax

    from jaxdp import __version__

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    devices = strategy.mesh.devices.flatten()
    first = devices[0]
    held = sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(state)
               for shard in getattr(leaf, "addressable_shards", ()) if shard.device == first)
    shapes = getattr(strategy, "shapes", None)  # the full params' shapes, once a state is built
    params = f"{sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)):,}" if shapes else "?"
    mesh = " x ".join(f"{name}={size}" for name, size in strategy.mesh.shape.items())
    return "\n".join([
        f"jaxdp {__version__} (jax {jax.__version__}, flax {installed('flax')}, optax {installed('optax')}, "
        f"torch {installed('torch')})",
        f"backend {jax.default_backend()}: {len(devices)} x {first.device_kind}, {jax.process_count()} "
        f"process(es); mesh {mesh}",
        f"{cfg.strategy} training {cfg.model} ({params} params, {cfg.dtype}): micro-batch "
        f"{per_device // cfg.accum_steps} x {cfg.accum_steps} accumulation step(s) per device x {len(devices)} "
        f"devices = global batch {cfg.global_batch_size}",
        f"model state per device: {held / 2**20:.2f} MiB (params, optimizer state, buffers)",
    ])


class _PendingRecords:
    """Train records whose metrics are still being computed: the loop writes a step's
    record once the next step is queued, so reading its loss never stalls the device."""

    def __init__(self, log, bar, throughput):
        self.log, self.bar, self.throughput = log, bar, throughput
        self.pending = []

    def add(self, step: int, epoch: int, lr: float, metrics) -> None:
        self.pending.append((step, epoch, lr, metrics))

    def write(self, keep_newest: int = 0) -> None:
        """Write the records, oldest first, but the newest ``keep_newest``. A record leaves
        the queue only once written, so an interruption here loses none of them."""
        while len(self.pending) > keep_newest:
            _report(self.pending[0], self.log, self.bar, self.throughput)
            self.pending.pop(0)


class TrainingAborted(KeyboardInterrupt):
    """A second Ctrl-C: stop at once, without a checkpoint."""


class Preempted(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, ``kill``): the step in hand was checkpointed."""


class DeferredInterrupt:
    """While active, Ctrl-C (SIGINT) and SIGTERM only set ``requested``; the loop checks it
    between steps, then checkpoints and raises ``exception()`` (``KeyboardInterrupt``, or
    ``Preempted`` for SIGTERM). Raised where the signal lands, the interrupt could split a
    step from its bookkeeping (or hit a step whose input buffers were already donated), and
    the checkpoint would not be the step it claims. A second Ctrl-C raises
    ``TrainingAborted`` at once.

    Only installed from the main thread over the default handlers: an ignored signal (a
    background job) or an application's own handler is left alone.
    """

    def __init__(self, prog: str, enabled: bool = True):
        import signal
        import threading

        self.prog = prog
        self.requested = False
        self.preempted = False
        main = enabled and threading.current_thread() is threading.main_thread()
        self._signals = [s for s, default in ((signal.SIGINT, signal.default_int_handler),
                                             (signal.SIGTERM, signal.SIG_DFL))
                         if main and signal.getsignal(s) is default]
        self._previous = {}

    def __enter__(self) -> "DeferredInterrupt":
        import signal

        for s in self._signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def exception(self) -> KeyboardInterrupt:
        return Preempted() if self.preempted else KeyboardInterrupt()

    def _on_signal(self, signum, frame) -> None:
        import signal

        if signum == signal.SIGTERM:
            self.requested = self.preempted = True
            print(f"\n{self.prog}: SIGTERM: finishing this step, then checkpointing it and exiting",
                  file=sys.stderr, flush=True)
            return
        if self.requested:
            raise TrainingAborted
        self.requested = True
        print(f"\n{self.prog}: Ctrl-C: finishing this step, then checkpointing it (Ctrl-C again to abort "
              "without a checkpoint)", file=sys.stderr, flush=True)


def interrupted_message(e: KeyboardInterrupt) -> str:
    """What the command line says after ``train`` raised ``e`` (both trainers)."""
    step = getattr(e, "checkpointed_step", None)
    what = "preempted (SIGTERM)" if isinstance(e, Preempted) else "interrupted"
    if step is not None:
        return f"{what}; step {step} was checkpointed: add --resume to continue"
    if isinstance(e, TrainingAborted):
        return "aborted without a checkpoint; --resume continues from the last one, if any"
    return "interrupted; --resume continues from the last checkpoint, if any"


# ----------------------------------------------------------------------------- the run directory

NOTHING_TO_RESUME = ("--resume: {out} holds no checkpoint to resume from (check --out, or drop --resume "
                     "to start a new run there)")
EARLIER_RUN = ("{out} already holds checkpoints of an earlier run (latest step {step}): pass --resume to "
               "continue it, --overwrite to start over, or another --out")


def refuse_earlier_run(cfg: TrainConfig, latest_step: Optional[int]) -> bool:
    """Whether ``cfg.out`` holds an earlier run that this fresh run may replace (--overwrite);
    without --resume or --overwrite, that is an error: a later --resume would restore it."""
    if cfg.resume or latest_step is None:
        return False
    if not cfg.overwrite:
        raise TrainError(EARLIER_RUN.format(out=cfg.out, step=latest_step))
    return True


def remove_run_files(out: str) -> None:
    """Delete what a run writes in ``out`` (checkpoints/, metrics, config, sample ids) and
    nothing else: ``out`` may hold the user's own files."""
    import shutil

    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    for name in os.listdir(out):
        if name in ("metrics.jsonl", "config.json") or _sample_log_process(name) is not None:
            os.remove(os.path.join(out, name))


def latest_jaxdp_checkpoint(out: str) -> Optional[int]:
    """The newest complete checkpoint's step in ``out``, read from the folder names (orbax
    names a complete save by its step; one in progress has a temporary suffix)."""
    directory = os.path.join(out, "checkpoints")
    if not os.path.isdir(directory):
        return None
    steps = [int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n))]
    return max(steps, default=None)


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


def _report(pending, log, bar, throughput):
    step, epoch, lr, metrics = pending
    loss = float(metrics["loss"])  # waits for that step only; the next is already queued
    ips = throughput.tick()  # None for a step whose time holds the compile
    log.write({"kind": "train", "epoch": epoch + 1, "step": step, "loss": loss,
               "accuracy": float(metrics["accuracy"]), "lr": lr, "images_per_sec": ips})
    bar.set_postfix(loss=f"{loss:.4f}", **({"img_s": f"{ips:,.0f}"} if ips else {}))
    bar.update(1)


def _check_fingerprint(saved: dict, current: dict, where: str) -> None:
    saved = {k: v for k, v in saved.items() if k != "steps_per_epoch"}  # older checkpoints: now in "data"
    saved = {**TrainConfig().fingerprint(), **saved}  # options added since it was written: their defaults
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        from jaxdp.checkpoint import CheckpointError

        raise CheckpointError(f"cannot resume from {where}: the config differs ({'; '.join(diffs)})")
