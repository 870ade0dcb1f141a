"""``jaxdp train``'s configuration: one tree of typed sections, each field declared once
with its default, its help and whether it changes the numbers (``jaxdp.config.fields.option``).

The sections below are what ``jaxdp train --help`` groups; ``TrainConfig`` joins them into
the one flat config both trainers read (``cfg.lr``, ``TrainConfig(lr=0.1)``). Its flags
(``jaxdp.cli.command``), config-file keys (``jaxdp.config.files``) and resume fingerprint
(``TrainConfig.fingerprint``) are generated from these fields.
"""

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional, Tuple

from jaxdp.config import choices
from jaxdp.config.flags import MESH_HELP, flag_name, step_range
from jaxdp.runtime.mesh import MeshDims, MeshError, mesh_sizes  # jax-free at import
from jaxdp.config.fields import fingerprint as number_fingerprint
from jaxdp.config.fields import declared, option
from jaxdp.config.step import StrategyOptions


class TrainError(ValueError):
    """A configuration that cannot be trained, caught before any work is done (both trainers)."""


@dataclass
class Model:
    model: str = option("resnet18", "architecture", numbers=True, choices=choices.MODELS)
    width: int = option(64, "ResNet: channels of the first stage (64 = torchvision)", numbers=True)
    blocks: Optional[Tuple[int, int, int, int]] = option(
        None, "ResNet: blocks per stage, e.g. 1,1,1,1 (default: the named depth's)", numbers=True)
    stem: str = option("cifar", "ResNet stem: 3x3 conv or 7x7 + max-pool", numbers=True, choices=choices.STEMS)
    dtype: str = option("float32", "bfloat16: bf16 compute with float32 params", numbers=True,
                        choices=choices.DTYPES)


@dataclass
class Data:
    dataset: str = option("synthetic", "synthetic works offline", numbers=True, choices=choices.DATASETS)
    data_dir: Optional[str] = option(None, "CIFAR-10 folder or archive (default $JAXDP_DATA_DIR or ./data)",
                                     numbers=False)
    download: bool = option(False, "download CIFAR-10 if it is missing", numbers=False)
    synthetic_size: Tuple[int, int] = option((10000, 2000), "train,test sizes of the synthetic set", numbers=True)


@dataclass
class Parallelism(StrategyOptions):
    """Where the run's devices go: the strategy and its options (``StrategyOptions``), the
    mesh, and the global batch (part of the numbers: it fixes which samples each step takes,
    whatever the device count)."""

    mesh: Optional[str] = option(None, MESH_HELP + ": model parallelism beside the data-parallel strategy",
                                 numbers=False)
    microbatches: Optional[int] = option(
        None, "pipeline micro-batches per device and update, with a stage axis in --mesh (default: the stage count)",
        numbers=False, at_least=1, hint=" (omit it for one per stage)")
    devices: Optional[int] = option(
        None, "devices to use (default: all). On a CPU-only machine --devices N simulates N devices (any N >= 1), "
              "unless XLA_FLAGS already sets --xla_force_host_platform_device_count, which then fixes how many "
              "there are", numbers=False, at_least=1, hint=" (omit it to use every device)")
    global_batch_size: int = option(128, "images per update, over every device and micro-batch", numbers=True,
                                    flags=("--batch-size",), at_least=1)


@dataclass
class Optimisation:
    epochs: int = option(1, "passes over the training set", numbers=True, at_least=1)
    max_steps: Optional[int] = option(
        None, "updates in all, overriding --epochs (the lr schedule spans them; default: --epochs)", numbers=True,
        at_least=1, hint=" (omit it to train --epochs)")
    optimizer: str = option("sgd", "torch.optim's semantics", numbers=True, choices=choices.OPTIMIZERS)
    lr: float = option(0.1, "peak learning rate", numbers=True)
    momentum: float = option(0.9, "sgd momentum", numbers=True)
    nesterov: bool = option(False, "sgd: Nesterov momentum", numbers=True)
    weight_decay: float = option(5e-4, "L2 added to the gradient (sgd, adam) or decoupled (adamw)", numbers=True)
    schedule: str = option("cosine", "lr schedule over the updates", numbers=True, choices=choices.SCHEDULES)
    milestones: Optional[Tuple[int, ...]] = option(
        None, "multistep (required): EPOCHS at whose first step the lr is multiplied by --gamma, e.g. 100,150 "
              "(torch's MultiStepLR stepped once per epoch)", numbers=True)
    gamma: float = option(0.1, "multistep: lr factor at each milestone", numbers=True)
    warmup_steps: int = option(0, "warmup_cosine: linear warmup updates", numbers=True)
    seed: int = option(0, "init, shuffling and augmentation", numbers=True)


@dataclass
class Output:
    out: str = option("runs/default", "run directory: metrics.jsonl, config.json, checkpoints/", numbers=False)
    resume: bool = option(False, "continue from the latest checkpoint in --out; or in RUN_DIR, with that run's "
                                 "options (its config.json), any flag given here overriding them", numbers=False,
                          parse=str, nargs="?", const=True, metavar="RUN_DIR")
    overwrite: bool = option(False, "start over in an --out that holds an earlier run: delete its checkpoints and "
                                    "metrics", numbers=False)
    checkpoint_every: int = option(0, "steps (0 = each epoch)", numbers=False, at_least=0,
                                   hint=" (0 = once per epoch)")
    keep: int = option(3, "newest checkpoints to keep", numbers=False, at_least=1)
    eval_every: int = option(0, "also evaluate every N steps (0 = only at the end of each epoch, which always "
                                "evaluates)", numbers=False, at_least=0,
                           hint=" (0 = at the end of each epoch)")
    progress: bool = option(True, "no progress bar", numbers=False)
    tensorboard: bool = option(True, "no TensorBoard scalars in OUT/tensorboard (metrics.jsonl has the same "
                                     "numbers)", numbers=False)


@dataclass
class Job:
    """Multi-process jobs (``jaxdp launch``, srun: see ``jaxdp.runtime.distributed``) and fault tolerance."""

    init_timeout: int = option(300, "seconds for every process to join the job before a clear error",
                               numbers=False)
    heartbeat_timeout: int = option(100, "seconds before the processes give up on a peer that stopped answering",
                                    numbers=False)
    log_sample_ids: bool = option(False, "write each step's dataset ids to OUT/sample_ids.p<process>.jsonl",
                                  numbers=False)
    accept_unverified: bool = option(False, "--resume: restore a checkpoint without its manifest (unverified: its "
                                            "files cannot be checked) rather than fall back to an older one",
                                     numbers=False)


@dataclass
class Performance:
    data_on_device: str = option(
        "auto", "keep the training set on every device and augment there (auto: if it takes at most 1/8 of a "
                "device's memory)", numbers=False, choices=("auto", "on", "off"))
    data_workers: Optional[int] = option(
        None, "host pipeline (data not on the devices): crop in N processes (0 = one background thread; default 0 "
              "on CPU, else half the cores, at most 8)", numbers=False, at_least=0,
        hint=" (0 = a background thread)")
    profile_steps: Optional[Tuple[int, int]] = option(
        None, "write a jax.profiler trace of steps A..B-1 to OUT/tensorboard (TensorBoard's profile tab)",
        numbers=False, parse=step_range, metavar="A:B")
    peak_flops: Optional[float] = option(
        None, "peak FLOP/s per device, for MFU in the train records (default: known GPUs' bf16 peak with --dtype "
              "bfloat16, else MFU is n/a)", numbers=False)
    compile_cache: bool = option(True, "do not use JAX's persistent compilation cache (default: "
                                       "$JAX_COMPILATION_CACHE_DIR, else $JAXDP_CACHE_DIR or ~/.cache/jaxdp)",
                                 numbers=False)


# --help's groups, in order; torch_ref's trainer shares the first five (SHARED)
SECTIONS = {"model": Model, "data": Data, "parallelism": Parallelism, "optimisation": Optimisation,
            "output": Output, "multi-process jobs (jaxdp launch, srun) and fault tolerance": Job,
            "performance": Performance}
SHARED = ("model", "data", "parallelism", "optimisation", "output")


@dataclass
class TrainConfig(Performance, Job, Output, Optimisation, Parallelism, Data, Model):
    """Every option of a training run: the sections above, flat."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def fingerprint(self) -> dict:
        """The fields a resumed run must share with the checkpoint it resumes: those
        declared ``numbers=True``. Devices (and processes), the strategy, output paths and
        progress display may change across a resume; anything that changes the math may not."""
        return number_fingerprint(self)

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
    try:
        return MeshDims.named(**mesh_sizes(cfg.mesh, cfg.devices)).devices
    except MeshError as e:
        raise TrainError(str(e)) from None


def check_config(cfg: TrainConfig) -> None:
    """What can be refused from the config alone, before jax or torch starts: raises
    ``TrainError`` naming the flag. (Names of models, strategies and optimizers are checked
    by the trainers' factories, still before any data is loaded.)"""
    if cfg.resume and cfg.overwrite:
        raise TrainError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    for f in declared(TrainConfig):  # the bounds the fields declare
        value, minimum = getattr(cfg, f.name), f.metadata["at_least"]
        if minimum is not None and value is not None and value < minimum:
            raise TrainError(f"{flag_name(f.name)} must be >= {minimum}{f.metadata['hint']}, got {value}")
    if cfg.mesh is not None:
        mesh_devices(cfg)
    if cfg.profile_steps is not None and not (len(cfg.profile_steps) == 2 and 1 <= cfg.profile_steps[0]
                                              < cfg.profile_steps[1]):
        raise TrainError(f"--profile-steps takes A:B with 1 <= A < B (steps A to B-1 are traced), got "
                         f"{':'.join(map(str, cfg.profile_steps))}")
    if cfg.peak_flops is not None and not cfg.peak_flops > 0:
        raise TrainError(f"--peak-flops must be a positive FLOP/s per device, got {cfg.peak_flops}")
    if len(cfg.synthetic_size) != 2 or min(cfg.synthetic_size) < 1:
        raise TrainError(f"--synthetic-size takes two positive counts TRAIN,TEST (e.g. 10000,2000), "
                         f"got {','.join(map(str, cfg.synthetic_size))}")
    check_choice("--data-on-device", cfg.data_on_device, choices_of("data_on_device"))
    _check_milestones(cfg)
    _check_powersgd_flags(cfg)


def check_choice(flag: str, value: str, names) -> None:
    if value not in names:
        raise TrainError(f"unknown {flag} {value!r}; choose one of {', '.join(names)}")


def choices_of(name: str) -> Tuple[str, ...]:
    """The names a field of the tree takes, as its option declares them."""
    return TrainConfig.__dataclass_fields__[name].metadata["choices"]


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
    from jaxdp.data.loader import steps_per_epoch  # not for --help: the data package adds ~30 ms to its start

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
