"""The training run's configuration: one flat dataclass shared by the CLI and the trainer."""

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional, Tuple

from jaxdp.step_config import StrategyOptions


class TrainError(ValueError):
    """A configuration that cannot be trained, caught before any work is done (both trainers)."""


@dataclass
class TrainConfig(StrategyOptions):
    """Every option of a training run. The strategy and its options (``strategy``,
    ``accum_steps``, ``sync_bn``, ``bucket_cap_mb``, ...) are ``StrategyOptions``, the names
    and defaults jaxdp parity and torch_ref's step config share."""

    # what to train
    model: str = "resnet18"
    width: int = 64
    blocks: Optional[Tuple[int, int, int, int]] = None
    stem: str = "cifar"
    dtype: str = "float32"
    # data
    dataset: str = "synthetic"
    data_dir: Optional[str] = None
    download: bool = False
    synthetic_size: Tuple[int, int] = (10000, 2000)
    data_on_device: str = "auto"  # keep the training set on the devices: auto (if it fits), on, off
    data_workers: Optional[int] = None  # host pipeline processes (default: 0 on CPU, else half the cores, <= 8)
    # how to train it (and the strategy with its options: StrategyOptions)
    devices: Optional[int] = None  # default: every device; on CPU, N simulated devices
    mesh: Optional[str] = None  # named axis sizes, e.g. "data=2,model=2"; their product is the device count
    microbatches: Optional[int] = None  # pipeline micro-batches (a stage axis in mesh; default: the stage count)
    global_batch_size: int = 128
    # optimisation
    epochs: int = 1
    max_steps: Optional[int] = None  # updates in all; overrides epochs (the schedule spans them)
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    milestones: Optional[Tuple[int, ...]] = None  # multistep: epochs at whose start lr *= gamma
    gamma: float = 0.1
    seed: int = 0
    # bookkeeping
    out: str = "runs/default"
    resume: bool = False
    overwrite: bool = False  # a fresh run may delete an earlier run's checkpoints and metrics in out
    checkpoint_every: int = 0  # steps; 0 = once per epoch
    keep: int = 3  # newest checkpoints kept
    eval_every: int = 0  # steps; 0 = at the end of each epoch only (it always evaluates there)
    progress: bool = True
    log_sample_ids: bool = False  # write each step's dataset ids to sample_ids.p<process>.jsonl
    tensorboard: bool = True  # scalars in OUT/tensorboard beside metrics.jsonl (needs tensorboardX)
    # performance
    profile_steps: Optional[Tuple[int, int]] = None  # (A, B): a jax.profiler trace of steps A..B-1
    peak_flops: Optional[float] = None  # per device, FLOP/s, for MFU (default: jaxdp.perf.PEAK_FLOPS)
    compile_cache: bool = True  # JAX's persistent compilation cache (see jaxdp.perf.enable_compile_cache)
    # multi-process jobs (jaxdp launch, srun): see jaxdp.distributed
    init_timeout: int = 300  # seconds for every process to join
    heartbeat_timeout: int = 100  # seconds before the survivors give up on a silent peer

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def fingerprint(self) -> dict:
        """The fields a resumed run must share with the checkpoint it resumes.

        Devices (and processes), output paths and progress display may change across
        a resume; anything that changes the math may not. The global batch is part of
        it: it fixes which samples each step takes, whatever the device count.
        """
        ignored = {"out", "resume", "overwrite", "progress", "devices", "mesh", "microbatches", "checkpoint_every",
                   "data_dir",
                   "download",
                   "strategy", "mesh_shape", "bucket_cap_mb", "remat", "log_sample_ids", "init_timeout",
                   "heartbeat_timeout", "keep", "eval_every", "tensorboard", "profile_steps", "peak_flops",
                   "compile_cache", "data_on_device", "data_workers"}
        return {k: v for k, v in json.loads(self.to_json()).items() if k not in ignored}

    def schedule_options(self, steps_per_epoch: int) -> dict:
        """``make_schedule``'s options. Both trainers step the schedule once per update, so
        the milestones, given in epochs, become ``epoch * steps_per_epoch`` updates: the lr
        changes at the first step of each milestone epoch, as torch's MultiStepLR stepped
        once per epoch does."""
        return {"warmup_steps": self.warmup_steps, "gamma": self.gamma,
                "milestones": tuple(m * steps_per_epoch for m in self.milestones or ())}


def mesh_devices(cfg: TrainConfig) -> Optional[int]:
    """The device count ``--mesh`` (or else ``--devices``) asks for; a mesh that names an
    unknown axis, or whose sizes do not multiply to ``--devices``, is one line."""
    if cfg.mesh is None:
        return cfg.devices
    from jaxdp.mesh import MeshError, mesh_sizes  # jax-free at import

    try:
        sizes = mesh_sizes(cfg.mesh, cfg.devices)
    except MeshError as e:
        raise TrainError(str(e)) from None
    total = 1
    for size in sizes.values():
        total *= size
    return total


def check_config(cfg: TrainConfig) -> None:
    """What can be refused from the config alone, before jax or torch starts: raises
    ``TrainError`` naming the flag. (Names of models, strategies and optimizers are checked
    by the trainers' factories, still before any data is loaded.)"""
    if cfg.resume and cfg.overwrite:
        raise TrainError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    _at_least("--global-batch-size", cfg.global_batch_size, 1)
    _at_least("--accum-steps", cfg.accum_steps, 1)
    if cfg.devices is not None:
        _at_least("--devices", cfg.devices, 1, hint=" (omit it to use every device)")
    if cfg.mesh is not None:
        mesh_devices(cfg)
    if cfg.microbatches is not None:
        _at_least("--microbatches", cfg.microbatches, 1, hint=" (omit it for one per stage)")
    _at_least("--epochs", cfg.epochs, 1)
    _at_least("--checkpoint-every", cfg.checkpoint_every, 0, hint=" (0 = once per epoch)")
    _at_least("--eval-every", cfg.eval_every, 0, hint=" (0 = at the end of each epoch)")
    _at_least("--keep", cfg.keep, 1)
    if cfg.max_steps is not None:
        _at_least("--max-steps", cfg.max_steps, 1, hint=" (omit it to train --epochs)")
    if cfg.profile_steps is not None and not (len(cfg.profile_steps) == 2 and 1 <= cfg.profile_steps[0]
                                              < cfg.profile_steps[1]):
        raise TrainError(f"--profile-steps takes A:B with 1 <= A < B (steps A to B-1 are traced), got "
                         f"{':'.join(map(str, cfg.profile_steps))}")
    if cfg.peak_flops is not None and not cfg.peak_flops > 0:
        raise TrainError(f"--peak-flops must be a positive FLOP/s per device, got {cfg.peak_flops}")
    if len(cfg.synthetic_size) != 2 or min(cfg.synthetic_size) < 1:
        raise TrainError(f"--synthetic-size takes two positive counts TRAIN,TEST (e.g. 10000,2000), "
                         f"got {','.join(map(str, cfg.synthetic_size))}")
    check_choice("--data-on-device", cfg.data_on_device, ("auto", "on", "off"))
    if cfg.data_workers is not None:
        _at_least("--data-workers", cfg.data_workers, 0, hint=" (0 = a background thread)")
    _check_milestones(cfg)
    _check_powersgd_flags(cfg)


def check_choice(option: str, value: str, choices) -> None:
    if value not in choices:
        raise TrainError(f"unknown {option} {value!r}; choose one of {', '.join(choices)}")


def _at_least(flag: str, value: int, minimum: int, hint: str = "") -> None:
    if value < minimum:
        raise TrainError(f"{flag} must be >= {minimum}{hint}, got {value}")


def _check_milestones(cfg: TrainConfig) -> None:
    if cfg.schedule != "multistep":
        if cfg.milestones:
            raise TrainError(f"--milestones applies to --schedule multistep, not {cfg.schedule!r}")
        return
    if not cfg.milestones:
        raise TrainError("--schedule multistep needs --milestones E1,E2,... (epochs at whose start "
                         "the lr is multiplied by --gamma); without them it is a constant lr")
    outside = [m for m in cfg.milestones if not 1 <= m < cfg.epochs]
    if outside:
        valid = f"1 to {cfg.epochs - 1}" if cfg.epochs > 1 else "none, the run has one epoch"
        raise TrainError(f"--milestones {','.join(map(str, outside))} never take effect: milestones are the "
                         f"epochs at whose start the lr changes (for --epochs {cfg.epochs}: {valid})")


def _check_powersgd_flags(cfg: TrainConfig) -> None:
    defaults = TrainConfig()
    for name in ("powersgd_rank", "powersgd_start_iter"):
        if getattr(cfg, name) != getattr(defaults, name) and cfg.compress != "powersgd":
            raise TrainError(f"--{name.replace('_', '-')} applies to --compress powersgd only")


# ----------------------------------------------------------------------------- checks that need the device count
# (both trainers; no jax, no torch)

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


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Updates in the whole run: ``--max-steps``, else ``--epochs`` whole epochs."""
    return cfg.max_steps if cfg.max_steps is not None else cfg.epochs * steps_per_epoch


def end_position(cfg: TrainConfig, steps_per_epoch: int) -> Tuple[int, int]:
    """(epoch, steps of it done) when the run is over."""
    epoch, step = divmod(total_steps(cfg, steps_per_epoch), steps_per_epoch)
    return (epoch - 1, steps_per_epoch) if step == 0 else (epoch, step)


def batchnorm_batch_error(cfg: TrainConfig, devices: int, reason) -> TrainError:
    """The one-line error for a micro-batch too small for BatchNorm (both trainers)."""
    where = "per device" + (" and micro-batch" if cfg.accum_steps > 1 else "")
    return TrainError(f"1 image {where} is too few for --stem {cfg.stem}: {reason}; pass "
                      f"--global-batch-size {2 * devices * cfg.accum_steps} or more")
