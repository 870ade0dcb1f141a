"""The training loop: data -> strategy.step -> metrics, eval and checkpoints.

It knows nothing about which strategy runs; it only asks the strategy to place
the state and batches, step, evaluate, and convert to the canonical layout for
checkpoints.
"""

import json
import os
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
    """Initial params and BN buffers (torch's init distributions, see models.resnet)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda key: model.init(key, jnp.zeros((1, *image_shape), model.dtype), train=False))(
        jax.random.key(seed)
    )


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


def evaluate(strategy, state, test_set, per_device: int) -> dict:
    from jaxdp.data.loader import eval_batches

    totals = np.zeros(3)
    for batch in eval_batches(test_set, num_replicas=strategy.num_devices, batch_per_replica=per_device):
        images, labels, mask = strategy.shard_batch(
            _flat(batch.images), _flat(batch.labels), _flat(batch.mask)
        )
        out = strategy.evaluate(state, images, labels, mask)
        totals += [float(out["loss_sum"]), float(out["correct"]), float(out["count"])]
    return {"loss": totals[0] / totals[2], "accuracy": totals[1] / totals[2], "count": int(totals[2])}


def _flat(a: np.ndarray) -> np.ndarray:
    """(replicas, b, ...) -> (replicas * b, ...): device r gets rows [r*b, (r+1)*b)."""
    return a.reshape(-1, *a.shape[2:])


def train(cfg: TrainConfig, *, stop_after_steps: Optional[int] = None,
          on_step: Optional[Callable] = None) -> dict:
    """Train ``cfg``; returns a summary. ``stop_after_steps`` simulates an interruption
    (checkpoint, then return) so resume can be tested without killing processes."""
    import jax
    from tqdm.auto import tqdm

    from jaxdp.checkpoint import Checkpointer, CheckpointError
    from jaxdp.data import Prefetcher, epoch_batches

    strategy, schedule, train_set, test_set, per_device, steps_per_epoch = _setup(cfg)

    is_main = jax.process_index() == 0
    os.makedirs(cfg.out, exist_ok=True)
    variables = init_variables(strategy.model, cfg.seed)
    state = strategy.init_state(variables)
    ckpt = Checkpointer(os.path.join(cfg.out, "checkpoints"))
    fingerprint = dict(cfg.fingerprint(), steps_per_epoch=steps_per_epoch)

    start_epoch, start_step = 0, 0
    if cfg.resume and ckpt.latest_step() is not None:
        step, meta = ckpt.read_meta()
        _check_fingerprint(meta["fingerprint"], fingerprint, ckpt.directory)
        canonical, meta = ckpt.restore(strategy.canonical(state), step)
        state = strategy.from_canonical(canonical)
        start_epoch, start_step = meta["epoch"], meta["step_in_epoch"]
    global_step = start_epoch * steps_per_epoch + start_step
    if is_main:
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            f.write(cfg.to_json())
    log = _Log(os.path.join(cfg.out, "metrics.jsonl"), is_main, global_step if cfg.resume else 0)

    def save(epoch, step_in_epoch):
        meta = {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step,
                "fingerprint": fingerprint}
        ckpt.save(global_step, strategy.canonical(state), meta)

    def shard(batch):
        return strategy.shard_batch(_flat(batch.images), _flat(batch.labels))

    summary = {"steps": 0, "eval": None, "interrupted": False}
    t_start = time.perf_counter()
    try:
        for epoch in range(start_epoch, cfg.epochs):
            first = start_step if epoch == start_epoch else 0
            batches = Prefetcher(
                epoch_batches(train_set, num_replicas=strategy.num_devices, batch_per_replica=per_device,
                              epoch=epoch, seed=cfg.seed, start_step=first),
                transform=shard,
            )
            bar = tqdm(total=steps_per_epoch, initial=first, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       disable=not (cfg.progress and is_main), unit="step", dynamic_ncols=True)
            pending = None  # metrics of the previous step: read them while the next one runs
            t_last = time.perf_counter()
            for step_in_epoch, (images, labels) in enumerate(batches, start=first):
                state, metrics = strategy.step(state, images, labels)
                if pending is not None:
                    t_last = _report(pending, log, bar, cfg.global_batch_size, t_last)
                global_step += 1
                pending = (global_step, epoch, float(schedule(global_step - 1)), metrics)
                if on_step is not None:
                    on_step(global_step, state, metrics)
                if cfg.checkpoint_every and global_step % cfg.checkpoint_every == 0:
                    save(epoch, step_in_epoch + 1)
                if stop_after_steps is not None and global_step >= stop_after_steps:
                    _report(pending, log, bar, cfg.global_batch_size, t_last)
                    batches.close()
                    save(epoch, step_in_epoch + 1)
                    summary.update(interrupted=True, steps=global_step)
                    return summary
            if pending is not None:
                _report(pending, log, bar, cfg.global_batch_size, t_last)
            bar.close()
            batches.close()
            result = evaluate(strategy, state, test_set, per_device)
            log.write({"kind": "eval", "epoch": epoch + 1, "step": global_step, **result})
            if is_main:
                tqdm.write(f"epoch {epoch + 1}: eval loss {result['loss']:.4f} accuracy {result['accuracy']:.4f}")
            summary["eval"] = result
            save(epoch + 1, 0)
    except KeyboardInterrupt:
        # Keep every completed step: the state in hand is consistent.
        save(*_position(global_step, steps_per_epoch))
        summary["interrupted"] = True
        raise
    finally:
        log.close()
        ckpt.close()
    summary.update(steps=global_step, seconds=time.perf_counter() - t_start, state=state)
    return summary


def _position(global_step: int, steps_per_epoch: int):
    return divmod(global_step, steps_per_epoch)


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
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        from jaxdp.checkpoint import CheckpointError

        raise CheckpointError(f"cannot resume from {where}: the config differs ({'; '.join(diffs)})")
